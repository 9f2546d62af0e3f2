"""What the planner decided, per pool, and the recommendations it remembers for its windows."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

PoolName = Literal["prefill", "tilert", "native"]
POOLS: tuple[PoolName, ...] = ("prefill", "tilert", "native")


@dataclass(frozen=True)
class PoolDecision:
    pool: PoolName
    #: Replicas the workload had when the planner ran.
    current: int
    #: What the load asks for, before the windows, bounds, ratio and drain rules.
    recommended: int
    #: What the workload should have: the number to render.
    desired: int
    #: Why, in words, for status and the Event.
    reason: str

    @property
    def change(self) -> int:
        return self.desired - self.current


@dataclass(frozen=True)
class Decision:
    at: float
    prefill: PoolDecision
    tilert: PoolDecision
    native: PoolDecision
    #: TileRT ordinals the load would let go but that still hold streams: the count stays above them
    #: until they are idle. An actuator may stop routing new requests to them so they empty sooner.
    drain_first: tuple[int, ...] = ()

    def pool(self, name: PoolName) -> PoolDecision:
        decision: PoolDecision = getattr(self, name)
        return decision


@dataclass(frozen=True)
class Recommendation:
    at: float
    replicas: dict[PoolName, int]


@dataclass(frozen=True)
class History:
    """The raw recommendations of the last `keep_s` seconds, oldest first: the windows' memory (the
    HPA keeps the same). Immutable: `add` returns the next one."""

    records: tuple[Recommendation, ...] = ()

    def add(self, decision: Decision, keep_s: float) -> History:
        rec = Recommendation(decision.at, {p: decision.pool(p).recommended for p in POOLS})
        kept = tuple(r for r in self.records if r.at > decision.at - keep_s)
        return History((*kept, rec))

    def within(self, pool: PoolName, now: float, window_s: float) -> list[int]:
        """The recommendations for `pool` made in (now - window_s, now]."""
        return [r.replicas[pool] for r in self.records if now - window_s < r.at <= now]
