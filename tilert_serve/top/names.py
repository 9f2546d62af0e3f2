"""The metric names `tilert-pd top` reads, taken from the components' own metric definitions (the
router's `Metrics`, the node's `NodeMetrics`), which docs/metrics.md is generated from: no name is
typed twice, and a renamed metric changes here with its definition.

Names are as a scrape shows them: a counter's with `_total`, a histogram's base name (its series add
`_bucket`, `_sum`, `_count`)."""

from __future__ import annotations

import functools
from dataclasses import dataclass

from prometheus_client import Counter, Gauge, Histogram

from tilert_serve.decode.metrics import NodeMetrics
from tilert_serve.router.metrics import Metrics


def _exposed(metric: Counter | Gauge | Histogram) -> str:
    name = str(next(iter(metric.describe())).name)
    return name + "_total" if isinstance(metric, Counter) else name


@dataclass(frozen=True)
class RouterNames:
    requests: str  # counter {path, outcome}
    ttft: str  # histogram {path}
    inter_token: str  # histogram {path}
    handoff: str  # histogram
    inflight: str  # gauge {path}
    path_up: str  # gauge {path}
    healthy: str  # gauge {pool, endpoint}
    endpoint_breaker_open: str  # gauge {pool, endpoint}
    upstream_errors: str  # counter {pool, kind}
    slots: str  # gauge {node}
    breaker_open: str  # gauge {node}


@dataclass(frozen=True)
class NodeNames:
    slots: str  # gauge
    slots_busy: str  # gauge
    handoffs: str  # counter {outcome}
    handoff_bytes: str  # counter
    handoff_seconds: str  # histogram
    tpot: str  # histogram
    requests: str  # counter {finish_reason}


@functools.cache
def router() -> RouterNames:
    m = Metrics()
    return RouterNames(
        requests=_exposed(m.requests.metric),
        ttft=_exposed(m.ttft.metric),
        inter_token=_exposed(m.itl.metric),
        handoff=_exposed(m.handoff),
        inflight=_exposed(m.inflight.metric),
        path_up=_exposed(m.path_up.metric),
        healthy=_exposed(m.healthy.metric),
        endpoint_breaker_open=_exposed(m.endpoint_breaker_open.metric),
        upstream_errors=_exposed(m.upstream_errors.metric),
        slots=_exposed(m.slots.metric),
        breaker_open=_exposed(m.breaker_open.metric),
    )


@functools.cache
def node() -> NodeNames:
    m = NodeMetrics(slots=1)
    return NodeNames(
        slots=_exposed(m.slots_total),
        slots_busy=_exposed(m.slots_busy),
        handoffs=_exposed(m.handoffs.metric),
        handoff_bytes=_exposed(m.handoff_bytes),
        handoff_seconds=_exposed(m.handoff_seconds),
        tpot=_exposed(m.tpot_seconds),
        requests=_exposed(m.requests.metric),
    )
