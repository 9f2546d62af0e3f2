"""The planner's rules, one at a time, then its windows over sequences of load (no flapping on a noisy
signal), and a property test over random load: replicas stay within bounds and change no more often
than the windows allow."""

from __future__ import annotations

import itertools
from dataclasses import replace
from typing import Any

import pdc_helpers as helpers
from hypothesis import given, settings
from hypothesis import strategies as st

from tilert_operator import spec as specmod
from tilert_operator.autoscale import planner
from tilert_operator.autoscale.decision import POOLS, Decision, History, PoolName
from tilert_operator.autoscale.inputs import NativeObserved, Observed, PrefillObserved, TileRTObserved

DT = 15.0


def _spec(
    *,
    prefill: tuple[int, int, int] = (1, 1, 4),
    tilert: tuple[int, int, int] = (1, 1, 8),
    native: tuple[int, int, int] = (0, 0, 4),
    slots: int = 4,
    up_s: int = 0,
    down_s: int = 300,
    **top: Any,
) -> specmod.PDClusterSpec:
    """Pools as (replicas, min, max), all autoscaled."""

    def pool(r: tuple[int, int, int]) -> dict[str, Any]:
        return {
            "replicas": r[0],
            "autoscaling": {
                "enabled": True,
                "minReplicas": r[1],
                "maxReplicas": r[2],
                "scaleUpStabilizationSeconds": up_s,
                "scaleDownStabilizationSeconds": down_s,
            },
        }

    return specmod.parse(
        helpers.minimal(
            prefill=pool(prefill),
            decode={"tilert": {**pool(tilert), "slots": slots}, "native": pool(native)},
            **top,
        )
    )


def _obs(
    *,
    current: dict[str, int] | None = None,
    p_rate: float = 0.0,
    p_s: float = 0.2,
    p_wait: float = 0.0,
    ttft: float | None = None,
    busy: tuple[int, ...] = (0,),
    slots: int = 4,
    admit: float = 0.0,
    overflow: float = 0.0,
    t_tpot: float | None = None,
    kv: float = 0.0,
    n_ready: int = 0,
    n_wait: float = 0.0,
    n_rate: float = 0.0,
    n_tpot: float | None = None,
    stream_s: float = 4.0,
) -> Observed:
    cur = current or {}
    return Observed(
        prefill=PrefillObserved(cur.get("prefill", 1), p_rate, p_s, p_wait, ttft),
        tilert=TileRTObserved(len(busy), slots, busy, admit, overflow, t_tpot),
        native=NativeObserved(n_ready, kv, n_wait, n_rate, n_tpot),
        current=cur,
        mean_stream_s=stream_s,
    )


def _plan(
    spec: specmod.PDClusterSpec, obs: Observed, history: History | None = None, now: float = 0.0
) -> Decision:
    return planner.plan(spec, obs, history or History(), now)


# -- each rule ------------------------------------------------------------------------------------------


def test_tilert_is_sized_from_busy_slots_at_the_target_utilization() -> None:
    # 6 busy slots, 4 per node, target 0.7: 6 / 2.8 = 2.14 -> 3 nodes.
    d = _plan(_spec(tilert=(2, 1, 8)), _obs(current={"tilert": 2}, busy=(3, 3), admit=1.5))
    assert (d.tilert.recommended, d.tilert.desired) == (3, 3)
    assert "6.0 slots wanted" in d.tilert.reason


def _overflowing() -> Observed:
    """2 full nodes admitting 2/s (hold 8 / 2 = 4 s), 1/s overflowing to 1 native replica at KV 90 %."""
    return _obs(
        current={"tilert": 2, "native": 1},
        busy=(4, 4),
        admit=2.0,
        overflow=1.0,
        kv=0.9,
        n_ready=1,
        n_rate=1.0,
    )


def test_overflow_drives_tilert_first_and_native_does_not_grow_for_it() -> None:
    # 8 busy + 1/s x 4 s overflowing = 12 slots -> 5 nodes. The native pool's whole load is that
    # overflow, which TileRT at 5 takes over: no native growth.
    d = _plan(_spec(tilert=(2, 1, 8), native=(1, 0, 4)), _overflowing())
    assert d.tilert.desired == 5
    # Without TileRT first, KV 90 % of 1 replica at 0.7 would ask for 2 (the next test).
    assert d.native.desired == 1 and "TileRT takes over" in d.native.reason


def test_overflow_tilert_cannot_take_goes_to_native() -> None:
    # Same load, TileRT capped at 2 nodes: all the overflow stays native; KV 90 % of 1 -> 2 replicas.
    d = _plan(_spec(tilert=(2, 1, 2), native=(1, 0, 4)), _overflowing())
    assert d.tilert.desired == 2 and "maxReplicas 2" in d.tilert.reason
    assert d.native.desired == 2


def test_overflow_with_native_at_zero_brings_native_up() -> None:
    spec = _spec(tilert=(2, 1, 2), native=(0, 0, 4))
    d = _plan(spec, _obs(current={"tilert": 2, "native": 0}, busy=(4, 4), admit=2.0, overflow=1.0))
    assert d.native.desired == 1 and "TileRT cannot take" in d.native.reason


def test_native_queue_and_tpot_each_add_a_replica() -> None:
    spec = _spec(native=(2, 0, 4))
    calm = _obs(current={"native": 2}, kv=0.3, n_ready=2)
    assert _plan(spec, calm).native.recommended == 1
    assert _plan(spec, replace(calm, native=replace(calm.native, waiting=3))).native.recommended == 3
    slow = replace(calm, native=replace(calm.native, tpot_s=0.5))
    d = _plan(spec, slow)
    assert d.native.recommended == 3 and "TPOT 0.500 s above 0.1 s" in d.native.reason


def test_prefill_is_sized_from_arrivals_times_prefill_time() -> None:
    # 10/s x 0.2 s = 2 busy replicas at 0.7 -> 3.
    d = _plan(_spec(), _obs(p_rate=10.0, p_s=0.2))
    assert (d.prefill.recommended, d.prefill.desired) == (3, 3)


def test_a_missed_ttft_adds_a_prefill_only_when_the_prefill_queue_explains_it() -> None:
    spec = _spec(prefill=(2, 1, 4), autoscaling={"targetUtilization": 0.95})
    # 9/s x 0.2 s = 1.8 busy of 2: an M/M/2 queue waits seconds at p95; the TTFT miss is the prefill's.
    busy = _obs(current={"prefill": 2}, p_rate=9.0, p_s=0.2, ttft=3.0)
    d = _plan(spec, busy)
    assert d.prefill.recommended == 3 and "TTFT 3.00 s above 2 s: 3" in d.prefill.reason
    # 1/s x 0.2 s: the prefill's own p95 is 0.2 s; the time went to the native queue, which grows.
    idle = _obs(current={"prefill": 2, "native": 0}, p_rate=1.0, p_s=0.2, ttft=3.0)
    d = _plan(spec, idle)
    assert d.prefill.recommended == 1 and "not the prefill's" in d.prefill.reason
    assert d.native.desired == 1 and "TTFT missed in the native queue" in d.native.reason


def test_a_missed_ttft_while_tilert_overflows_grows_tilert_first() -> None:
    spec = _spec(tilert=(1, 1, 4), native=(1, 1, 4))
    obs = _obs(
        current={"prefill": 1, "tilert": 1, "native": 1},
        p_rate=1.0,
        ttft=3.0,
        busy=(1,),
        admit=1.0,
        overflow=0.001,
        kv=0.3,
        n_ready=1,
        n_rate=0.5,
    )
    d = _plan(spec, obs)
    assert d.tilert.desired == 2 and "TTFT missed while overflowing" in d.tilert.reason
    assert d.native.desired == 1


def test_a_tilert_tpot_miss_adds_a_node() -> None:
    spec = _spec(tilert=(2, 1, 8))
    d = _plan(spec, _obs(current={"tilert": 2}, busy=(1, 1), admit=0.5, t_tpot=0.3))
    assert d.tilert.desired == 3


def test_bounds_clamp_the_recommendation() -> None:
    spec = _spec(prefill=(2, 2, 3))
    assert _plan(spec, _obs(current={"prefill": 2}, p_rate=100.0)).prefill.desired == 3
    assert _plan(spec, _obs(current={"prefill": 2}, p_rate=0.0)).prefill.desired == 2


def test_a_pool_with_autoscaling_off_keeps_its_replicas() -> None:
    spec = specmod.parse(helpers.minimal(prefill={"replicas": 2}))
    d = _plan(spec, _obs(current={"prefill": 2}, p_rate=100.0))
    assert d.prefill.desired == 2 and "autoscaling off" in d.prefill.reason


def test_ratio_max_raises_decode_tilert_first() -> None:
    spec = _spec(
        prefill=(1, 1, 8),
        tilert=(1, 1, 8),
        native=(1, 0, 8),
        autoscaling={"prefillToDecodeRatio": {"max": 1}},
    )
    # Prefill wants 4 (2 busy / 0.7 -> 3 ... 4.2 busy -> 6); decode wants 1 + 0: ratio max 1 -> decode 6.
    obs = _obs(current={"prefill": 1, "tilert": 1, "native": 1}, p_rate=21.0, p_s=0.2, busy=(1,), admit=0.5)
    d = _plan(spec, obs)
    assert d.prefill.desired == 6
    assert d.tilert.desired + d.native.desired >= 6
    assert d.tilert.desired == 6 - d.native.desired and d.native.desired <= 1
    assert "ratio max 1" in d.tilert.reason


def test_ratio_min_raises_the_prefill() -> None:
    spec = _spec(prefill=(1, 1, 8), tilert=(4, 1, 8), autoscaling={"prefillToDecodeRatio": {"min": 0.5}})
    d = _plan(spec, _obs(current={"prefill": 1, "tilert": 4}, busy=(3, 3, 3, 3), admit=3.0))
    # TileRT wants ceil(12 / 2.8) = 5 nodes, so the prefill must be at least 3.
    assert d.tilert.desired == 5 and d.prefill.desired == 3


def test_tilert_never_drops_below_a_node_holding_streams() -> None:
    spec = _spec(tilert=(4, 1, 8), down_s=0)
    d = _plan(spec, _obs(current={"tilert": 4}, busy=(0, 0, 0, 1), admit=0.1))
    assert d.tilert.recommended == 1 and d.tilert.desired == 4 and d.drain_first == (3,)
    assert "drained first" in d.tilert.reason
    d = _plan(spec, _obs(current={"tilert": 4}, busy=(1, 0, 1, 0), admit=0.1))
    assert d.tilert.desired == 3 and d.drain_first == (2,)
    d = _plan(spec, _obs(current={"tilert": 4}, busy=(1, 0, 0, 0), admit=0.1))
    assert d.tilert.desired == 1 and d.drain_first == ()


# -- windows over time ------------------------------------------------------------------------------


def _run(spec: specmod.PDClusterSpec, loads: list[Observed]) -> list[Decision]:
    """Feed each decision's replicas back as the next interval's current (pods ready at once)."""
    history = History()
    keep = planner.history_keep_s(spec)
    current: dict[str, int] = {p: b.lo for p, b in planner.pool_bounds(spec).items()}
    out = []
    for i, obs in enumerate(loads):
        d = planner.plan(spec, replace(obs, current=dict(current)), history, i * DT)
        history = history.add(d, keep)
        current = {p: d.pool(p).desired for p in POOLS}
        out.append(d)
    return out


def test_scale_down_waits_for_the_window() -> None:
    spec = _spec(prefill=(1, 1, 8))
    high, low = _obs(p_rate=14.0), _obs(p_rate=1.0)  # 4 replicas, then 1
    ds = _run(spec, [high] * 4 + [low] * 30)
    series = [d.prefill.desired for d in ds]
    assert series[:4] == [4] * 4
    last_high = 3 * DT
    for i, d in enumerate(ds):
        if i * DT - last_high < 300:
            assert d.prefill.desired == 4, (i, series)
    assert series[-1] == 1
    assert "held at 4 by the 300 s window" in ds[5].prefill.reason


def test_a_noisy_signal_does_not_flap() -> None:
    spec = _spec(prefill=(1, 1, 8))
    noisy = [_obs(p_rate=14.0 if i % 3 == 0 else 2.0) for i in range(60)]
    series = [d.prefill.desired for d in _run(spec, noisy)]
    changes = sum(1 for a, b in itertools.pairwise(series) if a != b)
    assert changes == 0 and series[0] == 4, series


def test_a_one_interval_spike_does_not_scale_up_with_an_up_window() -> None:
    spec = _spec(prefill=(1, 1, 8), up_s=60)
    loads = [_obs(p_rate=1.0)] * 4 + [_obs(p_rate=14.0)] + [_obs(p_rate=1.0)] * 4 + [_obs(p_rate=14.0)] * 6
    series = [d.prefill.desired for d in _run(spec, loads)]
    assert max(series[:9]) == 1
    # Sustained: up once every recommendation of the last 60 s, (t - 60, t], asks for 4: the 4th
    # high interval.
    assert series[9:] == [1, 1, 1, 4, 4, 4], series


# -- property: bounds and windows hold on any load ----------------------------------------------------

load_step = st.fixed_dictionaries(
    {
        "p_rate": st.floats(0, 60),
        "p_wait": st.floats(0, 20),
        "ttft": st.one_of(st.none(), st.floats(0, 10)),
        "busy_share": st.floats(0, 1),
        "admit": st.floats(0, 10),
        "overflow": st.floats(0, 10),
        "kv": st.floats(0, 1),
        "n_tpot": st.one_of(st.none(), st.floats(0, 1)),
    }
)


@settings(max_examples=60, deadline=None)
@given(
    steps=st.lists(load_step, min_size=5, max_size=60),
    up_s=st.sampled_from([0, 30, 60]),
    down_s=st.sampled_from([0, 60, 300]),
    ratio=st.sampled_from([None, (0.25, 2.0)]),
)
def test_replicas_stay_in_bounds_and_change_no_faster_than_the_windows(
    steps: list[dict[str, Any]], up_s: int, down_s: int, ratio: tuple[float, float] | None
) -> None:
    top = {"autoscaling": {"prefillToDecodeRatio": {"min": ratio[0], "max": ratio[1]}}} if ratio else {}
    spec = _spec(prefill=(1, 1, 6), tilert=(1, 1, 5), native=(1, 0, 5), up_s=up_s, down_s=down_s, **top)
    bounds = planner.pool_bounds(spec)
    history = History()
    current: dict[PoolName, int] = {p: bounds[p].lo for p in POOLS}
    recs: dict[PoolName, list[tuple[float, int]]] = {p: [] for p in POOLS}
    last_up: dict[PoolName, float] = {}
    for i, s in enumerate(steps):
        now = i * DT
        t_ready = current["tilert"]
        busy = tuple(round(s["busy_share"] * 4) if j == t_ready - 1 else 0 for j in range(t_ready))
        obs = _obs(
            current=dict(current),
            p_rate=s["p_rate"],
            p_wait=s["p_wait"],
            ttft=s["ttft"],
            busy=busy,
            admit=s["admit"],
            overflow=s["overflow"],
            kv=s["kv"],
            n_ready=current["native"],
            n_rate=s["overflow"] + 0.5,
            n_tpot=s["n_tpot"],
        )
        d = planner.plan(spec, obs, history, now)
        history = history.add(d, planner.history_keep_s(spec))
        for p in POOLS:
            pd = d.pool(p)
            recs[p].append((now, pd.recommended))
            assert bounds[p].lo <= pd.desired <= bounds[p].hi, (p, pd)
            if p == "tilert" and pd.desired < current[p]:
                assert all(b == 0 for b in busy[pd.desired :]), (busy, pd)  # no node with streams removed
            if ratio is None and pd.desired > current[p]:
                last_up[p] = now
                window = [r for t, r in recs[p] if now - up_s < t <= now] if up_s else [pd.recommended]
                assert min(window) >= pd.desired  # a rise only when the whole up window asked for it
            if ratio is None and pd.desired < current[p] and p != "tilert":
                assert p not in last_up or now - last_up[p] >= down_s, (p, now, last_up[p])
                window = [r for t, r in recs[p] if now - down_s < t <= now] if down_s else [pd.recommended]
                assert max(window) <= pd.desired  # a fall only to the highest of the down window
        current = {p: d.pool(p).desired for p in POOLS}
        if ratio is not None:
            decode = current["tilert"] + current["native"]
            assert (
                current["prefill"] <= ratio[1] * decode + 1e-9 or current["prefill"] == bounds["prefill"].lo
            )
