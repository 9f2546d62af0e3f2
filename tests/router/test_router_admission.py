"""Exact admission under concurrency: 100 concurrent requests against 3 TileRT slots."""

from __future__ import annotations

import asyncio

import openai
import pytest
from router_fakes import MODEL, until


@pytest.mark.parametrize("slots", [(3,), (1, 1, 1)], ids=["one-node-3-slots", "three-nodes-1-slot"])
@pytest.mark.parametrize("overflow", ["native", "reject"])
async def test_100_concurrent_against_3_slots(make_stack, overflow, slots):
    s = await make_stack(node_slots=slots, policy={"when_tilert_full": overflow})
    for n in s.nodes:
        n.token_interval_s = 0.002
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
    for n in s.nodes:
        assert n.max_active <= n.slots  # never more requests at a node than it has slots
        assert n.rejected_full == 0  # the router never asked a full node
    completed = sum(n.completed for n in s.nodes)
    assert completed >= 3
    if overflow == "native":
        assert len(done) == 100 and len(s.native.bodies) == 100 - completed
    else:
        assert s.native.bodies == []
        assert len(done) == completed
    # Every slot comes back, some through background work that may outlive the last response.
    await until(
        lambda: (
            all(p.in_use == 0 for p in s.state.pools.tilert.values()) and all(n.active == 0 for n in s.nodes)
        )
    )
