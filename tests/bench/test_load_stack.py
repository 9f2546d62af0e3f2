"""The load harness through the real tiny stack (examples/tiny-cpu.yaml as `tilert-pd local up` runs
it) and vLLM alone beside it: a handful of requests over every route, streamed and not, completions
and chat, all answered, and every greedy output equal to vLLM alone's."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.load import references
from bench.load.harness import Load
from bench.load.plan import ROUTES, LoadPlan, Mix, PromptSet
from bench.load.stack import tiny_stack

# Booting three vLLMs on a busy 2-core box has taken 5 minutes; a component that never gets ready
# fails the start (with its log) within BOOT_S, inside the test's own limit.
BOOT_S = 600
pytestmark = [pytest.mark.slow, pytest.mark.timeout(BOOT_S + 300)]


async def test_a_handful_through_every_route_all_ok_and_equal_to_vllm_alone(tmp_path: Path) -> None:
    prompts = PromptSet(seed=7, n=3, max_tokens=(4, 10))
    plan = LoadPlan(rate=2.0, count=12, seed=7, prompts=prompts, mix=Mix(stream=0.5, chat=0.5))
    with tiny_stack(home=tmp_path / "home", timeout=BOOT_S) as stack:
        refs = await references.cached(tmp_path / "refs.json", stack.plain, prompts)
        assert (tmp_path / "refs.json").exists() and refs.covers(prompts)
        load = Load(stack.router, plan, references=refs)
        async with load:
            await load.finished()
    s = load.summary()
    assert s.total.requests == 12 and s.failed == 0, s.total.failures
    assert s.total.compared == 12 and s.mismatches == 0, [
        (r.route_asked, r.route_served, r.text) for r in load.records if r.greedy_match is False
    ]
    # The router says which path served each. A native request is served native; a TileRT one is
    # served by TileRT unless the router fell back (its policy may when no node can take it).
    assert {r.route_asked for r in load.records} <= set(ROUTES)
    for r in load.records:
        assert r.route_served in ("tilert", "native")
        if r.route_asked == "native":
            assert r.route_served == "native"
    assert s.total.served == {
        p: sum(r.route_served == p for r in load.records) for p in {r.route_served for r in load.records}
    }
    assert any(r.stream for r in load.records) and any(not r.stream for r in load.records)
    assert all(r.ttft is not None for r in load.records if r.stream)
