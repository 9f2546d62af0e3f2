"""TileRT nodes that cannot take a handoff: their control port locked out, every
legitimate handoff answered `busy`. Before, `auto` clients got a 502 (each retry went to another TileRT
node that failed the same way) with a healthy native pool beside, and /ready stayed 200.

Now: a failed handoff opens the node's circuit breaker (no request for `breaker.open_s`, doubled after
each failed trial); the retry of a request whose TileRT attempt failed goes native when the policy allows
it; once every node's breaker is open, `auto` goes native at once and a request the policy keeps on TileRT
gets a fast 503; after the open period one request tries the node (half-open) and a success closes the
breaker. /ready: 503 for a router whose only path is TileRT, 200 with the TileRT path reported down when
native is beside; `tilert_router_path_up` and `tilert_router_breaker_open` say the same.
"""

from __future__ import annotations

import json
import time
from typing import Any

import aiohttp
from router_fakes import MODEL, until

BREAKER = {"failures_to_open": 1, "open_s": 0.3, "max_open_s": 5.0}


async def _complete(url: str, headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], Any]:
    async with (
        aiohttp.ClientSession() as http,
        http.post(
            url + "/v1/completions",
            json={"model": MODEL, "prompt": "a", "max_tokens": 3},
            headers=headers or {},
        ) as r,
    ):
        return r.status, dict(r.headers), json.loads(await r.read())


async def _get(url: str, path: str) -> tuple[int, bytes]:
    async with aiohttp.ClientSession() as http, http.get(url + path) as r:
        return r.status, await r.read()


def _mark_probed_healthy(s: Any) -> None:
    for ep in s.state.pools.all():
        ep.healthy = True  # these stacks run without probes


async def test_auto_fails_over_to_native_and_returns_once_handoffs_work(make_stack):
    s = await make_stack(node_slots=(1, 1), breaker=BREAKER)
    _mark_probed_healthy(s)
    s.prefill.fail_handoffs = 10**6  # every handoff refused, as a locked-out control port answers busy
    times = []
    for _ in range(6):
        t0 = time.perf_counter()
        status, headers, body = await _complete(s.router_url)
        times.append(time.perf_counter() - t0)
        assert status == 200, body
        assert headers["X-PD-Route"] == "native"
    admits = sum(len(n.admits) for n in s.nodes)
    print(
        f"\n6 auto requests with every handoff failing: all served by native in "
        f"{', '.join(f'{t * 1e3:.0f}' for t in times)} ms; TileRT admissions {admits} (one per node, then none)"
    )
    assert admits == 2
    assert len(s.native.bodies) == 6

    status, raw = await _get(s.router_url, "/ready")
    ready = json.loads(raw)
    assert status == 200 and ready["ready"] is True, ready
    assert ready["paths"] == {"tilert": "down", "native": "up"}, ready
    assert any("circuit breaker open" in d for d in ready["degraded"]), ready
    _, metrics = await _get(s.router_url, "/metrics")
    assert b'tilert_router_path_up{path="tilert"} 0.0' in metrics
    assert b'tilert_router_breaker_open{node="t0"} 1.0' in metrics

    # Handoffs work again: after the open period one request tries each node, and closes its breaker.
    s.prefill.fail_handoffs = 0
    await until(lambda: all(n.breaker == "half-open" for n in s.state.pools.tilert.values()))
    t0 = time.perf_counter()
    status, headers, body = await _complete(s.router_url)
    assert status == 200 and headers["X-PD-Route"] == "tilert", body
    print(
        f"handoffs healed: the next request went to TileRT (half-open trial) in "
        f"{(time.perf_counter() - t0) * 1e3:.0f} ms"
    )
    await until(lambda: s.state.pools.tilert["t0"].in_use + s.state.pools.tilert["t1"].in_use == 0)
    status, raw = await _get(s.router_url, "/ready")
    assert json.loads(raw)["paths"]["tilert"] == "up"


async def test_a_failed_trial_reopens_the_breaker_for_longer(make_stack):
    s = await make_stack(breaker=BREAKER)
    s.prefill.fail_handoffs = 10**6
    assert (await _complete(s.router_url))[0] == 200
    node = s.state.pools.tilert["t0"]
    assert node.breaker == "open" and node.open_s == BREAKER["open_s"]
    await until(lambda: node.breaker == "half-open")
    assert (await _complete(s.router_url))[0] == 200  # the trial fails, the request is served by native
    assert node.breaker == "open" and node.open_s == 2 * BREAKER["open_s"]
    assert len(s.node.admits) == 2


async def test_a_tilert_only_router_is_not_ready_and_answers_fast_while_no_node_takes_a_handoff(make_stack):
    s = await make_stack(node_slots=(1, 1), n_native=0, breaker={**BREAKER, "open_s": 60.0})
    _mark_probed_healthy(s)
    status, raw = await _get(s.router_url, "/ready")
    assert status == 200, raw
    s.prefill.fail_handoffs = 10**6
    status, _, body = await _complete(s.router_url)
    # Both nodes tried, both failed and opened their breakers: the last retry finds none to try.
    assert status == 503 and body["error"]["code"] == "tilert_unavailable", body
    assert sum(len(n.admits) for n in s.nodes) == 2
    t0 = time.perf_counter()
    status, headers, body = await _complete(s.router_url)
    took = time.perf_counter() - t0
    print(
        f"\nTileRT-only router, no node takes a handoff: {status} {body['error']['code']} in {took * 1e3:.0f} ms"
    )
    assert status == 503 and body["error"]["code"] == "tilert_unavailable" and headers.get("Retry-After"), (
        body
    )
    assert sum(len(n.admits) for n in s.nodes) == 2  # the open breakers sent nothing to the nodes
    status, raw = await _get(s.router_url, "/ready")
    ready = json.loads(raw)
    assert status == 503 and ready["paths"] == {"tilert": "down", "native": "none"}, ready
    assert any("circuit breaker open" in r for r in ready["reasons"]), ready


async def test_a_policy_without_native_fallback_gets_a_fast_error_not_native(make_stack):
    s = await make_stack(breaker={**BREAKER, "open_s": 60.0}, policy={"when_tilert_full": "reject"})
    _mark_probed_healthy(s)
    s.prefill.fail_handoffs = 10**6
    status, _, body = await _complete(s.router_url)
    # The only node failed and its breaker opened: the retry finds no node and the policy keeps the
    # request off native.
    assert status == 503 and body["error"]["code"] == "tilert_unavailable", body
    status, _, body = await _complete(s.router_url)
    assert status == 503 and body["error"]["code"] == "tilert_unavailable", body
    assert not s.native.bodies and len(s.node.admits) == 1
