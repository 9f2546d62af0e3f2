"""Byte movers behind one interface (base.TransferEngine): Mooncake and NIXL.

Each engine's settings are its own where its library allows it. NIXL's are given to our agent alone
(transfer/nixl.py says how, and why UCX_MODULES is the exception). Mooncake's MC_TCP_SLICE_SIZE and
MC_USE_IPV6 go to the process environment, where it does not set them already, and stay there:
Mooncake has no per-engine parameter for them and reads them after create returns (the slice size
once per process, at its first TCP transfer; MC_USE_IPV6 when it parses a peer's address), so they
cannot be put back. Only Mooncake reads MC_* variables, and its slice size is one for the whole
process anyway. MC_TRANSFER_TIMEOUT is read per engine, when it is made: MooncakeEngine sets it for
that moment only.
"""

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
        env = {
            "UCX_TLS": "tcp",
            "UCX_MODULES": "^ib",
            **({"UCX_NET_DEVICES": interface} if interface else {}),
        }
    if name == "mooncake":
        if protocol == "tcp":
            env["MC_TCP_SLICE_SIZE"] = str(1 << 20)
        if dataplane.is_ipv6(host):
            env["MC_USE_IPV6"] = "1"
    return env


def create(
    name: str, *, host: str, protocol: str = "tcp", role: str = "peer", interface: str | None = None
) -> TransferEngine:
    """A ready engine. `host` is the address peers reach us at (the data-plane address), `interface`
    the network interface it is on when known; `role` names NIXL agents. The process environment's
    settings win over transport_env's."""
    if name not in ENGINES:
        raise TransferError(f"unknown transfer engine {name!r}; choose one of {', '.join(ENGINES)}")
    settings = transport_env(name, protocol, interface, host)
    if name == "mooncake":
        from tilert_serve.transfer.mooncake import MooncakeEngine

        for key, value in settings.items():
            os.environ.setdefault(key, value)
        # The bound on one write that the decode node's slot quarantine relies on (decode/slots.py).
        return MooncakeEngine(host, protocol, transfer_timeout_s=defaults.WRITE_BOUND_S)
    from tilert_serve.transfer.nixl import NixlEngine

    return NixlEngine(f"tilert-{role}-{uuid.uuid4().hex[:8]}", ucx=settings)


__all__ = ["ENGINES", "TransferEngine", "TransferError", "WriteOp", "create"]
