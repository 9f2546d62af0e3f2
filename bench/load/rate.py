"""Whether a probe at a rate was sustained (pure): the benchmark climbs a ladder of rates and keeps the
highest one the stack serves without failing and without a queue building up.

A queue shows three ways, each checked: the median latency rises well above the lowest rate's (the
closest to an idle stack this box gives); the requests sent last wait longer than those sent first;
and the answers trail the last arrival by far more than one request's latency (the backlog drains
after the arrivals stop)."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from bench.load.record import Record
from bench.load.summary import Stats

#: A probe's median latency over the lowest rate's above this means requests wait in a queue.
LATENCY_SLACK = 2.0
#: The last third's median latency over the first third's, above this (and GROWTH_FLOOR_S more): a
#: queue growing during the probe. Judged only with GROWTH_MIN_THIRD requests or more in a third: the
#: mix's requests differ (route, length) by several times in latency, so one against one is noise.
GROWTH_SLACK = 2.0
GROWTH_FLOOR_S = 0.5
GROWTH_MIN_THIRD = 3


@dataclass(frozen=True)
class Queue:
    """Signs of a queue in one probe's records."""

    #: Median latency of the last third of the requests (by send time) over the first third's.
    growth: float | None
    #: Seconds from the last request's send to the last answer.
    drain_s: float | None
    first_third_p50: float | None

    @classmethod
    def of(cls, records: Sequence[Record]) -> Queue:
        done = sorted((r for r in records if r.latency is not None), key=lambda r: r.start)
        if not done:
            return cls(None, None, None)
        ends = [r.end for r in done if r.end is not None]
        drain = max(ends) - done[-1].start
        third = len(done) // 3
        if third < GROWTH_MIN_THIRD:
            return cls(None, drain, None)
        head = statistics.median(r.latency for r in done[:third] if r.latency is not None)
        tail = statistics.median(r.latency for r in done[-third:] if r.latency is not None)
        return cls(tail / head if head > 0 else None, drain, head)


@dataclass(frozen=True)
class Verdict:
    rate: float
    sustained: bool
    why: str


def verdict(rate: float, stats: Stats, queue: Queue, lowest: Stats | None) -> Verdict:
    """`lowest`: the stats at the lowest rate of the ladder (None for that probe itself)."""
    if stats.failed:
        kinds = ", ".join(f"{k} {v}" for k, v in sorted(stats.failures.items()))
        return Verdict(rate, False, f"{stats.failed} of {stats.requests} failed ({kinds})")
    if not stats.ok or stats.latency_p50 is None:
        return Verdict(rate, False, "no request was answered")
    p50 = stats.latency_p50
    low = lowest.latency_p50 if lowest is not None else None
    if low is not None and p50 > LATENCY_SLACK * low:
        return Verdict(
            rate,
            False,
            f"latency p50 {p50 * 1e3:.0f} ms is over {LATENCY_SLACK:g}x the lowest rate's {low * 1e3:.0f} ms: "
            "requests queue",
        )
    head = queue.first_third_p50
    if (
        queue.growth is not None
        and head is not None
        and queue.growth > GROWTH_SLACK
        and (head * (queue.growth - 1) > GROWTH_FLOOR_S)
    ):
        return Verdict(
            rate,
            False,
            f"the last third's latency is {queue.growth:.1f}x the first third's ({head * 1e3:.0f} ms): a "
            "queue grew during the probe",
        )
    # One request's latency after the last arrival is what an idle stack takes; the worst at the
    # lowest rate, twice, allows for this box's noise.
    worst = (lowest or stats).latency_p99
    if queue.drain_s is not None and worst is not None and queue.drain_s > 2 * worst + GROWTH_FLOOR_S:
        return Verdict(
            rate,
            False,
            f"the answers trailed the last arrival by {queue.drain_s:.1f} s (over twice the lowest rate's "
            f"latency p99, {worst * 1e3:.0f} ms): a backlog",
        )
    return Verdict(rate, True, f"{stats.ok} ok, latency p50 {p50 * 1e3:.0f} ms")


def pick(verdicts: list[Verdict]) -> tuple[float, bool]:
    """The highest rate sustained below the first that was not (the ladder climbs), and whether any
    was: when none was, the lowest rate, flagged."""
    best: float | None = None
    for v in verdicts:
        if not v.sustained:
            break
        best = v.rate
    if best is None:
        return verdicts[0].rate, False
    return best, True
