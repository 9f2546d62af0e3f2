"""Active health checks: probe every endpoint on an interval; eject after N failures, return after M
successes (thresholds in the config). vLLM servers answer GET /health; TileRT nodes GET /ready, which
is 503 while the node cannot take work (engine loading, receive buffers not registered).
"""

from __future__ import annotations

import asyncio
import logging

import aiohttp

from tilert_serve.router.pools import Endpoint
from tilert_serve.router.state import RouterState, task_ctx

log = logging.getLogger(__name__)


async def probe(state: RouterState, ep: Endpoint) -> None:
    hc = state.config.health
    path = "/ready" if ep.pool == "tilert" else "/health"
    was = ep.healthy
    try:
        async with state.http.get(ep.url + path, timeout=aiohttp.ClientTimeout(total=hc.timeout_s)) as resp:
            await resp.read()
            ok = resp.status == 200
            why = f"GET {path} answered {resp.status}"
    except (TimeoutError, aiohttp.ClientError) as exc:
        ok, why = False, f"GET {path} failed: {type(exc).__name__} {exc}".strip()
    if ok:
        ep.record_ok(hc)
    else:
        ep.record_failure(hc, why)
    if was is not ep.healthy and ep.healthy is not None:
        log.info(
            "%s endpoint %s is now %s%s",
            ep.pool,
            ep.url,
            "healthy" if ep.healthy else "ejected",
            "" if ep.healthy else f" ({why})",
        )


async def probe_all(state: RouterState) -> None:
    await asyncio.gather(*(probe(state, ep) for ep in list(state.pools.all())))


async def _loop(state: RouterState) -> None:
    while True:
        try:
            await probe_all(state)
        except Exception:  # a probe round must never kill the loop
            log.exception("health probe round failed")
        await asyncio.sleep(state.config.health.interval_s)


#: cleanup_ctx: the probe loop lives as long as the app.
health_ctx = task_ctx(_loop)
