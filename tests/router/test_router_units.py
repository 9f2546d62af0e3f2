"""Pure parts: stop strings, the SSE decoder, request parsing and the routing decision."""

from __future__ import annotations

import pytest

from tilert_serve.router import openai_request, policy, sse
from tilert_serve.router.config import RoutingPolicy
from tilert_serve.router.errors import RouterError
from tilert_serve.router.stops import StopMatcher


def _run(stops, deltas, include=False):
    m = StopMatcher(tuple(stops), include)
    out = "".join(m.feed(d) for d in deltas)
    return out + m.flush(), m.stopped


@pytest.mark.parametrize(
    ("stops", "deltas", "want", "stopped"),
    [
        ([], ["a", "b"], "ab", False),
        (["END"], ["abc E", "N", "D tail"], "abc ", True),
        (["END"], ["abc E", "NX"], "abc ENX", False),
        (["END"], ["ab", "cE"], "abcE", False),  # held back, then flushed at the end
        (["xy", "b"], ["a", "bxy"], "a", True),  # the earliest match wins
        (["\n\n"], ["line\n", "\nnext"], "line", True),
    ],
)
def test_stop_matcher(stops, deltas, want, stopped):
    assert _run(stops, deltas) == (want, stopped)


def test_stop_matcher_include():
    assert _run(["END"], ["abEN", "D!"], include=True) == ("abEND", True)


def test_sse_decoder_partial_and_crlf():
    d = sse.Decoder()
    assert d.feed(b'data: {"a"') == []
    evs = d.feed(b": 1}\n\nevent: error\r\ndata: x\r\n\r\n: keepalive\n\ndata: [DO")
    assert [(e.event, e.data) for e in evs] == [("message", '{"a": 1}'), ("error", "x")]
    assert [e.data for e in d.feed(b"NE]\n\n")] == ["[DONE]"]


def _parse(body: str, kind="completions"):
    return openai_request.parse(kind, body.encode(), ["m"])


def test_parse_fields():
    r = _parse(
        '{"model":"m","messages":[{"role":"user","content":"x"}],"max_tokens":9,'
        '"max_completion_tokens":5,"stop":"##","stream":true,"stream_options":{"include_usage":true}}',
        "chat",
    )
    assert r.max_tokens == 5 and r.stop == ("##",) and r.stream and r.include_usage
    assert r.tilert_unsupported == ()
    r = _parse('{"model":"m","prompt":["a","b"],"logprobs":2,"n":2,"presence_penalty":0}')
    assert set(r.tilert_unsupported) == {"logprobs", "n", "prompt (batch)"}
    r = _parse('{"model":"m","prompt":"a","response_format":{"type":"text"},"logprobs":null,"echo":false}')
    assert r.tilert_unsupported == ()


def _decide(want="auto", unsupported=(), nodes=1, free=True, native="ok", tilert=None, **pol):
    req = _parse('{"model":"m","prompt":"a"}')
    req = openai_request.ParsedRequest(**{**req.__dict__, "tilert_unsupported": tuple(unsupported)})
    state = tilert or ("free" if free else "full")
    return policy.decide(RoutingPolicy(**pol), req, want, tilert_nodes=nodes, tilert=state, native=native)


def test_decide():
    assert _decide().route == "tilert"
    assert _decide(free=False).route == "native"
    assert _decide(want="native").route == "native"
    assert _decide(unsupported=["tools"]).route == "native"
    assert _decide(nodes=0).route == "native"
    with pytest.raises(RouterError) as ei:
        _decide(free=False, when_tilert_full="reject", retry_after_s=4)
    assert ei.value.status == 429 and ei.value.headers["Retry-After"] == "4"
    with pytest.raises(RouterError) as ei:
        _decide(free=False, native="full")
    assert ei.value.status == 429
    with pytest.raises(RouterError) as ei:
        _decide(want="native", native="none")
    assert ei.value.status == 503
    with pytest.raises(RouterError) as ei:
        _decide(want="tilert", unsupported=["tools"], unsupported_on_tilert="reject")
    assert ei.value.status == 400 and "tools" in ei.value.message
    # A pool with no node up is unavailable (503 with Retry-After), not full; auto falls back to native.
    with pytest.raises(RouterError) as ei:
        _decide(want="tilert", tilert="down", when_tilert_full="reject", retry_after_s=3)
    assert ei.value.status == 503 and ei.value.headers["Retry-After"] == "3"
    assert ei.value.code == "tilert_unavailable"
    d = _decide(tilert="down")
    assert (d.route, d.label) == ("native", "tilert down")
    with pytest.raises(RouterError) as ei:
        _decide(tilert="down", native="none")
    assert ei.value.status == 503 and "Retry-After" in ei.value.headers
    # The metric's reason is one of a fixed set whatever the request names; the detail goes to logs.
    d = _decide(unsupported=["tools", "logit_bias"])
    assert d.label == "unsupported on tilert" and "logit_bias" in d.detail
    assert policy.requested(RoutingPolicy(tilert_aliases=["m-fast"]), None, "m-fast") == "tilert"
    assert policy.requested(RoutingPolicy(), "NATIVE", "m") == "native"


def test_config_written_by_an_older_operator_still_parses():
    """The fields of the first config model only: every later field has a default."""
    import yaml

    from tilert_serve.router import config

    old = yaml.safe_load("""
model: m
prefill: [http://p:8100]
tilert: [{name: t0, http_url: "http://t0:5557", ctrl_host: t0, slots: 2}]
native: [http://d:8100]
policy: {header: x-pd-route, default: auto, when_tilert_full: native, retry_after_s: 1}
timeouts: {connect_s: 5, prefill_s: 600, idle_stream_s: 60}
api_keys_file: null
""")
    cfg = config.RouterConfig.model_validate(old)
    assert cfg.timeouts.admit_s == 2.0 and cfg.limits.native_max_inflight == 256
    assert cfg.served_models() == ["m"]


def test_panic_routing_when_a_whole_pool_is_ejected():
    from tilert_serve.router.config import RouterConfig
    from tilert_serve.router.pools import Pools

    pools = Pools(RouterConfig(model="m", prefill=["http://a", "http://b"], native=["http://n"]))
    pools.prefill["http://a"].healthy = False
    assert pools.pick_prefill(set()).url == "http://b"  # a healthy one is preferred
    pools.prefill["http://b"].healthy = False
    pools.native["http://n"].healthy = False
    assert pools.pick_prefill(set()) is not None  # none healthy: still try rather than fail for sure
    assert pools.native_state(10) == "ok"
