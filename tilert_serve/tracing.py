"""Traces of our own components (the router, the decode node): their settings, the W3C `traceparent`,
and the clock conversion the node's after-the-fact spans need. Nothing here imports OpenTelemetry, so
the operator (which renders these settings) and every component without an endpoint stay without it;
the tracer itself is `tilert_serve/tracing_otel.py`.

The `traceparent` header is parsed here (`parse_traceparent`) and trusted for nothing but the trace: a
malformed one is ignored, never an error, and a request without one starts a new root that
`sample_ratio` samples.
"""

from __future__ import annotations

import re
import time
from collections.abc import Mapping
from dataclasses import dataclass

#: The W3C Trace Context header (https://www.w3.org/TR/trace-context/).
TRACEPARENT = "traceparent"
#: Version 00's layout; a later version may append fields after a dash (the spec says: parse the
#: first four and ignore the rest), version ff is invalid.
_TRACEPARENT = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?")
#: vLLM reads this to pick its exporter's protocol (vllm/tracing/otel.py; its default is grpc).
VLLM_PROTOCOL_ENV = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"
OTLP_HTTP_PROTOCOL = "http/protobuf"
#: vLLM's TracerProvider takes its sampler from this (the SDK's own variable): follow the caller's
#: decision and start no trace of its own, so the router alone decides what is traced (the router's
#: handoff probes, which carry no traceparent, then leave no root spans behind).
VLLM_SAMPLER_ENV = "OTEL_TRACES_SAMPLER"
FOLLOW_PARENT_ONLY = "parentbased_always_off"
#: An OTLP/HTTP traces URL as every setting of it accepts one (the spec's field, the router's and the
#: node's): no user:password part, no query.
URL_PATTERN = r"https?://[A-Za-z0-9.:\[\]_-]+(/[A-Za-z0-9._/-]*)?"
_URL = re.compile(URL_PATTERN)


class TracingConfigError(ValueError):
    """A tracing setting that cannot work; the message says which and how to fix it."""


@dataclass(frozen=True)
class TracingConfig:
    """Where one component sends its spans. `endpoint`: the collector's OTLP/HTTP traces URL
    (http://host:4318/v1/traces), "" = no tracing; `sample_ratio`: the share of requests without a
    sampled parent that start a trace."""

    endpoint: str = ""
    sample_ratio: float = 1.0
    service_name: str = "tilert-pd"

    def __post_init__(self) -> None:
        if self.endpoint and not _URL.fullmatch(self.endpoint):
            raise TracingConfigError(
                f"tracing endpoint {self.endpoint!r} is not an http(s) URL: give the collector's OTLP/HTTP "
                "traces URL, e.g. http://otel-collector:4318/v1/traces, or '' for no tracing"
            )
        if not 0.0 <= self.sample_ratio <= 1.0:
            raise TracingConfigError(
                f"tracing sample ratio {self.sample_ratio} is outside 0..1: give the share of new requests "
                "to trace (1 = all, 0 = only those whose client sent a sampled traceparent)"
            )
        if not self.service_name:
            raise TracingConfigError("tracing service name is empty: name the component (router, node)")


@dataclass(frozen=True)
class TraceParent:
    """A parsed W3C traceparent: the caller's span, as a parent."""

    trace_id: int
    span_id: int
    sampled: bool

    def header(self) -> str:
        return f"00-{self.trace_id:032x}-{self.span_id:016x}-{int(self.sampled):02x}"


def parse_traceparent(value: str | None) -> TraceParent | None:
    """The header's parent, or None when it is absent or malformed (upper-case hex, all-zero ids,
    version ff, a wrong length: the spec says to start a new trace then, not to fail the request)."""
    if not value or len(value) > 512:
        return None
    m = _TRACEPARENT.fullmatch(value.strip())
    if m is None:
        return None
    version, trace_id, span_id, flags, rest = m.groups()
    if version == "ff" or (version == "00" and rest):
        return None
    tid, sid = int(trace_id, 16), int(span_id, 16)
    if tid == 0 or sid == 0:
        return None
    return TraceParent(tid, sid, bool(int(flags, 16) & 1))


def parent_of(headers: Mapping[str, str]) -> TraceParent | None:
    return parse_traceparent(headers.get(TRACEPARENT))


def wall_ns(perf: float, now_perf: float, now_ns: int) -> int:
    """A perf_counter (or, on Linux, monotonic: the same clock) reading as Unix nanoseconds, given one
    reading of both clocks taken together."""
    return now_ns - round((now_perf - perf) * 1e9)


def now() -> tuple[float, int]:
    """One reading of perf_counter and of the wall clock, for `wall_ns`."""
    return time.perf_counter(), time.time_ns()
