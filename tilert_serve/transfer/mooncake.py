"""Mooncake Transfer Engine in P2P-handshake mode: no metadata server; a peer is named by
"host:rpc_port" and the segment descriptor is fetched from that port on the first write.

`initialize(host, "P2PHANDSHAKE", "tcp"|"rdma", device)` and `batch_transfer_sync_write` return 0
on success; writes outside the target's registrations fail with -1. Its environment per protocol
(slice size) is transfer.transport_env's, put in the process environment by transfer.create. Its handshake and data
listeners bind every interface whatever address it is given (0.3.13 hard-codes the wildcard, with or
without MC_TCP_BIND_ADDRESS): peers reach it at the advertised data-plane address, and with a
secondary network the rendered NetworkPolicy closes the pod network's side to everything but the
node's HTTP port. Mooncake authenticates no peer: whoever reaches those ports can read and write
every registered buffer (the node's receive slots, a prefill's staging), which is why slots are
scrubbed, staging is zeroed after each send, and each handoff's digest is checked (handoff/digest.py).
transfer.create asks for a write timeout of defaults.WRITE_BOUND_S (Mooncake's default 30 s): the
bound on one write that the node's slot quarantine counts on. Mooncake reads it from
MC_TRANSFER_TIMEOUT when an engine is made (seen: a write to a stopped peer fails after the value
set while the engine was made, though the variable was removed before initialize), so it is set for
that moment only, unless the process environment sets it (then that wins).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from typing import Any

from tilert_serve.transfer.base import TransferError, WriteOp

# Our engines' creations, one at a time: each one's MC_TRANSFER_TIMEOUT is its own.
_CREATING = threading.Lock()


class MooncakeEngine:
    name = "mooncake"

    def __init__(
        self, host: str, protocol: str = "tcp", device_name: str = "", transfer_timeout_s: float | None = None
    ) -> None:
        if protocol not in ("tcp", "rdma"):
            raise TransferError(f"mooncake protocol must be tcp or rdma, not {protocol!r}")
        try:
            from mooncake.engine import TransferEngine
        except ImportError as exc:
            raise TransferError(
                f"Mooncake is not importable ({exc}); install mooncake-transfer-engine "
                "(GPU) or mooncake-transfer-engine-non-cuda (CPU) and libibverbs1"
            ) from exc
        with _CREATING:
            timeout = None
            if transfer_timeout_s is not None and "MC_TRANSFER_TIMEOUT" not in os.environ:
                timeout = os.environ["MC_TRANSFER_TIMEOUT"] = str(int(transfer_timeout_s))
            try:
                self._engine = TransferEngine()
            finally:
                if timeout is not None:
                    del os.environ["MC_TRANSFER_TIMEOUT"]
        rc = self._engine.initialize(host, "P2PHANDSHAKE", protocol, device_name)
        if rc != 0:
            raise TransferError(
                f"Mooncake initialize({host!r}, P2PHANDSHAKE, {protocol!r}, {device_name!r}) "
                f"returned {rc}; for rdma check the device name and that the RDMA device "
                "plugin gave this pod a NIC"
            )
        self.session_id = f"{host}:{self._engine.get_rpc_port()}"
        self.protocol = protocol

    def register(self, addr: int, nbytes: int, device: str = "cpu") -> None:
        location = "cpu:0" if device == "cpu" else device
        rc = self._engine.register_memory(addr, nbytes, location)
        if rc != 0:
            raise TransferError(
                f"Mooncake could not register {nbytes} bytes at 0x{addr:x} on {device} (rc {rc})"
            )

    def unregister(self, addr: int) -> None:
        self._engine.unregister_memory(addr)

    def peer_info(self) -> dict[str, Any]:
        return {"session_id": self.session_id, "protocol": self.protocol}

    def connect(self, peer: dict[str, Any]) -> str:
        try:
            return str(peer["session_id"])
        except KeyError as exc:
            raise TransferError(f"Mooncake peer info lacks session_id: {peer}") from exc

    def write(self, peer: str, ops: Sequence[WriteOp]) -> None:
        if not ops:
            return
        rc = self._engine.batch_transfer_sync_write(
            peer, [o.local_addr for o in ops], [o.remote_addr for o in ops], [o.nbytes for o in ops]
        )
        if rc != 0:
            total = sum(o.nbytes for o in ops)
            raise TransferError(
                f"Mooncake write of {len(ops)} ranges ({total} bytes) to {peer} failed (rc {rc}): "
                "the node may be down, unreachable, or the ranges outside its registered buffer"
            )

    def close(self) -> None:
        # The pybind object tears down on garbage collection; drop our reference.
        self._engine = None
