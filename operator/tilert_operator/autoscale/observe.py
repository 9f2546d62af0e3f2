"""From two scrapes of the pods' /metrics to one interval's `inputs.Observed`: pure, no I/O (the
scrapes come from `scrape.py`).

Counters become rates over the interval the way Prometheus' `rate()` takes them: per series, and a
value lower than before is a restart (the counter began again from 0, so the whole new value is this
interval's), never a negative rate. A pod with no earlier sample (new, or it did not answer last
time) gives its gauges but no rates: what its counters hold may be older than the interval. Histogram
percentiles come from the buckets' increase over the interval, summed over pods and interpolated
within a bucket as `histogram_quantile` does; None when no request ended in the interval.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Literal

from prometheus_client.parser import text_string_to_metric_families

from tilert_operator.autoscale.inputs import NativeObserved, Observed, PrefillObserved, TileRTObserved
from tilert_serve import metric_defs as m

#: Which pool a scraped pod serves.
Role = Literal["router", "prefill", "tilert", "native"]
#: The routing reasons that mean a request wanted TileRT and did not get it (the router's policy.Label).
OVERFLOW_REASONS = frozenset({"tilert full", "no tilert pool", "tilert down"})

Labels = frozenset[tuple[str, str]]
#: Sample name -> the labels of each of its series -> value.
Samples = Mapping[str, Mapping[Labels, float]]


class MetricsTextError(ValueError):
    """A /metrics answer that is not the Prometheus text format."""


def parse(text: str) -> dict[str, dict[Labels, float]]:
    """The samples of a Prometheus text exposition, by sample name (`x_total`, `x_bucket`, `x_sum`)."""
    out: dict[str, dict[Labels, float]] = {}
    try:
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                out.setdefault(s.name, {})[frozenset(s.labels.items())] = float(s.value)
    except (ValueError, TypeError) as e:
        raise MetricsTextError(f"not the Prometheus text format: {e}") from e
    return out


@dataclass(frozen=True)
class PodSample:
    """One pod's /metrics at one time."""

    pod: str
    role: Role
    at: float
    samples: Samples
    #: The StatefulSet ordinal of a TileRT node; None for the other pools.
    ordinal: int | None = None


@dataclass(frozen=True)
class Snapshot:
    """Every pod that answered one round of scrapes, by pod name, and those that did not."""

    pods: Mapping[str, PodSample] = field(default_factory=dict)
    #: Pod name -> why it gave no sample (a timeout, a refusal, text that did not parse).
    missing: Mapping[str, str] = field(default_factory=dict)

    def of(self, role: Role) -> list[PodSample]:
        return [p for p in self.pods.values() if p.role == role]


Match = Callable[[Mapping[str, str]], bool]


def _all(_labels: Mapping[str, str]) -> bool:
    return True


def label_is(key: str, *values: str) -> Match:
    allowed = frozenset(values)
    return lambda labels: labels.get(key) in allowed


def _series(sample: PodSample, name: str, match: Match) -> dict[Labels, float]:
    return {k: v for k, v in (sample.samples.get(name) or {}).items() if match(dict(k))}


def _increase(before: PodSample | None, after: PodSample, name: str, match: Match) -> dict[Labels, float]:
    """Each matching series' increase over the interval; a decrease is a restart (the new value is
    the increase). Empty without an earlier sample: the counter's age is not known."""
    if before is None:
        return {}
    old = _series(before, name, match)
    out: dict[Labels, float] = {}
    for k, v in _series(after, name, match).items():
        prev = old.get(k, 0.0)
        out[k] = v if v < prev else v - prev
    return out


def _pairs(before: Snapshot, after: Snapshot, role: Role) -> Iterable[tuple[PodSample | None, PodSample]]:
    for p in after.of(role):
        prev = before.pods.get(p.pod)
        # A restart between the samples may move it to another node: only the name and role need match.
        yield (prev if prev is not None and prev.role == role else None), p


def increase(before: Snapshot, after: Snapshot, role: Role, name: str, match: Match = _all) -> float:
    """A counter's increase over the interval, summed over the pods of `role` and matching series."""
    return sum(sum(_increase(b, a, name, match).values()) for b, a in _pairs(before, after, role))


def interval_s(before: Snapshot, after: Snapshot, role: Role) -> float:
    """Seconds between the two scrapes of `role`'s pods (the mean over the pods seen in both); 0 when
    no pod was seen in both."""
    spans = [a.at - b.at for b, a in _pairs(before, after, role) if b is not None and a.at > b.at]
    return sum(spans) / len(spans) if spans else 0.0


def rate(before: Snapshot, after: Snapshot, role: Role, name: str, match: Match = _all) -> float:
    """A counter's per-second rate over the interval (0 when the interval is unknown)."""
    dt = interval_s(before, after, role)
    return increase(before, after, role, name, match) / dt if dt > 0 else 0.0


def mean(before: Snapshot, after: Snapshot, role: Role, histogram: str, match: Match = _all) -> float:
    """A histogram's mean over the interval: increase of `_sum` over increase of `_count` (0 when none)."""
    count = increase(before, after, role, f"{histogram}_count", match)
    return increase(before, after, role, f"{histogram}_sum", match) / count if count > 0 else 0.0


def bucket_increase(
    before: Snapshot, after: Snapshot, role: Role, histogram: str, match: Match = _all
) -> dict[float, float]:
    """The buckets' increase over the interval, summed over pods and series: upper bound -> count."""
    out: dict[float, float] = {}
    for b, a in _pairs(before, after, role):
        if b is None:
            continue
        # A restart resets every bucket: judged on the series' +Inf bucket (its count), so a pod's
        # buckets are all taken whole or all as differences, never mixed.
        grown = _increase(b, a, f"{histogram}_bucket", match)
        restarted = _restarted(b, a, f"{histogram}_bucket", match)
        for k, v in grown.items():
            le = dict(k).get("le")
            if le is None:
                continue
            rest = frozenset((x, y) for x, y in k if x != "le")
            got = _series(a, f"{histogram}_bucket", match).get(k, 0.0) if rest in restarted else v
            out[float(le)] = out.get(float(le), 0.0) + got
    return out


def _restarted(before: PodSample, after: PodSample, name: str, match: Match) -> set[Labels]:
    """Series (without `le`) whose +Inf bucket went down: the pod restarted between the samples."""
    old, new = _series(before, name, match), _series(after, name, match)
    return {
        frozenset((x, y) for x, y in k if x != "le")
        for k, v in new.items()
        if dict(k).get("le") == "+Inf" and v < old.get(k, 0.0)
    }


def quantile(q: float, buckets: Mapping[float, float]) -> float | None:
    """The q-quantile of cumulative bucket counts (upper bound -> count), interpolated linearly within
    the bucket it falls in, as Prometheus' `histogram_quantile`; None with no observation. In the +Inf
    bucket it is the highest finite bound."""
    if not buckets:
        return None
    bounds = sorted(buckets)
    total = buckets[bounds[-1]] if math.isinf(bounds[-1]) else max(buckets.values())
    if total <= 0:
        return None
    rank = q * total
    lower_bound, lower_count = 0.0, 0.0
    for le in bounds:
        count = buckets[le]
        if count >= rank:
            if math.isinf(le):
                return lower_bound
            if count == lower_count:
                return le
            return lower_bound + (le - lower_bound) * (rank - lower_count) / (count - lower_count)
        lower_bound, lower_count = le, count
    return lower_bound


def gauge_sum(after: Snapshot, role: Role, *names: str) -> float:
    """A gauge summed over the pods of `role`: the first of `names` each pod exports."""
    return sum(_gauge(p, names) or 0.0 for p in after.of(role))


def gauge_mean(after: Snapshot, role: Role, *names: str) -> float:
    got = [g for p in after.of(role) if (g := _gauge(p, names)) is not None]
    return sum(got) / len(got) if got else 0.0


def _gauge(p: PodSample, names: tuple[str, ...]) -> float | None:
    for name in names:
        series = p.samples.get(name)
        if series:
            return sum(series.values())
    return None


@dataclass(frozen=True)
class Ready:
    """Ready pods per pool (the operator's pod list) and the TileRT nodes' ordinals that are ready."""

    prefill: int
    tilert: int
    native: int
    tilert_ordinals: tuple[int, ...] = ()


def observed(
    before: Snapshot,
    after: Snapshot,
    ready: Ready,
    current: Mapping[str, int],
    *,
    percentile: float,
    slots_per_node: int,
) -> Observed:
    """One interval's `inputs.Observed` from the scrapes at its start and end."""
    routes, dur = m.ROUTER_ROUTES, m.ROUTER_REQUEST_DURATION
    native_path = label_is("path", "native")
    overflow = rate(before, after, "router", routes, lambda lb: lb.get("reason") in OVERFLOW_REASONS)
    overflow += rate(before, after, "router", m.ROUTER_REJECTIONS, label_is("code", "429"))
    prefill = PrefillObserved(
        ready=ready.prefill,
        arrival_rate=rate(before, after, "router", routes),
        mean_prefill_s=mean(before, after, "router", m.ROUTER_PREFILL),
        waiting=gauge_sum(after, "prefill", m.VLLM_WAITING),
        ttft_s=quantile(percentile, bucket_increase(before, after, "router", m.ROUTER_TTFT)),
    )
    tilert = TileRTObserved(
        ready=ready.tilert,
        slots_per_node=int(max([_gauge(p, (m.DECODE_SLOTS,)) or 0.0 for p in after.of("tilert")], default=0))
        or slots_per_node,
        busy_by_node=busy_by_node(after, ready.tilert_ordinals, slots_per_node),
        admit_rate=rate(before, after, "router", routes, label_is("path", "tilert")),
        overflow_rate=overflow,
        tpot_s=quantile(percentile, bucket_increase(before, after, "tilert", m.DECODE_TPOT)),
    )
    native = NativeObserved(
        ready=ready.native,
        kv_usage=gauge_mean(after, "native", m.VLLM_KV_USAGE, m.VLLM_KV_USAGE_OLD),
        waiting=gauge_sum(after, "native", m.VLLM_WAITING),
        arrival_rate=rate(before, after, "router", routes, native_path),
        tpot_s=quantile(
            percentile, bucket_increase(before, after, "router", m.ROUTER_INTER_TOKEN, native_path)
        ),
        running=gauge_sum(after, "native", m.VLLM_RUNNING),
        mean_stream_s=mean(before, after, "router", dur, native_path),
    )
    return Observed(
        prefill, tilert, native, current=dict(current), mean_stream_s=mean(before, after, "router", dur)
    )


def busy_by_node(after: Snapshot, ready_ordinals: Iterable[int], slots_per_node: int) -> tuple[int, ...]:
    """Busy slots by ordinal. A ready node that did not answer counts as full: it may hold streams,
    and the planner never scales away a node that does (it is kept until it answers idle)."""
    busy: dict[int, int] = {}
    for p in after.of("tilert"):
        if p.ordinal is not None:
            busy[p.ordinal] = int(_gauge(p, (m.DECODE_SLOTS_BUSY,)) or 0)
    for o in ready_ordinals:
        busy.setdefault(o, slots_per_node)
    return tuple(busy.get(i, 0) for i in range(max(busy, default=-1) + 1))
