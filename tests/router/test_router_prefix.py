"""The router's prefill choice end to end (fake upstreams): cache_aware sends a shared prefix to the
prefill that got it first, gives way to an idle prefill past the balance thresholds, and keeps the
retry's exclusion; round_robin and least_loaded as named; the metrics count what happened."""

from __future__ import annotations

from router_fakes import MODEL

from tilert_serve.router.config import Endpoint

TILERT = {"x-pd-route": "tilert"}
NATIVE = {"x-pd-route": "native"}
SYSTEM = "You are a careful assistant who answers in one short sentence. " * 8  # ~15 blocks of 128


def _count(metric, *labels: str) -> float:
    child = metric.labels(*labels) if labels else metric
    return float(child._value.get())


def _sent(s) -> list[int]:
    return [len(p.bodies) for p in s.prefills]


async def test_a_shared_prefix_stream_goes_to_the_prefill_that_got_it_first(make_stack):
    s = await make_stack(n_prefill=3, node_slots=(2,))
    c = s.client()
    await c.completions.create(model=MODEL, prompt=SYSTEM + "Question 0?", max_tokens=2, extra_headers=TILERT)
    home = _sent(s).index(1)
    for i in range(1, 7):
        route = TILERT if i % 2 else NATIVE  # either decode path: the prefill choice is the same
        r = await c.completions.create(
            model=MODEL, prompt=SYSTEM + f"Question {i}?", max_tokens=2, extra_headers=route
        )
        assert r.choices[0].text
    assert _sent(s)[home] == 7 and sum(_sent(s)) == 7
    m = s.state.metrics
    assert _count(m.prefill_choices, "cache_aware", "prefix") == 6
    assert _count(m.prefill_choices, "cache_aware", "short_match") == 1  # the first: nobody held it
    prompt_blocks = _count(m.prefix_prompt_blocks)
    assert prompt_blocks == 7 * (len(SYSTEM + "Question 0?") // 128)
    # Each later request matched at least the system prompt's whole blocks.
    assert _count(m.prefix_matched_blocks) >= 6 * (len(SYSTEM) // 128)
    assert _count(m.prefix_index_blocks) == len(s.state.pools.prefixes) > 0


async def test_a_chat_conversation_stays_on_its_prefill_and_another_system_prompt_may_not(make_stack):
    s = await make_stack(n_prefill=2, node_slots=(2,))
    c = s.client()
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is a router?"}]
    for turn in range(4):
        r = await c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=2, extra_headers=TILERT)
        msgs += [
            {"role": "assistant", "content": r.choices[0].message.content},
            {"role": "user", "content": f"And then, turn {turn}?"},
        ]
    assert sorted(_sent(s)) == [0, 4]


async def test_a_loaded_home_loses_to_an_idle_prefill_past_the_threshold(make_stack):
    s = await make_stack(n_prefill=2, node_slots=(2,), policy={"balance_abs": 2, "balance_rel": 1.5})
    c = s.client()
    await c.completions.create(model=MODEL, prompt=SYSTEM + "first", max_tokens=2, extra_headers=TILERT)
    home = _sent(s).index(1)
    other = 1 - home
    ep = s.state.pools.prefill[s.prefills[home].url]
    # Two more in flight than the idle one: not past balance_abs, the prefix wins.
    ep.inflight = 2
    await c.completions.create(model=MODEL, prompt=SYSTEM + "second", max_tokens=2, extra_headers=TILERT)
    assert _sent(s)[home] == 2 and _sent(s)[other] == 0
    # Three more (and 3 > 0 * 1.5): past both thresholds, the idle one takes it.
    ep.inflight = 3
    await c.completions.create(model=MODEL, prompt=SYSTEM + "third", max_tokens=2, extra_headers=TILERT)
    assert _sent(s)[other] == 1
    ep.inflight = 0
    assert _count(s.state.metrics.prefill_choices, "cache_aware", "imbalance") == 1


async def test_round_robin_alternates_whatever_the_prompt(make_stack):
    s = await make_stack(n_prefill=3, node_slots=(2,), policy={"prefill": "round_robin"})
    c = s.client()
    order = []
    for _ in range(6):
        before = _sent(s)
        await c.completions.create(model=MODEL, prompt=SYSTEM, max_tokens=2, extra_headers=TILERT)
        order.append(next(i for i, (a, b) in enumerate(zip(before, _sent(s), strict=True)) if b > a))
    assert order[:3] == order[3:] and sorted(order[:3]) == [0, 1, 2]
    assert _count(s.state.metrics.prefill_choices, "round_robin", "round_robin") == 6
    assert len(s.state.pools.prefixes) == 0  # nothing learnt outside cache_aware


async def test_least_loaded_ignores_the_prefix(make_stack):
    s = await make_stack(n_prefill=2, node_slots=(2,), policy={"prefill": "least_loaded"})
    c = s.client()
    await c.completions.create(model=MODEL, prompt=SYSTEM + "a", max_tokens=2, extra_headers=TILERT)
    home = _sent(s).index(1)
    s.state.pools.prefill[s.prefills[home].url].inflight = 1
    await c.completions.create(model=MODEL, prompt=SYSTEM + "b", max_tokens=2, extra_headers=TILERT)
    s.state.pools.prefill[s.prefills[home].url].inflight = 0
    assert _sent(s) == [1, 1]


async def test_a_retry_still_excludes_the_prefill_that_failed_even_when_it_holds_the_prefix(make_stack):
    s = await make_stack(n_prefill=2, node_slots=(2,))
    c = s.client()
    await c.completions.create(model=MODEL, prompt=SYSTEM + "warm", max_tokens=2, extra_headers=TILERT)
    home = _sent(s).index(1)
    s.prefills[home].fail_status, s.prefills[home].fail_count = 500, 2  # its next request fails
    r = await c.completions.create(model=MODEL, prompt=SYSTEM + "again", max_tokens=2, extra_headers=TILERT)
    assert r.choices[0].text
    assert _sent(s)[home] == 2 and _sent(s)[1 - home] == 1  # failed once there, served by the other
    assert _count(s.state.metrics.retries, "tilert", "http_5xx") == 1


async def test_a_prefill_removed_from_the_config_is_forgotten(make_stack):
    s = await make_stack(n_prefill=2, node_slots=(2,))
    c = s.client()
    await c.completions.create(model=MODEL, prompt=SYSTEM, max_tokens=2, extra_headers=TILERT)
    home = s.prefills[_sent(s).index(1)].url
    assert s.state.pools.prefixes.size(home) > 0
    keep = [p.url for p in s.prefills if p.url != home]
    s.state.apply(s.cfg.model_copy(update={"prefill": [Endpoint(url=u) for u in keep]}))
    assert s.state.pools.prefixes.endpoints() == [] and len(s.state.pools.prefixes) == 0
