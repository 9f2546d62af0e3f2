"""Active health checks: probe every endpoint on an interval; eject after N failures (more when they
are all timeouts: a late answer on a loaded host is not a dead server), return after M successes
(thresholds in the config); a change that lets requests through wakes those waiting for a node.
vLLM servers answer GET /health; TileRT nodes GET /ready, which is 503 while the node cannot take
work (engine loading, receive buffers not registered).

The probes also feed the circuit breakers and the generation check: a vLLM server that refuses the
connection opens its breaker at once, one that answers lets an open breaker try a request at once
(half-open; a TileRT node's breaker counts handoffs, and only a decoded one closes it); a TileRT node's advertised generation (`compat` in /ready's body, else in /v1/status) is
compared with its configured one, and a node that runs another is not routed to (logged and counted
once per change).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Iterable

import aiohttp

from tilert_serve.router.pools import Endpoint
from tilert_serve.router.state import RouterState, task_ctx

log = logging.getLogger(__name__)


def _compat_of(raw: bytes) -> str | None:
    try:
        body = json.loads(raw)
    except ValueError:
        return None
    said = body.get("compat") if isinstance(body, dict) else None
    return said if isinstance(said, str) and said else None


async def _advertised(state: RouterState, ep: Endpoint, raw: bytes, timeout_s: float) -> str | None:
    """The generation a TileRT node advertises: /ready's body, else /v1/status (node token)."""
    said = _compat_of(raw)
    if said is not None or ep.compat is None:
        return said
    try:
        async with state.http.get(
            ep.url + "/v1/status",
            headers=state.node_headers({}),
            timeout=aiohttp.ClientTimeout(total=timeout_s),
        ) as resp:
            body = await resp.read()
            return _compat_of(body) if resp.status == 200 else None
    except (TimeoutError, aiohttp.ClientError):
        return None


def note_advertised(state: RouterState, ep: Endpoint, said: str | None) -> None:
    """Record what `ep` advertises; log and count a mismatch with its configured generation once."""
    if said is None:
        return
    was = ep.compat_mismatch
    ep.advertised = said
    if ep.compat_mismatch and not was:
        state.metrics.compat_mismatches.labels(ep.pool).inc()
        log.warning(
            "%s endpoint %s advertises generation %s but is configured as %s: not routed to until they "
            "match (check the image, --model-revision and the KV-cache dtype/MTP settings it runs against "
            "its generation's spec)",
            ep.pool,
            ep.url,
            said,
            ep.compat,
        )
    elif was and not ep.compat_mismatch:
        log.info("%s endpoint %s advertises its configured generation %s again", ep.pool, ep.url, said)


#: Longest a probe's connect may take. A server's kernel completes the handshake however loaded its
#: process is; only an address with nobody behind it (a pod deleted with its network, a lost machine)
#: stays silent, and that counts as a plain failure, not as a slow answer (timeouts_to_eject).
CONNECT_S = 2.0


def _usable(ep: Endpoint) -> tuple[bool, bool]:
    """What a probe may change that lets a request through: routable, and not behind an open breaker."""
    return ep.routable, ep.breaker != "open"


async def probe(state: RouterState, ep: Endpoint) -> None:
    """Probe `ep` and record the verdict; nothing when a probe of it is already under way (the round's
    and a waiting request's, probe_now, never count one silence twice)."""
    if ep.checking:
        return
    ep.checking = True
    try:
        await _probe(state, ep)
    finally:
        ep.checking = False


def probe_now(state: RouterState, eps: Iterable[Endpoint]) -> None:
    """Probe these endpoints now if they are ejected, apart from the round: a request waits for one
    of them (handlers._choose), and the round may be seconds away (its interval, and its slowest
    probe: a leaving server's that times out). One that answers is back at once, and wakes the
    request."""
    if not state.health_checks:
        return
    for ep in eps:
        if ep.healthy is False and not ep.checking:
            state.spawn(probe(state, ep))


async def _probe(state: RouterState, ep: Endpoint) -> None:
    hc = state.config.health
    path = "/ready" if ep.pool == "tilert" else "/health"
    was = ep.healthy
    usable = _usable(ep)
    refused = timed_out = False
    said: str | None = None
    try:
        timeout = aiohttp.ClientTimeout(total=hc.timeout_s, sock_connect=min(hc.timeout_s, CONNECT_S))
        async with state.http.get(ep.url + path, timeout=timeout) as resp:
            raw = await resp.read()
            ok = resp.status == 200
            why = f"GET {path} answered {resp.status}"
        if ok and ep.pool == "tilert":
            said = await _advertised(state, ep, raw, hc.timeout_s)
    except (TimeoutError, aiohttp.ClientError) as exc:
        ok, why = False, f"GET {path} failed: {type(exc).__name__} {exc}".strip()
        refused = isinstance(exc, aiohttp.ClientConnectorError)
        # A connect that times out is not a late answer: the address is silent (the pod is gone).
        timed_out = isinstance(exc, TimeoutError) and not isinstance(exc, aiohttp.ConnectionTimeoutError)
    if ok:
        ep.record_ok(hc)
        note_advertised(state, ep, said)
        if ep.pool != "tilert":
            ep.probe_answered(time.monotonic())
    else:
        # A timeout is not a "no": on a loaded host the answer may just be late (timeouts_to_eject).
        ep.record_failure(hc, why, timed_out=timed_out)
        if refused:
            ep.breaker_failed(time.monotonic(), why, at_once=True)
    if _usable(ep) != usable:
        state.pools.changes.notify()  # requests waiting for a node (handlers._choose) look again
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
