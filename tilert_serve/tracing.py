"""OpenTelemetry traces of our own components (the router, the decode node), exported over OTLP/HTTP.

One `Tracer` per component object, built from a `TracingConfig` by `make_tracer`: its own
TracerProvider (parent-based sampling on a trace-id ratio, a BatchSpanProcessor, an OTLP/HTTP
exporter). The global provider is never set: two components in one process (tests, `tilert-pd local`
runs nothing else in ours, but a test runs router and node side by side) keep their own service names
and exporters, and vLLM in the same interpreter (none of ours, but a library user's) keeps its own.
Without an endpoint `make_tracer` returns None and nothing is imported: the request path only checks
`tracer is None` (see docs/observability.md, "Traces", for its measured cost).

The W3C `traceparent` header is parsed here (`parse_traceparent`), not trusted for anything but the
trace: a malformed one is ignored, never an error, and a request without one starts a new root that
`sample_ratio` samples. Spans are started with explicit parents (`Tracer.start`) rather than through a
context variable, so no state leaks from one request into another's task.

The OpenTelemetry SDK and its OTLP/HTTP exporter are imported only when a tracer is made.
"""

from __future__ import annotations

import re
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.sampling import Sampler
    from opentelemetry.trace import Span

#: The W3C Trace Context header (https://www.w3.org/TR/trace-context/).
TRACEPARENT = "traceparent"
#: Version 00's layout; a later version may append fields after a dash (the spec says: parse the
#: first four and ignore the rest), version ff is invalid.
_TRACEPARENT = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?")
#: vLLM reads this to pick its exporter's protocol (vllm/tracing/otel.py; its default is grpc).
VLLM_PROTOCOL_ENV = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"
OTLP_HTTP_PROTOCOL = "http/protobuf"
_URL = re.compile(r"https?://[A-Za-z0-9.:\[\]_-]+(/[A-Za-z0-9._/-]*)?")
Kind = Literal["server", "client", "internal"]


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


def sampler(ratio: float) -> Sampler:
    """Follow the parent's sampled flag; without a parent, sample `ratio` of the trace ids."""
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

    return ParentBased(TraceIdRatioBased(ratio))


def wall_ns(perf: float, now_perf: float, now_ns: int) -> int:
    """A perf_counter (or, on Linux, monotonic: the same clock) reading as Unix nanoseconds, given one
    reading of both clocks taken together."""
    return now_ns - round((now_perf - perf) * 1e9)


class Tracer:
    """One component's tracer and the provider that exports its spans (see the module docstring)."""

    def __init__(self, config: TracingConfig, provider: TracerProvider) -> None:
        self.config = config
        self.provider = provider
        self._tracer = provider.get_tracer("tilert_serve")

    def start(
        self,
        name: str,
        parent: TraceParent | Span | None,
        kind: Kind = "internal",
        start_ns: int | None = None,
        attributes: Mapping[str, str | int | float | bool] | None = None,
    ) -> Span:
        """Start a span under `parent` (a remote traceparent, one of ours, or None: a new root)."""
        from opentelemetry.trace import SpanKind

        kinds = {"server": SpanKind.SERVER, "client": SpanKind.CLIENT, "internal": SpanKind.INTERNAL}
        return self._tracer.start_span(
            name,
            context=_context(parent),
            kind=kinds[kind],
            attributes=dict(attributes or {}),
            start_time=start_ns,
        )

    def record(
        self,
        name: str,
        parent: TraceParent | Span | None,
        start_ns: int,
        end_ns: int,
        attributes: Mapping[str, str | int | float | bool] | None = None,
        kind: Kind = "internal",
    ) -> Span:
        """A span that already happened (from timestamps taken on the way), ended at `end_ns`."""
        span = self.start(name, parent, kind, start_ns, attributes)
        span.end(end_time=max(end_ns, start_ns))
        return span

    def flush(self, timeout_s: float = 5.0) -> bool:
        return bool(self.provider.force_flush(int(timeout_s * 1000)))

    def shutdown(self) -> None:
        """Export what is queued and stop the exporter's thread (the component's own stop calls this)."""
        self.provider.shutdown()


def header_of(span: Span) -> str:
    """The traceparent a downstream call carries to be a child of `span`."""
    ctx = span.get_span_context()
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"


def _context(parent: TraceParent | Span | None) -> Context | None:
    from opentelemetry import trace
    from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

    if parent is None:
        return None
    if isinstance(parent, TraceParent):
        flags = TraceFlags(TraceFlags.SAMPLED if parent.sampled else TraceFlags.DEFAULT)
        parent = NonRecordingSpan(SpanContext(parent.trace_id, parent.span_id, True, flags))
    return trace.set_span_in_context(parent)


def make_tracer(config: TracingConfig) -> Tracer | None:
    """The component's tracer; None without an endpoint (nothing imported, nothing started)."""
    if not config.endpoint:
        return None
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = TracerProvider(
        sampler=sampler(config.sample_ratio),
        resource=Resource.create({"service.name": config.service_name}),
        # The component calls shutdown in its own stop; no atexit hook of the SDK's.
        shutdown_on_exit=False,
    )
    # A short batch delay: a trace is readable within a second of its request.
    provider.add_span_processor(
        BatchSpanProcessor(OTLPSpanExporter(endpoint=config.endpoint, timeout=5), schedule_delay_millis=500)
    )
    return Tracer(config, provider)


def now() -> tuple[float, int]:
    """One reading of perf_counter and of the wall clock, for `wall_ns`."""
    return time.perf_counter(), time.time_ns()
