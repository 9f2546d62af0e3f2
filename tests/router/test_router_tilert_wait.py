"""A planned change loses no request: when every TileRT node is out for a moment (a generation change
swaps the node list while the new nodes are ejected by a probe that came late on a loaded host), a
request the TileRT path must serve waits for a node to come back (woken by the change, bounded by
`policy.tilert_wait_s`) instead of failing at once with 503 tilert_unavailable; only after the bound
does it get the 503. A client that goes away while waiting leaves nothing held. A probe that times
out is weaker evidence than one answered "not ready": it ejects only after `timeouts_to_eject`.

Each test fails without the wait (the 503 came at once) or without the health-check change."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from router_fakes import MODEL, until

from tilert_serve.router import config, health
from tilert_serve.router.pools import Endpoint

#: The TileRT path is the only one (no native pool): a request with no node must wait or fail.
ONLY_TILERT: dict[str, Any] = {"n_native": 0}
BODY = {"model": MODEL, "prompt": "a", "max_tokens": 3}


async def _complete(url: str) -> tuple[int, dict[str, str], Any]:
    async with aiohttp.ClientSession() as http, http.post(url + "/v1/completions", json=BODY) as r:
        return r.status, dict(r.headers), json.loads(await r.read())


def _waits(s: Any, outcome: str) -> float:
    return float(s.state.metrics.tilert_waits.labels(outcome)._value.get())


def _waiting(s: Any) -> float:
    return float(s.state.metrics.tilert_waiting._value.get())


def _only_node(s: Any, index: int) -> None:
    """The router's config moves to node `index` alone (the old generation leaves the list)."""
    cfg = s.state.base_config
    s.state.apply(cfg.model_copy(update={"tilert": [cfg.tilert[index]]}))


@pytest.mark.parametrize("old_node_stopping", [False, True])
async def test_a_list_swap_onto_nodes_ejected_for_a_moment_serves_the_request_once_one_is_back(
    make_stack: Any, old_node_stopping: bool
) -> None:
    """t0 is the old generation, t1 the new one, ejected by a late probe just as the config moves to
    it. With the old node still listed and stopping, its admission answers 503 not_ready (as a node
    that stops does) and the request must not end on that either."""
    s = await make_stack(node_slots=(1, 1), **ONLY_TILERT)
    new = s.state.pools.tilert["t1"]
    new.healthy = False  # ejected: its probes timed out under load
    if old_node_stopping:
        s.nodes[0].admit_status = 503
    else:
        _only_node(s, 1)
    t0 = time.perf_counter()
    request = asyncio.create_task(_complete(s.router_url))
    await until(lambda: _waiting(s) == 1)
    assert not request.done() and not s.nodes[1].admits
    # The next probe reaches the node: it is back, and the waiting request goes on at once.
    await health.probe(s.state, new)
    status, headers, body = await request
    took = time.perf_counter() - t0
    print(f"\nserved after the node came back, {took * 1e3:.0f} ms after it arrived")
    assert status == 200 and headers["X-PD-Route"] == "tilert", body
    assert body["choices"][0]["text"] == " hello w0 w1"
    assert len(s.nodes[1].admits) == 1 and s.nodes[1].completed == 1
    assert _waits(s, "resumed") == 1 and _waits(s, "timed_out") == 0 and _waiting(s) == 0
    await until(lambda: all(n.in_use == 0 for n in s.state.pools.tilert.values()))


async def test_a_waiting_request_has_the_ejected_nodes_probed_at_once_not_at_the_next_round(
    make_stack: Any,
) -> None:
    """The probe round may be seconds away (its interval; its slowest probe): a request that waits
    asks for a probe of the nodes it waits for now, and one that answers serves it."""
    s = await make_stack(
        **ONLY_TILERT, health_checks=True, health={"interval_s": 60.0}, policy={"tilert_wait_s": 10.0}
    )
    node = s.state.pools.tilert["t0"]
    await until(lambda: all(ep.healthy is True for ep in s.state.pools.all()))  # the first round
    node.healthy = False  # a late probe ejected it; the next round is a minute away
    t0 = time.perf_counter()
    status, _, body = await _complete(s.router_url)
    took = time.perf_counter() - t0
    print(f"\nserved {took * 1e3:.0f} ms after it arrived (probe round interval 60 s, bound 10 s)")
    assert status == 200, body
    assert node.healthy is True and _waits(s, "resumed") == 1 and _waits(s, "timed_out") == 0


async def test_under_load_a_swap_onto_nodes_whose_probes_time_out_loses_no_request(make_stack: Any) -> None:
    """The docker runtime's generation change in small: clients keep sending while the config moves
    from t0 (old generation) to t1 (new), whose probes time out just then (a loaded host), so the
    health checks eject it. Every request is served; those that met the empty moment waited."""
    s = await make_stack(
        node_slots=(4, 4),
        **ONLY_TILERT,
        health_checks=True,
        health={"interval_s": 0.05, "timeout_s": 0.1, "failures_to_eject": 1, "timeouts_to_eject": 2},
        policy={"tilert_wait_s": 10.0},
    )
    old, new = s.state.pools.tilert["t0"], s.state.pools.tilert["t1"]
    await until(lambda: old.healthy is True and new.healthy is True)
    statuses: list[int] = []
    stop = asyncio.Event()

    async def client() -> None:
        async with aiohttp.ClientSession() as http:
            while not stop.is_set():
                async with http.post(s.router_url + "/v1/completions", json=BODY) as r:
                    await r.read()
                    statuses.append(r.status)

    clients = [asyncio.create_task(client()) for _ in range(4)]
    try:
        await until(lambda: len(statuses) >= 20)
        s.nodes[1].ready_gate.clear()  # t1's probes time out from now on
        await until(lambda: new.healthy is False)
        _only_node(s, 1)  # the old generation leaves the list: no node can take a request
        await until(lambda: _waiting(s) >= 1 or 503 in statuses)
        s.nodes[1].ready_gate.set()  # the host catches up: the next probe brings t1 back
        served = len(statuses)
        await until(lambda: len(statuses) >= served + 20)
    finally:
        stop.set()
        await asyncio.gather(*clients)
    print(f"\n{len(statuses)} requests across the swap, {_waits(s, 'resumed'):.0f} waited for t1")
    assert statuses and set(statuses) == {200}, sorted(set(statuses))
    assert _waits(s, "resumed") >= 1 and _waits(s, "timed_out") == 0
    assert s.nodes[1].completed >= 20


async def test_a_request_gives_up_with_the_503_after_the_bound(make_stack: Any) -> None:
    bound = 0.4
    s = await make_stack(**ONLY_TILERT, policy={"tilert_wait_s": bound, "retry_after_s": 2})
    s.state.pools.tilert["t0"].healthy = False  # ejected, and it stays so
    t0 = time.perf_counter()
    status, headers, body = await _complete(s.router_url)
    took = time.perf_counter() - t0
    print(f"\n503 after waiting {took * 1e3:.0f} ms (bound {bound * 1e3:.0f} ms)")
    assert status == 503 and body["error"]["code"] == "tilert_unavailable", body
    assert headers["Retry-After"] == "2"
    assert took >= bound
    assert _waits(s, "timed_out") == 1 and _waits(s, "resumed") == 0 and _waiting(s) == 0
    assert not s.node.admits


async def test_a_change_that_does_not_help_does_not_end_the_wait_early(make_stack: Any) -> None:
    """A wake-up by an unrelated change (a config reload naming the same ejected node) re-checks and
    waits on, within the same bound."""
    s = await make_stack(**ONLY_TILERT, policy={"tilert_wait_s": 30.0})
    node = s.state.pools.tilert["t0"]
    node.healthy = False
    request = asyncio.create_task(_complete(s.router_url))
    await until(lambda: _waiting(s) == 1)
    s.state.apply(s.state.base_config)  # wakes every waiter; still no node
    assert s.state.pools.changes._event is None  # the waiter was woken...
    await until(lambda: s.state.pools.changes._event is not None)  # ...looked, and waits again
    assert not request.done() and _waiting(s) == 1
    node.healthy = True
    s.state.pools.changes.notify()
    status, _, body = await request
    assert status == 200, body
    assert _waits(s, "resumed") == 1


async def test_a_request_waiting_behind_a_half_open_trial_goes_on_when_the_trial_decodes(
    make_stack: Any,
) -> None:
    """The only node is half-open and another request's trial holds it: the next request waits, and
    the trial's end (its handoff decoded, the breaker closed) wakes it, long before the bound."""
    s = await make_stack(
        node_slots=(2,), **ONLY_TILERT, breaker={"open_s": 0.05}, policy={"tilert_wait_s": 30.0}
    )
    node = s.state.pools.tilert["t0"]
    node.breaker_failed(time.monotonic(), "handoff_failed: scripted")
    await until(lambda: node.breaker == "half-open")
    s.node.go.clear()  # the trial's decode waits
    trial = asyncio.create_task(_complete(s.router_url))
    await until(lambda: len(s.node.generates) == 1)
    assert node.trial
    waiting = asyncio.create_task(_complete(s.router_url))
    await until(lambda: _waiting(s) == 1)
    s.node.go.set()
    assert (await trial)[0] == 200 and node.breaker == "closed"
    status, _, body = await asyncio.wait_for(waiting, 15.0)  # well inside the 30 s bound
    assert status == 200, body
    assert _waits(s, "resumed") == 1


async def test_no_wait_for_a_node_behind_an_open_breaker(make_stack: Any) -> None:
    """Failed handoffs (or a refused connection) open the breaker: that is an answer, given at once."""
    s = await make_stack(**ONLY_TILERT, breaker={"open_s": 60.0}, policy={"tilert_wait_s": 30.0})
    s.state.pools.tilert["t0"].breaker_failed(time.monotonic(), "handoff_failed: scripted")
    t0 = time.perf_counter()
    status, _, body = await _complete(s.router_url)
    assert status == 503 and body["error"]["code"] == "tilert_unavailable", body
    assert time.perf_counter() - t0 < 15.0  # far below the bound: no wait began
    assert _waits(s, "timed_out") == 0 and _waiting(s) == 0


async def test_a_client_that_goes_away_while_waiting_leaves_nothing_held(make_stack: Any) -> None:
    s = await make_stack(**ONLY_TILERT, policy={"tilert_wait_s": 30.0})
    node = s.state.pools.tilert["t0"]
    node.healthy = False
    request = asyncio.create_task(_complete(s.router_url))
    await until(lambda: _waiting(s) == 1)
    request.cancel()  # the client disconnects
    await until(lambda: _waits(s, "client_gone") == 1)
    assert _waiting(s) == 0 and s.state.pools.changes.waiting == 0
    assert node.in_use == 0 and not s.node.admits and not s.node.tickets
    # Nothing of it is left behind: the node, back, serves the next request in full.
    node.healthy = True
    status, _, body = await _complete(s.router_url)
    assert status == 200 and body["choices"][0]["text"] == " hello w0 w1", body
    assert _waits(s, "resumed") == 0 and len(s.node.admits) == 1


async def test_a_prefill_list_swapped_during_admission_is_retried_not_a_503(make_stack: Any) -> None:
    """The node is admitted, then the prefills are swapped for ones of another generation before the
    prefill is chosen (a generation change under way): nothing reached the client, so the request is
    decided again and paired anew."""
    s = await make_stack(node_slots=(1, 1), n_prefill=2, **ONLY_TILERT)
    a, b = "aaaaaaaaaaaa", "bbbbbbbbbbbb"
    cfg = s.state.base_config
    s.state.apply(
        cfg.model_copy(
            update={
                "prefill": [cfg.prefill[0].model_copy(update={"compat": a})],
                "tilert": [
                    cfg.tilert[0].model_copy(update={"compat": a}),
                    cfg.tilert[1].model_copy(update={"compat": b}),
                ],
            }
        )
    )
    swapped = s.state.base_config.model_copy(
        update={"prefill": [cfg.prefill[1].model_copy(update={"compat": b})]}
    )
    s.nodes[0].on_admit = lambda: s.state.apply(swapped)
    status, headers, body = await _complete(s.router_url)
    assert status == 200, body
    assert headers["X-PD-Attempts"] == "2" and headers["X-PD-Route"] == "tilert"
    assert s.nodes[1].completed == 1 and not s.prefills[0].bodies and len(s.prefills[1].bodies) == 1
    await until(lambda: all(n.in_use == 0 for n in s.state.pools.tilert.values()))


# -- the health checks: a late probe is not a dead node ------------------------------------------------


def test_timeouts_eject_only_after_timeouts_to_eject_and_a_no_after_failures_to_eject() -> None:
    hc = config.HealthChecks(failures_to_eject=2, timeouts_to_eject=4)
    ep = Endpoint("http://n", "tilert", healthy=True)
    for _ in range(3):
        ep.record_failure(hc, "GET /ready failed: TimeoutError", timed_out=True)
    assert ep.healthy is True
    ep.record_failure(hc, "GET /ready failed: TimeoutError", timed_out=True)
    assert ep.healthy is False
    ep.record_ok(hc)
    assert ep.healthy is True
    # A run with one real "no" in it is judged by failures_to_eject.
    ep.record_failure(hc, "GET /ready failed: TimeoutError", timed_out=True)
    ep.record_failure(hc, "GET /ready answered 503")
    assert ep.healthy is False
    # timeouts_to_eject below failures_to_eject does not make timeouts the stronger evidence.
    hc = config.HealthChecks(failures_to_eject=3, timeouts_to_eject=1)
    ep = Endpoint("http://n", "tilert", healthy=True)
    ep.record_failure(hc, "t", timed_out=True)
    ep.record_failure(hc, "t", timed_out=True)
    assert ep.healthy is True


async def _slow_ready(delay: asyncio.Event) -> tuple[web.AppRunner, str]:
    """A node whose /ready answers only once `delay` is set (a node, or a router, too busy to answer)."""

    async def ready(request: web.Request) -> web.Response:
        await delay.wait()
        return web.json_response({"ready": True})

    app = web.Application()
    app.add_routes([web.get("/ready", ready)])
    runner = web.AppRunner(app, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}"


async def test_a_probe_that_times_out_is_not_counted_as_a_no(make_stack: Any) -> None:
    s = await make_stack(
        **ONLY_TILERT, health={"timeout_s": 0.05, "failures_to_eject": 2, "timeouts_to_eject": 3}
    )
    answer = asyncio.Event()
    runner, url = await _slow_ready(answer)
    try:
        ep = Endpoint(url, "tilert", healthy=True)
        await health.probe(s.state, ep)
        await health.probe(s.state, ep)
        assert ep.healthy is True and "TimeoutError" in ep.last_error  # two late answers: still in
        await health.probe(s.state, ep)
        assert ep.healthy is False  # silent for timeouts_to_eject probes: out
        answer.set()
        cfg = s.state.base_config
        s.state.apply(cfg.model_copy(update={"health": cfg.health.model_copy(update={"timeout_s": 30.0})}))
        await health.probe(s.state, ep)
        assert ep.healthy is True
    finally:
        await runner.cleanup()


async def test_a_probe_whose_connect_times_out_is_a_plain_failure(make_stack: Any, monkeypatch: Any) -> None:
    """An address nobody answers (a pod deleted with its network) is not a slow server: the probe's
    connect gives up after health.CONNECT_S, and it ejects after failures_to_eject, not the more
    patient timeouts_to_eject."""
    import socket

    monkeypatch.setattr(health, "CONNECT_S", 0.2)
    s = await make_stack(
        **ONLY_TILERT, health={"timeout_s": 5.0, "failures_to_eject": 2, "timeouts_to_eject": 4}
    )
    # A listener whose accept queue is full drops further SYNs, as a silent address does.
    silent = socket.create_server(("127.0.0.1", 0), backlog=0)
    port = silent.getsockname()[1]
    fillers = []
    for _ in range(3):
        c = socket.socket()
        c.setblocking(False)
        c.connect_ex(("127.0.0.1", port))
        fillers.append(c)
    try:
        ep = Endpoint(f"http://127.0.0.1:{port}", "tilert", healthy=True)
        t0 = time.monotonic()
        await health.probe(s.state, ep)
        assert ep.healthy is True and "ConnectionTimeoutError" in ep.last_error, ep.last_error
        await health.probe(s.state, ep)
        assert ep.healthy is False  # out after failures_to_eject (2), not timeouts_to_eject (4)
        assert time.monotonic() - t0 < 5.0  # each probe ended at its connect bound, not at timeout_s
    finally:
        for c in fillers:
            c.close()
        silent.close()


async def test_requests_that_time_out_together_do_not_eject_a_node(make_stack: Any) -> None:
    """Passive health: admissions that time out at once under load are one slow spell, not N
    failures in a row; a refused connection still counts."""
    from tilert_serve.router import handlers
    from tilert_serve.router.upstream import UpstreamError

    s = await make_stack(**ONLY_TILERT, health={"failures_to_eject": 2})
    node = s.state.pools.tilert["t0"]
    node.healthy = True
    for _ in range(5):
        handlers._note_failure(s.state, UpstreamError("tilert", node.url, "timeout", "no answer within 2 s"))
    assert node.healthy is True
    for _ in range(2):
        handlers._note_failure(s.state, UpstreamError("tilert", node.url, "transport", "reset"))
    assert node.healthy is False


def test_dump_leaves_the_new_settings_out_at_their_defaults() -> None:
    """A router of the previous release (which refuses unknown keys) still reads the file during a
    rolling upgrade; a value that is set is written."""
    import yaml

    cfg = config.RouterConfig(model="m", prefill=["http://p"])
    data = yaml.safe_load(config.dump(cfg))
    assert "tilert_wait_s" not in data["policy"] and "timeouts_to_eject" not in data["health"]
    cfg = cfg.model_copy(
        update={
            "policy": cfg.policy.model_copy(update={"tilert_wait_s": 2.5}),
            "health": cfg.health.model_copy(update={"timeouts_to_eject": 6}),
        }
    )
    back = config.RouterConfig.model_validate(yaml.safe_load(config.dump(cfg)))
    assert back.policy.tilert_wait_s == 2.5 and back.health.timeouts_to_eject == 6
