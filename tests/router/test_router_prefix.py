"""The router's prefill choice end to end (fake upstreams): cache_aware sends a shared prefix to the
prefill that got it first, gives way to an idle prefill past the balance thresholds, and keeps the
retry's exclusion; round_robin and least_loaded as named; the metrics count what happened."""

from __future__ import annotations

import random

import yaml
from router_fakes import MODEL

from tilert_serve.router.config import Endpoint, RouterConfig, RoutingPolicy
from tilert_serve.router.config import dump as config_dump
from tilert_serve.router.pools import Pools

TILERT = {"x-pd-route": "tilert"}
NATIVE = {"x-pd-route": "native"}
#: RoutingPolicy's fields before the prefill choice existed: what a router of the previous release takes.
PREVIOUS_POLICY_FIELDS = {
    "header",
    "tilert_aliases",
    "native_aliases",
    "default",
    "when_tilert_full",
    "unsupported_on_tilert",
    "retry_after_s",
    "retries",
    "retry_budget_ratio",
    "retry_budget_min",
    "retry_budget_window_s",
}
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


async def test_a_chat_conversation_stays_on_its_prefill(make_stack):
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


def _pools(policy: dict[str, object], natives: int = 4):
    cfg = RouterConfig(
        model=MODEL,
        prefill=["http://p0", "http://p1"],
        native=[f"http://n{i}" for i in range(natives)],
        policy=RoutingPolicy(**policy),
    )
    return Pools(cfg, rng=random.Random(11))


def test_native_power_of_two_spreads_keeps_the_cap_and_prefers_untried_servers():
    pools = _pools({})
    for _ in range(400):  # requests that stay in flight
        ep = pools.pick_native(set(), cap=1000)
        assert ep is not None
        ep.inflight += 1
    loads = sorted(e.inflight for e in pools.native.values())
    assert loads[-1] - loads[0] <= 2 and sum(loads) == 400
    # At the cap a server is never drawn; with every server at it there is none.
    for e in pools.native.values():
        e.inflight = 5
    pools.native["http://n2"].inflight = 4
    assert all(pools.pick_native(set(), cap=5).url == "http://n2" for _ in range(20))
    pools.native["http://n2"].inflight = 5
    assert pools.pick_native(set(), cap=5) is None
    # A retry draws among the servers it has not tried while there are some.
    for e in pools.native.values():
        e.inflight = 0
    tried = {"http://n0", "http://n1", "http://n2"}
    assert all(pools.pick_native(tried, cap=5).url == "http://n3" for _ in range(20))


def test_native_least_loaded_is_still_offered():
    pools = _pools({"native": "least_loaded"})
    pools.native["http://n0"].inflight = 3
    pools.native["http://n1"].inflight = 1
    pools.native["http://n2"].inflight = 2
    pools.native["http://n3"].inflight = 2
    assert pools.pick_native(set(), cap=10).url == "http://n1"


def test_pick_prefill_without_a_request_is_least_loaded_and_learns_nothing():
    pools = _pools({})
    pools.prefill["http://p0"].inflight = 2
    assert pools.pick_prefill(set()).url == "http://p1"
    assert len(pools.prefixes) == 0


def test_a_config_at_the_default_choice_dumps_as_the_previous_release_reads_it():
    plain = RouterConfig(model=MODEL, prefill=["http://p0"])
    policy = yaml.safe_load(config_dump(plain))["policy"]
    assert not set(policy) & set(RoutingPolicy.model_fields) - PREVIOUS_POLICY_FIELDS
    tuned = plain.model_copy(update={"policy": RoutingPolicy(prefill="round_robin", balance_abs=3)})
    back = RouterConfig.model_validate(yaml.safe_load(config_dump(tuned)))
    assert back.policy == tuned.policy


async def test_a_prefill_that_was_ejected_or_refused_a_connection_starts_cold(make_stack):
    s = await make_stack(n_prefill=2, node_slots=(2,))
    c = s.client()
    m, pools = s.state.metrics, s.state.pools

    async def warm() -> str:
        await c.completions.create(model=MODEL, prompt=SYSTEM + "warm", max_tokens=2, extra_headers=TILERT)
        home = next(url for url, ep in pools.prefill.items() if pools.prefixes.size(url))
        assert pools.prefixes.size(home) > 0
        return home

    home = await warm()
    ep = pools.prefill[home]
    for _ in range(s.cfg.health.failures_to_eject):  # ejected by its probes (health.py does this)
        ep.record_failure(s.cfg.health, "probe timed out")
    ep.record_ok(s.cfg.health)
    short = _count(m.prefill_choices, "cache_aware", "short_match")
    await c.completions.create(model=MODEL, prompt=SYSTEM + "after", max_tokens=2, extra_headers=TILERT)
    assert _count(m.prefill_choices, "cache_aware", "short_match") == short + 1  # nothing matched

    pools.prefixes.keep_only([])
    home = await warm()
    ep = pools.prefill[home]
    ep.breaker_failed(0.0, "connect: refused", at_once=True)
    ep.breaker_ok()
    short = _count(m.prefill_choices, "cache_aware", "short_match")
    await c.completions.create(model=MODEL, prompt=SYSTEM + "again", max_tokens=2, extra_headers=TILERT)
    assert _count(m.prefill_choices, "cache_aware", "short_match") == short + 1
