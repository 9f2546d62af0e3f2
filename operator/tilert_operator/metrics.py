"""The operator's Prometheus metrics, served on /metrics: reconcile duration and errors, API writes,
PDClusters by state, Kubernetes API calls by verb. One registry per Metrics, because tests run
several operators in one process. docs/metrics.md lists them (tilert_serve.metrics_catalogue)."""

from __future__ import annotations

import collections
from collections.abc import Iterator, Mapping

from prometheus_client import generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

from tilert_operator.status import CONDITION_TYPES
from tilert_serve.metric_defs import Domain, Registry, Unbounded, counter, histogram, values

BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
#: A PDCluster's state as the controller keeps it; every state is a series, 0 when none is in it.
STATES = values(("ready", "not_ready", "invalid"), other=False)
#: The API client's verbs (kubeapi.Client.request's first argument); another counts as "other".
API_VERBS = values(("get", "list", "watch", "patch", "create", "delete"))
#: A PDCluster's condition types (status.CONDITION_TYPES) and a condition's status values.
CONDITIONS = values(CONDITION_TYPES, other=False)
CONDITION_STATUS = values(("True", "False", "Unknown"), other=False)
#: Not `namespace`: a scrape adds the operator pod's own namespace under that name.
NAMESPACE = Unbounded("a PDCluster's namespace: one per namespace with PDClusters")
NAME = Unbounded("a PDCluster's name: one per PDCluster")
CONTENT_TYPE = CONTENT_TYPE_LATEST

_PDCLUSTERS = "tilert_pd_pdclusters"
_API_CALLS = "tilert_pd_api_calls"
_CONDITION = "tilert_pd_pdcluster_condition"


class Metrics:
    def __init__(self, api_calls: collections.Counter[str] | None = None) -> None:
        r = self.registry = Registry()
        self.reconcile_duration = histogram(
            r, "tilert_pd_reconcile_duration_seconds", "Seconds of one PDCluster reconcile.", BUCKETS
        )
        self.reconcile_errors = counter(
            r, "tilert_pd_reconcile_errors_total", "Reconciles that failed (each is retried with backoff)."
        )
        self.writes = counter(r, "tilert_pd_writes_total", "Kubernetes API writes made by reconciles.")
        #: (namespace, name) -> ready | not_ready | invalid; the controller keeps it, a scrape counts it.
        self.states: dict[tuple[str, str], str] = {}
        #: (namespace, name) -> {condition type: status} as the last reconcile left the status.
        self.conditions: dict[tuple[str, str], dict[str, str]] = {}
        #: verb -> calls; the API client counts them (kubeapi.Client.calls), a scrape reads them.
        self.api_calls: collections.Counter[str] = (
            api_calls if api_calls is not None else collections.Counter()
        )
        r.register(_ScrapeTime(self))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _ScrapeTime(Collector):
    """Series whose values live elsewhere (the controller's states, the client's call counts), read
    at scrape time so that they need no second bookkeeping."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def label_domains(self) -> Mapping[str, Mapping[str, Domain]]:
        return {
            _PDCLUSTERS: {"state": STATES},
            _API_CALLS: {"verb": API_VERBS},
            _CONDITION: {
                "namespace": NAMESPACE,
                "name": NAME,
                "type": CONDITIONS,
                "status": CONDITION_STATUS,
            },
        }

    def collect(self) -> Iterator[Metric]:
        # A PDCluster whose reconcile has not decided yet (reconcile.py's "unknown") is in no state.
        by_state = collections.Counter(self.metrics.states.values())
        clusters = GaugeMetricFamily(
            _PDCLUSTERS, "PDClusters this operator reconciles, by state.", labels=["state"]
        )
        for state in STATES.listed():
            clusters.add_metric([state], by_state.get(state, 0))
        yield clusters
        # As kube-state-metrics shows a pod's conditions: one series per status, 1 for the one held,
        # so an alert can say `status="False"` for as long as it lasts.
        conditions = GaugeMetricFamily(
            _CONDITION,
            "A PDCluster's status conditions: 1 for the status each type holds, 0 for the others.",
            labels=["pdcluster_namespace", "pdcluster", "type", "status"],
        )
        for (namespace, name), held in sorted(self.metrics.conditions.items()):
            for type_, now in sorted(held.items()):
                if type_ not in CONDITIONS.listed():
                    continue
                for st in CONDITION_STATUS.listed():
                    conditions.add_metric([namespace, name, type_, st], float(now == st))
        yield conditions
        by_verb = collections.Counter[str]()
        for verb, n in self.metrics.api_calls.items():
            by_verb[API_VERBS.bound(verb)] += n
        calls = CounterMetricFamily(
            _API_CALLS, "Kubernetes API calls by verb (retries included).", labels=["verb"]
        )
        for verb, n in sorted(by_verb.items()):
            calls.add_metric([verb], n)
        yield calls
