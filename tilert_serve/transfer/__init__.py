"""Byte movers behind one interface (base.TransferEngine): Mooncake and NIXL."""

from __future__ import annotations

import os
import uuid

from tilert_serve import dataplane, defaults
from tilert_serve.transfer.base import TransferEngine, TransferError, WriteOp

ENGINES = ("mooncake", "nixl")


def transport_env(name: str, protocol: str, interface: str | None = None, host: str = "") -> dict[str, str]:
    """The environment a byte mover needs for `protocol`, as defaults: what the process already has
    (the spec's transfer.rdma.env, rendered into the pod) wins, and nothing set for one protocol
    leaks into the other.

    NIXL over tcp: UCX's TCP transport only (else it may pick shared memory or CMA on one host), without
    its InfiniBand modules (useless over tcp, and they crash at exit where the system's libefa is
    present), on the data-plane interface only when it is known. NIXL over rdma: UCX's own choice of
    IB/RoCE transports; the NICs come from the spec's env (UCX_NET_DEVICES=mlx5_0:1, ...). Mooncake over
    tcp: 1 MiB slices (the 64 KiB default is ~1.7x slower on loopback); over rdma its defaults. Mooncake
    on an IPv6 data-plane address, either protocol: MC_USE_IPV6 (0.3.13's handshake otherwise listens
    on IPv4 only and cannot parse an IPv6 peer's "addr:port").
    """
    env: dict[str, str] = {}
    if name == "nixl" and protocol == "tcp":
        env = {"UCX_TLS": "tcp", "UCX_MODULES": "^ib", **({"UCX_NET_DEVICES": interface} if interface else {})}
    if name == "mooncake":
        if protocol == "tcp":
            env["MC_TCP_SLICE_SIZE"] = str(1 << 20)
        if dataplane.is_ipv6(host):
            env["MC_USE_IPV6"] = "1"
    return env


def create(name: str, *, host: str, protocol: str = "tcp", role: str = "peer",
           interface: str | None = None) -> TransferEngine:
    """A ready engine. `host` is the address peers reach us at (the data-plane address), `interface`
    the network interface it is on when known; `role` names NIXL agents."""
    if name not in ENGINES:
        raise TransferError(f"unknown transfer engine {name!r}; choose one of {', '.join(ENGINES)}")
    # Before the engine's library initialises: UCX and Mooncake read their settings once.
    for key, value in transport_env(name, protocol, interface, host).items():
        os.environ.setdefault(key, value)
    if name == "mooncake":
        # The bound on one write that the decode node's slot quarantine relies on (decode/slots.py).
        os.environ.setdefault("MC_TRANSFER_TIMEOUT", str(int(defaults.WRITE_BOUND_S)))
    if name == "mooncake":
        from tilert_serve.transfer.mooncake import MooncakeEngine

        return MooncakeEngine(host, protocol)
    from tilert_serve.transfer.nixl import NixlEngine

    return NixlEngine(f"tilert-{role}-{uuid.uuid4().hex[:8]}")


__all__ = ["ENGINES", "TransferEngine", "TransferError", "WriteOp", "create"]
