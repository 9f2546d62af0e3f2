"""The router's spans over scripted upstreams, received by an OTLP/HTTP receiver in the test: the
request's server span continues the client's traceparent, admission, prefill leg and decode leg are
its children in that order and inside it, the prefill is called with the prefill leg's traceparent and
the node with the admission's and the decode leg's; without an endpoint nothing is exported and no
traceparent goes upstream; sampling follows the client's flag, else the ratio."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from router_fakes import MODEL

from tests.observability.otlp_receiver import Receiver, Span
from tilert_serve.tracing import parse_traceparent

ROUTE = {"x-pd-route": "tilert"}
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
SAMPLED = f"00-{TRACE_ID}-{CLIENT_SPAN}-01"
NOT_SAMPLED = f"00-{TRACE_ID}-{CLIENT_SPAN}-00"


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver().start()
    yield r
    r.stop()


def _by_name(spans: list[Span]) -> dict[str, Span]:
    out: dict[str, Span] = {}
    for s in spans:
        assert s.name not in out, f"two {s.name} spans: {spans}"
        out[s.name] = s
    return out


def _has_root(spans: list[Span]) -> bool:
    return any(s.name == "router.request" for s in spans)


async def test_a_request_is_one_trace_continuing_the_clients(make_stack, receiver: Receiver) -> None:
    s = await make_stack(tracing={"endpoint": receiver.url})
    r = await s.client().completions.create(
        model=MODEL, prompt="hi", max_tokens=5, extra_headers={**ROUTE, "traceparent": SAMPLED}
    )
    assert r.choices[0].finish_reason == "length"
    spans = _by_name(receiver.wait_for("the router's spans", _has_root))
    assert set(spans) == {"router.request", "router.admission", "router.prefill", "router.decode"}
    assert {x.trace_id for x in spans.values()} == {TRACE_ID}
    root = spans["router.request"]
    assert root.parent_id == CLIENT_SPAN and root.service == "tilert-router"
    assert root.attributes["tilert_pd.route"] == "tilert" and root.attributes["tilert_pd.outcome"] == "ok"
    legs = [spans[n] for n in ("router.admission", "router.prefill", "router.decode")]
    for leg in legs:
        assert leg.parent_id == root.span_id
        assert root.start_ns <= leg.start_ns <= leg.end_ns <= root.end_ns, leg
    # In order, one after the other: their durations add up to no more than the request's.
    assert legs[0].end_ns <= legs[1].start_ns and legs[1].end_ns <= legs[2].start_ns
    assert sum(x.duration_ns for x in legs) <= root.duration_ns
    # Each upstream got the traceparent of its own leg: vLLM's span and the node's are that leg's children.
    sent = parse_traceparent(s.prefill.headers[0]["traceparent"])
    assert sent is not None and sent.sampled
    assert (f"{sent.trace_id:032x}", f"{sent.span_id:016x}") == (TRACE_ID, spans["router.prefill"].span_id)


async def test_a_malformed_traceparent_is_ignored_and_a_new_root_starts(
    make_stack, receiver: Receiver
) -> None:
    s = await make_stack(tracing={"endpoint": receiver.url})
    for bad in ("00-zz-00f067aa0ba902b7-01", f"00-{'0' * 32}-{CLIENT_SPAN}-01", "x" * 600, SAMPLED.upper()):
        r = await s.client().completions.create(
            model=MODEL, prompt="hi", max_tokens=2, extra_headers={**ROUTE, "traceparent": bad}
        )
        assert r.choices[0].text  # served as if no header came
    got = receiver.wait_for("four roots", lambda sp: sum(x.name == "router.request" for x in sp) == 4)
    roots = [x for x in got if x.name == "router.request"]
    assert all(x.parent_id == "" for x in roots)
    assert len({x.trace_id for x in roots}) == 4 and TRACE_ID not in {x.trace_id for x in roots}


async def test_sampling_follows_the_clients_flag_else_the_ratio(make_stack, receiver: Receiver) -> None:
    s = await make_stack(tracing={"endpoint": receiver.url, "sample_ratio": 0.0})
    c = s.client()
    for headers in ({}, {"traceparent": NOT_SAMPLED}, {"traceparent": SAMPLED}):
        await c.completions.create(model=MODEL, prompt="hi", max_tokens=2, extra_headers={**ROUTE, **headers})
    got = receiver.wait_for("the sampled request's spans", lambda sp: _has_root(sp) and len(sp) >= 4)
    # Export is batched: the sampled request's four spans came after the other two requests, in one
    # batch or more; the unsampled ones left none (the provider was flushed at the third's end).
    assert {x.trace_id for x in got} == {TRACE_ID} and len(got) == 4
    # Upstreams see the decision: an unsampled request's traceparent says so (vLLM then records nothing).
    flags = [parse_traceparent(h["traceparent"]) for h in s.prefill.headers]
    assert [f is not None and f.sampled for f in flags] == [False, False, True]


async def test_without_an_endpoint_nothing_is_exported_and_nothing_goes_upstream(
    make_stack, receiver: Receiver
) -> None:
    s = await make_stack()
    r = await s.client().completions.create(
        model=MODEL, prompt="hi", max_tokens=3, extra_headers={**ROUTE, "traceparent": SAMPLED}
    )
    assert r.choices[0].text
    await s.runner.cleanup()  # a tracer would flush what it holds here
    assert receiver.spans() == []
    assert "traceparent" not in s.prefill.headers[0]


async def test_the_native_path_has_the_same_legs_and_each_vllm_gets_its_own(
    make_stack, receiver: Receiver
) -> None:
    s = await make_stack(tracing={"endpoint": receiver.url})
    stream = await s.client().completions.create(
        model=MODEL,
        prompt="hi",
        max_tokens=4,
        stream=True,
        extra_headers={"x-pd-route": "native", "traceparent": SAMPLED},
    )
    assert [c async for c in stream]
    spans = _by_name(receiver.wait_for("the router's spans", _has_root))
    assert set(spans) == {"router.request", "router.admission", "router.prefill", "router.decode"}
    root = spans["router.request"]
    assert root.attributes["tilert_pd.route"] == "native" and root.parent_id == CLIENT_SPAN
    for leg, fake in (("router.prefill", s.prefill), ("router.decode", s.native)):
        sent = parse_traceparent(fake.headers[0]["traceparent"])
        assert sent is not None and f"{sent.span_id:016x}" == spans[leg].span_id, leg
        assert spans[leg].parent_id == root.span_id
        assert root.start_ns <= spans[leg].start_ns <= spans[leg].end_ns <= root.end_ns
