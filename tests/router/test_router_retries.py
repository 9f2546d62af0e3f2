"""Retries before the first byte (policy.retries, within the retry budget) and circuit breakers on
prefill and native servers."""

from __future__ import annotations

import aiohttp
import openai
import pytest
from router_fakes import MODEL, WORDS, until

from tilert_serve.router import health
from tilert_serve.router.call import ATTEMPTS_HEADER
from tilert_serve.router.retry_budget import RetryBudget

TILERT = {"x-pd-route": "tilert"}
NATIVE = {"x-pd-route": "native"}


def _count(metric, *labels: str) -> float:
    return float(metric.labels(*labels)._value.get())


def test_retry_budget_is_a_share_of_recent_requests():
    b = RetryBudget(ratio=0.2, min_retries=1, window_s=10.0)
    for i in range(10):
        b.request(float(i) / 10)
    # 1 + 0.2 x 10 = 3 retries in the window, no more.
    assert [b.try_retry(1.0) for _ in range(4)] == [True, True, True, False]
    # The window moves on: old requests and retries stop counting.
    assert b.try_retry(12.0)  # nothing left in the window: the floor allows one
    assert not b.try_retry(12.0)
    b.request(12.5)
    assert b.snapshot(12.5) == {"window_s": 10.0, "requests": 1, "retries": 1, "allowed": 1.2}


async def test_retried_up_to_policy_retries_each_time_elsewhere(make_stack):
    s = await make_stack(n_prefill=3)
    s.prefills[0].fail_status = s.prefills[1].fail_status = 500
    for p in s.prefills[:2]:
        s.state.pools.prefill[p.url].inflight = 0
    s.state.pools.prefill[s.prefills[2].url].inflight = 1  # the good one is picked last
    r = await s.client().completions.create(model=MODEL, prompt="a", max_tokens=3, extra_headers=TILERT)
    assert r.choices[0].text == " hello w0 w1"
    assert [len(p.bodies) for p in s.prefills] == [1, 1, 1]  # each tried once, never twice
    assert _count(s.state.metrics.retries, "tilert", "http_5xx") == 2


@pytest.mark.parametrize("stream", [False, True])
async def test_answers_say_how_many_attempts_they_took(make_stack, stream: bool):
    s = await make_stack(n_prefill=2)
    s.prefills[0].fail_status = 500
    s.state.pools.prefill[s.prefills[0].url].inflight = 0
    s.state.pools.prefill[s.prefills[1].url].inflight = 1  # the failing one is picked first
    async with aiohttp.ClientSession() as http:
        async with http.post(
            s.router_url + "/v1/completions",
            json={"model": MODEL, "prompt": "a", "max_tokens": 2, "stream": stream},
            headers=TILERT,
        ) as resp:
            await resp.read()
            assert resp.status == 200
            assert resp.headers[ATTEMPTS_HEADER] == "2"
        s.prefills[0].fail_status = None
        async with http.post(
            s.router_url + "/v1/completions",
            json={"model": MODEL, "prompt": "a", "max_tokens": 2, "stream": stream},
            headers=TILERT,
        ) as resp:
            await resp.read()
            assert (resp.status, resp.headers[ATTEMPTS_HEADER]) == (200, "1")


async def test_a_retry_returns_the_same_greedy_text(make_stack):
    s = await make_stack(n_prefill=2, node_slots=(1, 1))
    c = s.client()
    alone = await c.completions.create(
        model=MODEL, prompt="a", max_tokens=6, temperature=0, extra_headers=TILERT
    )
    s.prefill.fail_handoffs = 10**6  # whatever prefill 0 does now fails the handoff
    s.prefills[1].fail_handoffs = 0
    s.state.pools.prefill[s.prefills[1].url].inflight = 1
    retried = await c.completions.create(
        model=MODEL, prompt="a", max_tokens=6, temperature=0, extra_headers=TILERT
    )
    assert retried.choices[0].text == alone.choices[0].text == " hello" + "".join(WORDS[:5])
    assert _count(s.state.metrics.retries, "tilert", "handoff_failed") == 1


async def test_a_prefill_that_ended_the_request_itself_is_retried_without_blaming_the_node(make_stack):
    """A leaving prefill (pooled connections still reach it) aborts a request: with one TileRT node and
    no native pool, the retry on the other prefill is served by the same node, whose breaker stays
    closed. Before, the node's breaker opened and the retry got 503 tilert_unavailable."""
    s = await make_stack(n_prefill=2)
    leaving, staying = s.prefills
    leaving.fail_handoffs, leaving.handoff_fault = 10**6, "prefill"
    s.state.pools.prefill[leaving.url].inflight = 0
    s.state.pools.prefill[staying.url].inflight = 1  # the leaving one is picked first
    r = await s.client().completions.create(model=MODEL, prompt="a", max_tokens=3, extra_headers=TILERT)
    assert r.choices[0].text == " hello w0 w1"
    assert [len(p.bodies) for p in s.prefills] == [1, 1]
    (node,) = s.state.pools.tilert.values()
    assert node.breaker == "closed" and node.handoff_fail_at is None
    assert _count(s.state.metrics.retries, "tilert", "handoff_failed") == 1


async def test_a_retry_on_the_endpoint_that_failed_opens_a_new_connection(make_stack):
    """One prefill URL (a Service name in a cluster) whose pod answers 5xx while it shuts down: the
    retry must not reuse the pooled keep-alive connection to that pod (it would get the same 500), but
    open a new one (and resolve the name again), which a Service sends to a pod that serves."""
    s = await make_stack(n_prefill=1)
    c = s.client()
    await c.completions.create(model=MODEL, prompt="a", max_tokens=2, extra_headers=TILERT)  # pools one
    s.prefill.fail_status, s.prefill.fail_count = 500, 2  # this request's first attempt only
    r = await c.completions.create(model=MODEL, prompt="a", max_tokens=3, extra_headers=TILERT)
    assert r.choices[0].text == " hello w0 w1"
    warm, failed, retried = s.prefill.peers
    assert failed == warm  # the pooled connection served the first attempt
    assert retried != failed  # the retry came on a connection of its own
    assert _count(s.state.metrics.retries, "tilert", "http_5xx") == 1


async def test_the_retry_budget_stops_retries_when_spent(make_stack):
    s = await make_stack(n_prefill=2, policy={"retry_budget_min": 1, "retry_budget_ratio": 0.0})
    for p in s.prefills:
        p.fail_status = 500
    async with aiohttp.ClientSession() as http:
        statuses, attempts = [], []
        for _ in range(3):
            async with http.post(
                s.router_url + "/v1/completions",
                json={"model": MODEL, "prompt": "a", "max_tokens": 2},
                headers=TILERT,
            ) as resp:
                statuses.append(resp.status)
                attempts.append(resp.headers.get(ATTEMPTS_HEADER))
    assert statuses == [502, 502, 502]
    assert attempts == ["2", "1", "1"]  # the failed answers say how many attempts they took
    # One retry in the window, for the first request; the others failed on their first attempt.
    assert sum(len(p.bodies) for p in s.prefills) == 2 + 1 + 1
    assert _count(s.state.metrics.retries_denied, "tilert") == 3  # its second retry, and one each


async def test_a_native_decode_that_dies_before_its_first_byte_is_retried(make_stack):
    s = await make_stack(n_native=2)
    s.natives[0].die_after = 0  # accepts, then drops the connection before any event
    c = s.client()
    for stream in (True, False):
        for _ in range(2):
            if stream:
                out = [
                    ch.choices[0].text
                    async for ch in await c.completions.create(
                        model=MODEL, prompt="a", max_tokens=3, stream=True, extra_headers=NATIVE
                    )
                ]
                assert "".join(out) == "".join(WORDS[:3])
            else:
                r = await c.completions.create(model=MODEL, prompt="a", max_tokens=3, extra_headers=NATIVE)
                assert r.choices[0].text == "".join(WORDS[:3])
    assert _count(s.state.metrics.retries, "native", "reset") >= 1
    assert _count(s.state.metrics.stream_errors, "native", "stream_broken") == 0


async def test_a_dead_prefill_is_avoided_at_once_and_back_after_it_answers_a_probe(make_stack):
    s = await make_stack(n_prefill=2, endpoint_breaker={"open_s": 60.0})
    dead = s.prefills[0]
    ep = s.state.pools.prefill[dead.url]
    await dead.stop()
    s.state.pools.prefill[s.prefills[1].url].inflight = 1  # the dead one is the first pick
    c = s.client()
    r = await c.completions.create(model=MODEL, prompt="a", max_tokens=2, extra_headers=TILERT)
    assert r.choices[0].text == " hello w0"
    # One refused connection opened its breaker (passive): no later request tries it.
    assert ep.breaker == "open"
    assert _count(s.state.metrics.upstream_errors, "prefill", "connect") == 1
    s.state.pools.prefill[s.prefills[1].url].inflight = 0
    for _ in range(4):
        await c.completions.create(model=MODEL, prompt="a", max_tokens=2, extra_headers=TILERT)
    assert _count(s.state.metrics.upstream_errors, "prefill", "connect") == 1
    assert len(s.prefills[1].bodies) == 5
    # Exposed: /v1/status and the gauge.
    async with aiohttp.ClientSession() as http:
        async with http.get(s.router_url + "/v1/status") as resp:
            body = await resp.json()
        async with http.get(s.router_url + "/metrics") as resp:
            text = await resp.text()
    assert body["endpoints"]["prefill"][0]["breaker"] == "open"
    assert f'tilert_router_endpoint_breaker_open{{endpoint="{dead.url}",pool="prefill"}} 1.0' in text
    # Restarted on its port: the next probe that reaches it lets one request try it (half-open),
    # and an answer closes the breaker.
    port = int(dead.url.rsplit(":", 1)[1])
    runner = aiohttp.web.AppRunner(dead.app())
    await runner.setup()
    await aiohttp.web.TCPSite(runner, "127.0.0.1", port).start()
    dead.runner = runner
    await health.probe_all(s.state)
    assert ep.breaker == "half-open"
    s.state.pools.prefill[s.prefills[1].url].inflight = 1
    await c.completions.create(model=MODEL, prompt="a", max_tokens=2, extra_headers=TILERT)
    assert ep.breaker == "closed" and len(dead.bodies) == 1


async def test_the_health_probe_opens_a_refusing_servers_breaker(make_stack):
    s = await make_stack(n_native=2, endpoint_breaker={"open_s": 60.0})
    await s.natives[0].stop()
    await health.probe_all(s.state)
    ep = s.state.pools.native[s.natives[0].url]
    assert ep.breaker == "open"
    c = s.client()
    for _ in range(3):
        await c.completions.create(model=MODEL, prompt="a", max_tokens=2, extra_headers=NATIVE)
    assert len(s.natives[1].bodies) == 3
    assert _count(s.state.metrics.upstream_errors, "native", "connect") == 0


async def test_5xx_answers_open_a_breaker_after_failures_to_open(make_stack):
    s = await make_stack(n_native=2, endpoint_breaker={"failures_to_open": 2, "open_s": 60.0})
    s.natives[0].fail_status = 503
    ep = s.state.pools.native[s.natives[0].url]
    c = s.client()
    for _ in range(6):
        r = await c.completions.create(model=MODEL, prompt="a", max_tokens=2, extra_headers=NATIVE)
        assert r.choices[0].text
    assert ep.breaker == "open" and len(s.natives[0].bodies) == 2


async def test_a_client_error_is_not_retried_and_opens_no_breaker(make_stack):
    s = await make_stack(n_prefill=2)
    s.prefill.fail_status = 400
    s.state.pools.prefill[s.prefills[1].url].inflight = 1
    with pytest.raises(openai.BadRequestError):
        await s.client().completions.create(model=MODEL, prompt="a", max_tokens=2, extra_headers=TILERT)
    assert len(s.prefill.bodies) == 1 and not s.prefills[1].bodies
    assert s.state.pools.prefill[s.prefill.url].breaker == "closed"
    await until(lambda: s.node.active == 0)


async def test_a_node_dying_before_a_non_streamed_answer_is_retried_with_the_same_text(make_stack):
    s = await make_stack(node_slots=(1, 1))
    s.nodes[0].die_after = 2
    s.nodes[1].slots = 1
    s.state.pools.tilert["t1"].full_until = 0.0
    s.state.pools.tilert["t1"].in_use = 0
    c = s.client()
    seen = set()
    for _ in range(3):
        r = await c.completions.create(
            model=MODEL, prompt="a", max_tokens=6, temperature=0, extra_headers=TILERT
        )
        assert r.choices[0].text == " hello" + "".join(WORDS[:5])
        seen.add(len(s.nodes[0].generates))
    # t0 cut its stream (its breaker opened on the failed decode or it is simply retried): every
    # request was answered whole by t1.
    assert s.nodes[1].completed == 3
    assert _count(s.state.metrics.stream_errors, "tilert", "stream_broken") == 0


async def test_a_killed_node_is_avoided_from_the_first_refused_connection(make_stack):
    s = await make_stack(node_slots=(1, 1), breaker={"open_s": 60.0})
    await s.nodes[0].stop()
    c = s.client()
    for _ in range(4):
        r = await c.completions.create(model=MODEL, prompt="a", max_tokens=2, extra_headers=TILERT)
        assert r.choices[0].text == " hello w0"
    assert s.state.pools.tilert["t0"].breaker == "open"
    # At most one request met the refused connection (then tried t1 in the same turn); none after it.
    assert _count(s.state.metrics.upstream_errors, "tilert", "connect") == 1
    assert s.nodes[1].completed == 4
