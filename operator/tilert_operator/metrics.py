"""The operator's Prometheus metrics, served on /metrics: reconcile duration and errors, API writes,
PDClusters by state, Kubernetes API calls by verb. One registry per Metrics, because tests run
several operators in one process."""

from __future__ import annotations

import collections
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
STATES = ("ready", "not_ready", "invalid")
CONTENT_TYPE = CONTENT_TYPE_LATEST


class Metrics:
    def __init__(self, api_calls: collections.Counter[str] | None = None) -> None:
        r = self.registry = CollectorRegistry()
        self.reconcile_duration = Histogram(
            "tilert_pd_reconcile_duration_seconds", "Time of one PDCluster reconcile.", buckets=BUCKETS, registry=r,
        )  # fmt: skip
        self.reconcile_errors = Counter("tilert_pd_reconcile_errors", "Reconciles that failed (retried with backoff).", registry=r)
        self.writes = Counter("tilert_pd_writes", "API writes made by reconciles.", registry=r)
        #: (namespace, name) -> ready | not_ready | invalid; the controller keeps it, a scrape counts it.
        self.states: dict[tuple[str, str], str] = {}
        #: verb -> calls; the API client counts them (kubeapi.Client.calls), a scrape reads them.
        self.api_calls: collections.Counter[str] = api_calls if api_calls is not None else collections.Counter()
        r.register(_ScrapeTime(self))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _ScrapeTime(Collector):
    """Series whose values live elsewhere (the controller's states, the client's call counts), read
    at scrape time so that they need no second bookkeeping."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[Metric]:
        by_state = collections.Counter(self.metrics.states.values())
        clusters = GaugeMetricFamily("tilert_pd_pdclusters", "PDClusters by state.", labels=["state"])
        for state in STATES:
            clusters.add_metric([state], by_state.get(state, 0))
        yield clusters
        calls = CounterMetricFamily("tilert_pd_api_calls", "Kubernetes API calls by verb.", labels=["verb"])
        for verb, n in sorted(self.metrics.api_calls.items()):
            calls.add_metric([verb], n)
        yield calls
