"""Fault cases over scripted upstreams: failed prefill, failed handoff, decode dying mid-stream, a slow
node, a client that disconnects, a full pool."""

from __future__ import annotations

import asyncio

import aiohttp
import openai
import pytest
from router_fakes import MODEL, WORDS, until

ROUTE = {"x-pd-route": "tilert"}


async def test_prefill_500_retried_elsewhere(make_stack):
    s = await make_stack(n_prefill=2)
    s.prefills[0].fail_status = 500
    s.prefills[1].fail_status = None
    c = s.client()
    for _ in range(4):  # whichever prefill is picked first, every request succeeds
        r = await c.completions.create(model=MODEL, prompt="a", max_tokens=3, extra_headers=ROUTE)
        assert r.choices[0].text == " hello w0 w1"
    assert s.node.active == 0
    await until(lambda: s.state.pools.tilert["t0"].in_use == 0)


async def test_prefill_500_everywhere_gives_openai_error(make_stack):
    s = await make_stack()
    s.prefill.fail_status = 500
    c = s.client()
    with pytest.raises(openai.InternalServerError) as ei:
        await c.completions.create(model=MODEL, prompt="a", max_tokens=3, extra_headers=ROUTE)
    assert ei.value.status_code == 502
    assert "scripted prefill failure" in ei.value.message
    assert len(s.prefill.bodies) == 1 + s.cfg.policy.retries  # tried, retried policy.retries times
    await until(lambda: s.node.active == 0 and s.state.pools.tilert["t0"].in_use == 0)
    # Still serving.
    s.prefill.fail_status = None
    r = await c.completions.create(model=MODEL, prompt="a", max_tokens=2, extra_headers=ROUTE)
    assert r.choices[0].text == " hello w0"


async def test_handoff_failure_retried_on_another_node(make_stack):
    s = await make_stack(node_slots=(1, 1))
    s.prefill.fail_handoffs = 1
    c = s.client()
    res = await c.completions.create(model=MODEL, prompt="a", max_tokens=3, extra_headers=ROUTE)
    assert res.choices[0].text == " hello w0 w1"
    used = {n.name for n in s.nodes if n.generates}
    assert len(used) == 1
    await until(lambda: all(n.active == 0 for n in s.nodes))
    # The node whose handoff failed got its ticket cancelled.
    assert sum(len(n.cancels) for n in s.nodes) == 1


async def test_decode_dies_mid_stream_sse_error(make_stack):
    s = await make_stack()
    s.node.die_after = 2
    c = s.client()
    stream = await c.completions.create(
        model=MODEL, prompt="a", max_tokens=10, stream=True, extra_headers=ROUTE
    )
    got = []
    # An error event naming the node, not a short answer that looks complete.
    with pytest.raises(openai.APIError, match="decode failed mid-stream on TileRT node t0"):
        async for ch in stream:
            got.append(ch.choices[0].text)
    assert "".join(got) == " hello" + "".join(WORDS[:2])
    await until(lambda: s.state.pools.tilert["t0"].in_use == 0)
    r = await c.completions.create(model=MODEL, prompt="a", max_tokens=2, extra_headers=ROUTE)
    assert r.choices[0].text == " hello w0"


async def test_generate_error_before_stream_nonstreamed_retried(make_stack):
    s = await make_stack(node_slots=(1,))
    s.node.generate_status = 504
    c = s.client()
    # The only node keeps failing: the retry goes native (auto policy falls back when TileRT is excluded).
    r = await c.completions.create(model=MODEL, prompt="a", max_tokens=3)
    assert r.choices[0].text == "".join(WORDS[:3])
    assert len(s.native.bodies) == 1
    await until(lambda: s.state.pools.tilert["t0"].in_use == 0)


async def test_generate_error_after_first_token_streamed(make_stack):
    s = await make_stack()
    s.node.generate_status = 502
    c = s.client()
    stream = await c.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "a"}],
        max_tokens=5,
        stream=True,
        extra_headers=ROUTE,
    )
    got = []
    with pytest.raises(openai.APIError, match="scripted failure"):
        async for ch in stream:
            got.append(ch.choices[0].delta.content)
    assert got == [" hello"]
    await until(lambda: s.state.pools.tilert["t0"].in_use == 0)


async def test_slow_node_idle_timeout(make_stack):
    s = await make_stack(timeouts={"idle_stream_s": 0.3})
    s.node.stall_after = 1  # then silent for an hour, the connection open
    c = s.client()
    stream = await c.completions.create(
        model=MODEL, prompt="a", max_tokens=10, stream=True, extra_headers=ROUTE
    )

    async def drain() -> None:
        async for _ in stream:
            pass

    # Only the router's idle timeout can end this stream; the bound stops a test that would hang.
    with pytest.raises(openai.APIError, match="decode failed") as ei:
        await asyncio.wait_for(drain(), 60)
    assert ei.value.code == "timeout"
    await until(lambda: s.state.pools.tilert["t0"].in_use == 0 and s.node.active == 0)
    assert len(s.node.cancels) == 1


async def test_slow_prefill_timeout(make_stack):
    s = await make_stack(timeouts={"prefill_s": 0.3})
    s.prefill.stall_s = 5
    c = s.client()
    with pytest.raises(openai.APIStatusError) as ei:
        await c.completions.create(model=MODEL, prompt="a", max_tokens=3, extra_headers=ROUTE)
    assert ei.value.status_code == 504
    await until(lambda: s.state.pools.tilert["t0"].in_use == 0 and s.node.active == 0)


@pytest.mark.parametrize("phase", ["prefill", "decode"])
async def test_client_disconnect_cancels_the_ticket(make_stack, phase):
    s = await make_stack()
    # The upstream never finishes on its own: only the client's disconnect can send the cancel.
    if phase == "prefill":
        s.prefill.stall_s = 3600
    else:
        s.node.stall_after = 1
    body = {"model": MODEL, "prompt": "a", "max_tokens": 50, "stream": True}
    async with aiohttp.ClientSession() as http:
        posting = asyncio.create_task(http.post(s.router_url + "/v1/completions", json=body, headers=ROUTE))
        if phase == "prefill":
            # No byte has come back yet (the prefill is running): drop the connection mid-wait.
            await until(lambda: len(s.prefill.bodies) == 1)
            posting.cancel()
        else:
            resp = await posting
            assert resp.status == 200
            await resp.content.readuntil(b"\n\n")  # the first token
            await until(lambda: len(s.node.generates) == 1)
            resp.close()  # drops the connection
    await until(lambda: s.node.cancels and s.node.active == 0)
    if phase == "prefill":
        await until(lambda: s.prefill.aborted == 1)
    await until(lambda: s.state.pools.tilert["t0"].in_use == 0)


async def test_full_pool_reject_gives_429_with_retry_after(make_stack):
    s = await make_stack(policy={"when_tilert_full": "reject", "retry_after_s": 3})
    s.node.go.clear()  # the first request holds the only slot until the test lets it go
    c = s.client()
    first = asyncio.create_task(
        c.completions.create(model=MODEL, prompt="a", max_tokens=3, extra_headers=ROUTE)
    )
    await until(lambda: len(s.node.generates) == 1)
    with pytest.raises(openai.RateLimitError) as ei:
        await c.completions.create(model=MODEL, prompt="a", max_tokens=3, extra_headers=ROUTE)
    assert ei.value.response.headers["Retry-After"] == "3"
    s.node.go.set()
    assert (await first).choices[0].finish_reason == "length"


async def test_full_pool_falls_back_to_native(make_stack):
    s = await make_stack()
    s.node.go.clear()
    c = s.client()
    first = asyncio.create_task(c.completions.create(model=MODEL, prompt="a", max_tokens=3))
    await until(lambda: len(s.node.generates) == 1)
    r = await c.completions.create(model=MODEL, prompt="a", max_tokens=3)
    assert len(s.native.bodies) == 1 and r.choices[0].text == "".join(WORDS[:3])
    s.node.go.set()
    assert (await first).choices[0].text == " hello w0 w1"


async def test_node_says_full_router_moves_on(make_stack):
    """Another router took the slot: the node's 429 makes this router try the next node."""
    s = await make_stack(node_slots=(1, 1))
    s.nodes[0].slots = 0  # node t0 answers 429 although the router counts a free slot
    s.nodes[1].slots = 1
    c = s.client()
    for _ in range(2):
        r = await c.completions.create(model=MODEL, prompt="a", max_tokens=2, extra_headers=ROUTE)
        assert r.choices[0].text == " hello w0"
    assert s.nodes[0].rejected_full >= 1 and len(s.nodes[1].generates) == 2


async def test_too_long_goes_native(make_stack):
    s = await make_stack()
    s.node.max_seq_len = 10
    c = s.client()
    r = await c.completions.create(model=MODEL, prompt="a", max_tokens=50)
    assert len(s.native.bodies) == 1 and r.choices[0].finish_reason == "length"
    assert s.state.pools.tilert["t0"].in_use == 0


@pytest.mark.parametrize("route", ["tilert", "native"])
async def test_client_gone_mid_stream_is_not_an_upstream_error(make_stack, route, caplog):
    s = await make_stack()
    s.node.token_interval_s = 0.05
    s.native.token_interval_s = 0.05
    s.native.tokens = 50
    body = {"model": MODEL, "prompt": "a", "max_tokens": 50, "stream": True}
    async with aiohttp.ClientSession() as http:
        resp = await http.post(s.router_url + "/v1/completions", json=body, headers={"x-pd-route": route})
        await resp.content.readuntil(b"\n\n")
        resp.close()
    # The handler has ended (it counts the request last) and so has the cancel sent for it: every
    # error they could log is in the log by then.
    reg = s.state.metrics.registry
    await until(
        lambda: (
            reg.get_sample_value("tilert_router_requests_total", {"path": route, "outcome": "client_gone"})
            == 1
            and not s.state.background
        )
    )
    assert s.state.pools.tilert["t0"].in_use == 0 and s.state.pools.native[s.native.url].inflight == 0
    await until(lambda: s.node.active == 0)
    assert not [r for r in caplog.records if r.levelname == "ERROR"], caplog.text
    assert 'kind="stream_broken"' not in s.state.metrics.render().decode()
