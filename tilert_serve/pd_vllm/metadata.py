"""What the scheduler side tells the workers each step (pickled across processes), and the
per-request destination parsed from kv_transfer_params in exactly one place."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

ReqId = str


@dataclass(frozen=True)
class Destination:
    """Where a claimed request's state goes (from the router, via kv_transfer_params)."""

    host: str
    ctrl_port: int
    ticket: str | None
    #: `tilert_layerwise` of this request (overrides the connector's tilert_layerwise; None: the
    #: connector's), so a benchmark or test can compare both handoffs on one prefill.
    layerwise: bool | None = None

    def wants_layerwise(self, default: bool) -> bool:
        """This request's choice of the layer-wise handoff, else the connector's `default`."""
        return default if self.layerwise is None else self.layerwise

    @staticmethod
    def claims(params: dict[str, Any] | None) -> bool:
        """The claim filter: only requests the router marked for TileRT (tilert_host) are ours."""
        return isinstance(params, dict) and "tilert_host" in params

    @classmethod
    def parse(cls, params: dict[str, Any]) -> Destination:
        host = params.get("tilert_host")
        port = params.get("tilert_ctrl_port")
        ticket = params.get("tilert_ticket")
        if not isinstance(host, str) or not host:
            raise ValueError(f"tilert_host must be a non-empty string, got {host!r}")
        if not isinstance(port, int) or not 0 < port < 65536:
            raise ValueError(f"tilert_ctrl_port must be a port number, got {port!r}")
        if ticket is not None and not isinstance(ticket, str):
            raise ValueError(f"tilert_ticket must be a string, got {type(ticket).__name__}")
        layerwise = params.get("tilert_layerwise")
        if layerwise is not None and not isinstance(layerwise, bool):
            raise ValueError(f"tilert_layerwise must be true or false, got {layerwise!r}")
        return cls(host, port, ticket, layerwise)


@dataclass(frozen=True)
class SendJob:
    """Extract this request's state in this step's wait_for_save and hand it to the sender; with
    `upto`, a step of a chunked prefill before the prompt's last (layer-wise only), which may send
    the tokens computed so far."""

    req_id: ReqId
    dest: Destination
    num_tokens: int
    last_prompt_token: int
    #: The prompt; a chunked prefill's jobs carry it in their first step and their last only.
    prompt_token_ids: list[int]
    #: Block ids per KV-cache group covering the prompt (with `upto`, its first `upto` tokens), in token order.
    block_ids: tuple[list[int], ...]
    #: Tokens of the prompt computed by the end of this step, when that is not yet all of them.
    upto: int | None = None


@dataclass
class TileRTConnectorMetadata(KVConnectorMetadata):
    jobs: list[SendJob] = field(default_factory=list)
