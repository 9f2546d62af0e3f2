"""Whether a probe at a rate was sustained (pure): the benchmark climbs a ladder of rates and keeps the
highest one the stack serves without failing and without a queue building up."""

from __future__ import annotations

from dataclasses import dataclass

from bench.load.summary import Stats

#: A probe's median latency over the lowest rate's above this means requests wait in a queue.
LATENCY_SLACK = 2.0


@dataclass(frozen=True)
class Verdict:
    rate: float
    sustained: bool
    why: str


def verdict(rate: float, stats: Stats, lowest_latency_p50: float | None) -> Verdict:
    """`lowest_latency_p50`: the median latency at the lowest rate of the ladder (None for that probe
    itself), which is as close to an idle stack's latency as this box gives."""
    if stats.failed:
        kinds = ", ".join(f"{k} {v}" for k, v in sorted(stats.failures.items()))
        return Verdict(rate, False, f"{stats.failed} of {stats.requests} failed ({kinds})")
    if not stats.ok or stats.latency_p50 is None:
        return Verdict(rate, False, "no request was answered")
    p50 = stats.latency_p50
    if lowest_latency_p50 is not None and p50 > LATENCY_SLACK * lowest_latency_p50:
        return Verdict(
            rate,
            False,
            f"latency p50 {p50 * 1e3:.0f} ms is over {LATENCY_SLACK:g}x the lowest rate's "
            f"{lowest_latency_p50 * 1e3:.0f} ms: requests queue",
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
