"""Who decides the replicas in the simulator: the planner, static pools, and an HPA on CPU use.

Each strategy is called once an interval with what that interval showed and answers the replicas each
pool should have (asked for now; ready after the start-up delay, as for everyone).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Protocol

from bench.autoscale.model import Capacities, Interval, Ready
from tilert_operator import spec as specmod
from tilert_operator.autoscale import planner
from tilert_operator.autoscale.decision import POOLS, History, PoolName
from tilert_operator.autoscale.inputs import NativeObserved, Observed, PrefillObserved, TileRTObserved


class Strategy(Protocol):
    name: str

    def decide(
        self, now: float, seen: Interval, asked: dict[PoolName, int], ready: Ready
    ) -> dict[PoolName, int]: ...


@dataclass
class Static:
    name: str
    replicas: Ready

    def decide(
        self, now: float, seen: Interval, asked: dict[PoolName, int], ready: Ready
    ) -> dict[PoolName, int]:
        return {
            "prefill": self.replicas.prefill,
            "tilert": self.replicas.tilert,
            "native": self.replicas.native,
        }


#: Kubernetes' HPA (v2) defaults: 10 % tolerance, no scale-up window but at most double or +4 pods per
#: 15 s; 80 % is a common CPU target. Its scale-down window is the planner's (`down_window_s`).
HPA_TOLERANCE = 0.1
HPA_TARGET = 0.8


def down_window_s(cap: Capacities) -> int:
    """The scale-down stabilization both autoscalers get: the HPA's 300 s default, or 1.5x the slowest
    pod's start-up where that is longer (a window shorter than the start-up lets a burst's new pods go
    before they were ever ready, and the next burst finds none: docs/autoscaling.md)."""
    return int(max(300.0, 1.5 * max(cap.startup_s.values())))


#: CPU use of a serving pod, modelled: vLLM's engine loop busy-polls a core whenever any request runs,
#: so an idle pod shows ~5 % and a pod with work at least 60 %, the rest growing with its occupancy.
CPU_IDLE, CPU_BUSY_FLOOR = 0.05, 0.6


def cpu_use(occupancy: float) -> float:
    return CPU_IDLE if occupancy <= 0 else CPU_BUSY_FLOOR + (1 - CPU_BUSY_FLOOR) * min(1.0, occupancy)


@dataclass
class CpuHpa:
    """One HPA per pool on the pods' CPU utilization: desired = ceil(current x use / target)."""

    bounds: dict[PoolName, tuple[int, int]]
    window_s: float = 300.0
    name: str = "HPA on CPU"
    recs: dict[PoolName, list[tuple[float, int]]] = field(default_factory=lambda: {p: [] for p in POOLS})

    def decide(
        self, now: float, seen: Interval, asked: dict[PoolName, int], ready: Ready
    ) -> dict[PoolName, int]:
        occupancy: dict[PoolName, float] = {
            "prefill": seen.prefill_busy / ready.prefill if ready.prefill else 0.0,
            "tilert": seen.tilert_busy / max(1, ready.tilert) if ready.tilert else 0.0,
            "native": seen.native_occupancy,
        }
        out: dict[PoolName, int] = {}
        for p in POOLS:
            cur = asked[p]
            r_ready = getattr(ready, p)
            use = cpu_use(occupancy[p])
            ratio = use / HPA_TARGET
            rec = (
                cur if abs(ratio - 1) <= HPA_TOLERANCE or r_ready == 0 else math.ceil(r_ready * ratio - 1e-9)
            )
            lo, hi = self.bounds[p]
            if cur == 0 and occupancy[p] > 0:
                rec = 1  # a pool at 0 has no pods to measure: the HPA cannot scale it from 0 (here: at once)
            self.recs[p] = [(t, r) for t, r in self.recs[p] if t > now - self.window_s] + [(now, rec)]
            if rec < cur:
                rec = min(cur, max(r for _, r in self.recs[p]))
            rec = min(rec, max(2 * cur, cur + 4))
            out[p] = min(max(rec, lo), hi)
        return out


@dataclass
class Planned:
    """The planner (tilert_operator.autoscale.planner), fed what the operator would scrape."""

    spec: specmod.PDClusterSpec
    cap: Capacities
    name: str = "planner"
    history: History = field(default_factory=History)
    drain: tuple[int, ...] = ()

    def observe(self, seen: Interval, asked: dict[PoolName, int], ready: Ready) -> Observed:
        c = self.cap
        busy = round(seen.tilert_busy)
        # The router spreads streams over the nodes it may use; nodes named in the last decision's
        # drain_first get none (the actuator's cordon), so they are idle an interval later.
        usable = [i for i in range(ready.tilert) if i not in self.drain]
        by_node = [0] * ready.tilert
        for k in range(min(busy, len(usable) * c.tilert_slots)):
            by_node[usable[k % len(usable)]] += 1
        rate = seen.native_rate
        return Observed(
            prefill=PrefillObserved(
                ready.prefill,
                seen.rate,
                c.prefill_s,
                seen.backlog.prefill,
                seen.ttft_s if math.isfinite(seen.ttft_s) else 1e9,
            ),
            tilert=TileRTObserved(
                ready.tilert,
                c.tilert_slots,
                tuple(by_node),
                seen.tilert_admitted,
                seen.overflow,
                seen.tilert_tpot_s,
            ),
            native=NativeObserved(
                ready.native,
                seen.native_occupancy,
                seen.native_waiting,
                rate,
                seen.native_tpot_s if ready.native else None,
                running=seen.native_running,
                mean_stream_s=c.output_tokens * seen.native_tpot_s,
            ),
            current={str(p): n for p, n in asked.items()},
            mean_stream_s=c.tilert_hold_s,
        )

    def decide(
        self, now: float, seen: Interval, asked: dict[PoolName, int], ready: Ready
    ) -> dict[PoolName, int]:
        d = planner.plan(self.spec, self.observe(seen, asked, ready), self.history, now)
        self.history = self.history.add(d, planner.history_keep_s(self.spec))
        self.drain = d.drain_first
        return {p: d.pool(p).desired for p in POOLS}


def planner_spec(
    cap: Capacities, start: Ready, bounds: dict[PoolName, tuple[int, int]], down_s: int
) -> specmod.PDClusterSpec:
    """A PDCluster spec for the planner: every pool autoscaled within `bounds`, the capacities' SLO."""

    def pool(p: PoolName, replicas: int) -> dict[str, object]:
        lo, hi = bounds[p]
        return {
            "replicas": min(max(replicas, lo), hi),
            "autoscaling": {
                "enabled": True,
                "minReplicas": lo,
                "maxReplicas": hi,
                "scaleDownStabilizationSeconds": down_s,
            },
        }

    return specmod.parse(
        {
            "model": {"name": "m", "weights": {"tiny": True}, "tilertModel": "mla"},
            "prefill": pool("prefill", start.prefill),
            "decode": {
                "tilert": {
                    **pool("tilert", start.tilert),
                    "engine": "reference",
                    "gpus": 0,
                    "slots": cap.tilert_slots,
                },
                "native": pool("native", start.native),
            },
            "autoscaling": {
                "objective": {
                    "ttftSeconds": cap.ttft_objective_s,
                    "tpotSeconds": cap.tpot_objective_s,
                    "percentile": cap.percentile,
                }
            },
        }
    )
