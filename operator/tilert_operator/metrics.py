"""The operator's Prometheus metrics, served on /metrics: reconcile duration and errors, API writes,
PDClusters by state, Kubernetes API calls by verb. One registry per Metrics, because tests run
several operators in one process. docs/metrics.md lists them (tilert_serve.metrics_catalogue)."""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterator, Mapping

from prometheus_client import generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

from tilert_operator.autoscale.decision import POOLS, Decision
from tilert_operator.autoscale.inputs import Observed
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
_AS_DESIRED = "tilert_pd_autoscale_desired_replicas"
_AS_RECOMMENDED = "tilert_pd_autoscale_recommended_replicas"
_AS_INPUT = "tilert_pd_autoscale_input"
_AS_MISSING = "tilert_pd_autoscale_unscraped_pods"
#: The serving pools the planner sizes (autoscale/decision.py).
AUTOSCALED_POOLS = values(POOLS, other=False)
#: The planner's inputs the operator exports, each a function of one interval's `Observed`.
AUTOSCALE_INPUTS: dict[str, Callable[[Observed], float | None]] = {
    "prefill_arrival_rate": lambda o: o.prefill.arrival_rate,
    "prefill_waiting": lambda o: o.prefill.waiting,
    "prefill_mean_seconds": lambda o: o.prefill.mean_prefill_s,
    "ttft_seconds": lambda o: o.prefill.ttft_s,
    "tilert_busy_slots": lambda o: float(o.tilert.busy),
    "tilert_admit_rate": lambda o: o.tilert.admit_rate,
    "tilert_overflow_rate": lambda o: o.tilert.overflow_rate,
    "tilert_tpot_seconds": lambda o: o.tilert.tpot_s,
    "native_kv_usage": lambda o: o.native.kv_usage,
    "native_waiting": lambda o: o.native.waiting,
    "native_running": lambda o: o.native.running,
    "native_arrival_rate": lambda o: o.native.arrival_rate,
    "native_tpot_seconds": lambda o: o.native.tpot_s,
}
INPUTS = values(AUTOSCALE_INPUTS, other=False)


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
        #: (namespace, name) -> the planner's last decision, its inputs and the pods it could not read.
        self.autoscale: dict[tuple[str, str], tuple[Decision, Observed | None, int]] = {}
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
            _AS_DESIRED: {"pdcluster_namespace": NAMESPACE, "pdcluster": NAME, "pool": AUTOSCALED_POOLS},
            _AS_RECOMMENDED: {"pdcluster_namespace": NAMESPACE, "pdcluster": NAME, "pool": AUTOSCALED_POOLS},
            _AS_INPUT: {"pdcluster_namespace": NAMESPACE, "pdcluster": NAME, "input": INPUTS},
            _AS_MISSING: {"pdcluster_namespace": NAMESPACE, "pdcluster": NAME},
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
        yield from self._autoscale()

    def _autoscale(self) -> Iterator[Metric]:
        """The planner's last decision per pool and the inputs it was made on (autoscale/loop.py)."""
        labels = ["pdcluster_namespace", "pdcluster"]
        desired = GaugeMetricFamily(
            _AS_DESIRED, "Replicas the autoscaling planner decided for a pool.", labels=[*labels, "pool"]
        )
        recommended = GaugeMetricFamily(
            _AS_RECOMMENDED,
            "Replicas the load asked for, before the windows, the bounds and the prefill:decode balance.",
            labels=[*labels, "pool"],
        )
        inputs = GaugeMetricFamily(
            _AS_INPUT,
            "The planner's inputs over its last interval (rates per second, latencies at the objective's "
            "percentile; a latency is absent when no request ended in the interval).",
            labels=[*labels, "input"],
        )
        missing = GaugeMetricFamily(
            _AS_MISSING,
            "Ready pods whose /metrics the planner could not read in its last run.",
            labels=labels,
        )
        for (namespace, name), (decision, observed, unread) in sorted(self.metrics.autoscale.items()):
            for pool in POOLS:
                desired.add_metric([namespace, name, pool], decision.pool(pool).desired)
                recommended.add_metric([namespace, name, pool], decision.pool(pool).recommended)
            for key, read in AUTOSCALE_INPUTS.items():
                value = read(observed) if observed is not None else None
                if value is not None:
                    inputs.add_metric([namespace, name, key], value)
            missing.add_metric([namespace, name], unread)
        yield from (desired, recommended, inputs, missing)
