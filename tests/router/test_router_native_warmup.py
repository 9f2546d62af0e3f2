"""Warming (prefill, native decode) pairs before users need them (router/native_pairs.py,
native_warmup.py): the first KV a native decode pulls from a prefill pays the connector's first
contact, so the router sends one small request of its own through each new pair, and while some pair
is warm, native requests go through warm pairs; `tilert-pd local apply` waits for the warm-ups before
it removes an old pod.
"""

from __future__ import annotations

import asyncio
from typing import Any

from router_fakes import MODEL, until

from tilert_serve.local import apply
from tilert_serve.router import config, native_warmup
from tilert_serve.router.native_pairs import PairTable
from tilert_serve.router.pools import Endpoint, Pools

WARMUP = {"native_warmup": {"enabled": True, "retry_s": 0.2}, "health": {"interval_s": 0.05}}


def _ep(url: str, pool: str, generation: str | None = None) -> Endpoint:
    return Endpoint(url, pool, healthy=True, compat=generation)


def test_a_pair_goes_cold_warming_warm_and_cold_again_when_a_side_restarts() -> None:
    t = PairTable()
    p0, p1, n = _ep("p0", "prefill"), _ep("p1", "prefill"), _ep("n", "native")
    assert t.due([p0, p1], [n], 0.0, 10.0) == [(p0, n), (p1, n)]
    t.started(p0, n)
    assert t.state(p0, n) == "warming" and t.due([p0, p1], [n], 0.0, 10.0) == [(p1, n)]
    t.succeeded(p0, n)
    t.failed(p1, n, now=100.0)
    assert t.warm(p0, n) and not t.warm(p1, n)
    assert t.due([p0, p1], [n], 105.0, 10.0) == []  # p1's failure is retried after retry_s
    assert t.due([p0, p1], [n], 110.0, 10.0) == [(p1, n)]
    p0.cache_epoch += 1  # p0 restarted: a new process has met nobody
    assert t.state(p0, n) == "cold"
    assert t.counts([p0, p1], [n]) == {"cold": 1, "warming": 0, "warm": 0, "failed": 1}
    t.keep_only(["p1"], ["n"])
    p0.cache_epoch -= 1
    assert t.state(p0, n) == "cold"  # forgotten when p0 left the config


def test_only_healthy_pairs_of_one_generation_are_warmed_or_counted() -> None:
    t = PairTable()
    pa, pb, na = _ep("pa", "prefill", "a"), _ep("pb", "prefill", "b"), _ep("na", "native", "a")
    assert t.due([pa, pb], [na], 0.0, 1.0) == [(pa, na)]
    pa.healthy = None  # not probed yet: not warmed, but counted (local apply waits for it)
    assert t.due([pa, pb], [na], 0.0, 1.0) == []
    assert t.counts([pa, pb], [na])["cold"] == 1
    pa.healthy = False  # ejected: neither
    assert t.counts([pa, pb], [na]) == {"cold": 0, "warming": 0, "warm": 0, "failed": 0}


def _pairs(s: Any) -> dict[str, int]:
    pools = s.state.pools
    return dict(pools.pairs.counts(pools.prefill.values(), pools.native.values()))


def _pools(warmup: bool) -> tuple[Pools, Endpoint, Endpoint, Endpoint]:
    cfg = config.RouterConfig.model_validate(
        {"model": MODEL, "prefill": ["http://p"], "native": ["http://n0", "http://n1"]}
        | ({"native_warmup": {"enabled": True}} if warmup else {})
    )
    pools = Pools(cfg)
    p, n0, n1 = pools.prefill["http://p"], pools.native["http://n0"], pools.native["http://n1"]
    for e in (p, n0, n1):
        e.healthy = True
    return pools, p, n0, n1


def test_native_requests_go_through_warm_pairs_while_one_is_cold() -> None:
    pools, p, n0, n1 = _pools(warmup=True)
    pools.pairs.succeeded(p, n0)
    assert {pools.pick_native(set(), 10).url for _ in range(20)} == {"http://n0"}
    pools.pairs.succeeded(p, n1)
    assert {pools.pick_native(set(), 10).url for _ in range(40)} == {"http://n0", "http://n1"}
    # With no warm pair at all (a cold start), every native decode is used.
    pools, p, n0, n1 = _pools(warmup=True)
    assert {pools.pick_native(set(), 10).url for _ in range(40)} == {"http://n0", "http://n1"}


def test_a_new_prefill_is_avoided_on_every_route_until_it_has_met_a_native_decode() -> None:
    cfg = config.RouterConfig.model_validate(
        {
            "model": MODEL,
            "prefill": ["http://p0", "http://p1"],
            "native": ["http://n"],
            "native_warmup": {"enabled": True},
        }
    )
    pools = Pools(cfg)
    p0, p1, n = pools.prefill["http://p0"], pools.prefill["http://p1"], pools.native["http://n"]
    for e in (p0, p1, n):
        e.healthy = True
    pools.pairs.succeeded(p0, n)
    assert {pools.pick_prefill(set()).url for _ in range(20)} == {"http://p0"}  # a TileRT request's choice
    pools.pairs.succeeded(p1, n)
    assert {pools.pick_prefill(set()).url for _ in range(20)} == {"http://p0", "http://p1"}


def test_without_warm_ups_a_cold_pair_is_not_avoided() -> None:
    """Only the warm-ups make a cold pair warm without users: with them off, avoiding it would starve it."""
    pools, p, n0, _n1 = _pools(warmup=False)
    pools.pairs.succeeded(p, n0)
    assert {pools.pick_native(set(), 10).url for _ in range(40)} == {"http://n0", "http://n1"}


async def test_the_router_warms_every_new_pair_and_local_apply_waits_for_it(make_stack: Any) -> None:
    s = await make_stack(n_prefill=2, n_native=2, health_checks=True, **WARMUP)
    warmups = lambda fake: [  # noqa: E731
        h for h in fake.headers if h.get("x-request-id", "").startswith(native_warmup.PREFIX)
    ]
    # Each native decode got one warm-up from each prefill (the prefill leg carries the remote-decode
    # parameters, the decode leg the prefill's answer), and the router reports every pair warm.
    await until(lambda: all(len(warmups(n)) == 2 for n in s.natives))
    all_warm = {"cold": 0, "warming": 0, "warm": 4, "failed": 0}
    await until(lambda: _pairs(s) == all_warm)
    assert await asyncio.to_thread(apply.native_pairs, s.router_url) == all_warm  # as local apply reads it
    assert all(len(warmups(p)) == 2 for p in s.prefills)
    first = next(
        b
        for b, h in zip(s.prefills[0].bodies, s.prefills[0].headers, strict=True)
        if h in warmups(s.prefills[0])
    )
    assert first["kv_transfer_params"]["do_remote_decode"] is True and first["max_tokens"] == 1
    warmed = s.state.metrics.native_warmups.labels("ok")._value.get()
    assert warmed == 4

    # A restarted native decode (a new process at the same address) is warmed again; local apply,
    # asked meanwhile, returns once it is.
    s.state.pools.native[s.natives[1].url].cache_epoch += 1
    said: list[str] = []
    await asyncio.to_thread(apply.await_warm, s.router_url, said.append)
    assert _pairs(s) == all_warm
    assert len(warmups(s.natives[1])) == 4 and len(warmups(s.natives[0])) == 2


async def test_a_failed_warm_up_is_retried_and_user_requests_are_still_served(make_stack: Any) -> None:
    s = await make_stack(n_prefill=1, n_native=1, health_checks=True, **WARMUP)
    native = s.natives[0]
    native.fail_status = 500
    await until(lambda: s.state.metrics.native_warmups.labels("failed")._value.get() >= 2)
    native.fail_status = None
    await until(lambda: _pairs(s) == {"cold": 0, "warming": 0, "warm": 1, "failed": 0})
    client = s.client()
    out = await client.completions.create(
        model=MODEL, prompt="hi", max_tokens=3, extra_headers={"x-pd-route": "native"}
    )
    assert out.choices[0].text
