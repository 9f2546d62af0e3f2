"""The queueing model of one interval of the stack, and the per-replica capacities it takes. Pure.

The model, stated (every strategy is judged by the same one):

- **Prefill** is an M/M/c queue: c ready replicas, each serving one prompt in `prefill_s` (vLLM
  batches prefills, but a replica's throughput in prompt tokens is what bounds it, so serial service
  at that rate is the usual approximation). Its wait at the percentile comes from Erlang C; when
  arrivals exceed capacity, the excess is carried to the next interval as a backlog (a fluid queue),
  whose wait is backlog / capacity.
- **TileRT** is a loss system (Erlang B): ready nodes x slots servers, each stream holding a slot for
  `output_tokens x tilert_tpot_s`. A request that wants TileRT and finds every slot taken overflows
  to native (the router's `whenTilertFull: native`); the router never queues at a node.
- **Native** is an M/M/c queue over its streams: ready replicas x `native_streams` servers, each
  stream `output_tokens x TPOT` long, where TPOT grows linearly from `native_tpot_s[0]` (one stream)
  to `[1]` (a full replica) with the pool's occupancy. Overload carries a backlog, as for the prefill.
- **An interval meets the SLO** when TTFT at the percentile (prefill service + its wait, plus the
  native wait when more than 1 - percentile of the requests decode natively) is within the objective,
  and TPOT at the percentile (native's when more than 1 - percentile decode natively, else TileRT's)
  is within its objective.
- **Replicas** take `startup_s` from being asked for to being ready (the same for every strategy);
  every replica asked for counts toward replica-seconds from that moment, ready or not.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tilert_operator.autoscale.decision import PoolName
from tilert_operator.autoscale.queueing import erlang_b, erlang_c, wait_quantile


@dataclass(frozen=True)
class Capacities:
    """Per-replica figures of one deployment, with where each comes from (printed as assumptions)."""

    name: str
    prefill_s: float
    output_tokens: int
    tilert_slots: int
    tilert_tpot_s: float
    native_streams: int
    native_tpot_s: tuple[float, float]
    #: Share of requests that want TileRT (auto routing with a free slot, or asked for it); the rest
    #: ask for native.
    tilert_share: float
    gpus: dict[PoolName, int]
    startup_s: dict[PoolName, float]
    ttft_objective_s: float
    tpot_objective_s: float
    percentile: float
    sources: dict[str, str]

    @property
    def tilert_hold_s(self) -> float:
        return self.output_tokens * self.tilert_tpot_s

    def native_tpot(self, occupancy: float) -> float:
        lo, hi = self.native_tpot_s
        return lo + (hi - lo) * min(1.0, max(0.0, occupancy))


@dataclass(frozen=True)
class Ready:
    prefill: int
    tilert: int
    native: int


@dataclass(frozen=True)
class Backlog:
    """Requests carried over, per queue."""

    prefill: float = 0.0
    native: float = 0.0


@dataclass(frozen=True)
class Interval:
    """What one interval looked like: the SLO verdict and what the planner's inputs would show."""

    met: bool
    rate: float
    ttft_s: float
    tpot_s: float
    backlog: Backlog
    prefill_busy: float
    tilert_admitted: float
    tilert_busy: float
    overflow: float
    native_rate: float
    native_streams: float
    #: Streams decoding on native, and requests waiting (the M/M/c queue's mean length, plus backlog).
    native_running: float
    native_waiting: float
    native_occupancy: float
    tilert_tpot_s: float
    native_tpot_s: float


def _mean_queue(servers: int, load: float) -> float:
    """Mean number waiting in an M/M/c queue (Lq = C a / (c - a)); the backlog covers overload."""
    if servers <= 0 or load >= servers:
        return 0.0
    return erlang_c(servers, load) * load / (servers - load)


def _queue(
    servers: int, rate: float, service_s: float, backlog: float, dt: float, p: float
) -> tuple[float, float]:
    """(wait at the percentile, backlog after) of an M/M/c queue with a fluid overflow."""
    capacity = servers / service_s  # requests per second
    left = max(0.0, backlog + (rate - capacity) * dt)
    if left > 0 or backlog > 0:
        return (left / capacity if capacity > 0 else math.inf), left
    return wait_quantile(servers, rate, service_s, p), 0.0


def step(cap: Capacities, rate: float, ready: Ready, backlog: Backlog, dt: float) -> Interval:
    p = cap.percentile
    p_wait, p_left = _queue(ready.prefill, rate, cap.prefill_s, backlog.prefill, dt, p)
    want_t = rate * cap.tilert_share
    hold = cap.tilert_hold_s
    blocked = erlang_b(ready.tilert * cap.tilert_slots, want_t * hold) if want_t > 0 else 0.0
    admitted = want_t * (1 - blocked)
    overflow = want_t * blocked
    native_rate = rate * (1 - cap.tilert_share) + overflow
    servers = ready.native * cap.native_streams
    # TPOT at the load the pool would carry; the stream length follows from it.
    occupancy = min(1.0, native_rate * cap.output_tokens * cap.native_tpot_s[1] / servers) if servers else 1.0
    n_tpot = cap.native_tpot(occupancy)
    n_hold = cap.output_tokens * n_tpot
    n_wait, n_left = _queue(servers, native_rate, n_hold, backlog.native, dt, p)
    native_share = native_rate / rate if rate > 0 else 0.0
    tail_native = native_share > 1 - p
    ttft = cap.prefill_s + p_wait + (n_wait if tail_native else 0.0)
    tpot = n_tpot if tail_native else cap.tilert_tpot_s
    met = ttft <= cap.ttft_objective_s and tpot <= cap.tpot_objective_s
    return Interval(
        met=met,
        rate=rate,
        ttft_s=ttft,
        tpot_s=tpot,
        backlog=Backlog(p_left, n_left),
        prefill_busy=min(float(ready.prefill), rate * cap.prefill_s),
        tilert_admitted=admitted,
        tilert_busy=admitted * hold,
        overflow=overflow,
        native_rate=native_rate,
        native_streams=min(float(servers), native_rate * n_hold) + n_left,
        native_running=min(float(servers), native_rate * n_hold),
        native_waiting=n_left + _mean_queue(servers, native_rate * n_hold),
        native_occupancy=occupancy if servers else (1.0 if native_rate > 0 else 0.0),
        tilert_tpot_s=cap.tilert_tpot_s,
        native_tpot_s=n_tpot,
    )


def _steady(iv: Interval) -> bool:
    """Meets the SLO with no queue growing (a backlog would miss it a few intervals later)."""
    return iv.met and iv.backlog.prefill == 0 and iv.backlog.native == 0


def static_size(cap: Capacities, rate: float, target_utilization: float) -> Ready:
    """The fewest replicas per pool that meet the SLO at a steady `rate`, TileRT sized to run at the
    planner's target utilization (so static and planned TileRT pools are comparable)."""
    want_t = rate * cap.tilert_share
    t = math.ceil(want_t * cap.tilert_hold_s / (cap.tilert_slots * target_utilization) - 1e-9)
    p = 1
    while cap.prefill_s + wait_quantile(p, rate, cap.prefill_s, cap.percentile) > cap.ttft_objective_s / 2:
        p += 1
    n = 0
    while not _steady(step(cap, rate, Ready(p, t, n), Backlog(), 1.0)):
        n += 1
        if n > 10_000:
            raise ValueError(
                f"{cap.name}: no native pool meets the SLO at {rate:g} req/s; check the capacities"
            )
    if n == 0 and cap.tilert_share < 1:
        n = 1
    return Ready(p, t, n)
