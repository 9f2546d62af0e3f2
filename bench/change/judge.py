"""Each scenario's row of the table and its verdict, from the load's records and marks (pure).

The bar:
- a planned change: no request sent while it ran or in the settle window after it failed, every
  greedy output equals vLLM alone's, and TTFT p99 of the requests in flight while it ran is within 2x
  of the steady state's;
- an unplanned one (a kill): only the requests in flight on the killed component may fail (each with
  a clean error: an HTTP error or an error event, never a cut stream), requests sent after the kill all
  succeed from within 2 s of it (the pod is restored at once, as the kubelet restarts a killed
  container, and the restore is part of that window).
Requests for a route the stack no longer has (`Scenario.unservable`) are left out of the counts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from bench.change.scenarios import Scenario
from bench.load.record import Record
from bench.load.summary import Mark, Stats, recovery

STEADY = "steady"
#: TTFT p99 while a planned change runs, over the steady state's.
TTFT_SLACK = 2.0
#: New requests served again within this long of a kill.
SERVE_WITHIN_S = 2.0
#: Failures that end a request cleanly: the client is told (a status, an error event). A cut stream or
#: a reset connection is not clean.
CLEAN = ("http_4xx", "http_5xx", "stream_error")


def after(name: str) -> str:
    return f"{name}: after"


@dataclass(frozen=True)
class Row:
    scenario: Scenario
    #: Seconds from the change's start (a kill) to the end of its apply (a kill's: the restore).
    took_s: float
    #: The requests judged: sent from the change's start to the next scenario's.
    stats: Stats
    #: A kill: requests in flight on it that failed, and how many of those failed cleanly.
    in_flight_failed: int | None
    in_flight_clean: int | None
    #: A kill: from the kill to the first request after which every request succeeded.
    served_again_s: float | None
    ttft_ratio: float | None
    problems: tuple[str, ...]

    @property
    def met(self) -> bool:
        return not self.problems


def _between(records: Sequence[Record], start: float, end: float, scenario: Scenario) -> list[Record]:
    return [
        r
        for r in records
        if start <= r.start < end and r.outcome is not None and r.route_asked not in scenario.unservable
    ]


def _overlapping(records: Sequence[Record], start: float, end: float, scenario: Scenario) -> list[Record]:
    """The requests in flight at some time in [start, end): the ones a change can have slowed, those
    sent just before it included (a change of a few seconds may see no request sent within it)."""
    return [
        r
        for r in records
        if r.start < end
        and r.end is not None
        and r.end > start
        and r.outcome is not None
        and r.route_asked not in scenario.unservable
    ]


def _at(marks: Sequence[Mark], name: str) -> float:
    return next(m.at for m in marks if m.name == name)


def _next(marks: Sequence[Mark], name: str) -> float:
    i = next(i for i, m in enumerate(marks) if m.name == name)
    return marks[i + 1].at if i + 1 < len(marks) else float("inf")


def row(records: Sequence[Record], marks: Sequence[Mark], scenario: Scenario, steady: Stats) -> Row:
    """The row of `scenario`, whose marks are `scenario.name` (the change starts, or the kill) and
    `after(name)` (its apply returned: the settle window)."""
    name = scenario.name
    start, settled = _at(marks, name), _at(marks, after(name))
    judged = _between(records, start, _next(marks, after(name)), scenario)
    stats = Stats.of(judged)
    problems: list[str] = []
    in_flight_failed = in_flight_clean = None
    served_again = None
    during = Stats.of(_overlapping(records, start, settled, scenario))
    failed = stats.failures
    if not scenario.planned:
        # The pod is brought back at once, as the kubelet restarts a killed container: the requests
        # sent from the kill on are judged together, restore included.
        servable = [r for r in records if r.route_asked not in scenario.unservable]
        lost = [r for r in servable if r.start < start and r.end is not None and r.end > start and not r.ok]
        in_flight_failed = len(lost)
        in_flight_clean = sum(r.outcome in CLEAN for r in lost)
        if in_flight_clean < in_flight_failed:
            problems.append(
                f"{in_flight_failed - in_flight_clean} in-flight requests ended without a clean error"
            )
        rec = recovery(servable, Mark(name, start), _next(marks, after(name)))
        # Nothing sent after the kill failed: served all along (steady_from_s would be the first
        # request's start, which says when one was sent, not when serving came back).
        served_again = 0.0 if rec.failed == 0 else rec.steady_from_s
        if served_again is None:
            problems.append(f"the last request sent after the kill still failed ({rec.failed} failed)")
        elif served_again > SERVE_WITHIN_S:
            problems.append(
                f"requests sent after the kill all succeed only from {served_again:.2f} s on "
                f"(bar {SERVE_WITHIN_S:g} s; {rec.failed} failed after it)"
            )
    if scenario.planned and failed:
        problems.append(f"{sum(failed.values())} requests failed: {dict(sorted(failed.items()))}")
    if stats.mismatches:
        problems.append(f"{stats.mismatches} of {stats.compared} greedy outputs differ from vLLM alone's")
    ratio = None if during.ttft_p99 is None or not steady.ttft_p99 else during.ttft_p99 / steady.ttft_p99
    if scenario.planned:
        if ratio is None:
            problems.append("no streamed request succeeded while it ran: no TTFT to compare")
        elif ratio > TTFT_SLACK:
            problems.append(f"TTFT p99 while it ran is {ratio:.2f}x the steady state's (bar {TTFT_SLACK:g}x)")
    return Row(
        scenario=scenario,
        took_s=settled - start,
        stats=stats,
        in_flight_failed=in_flight_failed,
        in_flight_clean=in_flight_clean,
        served_again_s=served_again,
        ttft_ratio=ratio,
        problems=tuple(problems),
    )
