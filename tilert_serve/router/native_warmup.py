"""Warm-up requests for (prefill, native decode) pairs that have not moved KV yet (native_pairs.py
says why and holds the pairs' states): one small request of the router's own through the same
connector path a user's native request takes (the handoff probe's prompt, one token), started for each
due pair every half second while `native_warmup.enabled`.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from typing import Any

import aiohttp

from tilert_serve.router import canary, native_path
from tilert_serve.router.pools import Endpoint
from tilert_serve.router.state import RouterState, task_ctx
from tilert_serve.router.upstream import UpstreamError, error_message, post_json

log = logging.getLogger(__name__)

#: Request ids of warm-ups start with this (vLLM's logs show them for what they are).
PREFIX = "native-warmup-"


async def warm(state: RouterState, prefill: Endpoint, native: Endpoint) -> bool:
    """One warm-up request through the pair; records the outcome in the pools' PairTable."""
    cfg = state.config
    w, t = cfg.native_warmup, cfg.timeouts
    table = state.pools.pairs
    rid = PREFIX + secrets.token_hex(6)
    headers = {"X-Request-Id": rid}
    timeout = aiohttp.ClientTimeout(total=w.timeout_s, sock_connect=t.connect_s)
    body = canary.probe_body(cfg)
    table.started(prefill, native)
    prefill.inflight += 1
    native.inflight += 1
    outcome, message = "failed", ""
    try:
        leg = await native_path.prefill_leg(state, prefill)
        prefill_body = {**body, "kv_transfer_params": leg.params}
        pj = await _post(state, "prefill", prefill, prefill_body, {**headers, **leg.headers}, timeout)
        kvp = leg.decode_params(pj)
        if kvp is None:
            message = f"prefill {prefill.url} kept no KV for the decode ({error_message(pj, 'no kv_transfer_params')})"
            return False
        await _post(state, "native", native, {**body, "kv_transfer_params": kvp}, headers, timeout)
        outcome = "ok"
        return True
    except UpstreamError as exc:
        message = f"{exc.pool} {exc.url}: {exc.kind}: {exc.message}"
        return False
    finally:
        prefill.inflight -= 1
        native.inflight -= 1
        state.metrics.native_warmups.labels(outcome).inc()
        if outcome == "ok":
            table.succeeded(prefill, native)
        else:
            table.failed(prefill, native, time.monotonic())
            log.warning("warm-up of %s -> %s failed: %s", prefill.url, native.url, message)


async def _post(
    state: RouterState,
    pool: str,
    ep: Endpoint,
    body: dict[str, Any],
    headers: dict[str, str],
    timeout: aiohttp.ClientTimeout,
) -> dict[str, Any]:
    status, answer = await post_json(
        state.http, pool, ep.url, "/v1/completions", body, headers=headers, timeout=timeout
    )
    if status != 200:
        raise UpstreamError(pool, ep.url, f"http_{status}", error_message(answer, "refused the warm-up"))
    return answer


def due(state: RouterState, now: float) -> list[tuple[Endpoint, Endpoint]]:
    w = state.config.native_warmup
    if not w.enabled:
        return []
    pools = state.pools
    return pools.pairs.due(pools.prefill.values(), pools.native.values(), now, w.retry_s)


async def _loop(state: RouterState) -> None:
    while True:
        try:
            for prefill, native in due(state, time.monotonic()):
                state.spawn(warm(state, prefill, native))
        except Exception:  # a round must never kill the loop
            log.exception("native warm-up round failed")
        await asyncio.sleep(0.5)


#: cleanup_ctx: the warm-up loop lives as long as the app.
warmup_ctx = task_ctx(_loop)
