"""Exact admission under concurrency: 100 concurrent requests against 3 TileRT slots."""

from __future__ import annotations

import asyncio

import openai
import pytest

MODEL = "tiny"


@pytest.mark.parametrize("overflow", ["native", "reject"])
async def test_100_concurrent_against_3_slots(make_stack, overflow):
    s = await make_stack(node_slots=(3,), policy={"when_tilert_full": overflow})
    s.node.token_interval_s = 0.002
    s.native.token_interval_s = 0.002
    s.native.tokens = 6
    c = s.client(timeout=60)

    async def one(i: int):
        try:
            if i % 2:
                stream = await c.completions.create(model=MODEL, prompt=f"p{i}", max_tokens=6, stream=True)
                return "".join([ch.choices[0].text async for ch in stream if ch.choices])
            r = await c.completions.create(model=MODEL, prompt=f"p{i}", max_tokens=6)
            return r.choices[0].text
        except openai.RateLimitError as e:
            assert e.response.headers.get("Retry-After") == "1"
            return "429"

    results = await asyncio.gather(*(one(i) for i in range(100)))
    assert len(results) == 100
    done = [r for r in results if r != "429"]
    assert all(len(r.split()) == 6 for r in done), results  # every answered request is whole
    assert s.node.max_active <= 3
    assert s.node.rejected_full == 0  # the router never asked a full node
    assert s.node.completed >= 3
    if overflow == "native":
        assert len(done) == 100 and len(s.native.bodies) == 100 - s.node.completed
    else:
        assert s.native.bodies == []
        assert len(done) == s.node.completed
    await asyncio.sleep(0.05)
    assert s.state.pools.tilert["t0"].in_use == 0 and s.node.active == 0
