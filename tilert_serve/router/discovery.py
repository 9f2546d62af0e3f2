"""TileRT nodes from DNS: resolve the pool's headless Service name every few seconds and add the
ready pods it names to the configured endpoint list (config.TileRTDiscovery says why).

A node found here is reached at the address DNS gives, its pod IP, so discovery is right only where
the pod IP is the data-plane address: the operator (and `tilert-pd local`) renders no discovery entry
for a generation on a secondary network (tilert_operator/render/router.py `discovers`), whose nodes
the router then takes from the configured list alone, each at its address on that network.

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
            compat=d.compat,
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
    """One lookup of every discovery entry (one per generation); applies and returns True when the
    discovered set changed. A pod found under two entries (a Service that moved) counts under the first."""
    entries = state.base_config.discoveries()
    if not entries and not state.discovered:
        return False
    found = await asyncio.gather(*(resolver(d.service) for d in entries))
    nodes: list[TileRTNode] = []
    seen: set[str] = set()
    for d, addresses in zip(entries, found, strict=True):
        for n in nodes_from(addresses, d):
            if n.http_url not in seen:
                seen.add(n.http_url)
                nodes.append(n)
    if nodes == state.discovered:
        return False
    for d, addresses in zip(entries, found, strict=True):
        log.info("TileRT nodes found through %s: %s", d.service, ", ".join(sorted(set(addresses))) or "none")
    state.set_discovered(nodes)
    return True


async def _loop(state: RouterState, resolver: Resolver) -> None:
    while True:
        entries = state.base_config.discoveries()
        try:
            await refresh(state, resolver)
        except Exception:  # discovery must never stop; the configured list still serves
            log.exception("TileRT discovery failed")
        await asyncio.sleep(min((d.interval_s for d in entries), default=5.0))


def discovery_ctx(resolver: Resolver = resolve) -> Callable[[web.Application], AsyncIterator[None]]:
    async def run(state: RouterState) -> None:
        await _loop(state, resolver)

    return task_ctx(run)
