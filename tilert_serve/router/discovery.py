"""TileRT nodes from DNS: resolve the pool's headless Service name every few seconds and add the
ready pods it names to the configured endpoint list (config.TileRTDiscovery says why).

The merge is config.with_discovered (pure); the resolver is an argument, so tests drive the loop without a DNS server.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import AsyncIterator, Awaitable, Callable

from aiohttp import web

from tilert_serve import dataplane
from tilert_serve.router.config import TileRTDiscovery, TileRTNode
from tilert_serve.router.state import RouterState, task_ctx

log = logging.getLogger(__name__)
Resolver = Callable[[str], Awaitable[list[str]]]


def nodes_from(addresses: list[str], d: TileRTDiscovery) -> list[TileRTNode]:
    return [
        TileRTNode(
            name=f"{d.service}/{a}",
            http_url=dataplane.http_url(a, d.http_port),
            ctrl_host=a,
            ctrl_port=d.ctrl_port,
            slots=d.slots,
            max_seq_len=d.max_seq_len,
        )
        for a in sorted(set(addresses))
    ]


async def resolve(name: str) -> list[str]:
    """Addresses a name resolves to now; none when it does not resolve (no ready pod, or not yet)."""
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(name, None, type=socket.SOCK_STREAM)
    except socket.gaierror:
        return []
    return sorted({str(info[4][0]) for info in infos})


async def refresh(state: RouterState, resolver: Resolver) -> bool:
    """One lookup; applies and returns True when the discovered set changed."""
    d = state.base_config.tilert_discovery
    if d is None:
        return False
    nodes = nodes_from(await resolver(d.service), d)
    if nodes == state.discovered:
        return False
    log.info("TileRT nodes found through %s: %s", d.service, ", ".join(n.ctrl_host for n in nodes) or "none")
    state.set_discovered(nodes)
    return True


async def _loop(state: RouterState, resolver: Resolver) -> None:
    while True:
        d = state.base_config.tilert_discovery
        try:
            await refresh(state, resolver)
        except Exception:  # discovery must never stop; the configured list still serves
            log.exception("TileRT discovery failed")
        await asyncio.sleep(d.interval_s if d else 5.0)


def discovery_ctx(resolver: Resolver = resolve) -> Callable[[web.Application], AsyncIterator[None]]:
    async def run(state: RouterState) -> None:
        await _loop(state, resolver)

    return task_ctx(run)
