"""How the project defines a Prometheus metric: with each label's values beside it.

A label's values are either a fixed set taken from the code's own source of that set (`Values`), or
one per deployed thing (`Unbounded`: a node name, an endpoint URL), which the deployment's size bounds
and the code cannot. `tilert_serve.metrics_catalogue` reads these declarations, with the name, type
and help text from the registries themselves, to write docs/metrics.md; a labelled metric without a
declaration stops it.

Every registry is a `Registry`, which remembers what was registered on it: prometheus_client has no
public way to list a registry's collectors, and the catalogue asks each one for its labels.
"""

from __future__ import annotations

import re
import weakref
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar, runtime_checkable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.registry import Collector

#: The value a `Values` label takes for anything outside its set, so that a value the code does not
#: name (a peer's words, a new call site's typo) never makes a new series.
OTHER = "other"


@dataclass(frozen=True)
class Values:
    """A label with a fixed set of values: `values`, values that fully match `pattern` (described to
    readers by `more`), and, when `other`, "other" for anything else."""

    values: frozenset[str]
    pattern: str | None = None
    more: str = ""
    other: bool = True

    def __post_init__(self) -> None:
        if (self.pattern is None) != (not self.more):
            raise ValueError("a pattern needs its description for readers, and only a pattern has one")

    def bound(self, value: str) -> str:
        """`value` when the set holds it; "other" (or, without it, a ValueError: a bug) otherwise."""
        if value in self.values or (self.pattern is not None and re.fullmatch(self.pattern, value)):
            return value
        if self.other:
            return OTHER
        raise ValueError(f"{value!r} is not one of this label's values")

    def listed(self) -> list[str]:
        """The named values, sorted, "other" last when it is one."""
        return sorted(self.values) + ([OTHER] if self.other and OTHER not in self.values else [])


@dataclass(frozen=True)
class Unbounded:
    """A label with one value per deployed thing; `why` says what each value is."""

    why: str


Domain = Values | Unbounded


def values(source: Iterable[str], *, other: bool = True) -> Values:
    """A `Values` from the code's source of the set: a Literal's `typing.get_args`, a StrEnum, a frozenset."""
    return Values(frozenset(str(v) for v in source), other=other)


@runtime_checkable
class DeclaresLabels(Protocol):
    """A custom collector (one that builds its families at scrape time) declares each family's labels."""

    def label_domains(self) -> Mapping[str, Mapping[str, Domain]]:
        """Family name (as given to the family, without `_total`) -> label -> its values."""
        ...


class Registry(CollectorRegistry):
    """A registry that keeps its collectors in registration order (for the catalogue)."""

    def __init__(self) -> None:
        super().__init__()
        self.collectors: list[Collector] = []

    def register(self, collector: Collector) -> None:
        super().register(collector)
        self.collectors.append(collector)

    def unregister(self, collector: Collector) -> None:
        super().unregister(collector)
        self.collectors.remove(collector)


# Keyed by the metric object, weakly: a metric made by a class we do not own (vLLM's Counter class,
# or one of record.py's) is declared after the fact, and tests make thousands of registries.
_DOMAINS: weakref.WeakKeyDictionary[Any, dict[str, Domain]] = weakref.WeakKeyDictionary()

M = TypeVar("M", Counter, Gauge, Histogram)


def declare(metric: M, labels: Mapping[str, Domain]) -> M:
    """Record `labels` as `metric`'s label values; they must name exactly its labels, in order."""
    names = getattr(metric, "_labelnames", None)  # a wrapper class (vLLM's for Ray) may not keep them
    if names is not None and tuple(names) != tuple(labels):
        raise ValueError(f"{metric!r}: labels {names} declared as {tuple(labels)}")
    _DOMAINS[metric] = dict(labels)
    return metric


def declared(metric: object) -> dict[str, Domain] | None:
    """The label values declared for `metric` (None: never declared)."""
    return _DOMAINS.get(metric)


def label_names(metric: object) -> tuple[str, ...]:
    """A prometheus_client metric's label names. prometheus_client exposes them only privately, and a
    labelled metric with no series yet has no samples to read them from."""
    return tuple(getattr(metric, "_labelnames", ()))


def counter(
    registry: CollectorRegistry, name: str, documentation: str, labels: Mapping[str, Domain] | None = None
) -> Counter:
    return declare(Counter(name, documentation, list(labels or {}), registry=registry), labels or {})


def gauge(
    registry: CollectorRegistry, name: str, documentation: str, labels: Mapping[str, Domain] | None = None
) -> Gauge:
    return declare(Gauge(name, documentation, list(labels or {}), registry=registry), labels or {})


def histogram(
    registry: CollectorRegistry,
    name: str,
    documentation: str,
    buckets: Sequence[float],
    labels: Mapping[str, Domain] | None = None,
) -> Histogram:
    return declare(
        Histogram(name, documentation, list(labels or {}), buckets=buckets, registry=registry), labels or {}
    )


class Bounded:
    """A labelled metric whose `labels()` holds each `Values` label to its set, and whose children are
    looked up once per label set: prometheus_client's `labels()` costs a lock and a few dict
    operations, and hot paths call it several times per request (once per chunk written)."""

    def __init__(self, metric: Counter | Gauge | Histogram) -> None:
        domains = declared(metric)
        if domains is None:
            raise ValueError(f"{metric!r} has no declared labels")
        self.metric = metric
        self._domains = tuple(domains.values())
        # Keyed by bounded values only, so that a peer's words cannot grow it either; a bounded value
        # bounds to itself, so the values as given find their child at once when they are in the set.
        self._children: dict[tuple[str, ...], Any] = {}

    def labels(self, *values: str) -> Any:
        child = self._children.get(values)
        if child is None:
            bounded = tuple(
                d.bound(v) if isinstance(d, Values) else v for d, v in zip(self._domains, values, strict=True)
            )
            child = self._children.get(bounded)
            if child is None:
                child = self._children[bounded] = self.metric.labels(*bounded)
        return child

    def keep_only(self, keep: set[tuple[str, ...]]) -> None:
        """Drop every label set not in `keep` (series of endpoints that left the pools)."""
        for values in list(self._children):
            if values not in keep:
                del self._children[values]
                self.metric.remove(*values)


# The names of the metrics read by more than the registry that exports them: the operator's
# autoscaler reads them off each pod's /metrics (operator/tilert_operator/autoscale/observe.py), so
# the registries and the operator take them from here, without the operator importing the router or
# the decode node. Counters carry the `_total` their exposition has.
ROUTER_ROUTES = "tilert_router_routes_total"
ROUTER_REJECTIONS = "tilert_router_rejections_total"
ROUTER_TTFT = "tilert_router_ttft_seconds"
ROUTER_INTER_TOKEN = "tilert_router_inter_token_seconds"
ROUTER_PREFILL = "tilert_router_prefill_seconds"
ROUTER_REQUEST_DURATION = "tilert_router_request_duration_seconds"
DECODE_SLOTS = "tilert_decode_slots"
DECODE_SLOTS_BUSY = "tilert_decode_slots_busy"
DECODE_TPOT = "tilert_decode_tpot_seconds"
#: vLLM's own gauges (its /metrics, on the prefill and native decode pods).
VLLM_WAITING = "vllm:num_requests_waiting"
VLLM_RUNNING = "vllm:num_requests_running"
VLLM_KV_USAGE = "vllm:kv_cache_usage_perc"
#: What vLLM before 0.10 called the KV-cache use.
VLLM_KV_USAGE_OLD = "vllm:gpu_cache_usage_perc"
