"""The pure parts of tracing: the W3C traceparent (a malformed one is ignored), the sampling decision,
the settings' errors, the node's stage spans from its stamps, and what the operator renders for the
prefill, the native decode and the node when the spec sets an endpoint (and nothing when not)."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import timeit
from typing import Any

import pydantic
import pytest
import yaml
from opentelemetry.sdk.trace.sampling import Decision
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags, set_span_in_context

from tests.e2e.conftest import EXAMPLE
from tilert_operator import constants
from tilert_operator import spec as specmod
from tilert_operator.render import commands
from tilert_serve import tracing, tracing_otel
from tilert_serve.decode.record import GenerateStamps, stage_spans
from tilert_serve.router import config as router_config

TID, SID = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"


def test_a_valid_traceparent_is_parsed_and_written_back() -> None:
    p = tracing.parse_traceparent(f"00-{TID}-{SID}-01")
    assert p == tracing.TraceParent(int(TID, 16), int(SID, 16), True)
    assert p.header() == f"00-{TID}-{SID}-01"
    assert tracing.parse_traceparent(f"00-{TID}-{SID}-00") == tracing.TraceParent(
        int(TID, 16), int(SID, 16), False
    )
    # A later version may append fields: the first four are read (the spec's forward compatibility).
    assert tracing.parse_traceparent(f"01-{TID}-{SID}-03-extra") == tracing.TraceParent(
        int(TID, 16), int(SID, 16), True
    )


@pytest.mark.parametrize(
    "bad",
    [
        None,
        "",
        "garbage",
        f"00-{TID.upper()}-{SID}-01",  # upper-case hex
        f"00-{'0' * 32}-{SID}-01",  # all-zero trace id
        f"00-{TID}-{'0' * 16}-01",  # all-zero parent id
        f"ff-{TID}-{SID}-01",  # version ff
        f"00-{TID}-{SID}-01-extra",  # version 00 has exactly four fields
        f"00-{TID[:-1]}-{SID}-01",  # short trace id
        f"00-{TID}-{SID}-1",  # short flags
        "00-" + "a" * 600,  # long
    ],
)
def test_a_malformed_traceparent_is_none_never_an_error(bad: str | None) -> None:
    assert tracing.parse_traceparent(bad) is None
    assert tracing.parent_of({} if bad is None else {"traceparent": bad}) is None


def _decide(ratio: float, parent: tracing.TraceParent | None, trace_id: int) -> Decision:
    ctx = None
    if parent is not None:
        flags = TraceFlags(TraceFlags.SAMPLED if parent.sampled else TraceFlags.DEFAULT)
        ctx = set_span_in_context(NonRecordingSpan(SpanContext(parent.trace_id, parent.span_id, True, flags)))
    return tracing_otel.sampler(ratio).should_sample(ctx, trace_id, "router.request").decision


def test_sampling_follows_a_parent_else_the_ratio() -> None:
    yes, no = tracing.TraceParent(7, 9, True), tracing.TraceParent(7, 9, False)
    assert _decide(0.0, yes, 7) == Decision.RECORD_AND_SAMPLE
    assert _decide(1.0, no, 7) == Decision.DROP
    assert _decide(1.0, None, 7) == Decision.RECORD_AND_SAMPLE
    assert _decide(0.0, None, 7) == Decision.DROP
    # Without a parent: the share of trace ids sampled is the ratio (ids spread over the 64 low bits,
    # which the ratio sampler compares).
    ids = [(i * 0x9E3779B97F4A7C15) % (1 << 64) | (1 << 100) for i in range(1, 2001)]
    share = sum(_decide(0.25, None, t) == Decision.RECORD_AND_SAMPLE for t in ids) / len(ids)
    assert 0.2 < share < 0.3, share


def test_settings_errors_say_what_to_give() -> None:
    with pytest.raises(tracing.TracingConfigError, match="OTLP/HTTP traces URL"):
        tracing.TracingConfig(endpoint="otel-collector:4318")
    with pytest.raises(tracing.TracingConfigError, match=r"outside 0\.\.1"):
        tracing.TracingConfig(endpoint="http://c:4318/v1/traces", sample_ratio=1.5)
    with pytest.raises(pydantic.ValidationError, match="not an http"):
        router_config.Tracing(endpoint="grpc://c:4317")
    assert tracing_otel.make_tracer(tracing.TracingConfig()) is None


def test_no_endpoint_imports_nothing_and_costs_an_attribute_check() -> None:
    """Without an endpoint no OpenTelemetry module is loaded by the router's or the node's path."""
    code = (
        "import sys; from tilert_serve import tracing, tracing_otel; from tilert_serve.router import app; "
        "from tilert_serve.decode import http; "
        "assert tracing_otel.make_tracer(tracing.TracingConfig()) is None; "
        "print(sorted(m for m in sys.modules if m.startswith('opentelemetry')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"


def _stamps() -> GenerateStamps:
    s = GenerateStamps(received=10.0, landed=10.5, found=10.6, assembled=10.9, injected=11.0)
    s.first_step, s.ended = 11.2, 12.0
    # Converter work: one piece done before the call, one straddling its start, two on the critical path.
    s.work = [
        ("digest", 9.0, 9.1),
        ("convert", 10.55, 10.65),
        ("digest", 10.65, 10.7),
        ("convert", 10.7, 10.85),
    ]
    s.before = {"admit_to_accept_ms": 40.0, "accept_to_ready_ms": 300.0}
    return s


def test_stage_spans_nest_in_order_and_add_up() -> None:
    spans = stage_spans(_stamps())
    names = [s.name for s in spans]
    assert names == [
        "tilert.generate",
        "tilert.layers",
        "tilert.state",
        "tilert.conversion",
        "tilert.digest",
        "tilert.conversion",
        "tilert.injection",
        "tilert.first_step",
        "tilert.decode",
    ]
    root = spans[0]
    assert (root.start, root.end, root.parent) == (10.0, 12.0, None)
    assert root.attributes == {"tilert.admit_to_accept_ms": 40.0, "tilert.accept_to_ready_ms": 300.0}
    for s in spans[1:]:
        parent = spans[s.parent]  # type: ignore[index]
        assert parent.start <= s.start <= s.end <= parent.end, s
    for i, parent in enumerate(spans):
        kids = [s for s in spans if s.parent == i]
        assert sum(k.end - k.start for k in kids) <= parent.end - parent.start + 1e-9, parent
    # The straddling piece is clipped to the state's wait; the one done before the call is not a span.
    assert (spans[3].start, spans[3].end) == (10.6, 10.65)


def test_stages_not_reached_are_left_out() -> None:
    s = GenerateStamps(received=1.0, landed=2.0, ended=2.5)  # refused before the decode thread ran
    assert [x.name for x in stage_spans(s)] == ["tilert.generate", "tilert.layers"]
    s = _stamps()
    s.first_step = 0.0  # max_tokens 0: no engine step
    assert "tilert.first_step" not in [x.name for x in stage_spans(s)]


def _tiny(endpoint: str) -> specmod.PDClusterSpec:
    raw: dict[str, Any] = copy.deepcopy(yaml.safe_load(EXAMPLE.read_text())["spec"])
    raw["observability"] = {"tracing": {"endpoint": endpoint}} if endpoint else {}
    return specmod.parse(raw)


def test_the_operator_renders_tracing_only_when_the_spec_sets_an_endpoint() -> None:
    url = "http://otel-collector.monitoring:4318/v1/traces"
    on, off = commands.commands(_tiny(url)), commands.commands(_tiny(""))
    for pool in (constants.PREFILL, constants.NATIVE):
        argv, env = on[pool].argv, on[pool].env
        assert argv[argv.index("--otlp-traces-endpoint") + 1] == url
        # vLLM's exporter speaks gRPC unless told: the endpoint is OTLP/HTTP.
        assert env[tracing.VLLM_PROTOCOL_ENV] == "http/protobuf"
        # vLLM follows the router's decision and starts no trace of its own.
        assert env[tracing.VLLM_SAMPLER_ENV] == "parentbased_always_off"
        assert "--otlp-traces-endpoint" not in off[pool].argv and not {
            tracing.VLLM_PROTOCOL_ENV,
            tracing.VLLM_SAMPLER_ENV,
        } & set(off[pool].env)
        # Everything else is the same: turning tracing on changes nothing but tracing.
        rest = [a for a in argv if a not in ("--otlp-traces-endpoint", url)]
        assert json.dumps(rest) == json.dumps(off[pool].argv)
    node = on[constants.TILERT].argv
    assert node[node.index("--otlp-traces-endpoint") + 1] == url
    assert "--otlp-traces-endpoint" not in off[constants.TILERT].argv


def test_router_config_dump_leaves_tracing_out_when_off() -> None:
    cfg = router_config.RouterConfig(model="m", prefill=["http://p:8000"])
    assert "tracing" not in yaml.safe_load(router_config.dump(cfg))
    on = cfg.model_copy(update={"tracing": router_config.Tracing(endpoint="http://c:4318/v1/traces")})
    assert yaml.safe_load(router_config.dump(on))["tracing"]["endpoint"] == "http://c:4318/v1/traces"


def test_no_tracer_costs_less_than_a_microsecond_per_leg() -> None:
    """The request path without an endpoint: `Call.leg` hands back one shared no-op (the benchmark
    line in docs/observability.md comes from this measurement)."""
    from tilert_serve.router.call import _NO_LEG, Call

    call = Call.__new__(Call)
    call.trace = None
    n = 200_000

    def leg() -> None:
        with call.leg("router.prefill", endpoint="x"):
            pass

    per = min(timeit.repeat(leg, number=n, repeat=3)) / n
    assert call.leg("x") is _NO_LEG
    print(f"no-op leg: {per * 1e9:.0f} ns")
    assert per < 1e-6, per
