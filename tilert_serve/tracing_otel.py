"""The OpenTelemetry tracer of one of our components (the router, the decode node), exporting over
OTLP/HTTP.

One `Tracer` per component object, built from a `TracingConfig` by `make_tracer`: its own
TracerProvider (parent-based sampling on a trace-id ratio, a BatchSpanProcessor, an OTLP/HTTP
exporter). The global provider is never set: two components in one process (a test runs router and
node side by side) keep their own service names and exporters, and a vLLM in the same interpreter
keeps its own. Without an endpoint `make_tracer` returns None and imports nothing: the request path
then only checks `tracer is None` (docs/observability.md, "Traces", has its measured cost). Spans are
started with explicit parents (`Tracer.start`) rather than through a context variable, so nothing of
one request's trace leaks into another's task.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Literal

from tilert_serve.tracing import TraceParent, TracingConfig, TracingConfigError

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.sampling import Sampler
    from opentelemetry.trace import Span

Kind = Literal["server", "client", "internal"]


def sampler(ratio: float) -> Sampler:
    """Follow the parent's sampled flag; without a parent, sample `ratio` of the trace ids."""
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

    return ParentBased(TraceIdRatioBased(ratio))


class Tracer:
    """One component's tracer and the provider that exports its spans (see the module docstring)."""

    def __init__(self, provider: TracerProvider) -> None:
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

    def shutdown(self) -> None:
        """Export what is queued and stop the exporter's thread (the component's own stop calls this)."""
        self.provider.shutdown()


def header_of(span: Span) -> str:
    """The traceparent a downstream call carries to be a child of `span`."""
    ctx = span.get_span_context()
    return TraceParent(ctx.trace_id, ctx.span_id, ctx.trace_flags.sampled).header()


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
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError as exc:
        raise TracingConfigError(
            f"a tracing endpoint is set but OpenTelemetry is not installed ({exc}): install "
            "opentelemetry-sdk and opentelemetry-exporter-otlp-proto-http, or set no endpoint"
        ) from exc

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
    return Tracer(provider)
