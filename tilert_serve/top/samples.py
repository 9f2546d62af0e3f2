"""Prometheus text -> samples, and the arithmetic `top` does on them: sums over label matches, counter
increases between two scrapes, and quantiles from a histogram's bucket increases (as PromQL's
`histogram_quantile(q, increase(...))` computes them), all pure.

Parsing uses prometheus_client's own parser (the library that writes these texts), not a regex."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

Labels = tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class Samples:
    """One scrape's samples: sample name (as exposed: `x_total`, `x_bucket`) -> label set -> value."""

    series: Mapping[str, Mapping[Labels, float]]

    def get(self, name: str) -> Mapping[Labels, float]:
        return self.series.get(name, {})

    def label_values(self, name: str, label: str) -> list[str]:
        """The values `label` takes in `name`'s series, in the order first seen."""
        seen: dict[str, None] = {}
        for labels in self.get(name):
            value = dict(labels).get(label)
            if value is not None:
                seen.setdefault(value)
        return list(seen)


EMPTY = Samples({})


def parse(text: str) -> Samples:
    """The samples of a Prometheus text exposition; ValueError naming the problem when it is not one."""
    series: dict[str, dict[Labels, float]] = {}
    try:
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                series.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = float(s.value)
    except (ValueError, TypeError, IndexError, KeyError) as exc:
        raise ValueError(f"not Prometheus text exposition: {exc}") from exc
    return Samples(series)


def _matches(labels: Labels, match: Mapping[str, str]) -> bool:
    d = dict(labels)
    return all(d.get(k) == v for k, v in match.items())


def total(samples: Samples, name: str, **match: str) -> float | None:
    """The sum of `name`'s series whose labels include `match`; None when there is none."""
    values = [v for labels, v in samples.get(name).items() if _matches(labels, match)]
    return math.fsum(values) if values else None


def increase(current: float | None, previous: float | None) -> float:
    """A counter's increase between two scrapes. A counter below its previous value was reset (its
    process restarted), so all of its current value is new; one not seen before counts from zero."""
    if current is None:
        return 0.0
    if previous is None or current < previous:
        return current
    return current - previous


def counter_increase(current: Samples, previous: Samples | None, name: str, **match: str) -> float:
    """The increase of the sum of `name`'s matching series (see `increase`)."""
    return increase(
        total(current, name, **match), None if previous is None else total(previous, name, **match)
    )


def bucket_increases(
    current: Samples, previous: Samples | None, histogram: str, **match: str
) -> list[tuple[float, float]]:
    """A histogram's cumulative bucket counts gained between two scrapes, summed over the matching
    series: [(upper bound, count)] sorted by bound, +Inf last. A reset (any bucket below its previous
    count) takes the current counts as they are."""
    name = histogram + "_bucket"

    def by_le(samples: Samples) -> dict[float, float]:
        out: dict[float, float] = {}
        for labels, value in samples.get(name).items():
            d = dict(labels)
            le = d.pop("le", None)
            if le is not None and all(d.get(k) == v for k, v in match.items()):
                out[float(le)] = out.get(float(le), 0.0) + value
        return out

    cur = by_le(current)
    prev = by_le(previous) if previous is not None else {}
    if any(cur.get(le, 0.0) < count for le, count in prev.items()):
        prev = {}
    return sorted((le, cur[le] - prev.get(le, 0.0)) for le in cur)


def quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """The q-quantile (0..1) of the observations in cumulative `buckets` ([(upper bound, count)],
    sorted, +Inf last), interpolated linearly inside its bucket as Prometheus does; the highest finite
    bound when it falls in the +Inf bucket. None without observations."""
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"a quantile is between 0 and 1, got {q}")
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lower, below = 0.0, 0.0
    for upper, count in buckets:
        if count >= rank and count > below:
            if math.isinf(upper):
                return lower
            return lower + (upper - lower) * (rank - below) / (count - below)
        lower, below = upper, count
    return lower
