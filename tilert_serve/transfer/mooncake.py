"""Mooncake Transfer Engine in P2P-handshake mode: no metadata server; a peer is named by
"host:rpc_port" and the segment descriptor is fetched from that port on the first write.

Facts (reference/transfer-engines.md §2): `initialize(host, "P2PHANDSHAKE", "tcp"|"rdma", device)`,
`batch_transfer_sync_write` returns 0 on success, writes outside the target's registrations fail
with -1. Its environment per protocol (slice size) is transfer.transport_env's. Its handshake and data
listeners bind every interface whatever address it is given (0.3.13 hard-codes the wildcard, with or
without MC_TCP_BIND_ADDRESS): peers reach it at the advertised data-plane address, and with a
secondary network the rendered NetworkPolicy closes the pod network's side to everything but the
node's HTTP port. Mooncake authenticates no peer: whoever reaches those ports can read and write
every registered buffer (the node's receive slots, a prefill's staging), which is why slots are
scrubbed, staging is zeroed after each send, and each handoff's digest is checked (handoff/digest.py).
transfer.create sets MC_TRANSFER_TIMEOUT (seconds, Mooncake's default 30) to defaults.WRITE_BOUND_S:
the bound on one write that the node's slot quarantine counts on.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tilert_serve.transfer.base import TransferError, WriteOp


class MooncakeEngine:
    name = "mooncake"

    def __init__(self, host: str, protocol: str = "tcp", device_name: str = "") -> None:
        if protocol not in ("tcp", "rdma"):
            raise TransferError(f"mooncake protocol must be tcp or rdma, not {protocol!r}")
        try:
            from mooncake.engine import TransferEngine
        except ImportError as exc:
            raise TransferError(f"Mooncake is not importable ({exc}); install mooncake-transfer-engine "
                                "(GPU) or mooncake-transfer-engine-non-cuda (CPU) and libibverbs1") from exc
        self._engine = TransferEngine()
        rc = self._engine.initialize(host, "P2PHANDSHAKE", protocol, device_name)
        if rc != 0:
            raise TransferError(f"Mooncake initialize({host!r}, P2PHANDSHAKE, {protocol!r}, {device_name!r}) "
                                f"returned {rc}; for rdma check the device name and that the RDMA device "
                                "plugin gave this pod a NIC")
        self.session_id = f"{host}:{self._engine.get_rpc_port()}"
        self.protocol = protocol

    def register(self, addr: int, nbytes: int, device: str = "cpu") -> None:
        location = "cpu:0" if device == "cpu" else device
        rc = self._engine.register_memory(addr, nbytes, location)
        if rc != 0:
            raise TransferError(f"Mooncake could not register {nbytes} bytes at 0x{addr:x} on {device} (rc {rc})")

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
            peer, [o.local_addr for o in ops], [o.remote_addr for o in ops], [o.nbytes for o in ops])
        if rc != 0:
            total = sum(o.nbytes for o in ops)
            raise TransferError(f"Mooncake write of {len(ops)} ranges ({total} bytes) to {peer} failed (rc {rc}): "
                                "the node may be down, unreachable, or the ranges outside its registered buffer")

    def close(self) -> None:
        # The pybind object tears down on garbage collection; drop our reference.
        self._engine = None
