"""Replay each trace through each strategy on the queueing model (model.py); pure but for `main`."""

from __future__ import annotations

import math
from dataclasses import dataclass

from bench.autoscale import traces
from bench.autoscale.model import Backlog, Capacities, Ready, static_size, step
from bench.autoscale.strategies import CpuHpa, Planned, Static, Strategy, down_window_s, planner_spec
from tilert_operator import spec as specmod
from tilert_operator.autoscale.decision import POOLS, PoolName


@dataclass(frozen=True)
class Result:
    trace: str
    strategy: str
    intervals: int
    met: int
    replica_s: float
    gpu_s: float
    changes: int
    peak: dict[PoolName, int]

    @property
    def attainment(self) -> float:
        return self.met / self.intervals


class Pools:
    """Replicas asked for and when each becomes ready; a scale-down removes the youngest first."""

    def __init__(self, start: Ready, startup_s: dict[PoolName, float]) -> None:
        self.startup_s = startup_s
        self.ready_at: dict[PoolName, list[float]] = {p: [0.0] * getattr(start, p) for p in POOLS}

    def asked(self) -> dict[PoolName, int]:
        return {p: len(v) for p, v in self.ready_at.items()}

    def ready(self, now: float) -> Ready:
        n = {p: sum(1 for t in v if t <= now) for p, v in self.ready_at.items()}
        return Ready(n["prefill"], n["tilert"], n["native"])

    def set(self, want: dict[PoolName, int], now: float) -> int:
        changed = 0
        for p in POOLS:
            v = self.ready_at[p]
            if want[p] != len(v):
                changed += 1
            while len(v) < want[p]:
                v.append(now + self.startup_s[p])
            v.sort()
            del v[want[p] :]
        return changed


def simulate(
    cap: Capacities, trace: str, rates: list[float], strategy: Strategy, start: Ready, dt: float
) -> Result:
    pools = Pools(start, cap.startup_s)
    backlog = Backlog()
    met = changes = 0
    replica_s = gpu_s = 0.0
    peak: dict[PoolName, int] = {p: 0 for p in POOLS}
    for i, rate in enumerate(rates):
        now = i * dt
        ready = pools.ready(now)
        seen = step(cap, rate, ready, backlog, dt)
        backlog = seen.backlog
        met += seen.met
        asked = pools.asked()
        replica_s += sum(asked.values()) * dt
        gpu_s += sum(asked[p] * cap.gpus[p] for p in POOLS) * dt
        for p in POOLS:
            peak[p] = max(peak[p], asked[p])
        changes += pools.set(strategy.decide(now + dt, seen, asked, ready), now + dt)
    return Result(trace, strategy.name, len(rates), met, replica_s, gpu_s, changes, peak)


def run_trace(
    cap: Capacities,
    trace: str,
    mean_rate: float,
    hours: float,
    dt: float,
    seed: int,
    down_s: int | None = None,
) -> list[Result]:
    """Every strategy over one trace. `down_s`: both autoscalers' scale-down window (default
    `down_window_s`)."""
    n = int(hours * 3600 / dt)
    rates = traces.arrivals(traces.TRACES[trace](mean_rate, n, dt, seed), dt, seed)
    target = specmod.Autoscaling().target_utilization
    at_peak = static_size(cap, max(rates), target)
    at_mean = static_size(cap, sum(rates) / len(rates), target)
    # The planner's and the HPA's bounds: from 1 (native from 0 when TileRT takes everything) to
    # twice the peak's static size; both start at the static-at-mean size.
    bounds: dict[PoolName, tuple[int, int]] = {
        "prefill": (1, max(2, 2 * at_peak.prefill)),
        "tilert": (1, max(2, 2 * at_peak.tilert)),
        "native": (0 if cap.tilert_share >= 1 else 1, max(2, 2 * at_peak.native)),
    }
    window = down_s if down_s is not None else down_window_s(cap)
    start = Ready(*(min(max(getattr(at_mean, p), bounds[p][0]), bounds[p][1]) for p in POOLS))
    strategies: list[tuple[Strategy, Ready]] = [
        (Planned(planner_spec(cap, start, bounds, window), cap), start),
        (Static("static at peak", at_peak), at_peak),
        (Static("static at mean", at_mean), at_mean),
        (CpuHpa(bounds, float(window)), start),
    ]
    return [simulate(cap, trace, rates, s, r, dt) for s, r in strategies]


def verdict(results: list[Result]) -> str:
    """The issue's bar for one trace: the planner meets the SLO in >= 95 % of intervals with fewer
    replica-seconds than static-at-peak, and better attainment than static-at-mean and the HPA."""
    by = {r.strategy: r for r in results}
    p, peak, mean, hpa = by["planner"], by["static at peak"], by["static at mean"], by["HPA on CPU"]
    misses = []
    if p.attainment < 0.95:
        misses.append(f"attainment {p.attainment:.1%} < 95 %")
    cost, peak_cost = (p.gpu_s, peak.gpu_s) if peak.gpu_s else (p.replica_s, peak.replica_s)
    if cost >= peak_cost:
        misses.append("not fewer replica-seconds than static at peak")
    if p.attainment <= mean.attainment and mean.attainment < 1:
        misses.append("attainment not above static at mean")
    if p.attainment <= hpa.attainment and hpa.attainment < 1:
        misses.append("attainment not above the CPU HPA")
    return "met" if not misses else "NOT met: " + "; ".join(misses)


def rows(results: list[Result], cap: Capacities) -> list[list[str]]:
    by = {r.strategy: r for r in results}
    peak = by["static at peak"]
    unit = "GPU" if any(cap.gpus.values()) else "replica"
    out = []
    for r in results:
        cost = r.gpu_s if unit == "GPU" else r.replica_s
        base = peak.gpu_s if unit == "GPU" else peak.replica_s
        out.append(
            [
                cap.name,
                r.trace,
                r.strategy,
                f"{r.attainment:.1%}",
                f"{cost / 3600:,.0f}",
                f"{cost / base:.2f}x" if base else "-",
                f"{r.attainment / peak.attainment:.2f}x" if peak.attainment else "-",
                "/".join(str(r.peak[p]) for p in POOLS),
                str(r.changes),
            ]
        )
    return out


def hours_unit(cap: Capacities) -> str:
    return "GPU-hours" if any(cap.gpus.values()) else "replica-hours"


def fmt_s(x: float) -> str:
    return "inf" if not math.isfinite(x) else f"{x:g}"
