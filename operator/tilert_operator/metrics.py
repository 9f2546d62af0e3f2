"""Operator metrics in the Prometheus text format: reconcile duration and errors, PDClusters by
state, API calls by verb. Served on /metrics; hand-written to avoid a dependency for four series."""

from __future__ import annotations

import bisect
from collections import Counter
from dataclasses import dataclass, field

BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


@dataclass
class Metrics:
    durations: list[int] = field(default_factory=lambda: [0] * (len(BUCKETS) + 1))
    duration_sum: float = 0.0
    duration_count: int = 0
    errors: int = 0
    writes: int = 0
    #: (namespace, name) -> ready | not_ready | invalid
    states: dict[tuple[str, str], str] = field(default_factory=dict)
    #: Every reconcile's duration, for the benchmark's percentiles (bounded).
    samples: list[float] = field(default_factory=list)

    def observe(self, seconds: float) -> None:
        self.durations[bisect.bisect_left(BUCKETS, seconds)] += 1
        self.duration_sum += seconds
        self.duration_count += 1
        if len(self.samples) < 100_000:
            self.samples.append(seconds)

    def render(self, api_calls: Counter[str]) -> str:
        lines = [
            "# HELP tilert_pd_reconcile_duration_seconds Time of one PDCluster reconcile.",
            "# TYPE tilert_pd_reconcile_duration_seconds histogram",
        ]
        running = 0
        for bound, n in zip([*BUCKETS, float("inf")], self.durations, strict=True):
            running += n
            le = "+Inf" if bound == float("inf") else repr(bound)
            lines.append(f'tilert_pd_reconcile_duration_seconds_bucket{{le="{le}"}} {running}')
        lines += [
            f"tilert_pd_reconcile_duration_seconds_sum {self.duration_sum:.6f}",
            f"tilert_pd_reconcile_duration_seconds_count {self.duration_count}",
            "# HELP tilert_pd_reconcile_errors_total Reconciles that failed (retried with backoff).",
            "# TYPE tilert_pd_reconcile_errors_total counter",
            f"tilert_pd_reconcile_errors_total {self.errors}",
            "# HELP tilert_pd_writes_total API writes made by reconciles.",
            "# TYPE tilert_pd_writes_total counter",
            f"tilert_pd_writes_total {self.writes}",
            "# HELP tilert_pd_pdclusters PDClusters by state.",
            "# TYPE tilert_pd_pdclusters gauge",
        ]
        by_state = Counter(self.states.values())
        for state in ("ready", "not_ready", "invalid"):
            lines.append(f'tilert_pd_pdclusters{{state="{state}"}} {by_state.get(state, 0)}')
        lines += ["# HELP tilert_pd_api_calls_total Kubernetes API calls by verb.", "# TYPE tilert_pd_api_calls_total counter"]
        for verb, n in sorted(api_calls.items()):
            lines.append(f'tilert_pd_api_calls_total{{verb="{verb}"}} {n}')
        return "\n".join(lines) + "\n"
