"""Prometheus metrics, one registry per app (tests build many apps in one process)."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

# 0.5 ms .. 4 min: the router adds about a millisecond, prefills of long prompts take minutes.
_LATENCY_BUCKETS = (
    0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0, 240.0,
)
_ITL_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 5.0)

CONTENT_TYPE = CONTENT_TYPE_LATEST


#: Upstream failure kinds the router itself names, and the error types a TileRT node answers a
#: generate call with (prefixed "generate_"); anything else counts as "other", so that an upstream's
#: words never make new series.
_KINDS = frozenset({
    "timeout", "connect", "transport", "bad_response", "no_endpoint", "handoff_failed", "stream_error",
    "truncated", "stream_broken", "cancel", "bootstrap",
    *(f"generate_{t}" for t in ("unknown_ticket", "already_generating", "handoff_timeout", "handoff_failed",
                                "not_ready", "invalid_request", "invalid_json", "unauthorized",
                                "request_too_large", "internal_error", "decode_failed", "timeout", "transport")),
})
_HTTP_KIND = re.compile(r"^(admit_|generate_)?http_[1-5][0-9][0-9]$")


def bounded_kind(kind: str) -> str:
    """`kind` when it is one of a fixed set (an HTTP status included), else "other"."""
    return kind if kind in _KINDS or _HTTP_KIND.match(kind) else "other"


class _Cached:
    """A labelled metric whose children are looked up once per label set: prometheus_client's
    `labels()` costs a lock and a few dict operations, and the hot path calls it several times per
    request. Label values here are bounded (paths, node names, route reasons from a fixed set, status
    codes; error kinds through `bounded_kind`): no value comes from a client."""

    def __init__(self, metric: Any, normalize: Callable[[tuple[str, ...]], tuple[str, ...]] | None = None) -> None:
        self._metric = metric
        self._normalize = normalize
        self._children: dict[tuple[str, ...], Any] = {}

    def labels(self, *values: str) -> Any:
        if self._normalize is not None:
            values = self._normalize(values)
        child = self._children.get(values)
        if child is None:
            child = self._children[values] = self._metric.labels(*values)
        return child

    def keep_only(self, keep: set[tuple[str, ...]]) -> None:
        """Drop every label set not in `keep` (series of endpoints that left the pools)."""
        for values in list(self._children):
            if values not in keep:
                del self._children[values]
                self._metric.remove(*values)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        p = "tilert_router_"
        self.ttft = _Cached(Histogram(p + "ttft_seconds", "Request arrival to first token written, by path",
                              ["path"], buckets=_LATENCY_BUCKETS, registry=r))
        self.itl = _Cached(Histogram(p + "inter_token_seconds", "Gap between two chunks written to the client",
                             ["path"], buckets=_ITL_BUCKETS, registry=r))
        self.e2e = _Cached(Histogram(p + "request_duration_seconds", "Request arrival to the last byte, by path",
                             ["path"], buckets=_LATENCY_BUCKETS, registry=r))
        self.prefill = _Cached(Histogram(p + "prefill_seconds", "Prefill call duration, by path",
                                 ["path"], buckets=_LATENCY_BUCKETS, registry=r))
        self.handoff = Histogram(p + "handoff_seconds",
                                 "Prefill answer to the first token from the TileRT node (KV handoff)",
                                 buckets=_LATENCY_BUCKETS, registry=r)
        self.requests = _Cached(Counter(p + "requests_total", "Finished requests by path and outcome",
                                ["path", "outcome"], registry=r))
        self.routes = _Cached(Counter(p + "routes_total", "Routing decisions by path and reason",
                              ["path", "reason"], registry=r))
        self.admissions = _Cached(Counter(p + "admissions_total", "TileRT admission calls by node and result",
                                  ["node", "result"], registry=r))
        self.rejections = _Cached(Counter(p + "rejections_total", "Requests answered 4xx/5xx by the router, by code",
                                  ["code"], registry=r))
        self.upstream_errors = _Cached(Counter(p + "upstream_errors_total", "Upstream failures by pool and kind",
                                       ["pool", "kind"], registry=r),
                                       lambda v: (v[0], bounded_kind(v[1])))
        self.probes = _Cached(Counter(p + "handoff_probes_total", "Handoff probes (canary) by node and outcome",
                                      ["node", "outcome"], registry=r))
        self.retries = Counter(p + "retries_total", "Requests retried before their first byte",
                               registry=r)
        self.cancels = _Cached(Counter(p + "tilert_cancels_total", "Cancel calls to TileRT nodes by reason",
                               ["reason"], registry=r))
        self.inflight = _Cached(Gauge(p + "inflight_requests", "Requests in flight by path", ["path"], registry=r))
        self.slots = _Cached(Gauge(p + "tilert_slots_in_use", "TileRT slots this router holds, by node",
                           ["node"], registry=r))
        self.healthy = _Cached(Gauge(p + "endpoint_healthy", "1 healthy, 0 ejected, -1 not probed yet",
                             ["pool", "endpoint"], registry=r))
        self.breaker_open = _Cached(Gauge(p + "breaker_open", "1 while a TileRT node's circuit breaker is open or "
                                                              "half-open (failed handoffs), 0 closed", ["node"], registry=r))
        self.path_up = _Cached(Gauge(p + "path_up", "1 when a decode path can take a request, 0 down, -1 not configured",
                                     ["path"], registry=r))
        self.config_reloads = _Cached(Counter(p + "config_reloads_total", "Config reloads by result",
                                      ["result"], registry=r))

    def render(self) -> bytes:
        return generate_latest(self.registry)
