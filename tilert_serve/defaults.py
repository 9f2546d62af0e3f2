"""Defaults that more than one component must agree on: the one source for ports and limits.

The operator's renderers, the local runner, the decode node, the router and the connector all import
these; nothing else spells the numbers.
"""

from typing import Final

#: The decode node's control-plane port (handoff protocol), as upstream TileRT uses.
DECODE_CTRL_PORT: Final = 5556
#: The decode node's HTTP port (admission, token stream, health, metrics).
DECODE_HTTP_PORT: Final = 5557
#: The router's OpenAI-compatible HTTP port.
ROUTER_PORT: Final = 8000
#: vLLM's OpenAI server port (prefill and native decode pods).
VLLM_PORT: Final = 8100
#: How long an admission ticket holds a decode slot before the node frees it, in seconds.
TICKET_TTL_S: Final = 30.0
#: Where the handoff's shared secret is mounted in pods: the file senders sign with. The same directory
#: may hold `accept` (handoff.auth.ACCEPT_FILE): more secrets the nodes accept, one per line (rotation).
SECRET_PATH: Final = "/etc/tilert-pd/handoff/secret"
#: Longest a one-sided write may take before its transfer engine gives up, in seconds (Mooncake's
#: MC_TRANSFER_TIMEOUT, NIXL's write timeout; set by tilert_serve.transfer; Mooncake bounds a whole
#: write call by it). Twice a whole 128k-token GLM-5 state (8.2 GB) over 10 GbE TCP, where layer-wise
#: writes are a layer each and RDMA takes well under a second, and half the node's admission deadline
#: (TICKET_TTL_S): a write to a node gone silent holds one of the prefill's staging regions, which
#: other requests' handoffs wait for, this long.
WRITE_BOUND_S: Final = 15.0
#: How long a decode slot released while a sender may still be writing stays out of use: the write
#: bound plus a margin for bytes already on the wire (tilert_serve/decode/slots.py, Quarantine).
WRITE_QUARANTINE_S: Final = WRITE_BOUND_S + 30.0
#: Where the decode node's HTTP API credential (the `<cluster>-node-api` Secret's token) is mounted
#: in TileRT decode and router pods.
NODE_API_TOKEN_PATH: Final = "/etc/tilert-pd/node-api/token"
#: The handoff control protocol's version (tilert_serve/handoff/framing.py speaks it); part of the
#: compatibility generation (tilert_serve/compat.py), which the router and the operator compute too and
#: which must not pull the wire protocol into them.
HANDOFF_PROTOCOL_VERSION: Final = 2
