"""The planner: one pure function from a planning interval's observed load to the replicas each pool
should have, with the reason, for the three serving pools at once.

The rules, in the order they apply (docs/autoscaling.md says why each is so):

1. **What the load asks for**, per pool, sized so that the pool runs at `targetUtilization`:
   - TileRT: the slots wanted are the busy slots plus the requests that wanted TileRT and overflowed
     (to native, or refused) times how long each would hold a slot (Little's law: busy / admission
     rate). A TPOT above the objective adds a node.
   - native: its KV-cache use in replicas, less the share of its arrivals that is TileRT's overflow the
     TileRT plan absorbs (TileRT first: the same overflow does not grow both pools); a queue or a TPOT
     above the objective adds a replica; overflow TileRT cannot absorb brings it up from 0.
   - prefill: arrival rate x mean prefill time (busy replicas, the M/M/c load); a queue or a TTFT above
     the objective adds a replica, unless the prefill is idle enough that the TTFT is not its doing.
2. **Stabilization, as the HPA does it**: a rise takes the lowest recommendation of the scale-up
   window (the latest alone when it is 0), a fall the highest of the scale-down window; so a noisy
   signal never moves a pool back and forth faster than the windows.
3. **Bounds**: each pool's [minReplicas, maxReplicas]; a pool with autoscaling off keeps `replicas`.
4. **Prefill:decode ratio**: the lagging side is raised (decode: TileRT first when it is wanted), and
   only where it is at its maximum is the other side lowered.
5. **Drain first**: TileRT never goes below 1 + the highest ordinal holding a stream (a StatefulSet
   removes the highest ordinals); those nodes are named in `drain_first` until they are idle.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tilert_operator.autoscale.decision import POOLS, Decision, History, PoolDecision, PoolName
from tilert_operator.autoscale.inputs import NativeObserved, Observed, PrefillObserved, TileRTObserved
from tilert_operator.autoscale.queueing import erlang_b, wait_quantile
from tilert_operator.spec import Autoscaling, PDClusterSpec, ServingPool

#: Prefill requests waiting per ready replica above which the prefill is short of replicas: vLLM batches
#: the prefills it runs, so one or two waiting per replica is its normal state under load.
PREFILL_WAITING_PER_REPLICA = 2.0
#: A missed TTFT is taken as the prefill's when its own modelled share (service + queue wait at the
#: percentile) exceeds this share of the objective; otherwise a decode pool's queue took the time.
PREFILL_TTFT_SHARE = 0.5
#: Longest a stream is taken to hold a slot: a few admissions over many busy slots (an interval's
#: rates are noisy) must not make the overflow's demand unbounded.
MAX_HOLD_S = 3600.0
#: Slack for float sums (0.7 * 10 is 6.999...): a pool exactly at its target needs no extra replica.
_EPS = 1e-9


@dataclass(frozen=True)
class PoolBounds:
    enabled: bool
    lo: int
    hi: int
    up_s: float
    down_s: float


def pool_bounds(spec: PDClusterSpec) -> dict[PoolName, PoolBounds]:
    out: dict[PoolName, PoolBounds] = {}
    pools: dict[PoolName, ServingPool] = {
        "prefill": spec.prefill,
        "tilert": spec.decode.tilert,
        "native": spec.decode.native,
    }
    for name, pool in pools.items():
        a = pool.autoscaling
        lo, hi = a.bounds(pool.replicas)
        out[name] = PoolBounds(
            a.enabled,
            lo,
            hi,
            float(a.scale_up_stabilization_seconds),
            float(a.scale_down_stabilization_seconds),
        )
    return out


def history_keep_s(spec: PDClusterSpec) -> float:
    """How long a History must remember: the longest window of any pool."""
    return max(max(b.up_s, b.down_s) for b in pool_bounds(spec).values())


def _ceil(x: float) -> int:
    return max(0, math.ceil(x - _EPS))


def _missed(observed: float | None, objective_s: float) -> bool:
    return objective_s > 0 and observed is not None and observed > objective_s


# -- 1. what the load asks for ----------------------------------------------------------------------


@dataclass(frozen=True)
class TileRTNeed:
    replicas: int
    #: Requests per second that would still overflow with `planned` nodes.
    residual_overflow: float
    reason: str


def recommend_tilert(t: TileRTObserved, a: Autoscaling, hi: int, mean_stream_s: float) -> TileRTNeed:
    hold_s = t.busy / t.admit_rate if t.admit_rate > 0 and t.busy > 0 else mean_stream_s
    hold_s = min(hold_s, MAX_HOLD_S)
    wanted = t.busy + (t.overflow_rate * hold_s if t.overflow_rate > 0 else 0.0)
    rec = _ceil(wanted / (t.slots_per_node * a.target_utilization))
    why = (
        f"{wanted:.1f} slots wanted ({t.busy} busy + {t.overflow_rate:.2f}/s overflowing x {hold_s:.1f} s) "
        f"at {a.target_utilization:g} of {t.slots_per_node} per node: {rec}"
    )
    if _missed(t.tpot_s, a.objective.tpot_seconds) and t.busy > 0 and rec <= t.ready:
        rec = t.ready + 1
        why += f"; TPOT {t.tpot_s:.3f} s above {a.objective.tpot_seconds:g} s: {rec}"
    # What still overflows with the planned nodes: the router never queues at a node, so a TileRT pool
    # is a loss system and its overflow is Erlang B's blocking at the wanted load (a pool that stays as
    # it is keeps overflowing as now).
    if t.overflow_rate > 0:
        # Requests want TileRT and some find it full: a loss system's overflow falls with more slots as
        # Erlang B says; enough nodes that at most 1 - percentile of them overflow, within the maximum.
        n = rec
        while n < hi and erlang_b(n * t.slots_per_node, wanted) > 1 - a.objective.percentile:
            n += 1
        if n > rec:
            rec = n
            why += f"; overflow at most {1 - a.objective.percentile:.0%} of TileRT's requests: {rec}"
    planned = min(rec, hi)
    if planned <= t.ready:
        residual = t.overflow_rate
    else:
        residual = (t.admit_rate + t.overflow_rate) * erlang_b(planned * t.slots_per_node, wanted)
    return TileRTNeed(rec, min(residual, t.overflow_rate), why)


def recommend_native(
    n: NativeObserved, a: Autoscaling, overflow_now: float, overflow_after: float
) -> tuple[int, str]:
    # TileRT first: the share of native's arrivals that is TileRT's overflow and that the TileRT plan
    # takes over does not count here. What already waits in native's queue stays native's.
    keep = 1.0
    if overflow_now > 0 and n.arrival_rate > 0:
        share = min(1.0, overflow_now / n.arrival_rate)
        keep = 1.0 - share * (1.0 - min(1.0, overflow_after / overflow_now))
    units = n.kv_usage * n.ready * keep
    why = f"KV cache {n.kv_usage:.0%} of {n.ready}"
    if n.kv_usage > 0 and n.running > 0 and n.mean_stream_s > 0:
        # KV use saturates at 100 % however much is asked: size from the offered streams (arrivals x
        # stream length, plus the queue) over the streams a full replica holds, when that is known.
        per_replica = n.running / (n.kv_usage * n.ready)
        offered = n.arrival_rate * n.mean_stream_s * keep + n.waiting
        units = max(units, offered / per_replica)
        why = f"{offered:.0f} streams offered at {per_replica:.0f} a replica"
    if keep < 1:
        why += f", less {1 - keep:.0%} of arrivals that TileRT takes over"
    rec = _ceil(units / a.target_utilization)
    why += f" at {a.target_utilization:g}: {rec}"
    if overflow_after > 0 and rec == 0:
        rec = 1
        why += f"; {overflow_after:.2f}/s TileRT cannot take: 1"
    if n.waiting >= 1 and rec <= n.ready:
        rec = n.ready + 1
        why += f"; {n.waiting:g} waiting for KV: {rec}"
    if _missed(n.tpot_s, a.objective.tpot_seconds) and rec <= n.ready:
        rec = n.ready + 1
        why += f"; TPOT {n.tpot_s:.3f} s above {a.objective.tpot_seconds:g} s: {rec}"
    return rec, why


def recommend_prefill(p: PrefillObserved, a: Autoscaling) -> tuple[int, str, bool]:
    """(replicas, why, whether a missed TTFT is the prefill's doing)."""
    # The queue is work too: clearing it within the next interval takes waiting x prefill time.
    busy = p.arrival_rate * p.mean_prefill_s + p.waiting * p.mean_prefill_s / a.interval_seconds
    rec = max(1, _ceil(busy / a.target_utilization))
    why = f"{p.arrival_rate:.2f}/s x {p.mean_prefill_s:.3f} s = {busy:.2f} busy at {a.target_utilization:g}: {rec}"
    queued = p.waiting > PREFILL_WAITING_PER_REPLICA * max(1, p.ready)
    if queued and rec <= p.ready:
        rec = p.ready + 1
        why += f"; {p.waiting:g} waiting: {rec}"
    mine = False
    if _missed(p.ttft_s, a.objective.ttft_seconds):
        # The prefill's own share of TTFT at the percentile, as an M/M/c queue would have it: when
        # that is well inside the objective, the time went elsewhere (a decode pool's queue).
        own = p.mean_prefill_s + wait_quantile(
            max(1, p.ready), p.arrival_rate, p.mean_prefill_s, a.objective.percentile
        )
        mine = queued or own > PREFILL_TTFT_SHARE * a.objective.ttft_seconds
        if not mine:
            why += f"; TTFT {p.ttft_s:.2f} s above {a.objective.ttft_seconds:g} s, not the prefill's ({own:.2f} s)"
        elif rec <= p.ready:
            rec = p.ready + 1
            why += f"; TTFT {p.ttft_s:.2f} s above {a.objective.ttft_seconds:g} s: {rec}"
    return rec, why, mine


# -- 2. stabilization ---------------------------------------------------------------------------------


def stabilize(
    pool: PoolName, current: int, rec: int, history: History, now: float, b: PoolBounds
) -> tuple[int, str]:
    """The HPA's rule: up to the lowest recommendation of the up window, down to the highest of the
    down window, else hold."""
    up = min([*history.within(pool, now, b.up_s), rec]) if b.up_s > 0 else rec
    down = max([*history.within(pool, now, b.down_s), rec]) if b.down_s > 0 else rec
    if up > current:
        return up, "" if up == rec else f"; up to {up}, the lowest of the last {b.up_s:g} s"
    if down < current:
        return down, "" if down == rec else f"; down to {down}, the highest of the last {b.down_s:g} s"
    if rec != current:
        window = b.up_s if rec > current else b.down_s
        return current, f"; held at {current} by the {window:g} s window"
    return current, ""


# -- 4. ratio -------------------------------------------------------------------------------------------


def apply_ratio(
    desired: dict[PoolName, int], bounds: dict[PoolName, PoolBounds], a: Autoscaling, tilert_first: bool
) -> tuple[dict[PoolName, int], str]:
    r = a.prefill_to_decode_ratio
    out = dict(desired)
    notes: list[str] = []
    room = {p: (bounds[p].hi - out[p]) if bounds[p].enabled else 0 for p in POOLS}
    order: tuple[PoolName, PoolName] = ("tilert", "native") if tilert_first else ("native", "tilert")

    def decode() -> int:
        return out["tilert"] + out["native"]

    if r.max is not None and r.max > 0 and out["prefill"] > r.max * decode() + _EPS:
        short = _ceil(out["prefill"] / r.max) - decode()
        for p in order:
            add = min(short, room[p])
            out[p] += add
            short -= add
        if out["prefill"] > r.max * decode() + _EPS and bounds["prefill"].enabled:
            out["prefill"] = max(bounds["prefill"].lo, math.floor(r.max * decode() + _EPS))
        notes.append(f"ratio max {r.max:g}: prefill {out['prefill']}, decode {decode()}")
    if r.min is not None and out["prefill"] + _EPS < r.min * decode():
        if bounds["prefill"].enabled:
            out["prefill"] = min(bounds["prefill"].hi, _ceil(r.min * decode()))
        for p in ("native", "tilert"):  # native first: TileRT nodes may hold streams
            while out["prefill"] + _EPS < r.min * decode() and bounds[p].enabled and out[p] > bounds[p].lo:
                out[p] -= 1
        notes.append(f"ratio min {r.min:g}: prefill {out['prefill']}, decode {decode()}")
    return out, "; ".join(notes)


# -- 5. drain first --------------------------------------------------------------------------------------


def drain_guard(desired: int, current: int, busy_by_node: tuple[int, ...]) -> tuple[int, tuple[int, ...]]:
    """The TileRT count and the ordinals that must empty first: a StatefulSet removes its highest
    ordinals, so the count stays above the highest one holding a stream."""
    if desired >= current:
        return desired, ()
    holding = [i for i, b in enumerate(busy_by_node) if b > 0]
    floor = 1 + max(holding) if holding else 0
    if floor <= desired:
        return desired, ()
    return min(current, floor), tuple(i for i in holding if i >= desired)


# -- the planner ------------------------------------------------------------------------------------------


def plan(spec: PDClusterSpec, observed: Observed, history: History, now: float) -> Decision:
    """One planning step. `history` holds the recommendations of earlier steps (`History.add` the
    returned decision, kept `history_keep_s(spec)`); `observed.current` the replicas now."""
    a = spec.autoscaling
    bounds = pool_bounds(spec)
    current: dict[PoolName, int] = {p: observed.current.get(p, bounds[p].lo) for p in POOLS}
    t_need = recommend_tilert(
        observed.tilert,
        a,
        bounds["tilert"].hi if bounds["tilert"].enabled else current["tilert"],
        observed.mean_stream_s,
    )
    overflow_after = t_need.residual_overflow if bounds["tilert"].enabled else observed.tilert.overflow_rate
    n_rec, n_why = recommend_native(observed.native, a, observed.tilert.overflow_rate, overflow_after)
    p_rec, p_why, prefill_late = recommend_prefill(observed.prefill, a)
    recs: dict[PoolName, tuple[int, str]] = {
        "prefill": (p_rec, p_why),
        "tilert": (t_need.replicas, t_need.reason),
        "native": (n_rec, n_why),
    }
    if _missed(observed.prefill.ttft_s, a.objective.ttft_seconds) and not prefill_late:
        # The time went to a decode pool's queue: requests overflowing TileRT wait there, so TileRT
        # first while it can grow, else native.
        t, n = observed.tilert, observed.native
        if t.overflow_rate > 0 and bounds["tilert"].enabled and t_need.replicas < bounds["tilert"].hi:
            if t_need.replicas <= t.ready:
                recs["tilert"] = (
                    t.ready + 1,
                    t_need.reason + f"; TTFT missed while overflowing: {t.ready + 1}",
                )
        elif n_rec <= n.ready:
            recs["native"] = (n.ready + 1, n_why + f"; TTFT missed in the native queue: {n.ready + 1}")
    desired: dict[PoolName, int] = {}
    reasons: dict[PoolName, str] = {}
    for p in POOLS:
        b = bounds[p]
        rec, why = recs[p]
        if not b.enabled:
            desired[p], reasons[p] = b.lo, f"autoscaling off: {b.lo}"
            continue
        d, note = stabilize(p, current[p], rec, history, now, b)
        clamped = min(max(d, b.lo), b.hi)
        if clamped != d:
            note += f"; {'max' if clamped < d else 'min'}Replicas {clamped}"
        desired[p], reasons[p] = clamped, why + note
    tilert_first = bounds["tilert"].enabled and (
        observed.tilert.overflow_rate > 0 or observed.tilert.busy > 0
    )
    desired, ratio_note = apply_ratio(desired, bounds, a, tilert_first)
    if ratio_note:
        for p in POOLS:
            reasons[p] += f"; {ratio_note}"
    drain: tuple[int, ...] = ()
    if bounds["tilert"].enabled:
        kept, drain = drain_guard(desired["tilert"], current["tilert"], observed.tilert.busy_by_node)
        if drain:
            reasons["tilert"] += f"; kept at {kept}: node(s) {list(drain)} hold streams, drained first"
        desired["tilert"] = kept
    made = {p: PoolDecision(p, current[p], recs[p][0], desired[p], reasons[p]) for p in POOLS}
    return Decision(now, made["prefill"], made["tilert"], made["native"], drain_first=drain)
