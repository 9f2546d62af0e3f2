"""The numbers a run is judged by, computed from its records and marks (pure): failures by class,
greedy mismatches, TTFT / TPOT / latency percentiles per phase and per route, and how long after a
mark requests were served again."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from bench.load.record import Record


@dataclass(frozen=True)
class Mark:
    name: str
    #: Seconds after the run's start.
    at: float


def percentile(xs: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile (q in [0, 1]) of `xs`; None when empty. On few samples p99 is the
    maximum, which is what a "within 2x" check should see."""
    if not xs:
        return None
    s = sorted(xs)
    return s[max(0, math.ceil(q * len(s)) - 1)]


@dataclass(frozen=True)
class Stats:
    requests: int
    ok: int
    #: failure class (Record.failure) -> count.
    failures: dict[str, int]
    retried: int
    #: Greedy requests compared with a reference, and those whose text differed.
    compared: int
    mismatches: int
    #: route served (or "?" when the server does not say) -> count.
    served: dict[str, int]
    ttft_p50: float | None
    ttft_p99: float | None
    tpot_p50: float | None
    tpot_p99: float | None
    latency_p50: float | None
    latency_p99: float | None

    @property
    def failed(self) -> int:
        return sum(self.failures.values())

    @classmethod
    def of(cls, records: Iterable[Record]) -> Stats:
        recs = [r for r in records if r.outcome is not None]
        ok = [r for r in recs if r.ok]
        ttft = [r.ttft for r in ok if r.ttft is not None]
        tpot = [r.tpot for r in ok if r.tpot is not None]
        lat = [r.latency for r in ok if r.latency is not None]
        return cls(
            requests=len(recs),
            ok=len(ok),
            failures=dict(Counter(f for r in recs if (f := r.failure) is not None)),
            retried=sum(r.retried for r in recs),
            compared=sum(r.greedy_match is not None for r in recs),
            mismatches=sum(r.greedy_match is False for r in recs),
            served=dict(Counter(r.route_served or "?" for r in ok)),
            ttft_p50=percentile(ttft, 0.5),
            ttft_p99=percentile(ttft, 0.99),
            tpot_p50=percentile(tpot, 0.5),
            tpot_p99=percentile(tpot, 0.99),
            latency_p50=percentile(lat, 0.5),
            latency_p99=percentile(lat, 0.99),
        )


@dataclass(frozen=True)
class Recovery:
    """What the requests sent after a mark saw (up to the next mark)."""

    mark: str
    #: From the mark to the start of the first request sent after it that succeeded; None if none did.
    first_ok_s: float | None
    #: From the mark to the start of the first request after which every request (to the next mark)
    #: succeeded: when serving was steady again. None if the last one failed.
    steady_from_s: float | None
    #: Requests sent after the mark that failed.
    failed: int
    #: Requests in flight at the mark (sent before, ended after) that failed: the ones a kill may take.
    failed_in_flight: int


def recovery(records: Sequence[Record], mark: Mark, until: float = math.inf) -> Recovery:
    after = sorted((r for r in records if mark.at <= r.start < until and r.outcome), key=lambda r: r.start)
    first = next((r for r in after if r.ok), None)
    steady: Record | None = None
    for r in reversed(after):
        if not r.ok:
            break
        steady = r
    in_flight = [r for r in records if r.start < mark.at and (r.end is None or r.end > mark.at)]
    return Recovery(
        mark=mark.name,
        first_ok_s=None if first is None else first.start - mark.at,
        steady_from_s=None if steady is None else steady.start - mark.at,
        failed=sum(not r.ok for r in after),
        failed_in_flight=sum(r.outcome is not None and not r.ok for r in in_flight),
    )


@dataclass(frozen=True)
class Summary:
    total: Stats
    #: Phase (the initial one, then each mark's name, in order) -> stats of the requests sent in it.
    phases: dict[str, Stats]
    #: Route asked -> stats.
    routes: dict[str, Stats]
    #: (phase, route asked) -> stats.
    cells: dict[tuple[str, str], Stats]
    marks: tuple[Mark, ...]
    recoveries: dict[str, Recovery] = field(default_factory=dict)
    #: Requests still without an outcome when summarised (the run is still going).
    pending: int = 0
    #: Seconds from the first request's start to the last one's end.
    span_s: float = 0.0

    @property
    def failed(self) -> int:
        return self.total.failed

    @property
    def mismatches(self) -> int:
        return self.total.mismatches

    def phase(self, name: str) -> Stats:
        if name not in self.phases:
            raise KeyError(f"no requests were sent in phase {name!r}; phases: {', '.join(self.phases)}")
        return self.phases[name]

    def recovery(self, mark: str) -> Recovery:
        if mark not in self.recoveries:
            raise KeyError(f"no mark {mark!r}; marks: {', '.join(self.recoveries) or 'none'}")
        return self.recoveries[mark]

    def ttft_p99_ratio(self, phase: str, baseline: str) -> float | None:
        """TTFT p99 of `phase` over that of `baseline` (e.g. "rollout-start" over "steady")."""
        a, b = self.phase(phase).ttft_p99, self.phase(baseline).ttft_p99
        return None if a is None or not b else a / b


def summarize(records: Sequence[Record], marks: Sequence[Mark], initial_phase: str) -> Summary:
    done = [r for r in records if r.outcome is not None]
    order = [initial_phase, *(m.name for m in marks if m.name != initial_phase)]
    phases = {p: Stats.of(r for r in done if r.phase == p) for p in dict.fromkeys(order)}
    routes: list[str] = sorted({r.route_asked for r in done})
    cells = {
        (p, rt): Stats.of(r for r in done if r.phase == p and r.route_asked == rt)
        for p in phases
        for rt in routes
        if any(r.phase == p and r.route_asked == rt for r in done)
    }
    ends = [m.at for m in marks[1:]] + [math.inf] if marks else []
    starts = [r.start for r in done]
    stops = [r.end for r in done if r.end is not None]
    return Summary(
        total=Stats.of(done),
        phases=phases,
        routes={rt: Stats.of(r for r in done if r.route_asked == rt) for rt in routes},
        cells=cells,
        marks=tuple(marks),
        recoveries={m.name: recovery(done, m, until) for m, until in zip(marks, ends, strict=True)},
        pending=len(records) - len(done),
        span_s=(max(stops) - min(starts)) if starts and stops else 0.0,
    )
