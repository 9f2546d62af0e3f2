"""Byte movers behind one interface (base.TransferEngine): Mooncake and NIXL."""

from __future__ import annotations

import uuid

from tilert_serve.transfer.base import TransferEngine, TransferError, WriteOp

ENGINES = ("mooncake", "nixl")


def create(name: str, *, host: str, protocol: str = "tcp", role: str = "peer") -> TransferEngine:
    """A ready engine. `host` is the address peers reach us at; `role` names NIXL agents."""
    if name == "mooncake":
        from tilert_serve.transfer.mooncake import MooncakeEngine

        return MooncakeEngine(host, protocol)
    if name == "nixl":
        import os

        from tilert_serve.transfer.nixl import NixlEngine

        if protocol == "tcp":
            # Without this UCX may pick shared memory or CMA on one host; "tcp" means the network path.
            os.environ.setdefault("UCX_TLS", "tcp")

        return NixlEngine(f"tilert-{role}-{uuid.uuid4().hex[:8]}")
    raise TransferError(f"unknown transfer engine {name!r}; choose one of {', '.join(ENGINES)}")


__all__ = ["ENGINES", "TransferEngine", "TransferError", "WriteOp", "create"]
