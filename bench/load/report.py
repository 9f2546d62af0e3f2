"""Tables of a run's summary (markdown, as every benchmark prints and writes them), and the run's
section of bench/RESULTS.md through bench/common.py's `record`."""

from __future__ import annotations

from bench.common import record, table
from bench.load.summary import Stats, Summary

STATS_HEADER = [
    "requests",
    "ok",
    "served by",
    "failed (by class)",
    "retried",
    "greedy mismatches / compared",
    "TTFT p50 / p99 ms",
    "TPOT p50 / p99 ms",
    "latency p50 / p99 ms",
]


def ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.0f}" if x >= 0.1 else f"{x * 1e3:.1f}"


def failures(s: Stats) -> str:
    if not s.failures:
        return "0"
    return f"{s.failed} (" + ", ".join(f"{k} {v}" for k, v in sorted(s.failures.items())) + ")"


def served(s: Stats) -> str:
    """The paths the server said served the successful requests ("-" when it says none, as vLLM alone)."""
    said = {k: v for k, v in s.served.items() if k != "?"}
    return ", ".join(f"{k} {v}" for k, v in sorted(said.items())) or "-"


def cells(s: Stats) -> list[str]:
    return [
        str(s.requests),
        str(s.ok),
        served(s),
        failures(s),
        str(s.retried),
        f"{s.mismatches} / {s.compared}",
        f"{ms(s.ttft_p50)} / {ms(s.ttft_p99)}",
        f"{ms(s.tpot_p50)} / {ms(s.tpot_p99)}",
        f"{ms(s.latency_p50)} / {ms(s.latency_p99)}",
    ]


def summary_table(s: Summary) -> str:
    """One row per phase and route asked, then one per phase (all routes), then the total."""
    rows = [[p, rt, *cells(st)] for (p, rt), st in s.cells.items()]
    if len(s.routes) > 1:
        rows += [[p, "all", *cells(st)] for p, st in s.phases.items() if st.requests]
    if len(s.phases) > 1:
        rows.append(["all", "all", *cells(s.total)])
    return table(["phase", "route", *STATS_HEADER], rows)


def recovery_table(s: Summary) -> str:
    def sec(x: float | None) -> str:
        return "never" if x is None else f"{x:.2f}"

    rows = [
        [r.mark, sec(r.first_ok_s), sec(r.steady_from_s), str(r.failed), str(r.failed_in_flight)]
        for r in s.recoveries.values()
    ]
    return table(
        [
            "mark",
            "first success after (s)",
            "all succeed from (s)",
            "failed after",
            "failed in flight at mark",
        ],
        rows,
    )


def ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or not b else f"{a / b:.2f}x"


def comparison_table(runs: dict[str, Stats], baseline: str) -> str:
    """One row per run (e.g. each route through the router, and vLLM alone) with its TTFT and TPOT
    medians over the baseline's, measured in the same run."""
    base = runs[baseline]
    rows = [
        [
            name,
            *cells(s),
            f"{ratio(s.ttft_p50, base.ttft_p50)} / {ratio(s.ttft_p99, base.ttft_p99)}",
            f"{ratio(s.tpot_p50, base.tpot_p50)} / {ratio(s.latency_p50, base.latency_p50)}",
        ]
        for name, s in runs.items()
    ]
    return table(
        [
            "load",
            *STATS_HEADER,
            f"TTFT p50 / p99 vs {baseline}",
            f"TPOT p50 / latency p50 vs {baseline}",
        ],
        rows,
    )


def write(key: str, title: str, body: str, notes: str = "") -> str:
    """The run's section of bench/RESULTS.md (machine, date, commit, command added by `record`)."""
    return record(key, title, body, notes=notes)
