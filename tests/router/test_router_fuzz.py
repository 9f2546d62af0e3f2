"""Fuzzed requests on the router's OpenAI endpoints, with a real oracle.

Each example is one HTTP request with a generated method, path, headers and body: JSON objects built
from the fields the router reads, with values of any type and size (NaN, Infinity, 64-bit edges,
5000-digit integers, lone surrogates, nesting), or raw bytes. The oracle, checked on every example:

- the answer is a 200 (a JSON completion, or an SSE stream that ends with `data: [DONE]`) or a 4xx
  with OpenAI's error shape ({"error": {"message", "type", "param", "code"}}); never a 5xx (the one
  exception: /ready's 503, which the scripted stack, never probed, answers by design);
- afterwards the router is alive (/health answers 200) and holds no TileRT slot (none leaked).

The stack runs in its own thread and loop (hypothesis drives synchronous examples): scripted upstreams
from router_fakes, API keys on, the node-API token on.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from router_fakes import MODEL, FakeNative, FakeNode, FakePrefill, stack_config

from tilert_serve.router import config
from tilert_serve.router.app import bound_port, make_app, start
from tilert_serve.router.state import STATE, RouterState

KEY = "fuzz-key-1"
NODE_TOKEN = "fuzz-node-token"


class _Running:
    port: int
    state: RouterState
    node: FakeNode


@pytest.fixture(scope="module")
def router_in_thread(tmp_path_factory: pytest.TempPathFactory) -> Iterator[_Running]:
    tmp: Path = tmp_path_factory.mktemp("router-fuzz")
    (tmp / "keys").write_text(KEY + "\n")
    (tmp / "node-token").write_text(NODE_TOKEN + "\n")
    started, stop = threading.Event(), threading.Event()
    out = _Running()

    async def main() -> None:
        node = await FakeNode("t0", slots=2, max_seq_len=64, token=NODE_TOKEN).start()
        prefill = await FakePrefill([node]).start()
        native = await FakeNative().start()
        prefill.max_model_len = native.max_model_len = 64
        cfg = config.RouterConfig.model_validate(
            stack_config(
                [prefill.url],
                [native.url],
                [("t0", node.url, 2)],
                max_seq_len=64,
                api_keys_file=str(tmp / "keys"),
                tilert_api_token_file=str(tmp / "node-token"),
                policy={"tilert_aliases": ["tiny-fast"]},
                timeouts={"client_idle_s": 5.0, "client_body_s": 5.0},
            )
        )
        app = make_app(cfg, health_checks=False)
        runner = await start(app, "127.0.0.1", 0)
        out.port, out.state, out.node = bound_port(runner), app[STATE], node
        started.set()
        while not stop.is_set():
            await asyncio.sleep(0.05)
        await runner.cleanup()
        for f in (node, prefill, native):
            await f.stop()

    thread = threading.Thread(target=lambda: asyncio.run(main()), daemon=True)
    thread.start()
    assert started.wait(30)
    yield out
    stop.set()
    thread.join(10)


# -- strategies -----------------------------------------------------------------------------------------

_numbers = st.one_of(
    st.integers(-5, 70),
    st.integers(),
    st.sampled_from([2**63 - 1, 2**63, -(2**63), -(2**63) - 1, 2**64]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0.0, 1.0, 2.0, 2.0001, -0.0, 1e308]),
)
_leaves = st.one_of(
    st.none(),
    st.booleans(),
    _numbers,
    st.text(max_size=12),
    st.sampled_from(["\ud800", "a" * 3000, MODEL, "tiny-fast", "user", "tilert"]),
)
_json = st.recursive(
    _leaves,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=12,
)
_FIELDS = [
    "model",
    "prompt",
    "messages",
    "max_tokens",
    "max_completion_tokens",
    "stream",
    "stream_options",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "n",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "logprobs",
    "presence_penalty",
    "tools",
    "kv_transfer_params",
    "vllm_xargs",
    "min_tokens",
    "response_format",
    "include_stop_str_in_output",
]
_good = {
    "model": st.sampled_from([MODEL, "tiny-fast"]),
    "prompt": st.one_of(st.text(max_size=20), st.lists(st.integers(0, 100), min_size=1, max_size=4)),
    "messages": st.just([{"role": "user", "content": "hi"}]),
    "max_tokens": st.integers(1, 8),
    "stream": st.booleans(),
}


@st.composite
def _bodies(draw: st.DrawFn) -> bytes:
    kind = draw(st.sampled_from(["near-valid"] * 6 + ["any-json", "raw"]))
    if kind == "raw":
        return draw(st.binary(max_size=64))
    if kind == "any-json":
        return json.dumps(draw(_json)).encode()
    body: dict[str, Any] = {k: draw(v) for k, v in _good.items() if draw(st.booleans()) or k == "model"}
    if draw(st.booleans()):
        for name in draw(st.lists(st.sampled_from(_FIELDS), max_size=3)):
            body[name] = draw(_json)
    return json.dumps(body).encode()


_PATHS = {
    "/v1/completions": "POST",
    "/v1/chat/completions": "POST",
    "/v1/models": "GET",
    "/metrics": "GET",
    "/ready": "GET",
    "/health": "GET",
    "/v1/nope": "GET",
}


@st.composite
def _method_path(draw: st.DrawFn) -> tuple[str, str]:
    path = draw(st.sampled_from([*_PATHS, "/v1/completions", "/v1/chat/completions", "/v1/completions"]))
    method = draw(st.sampled_from([_PATHS[path]] * 8 + ["GET", "POST", "PUT"]))
    return method, path


_requests = st.tuples(
    _method_path(),
    st.fixed_dictionaries(
        {
            "Authorization": st.sampled_from([f"Bearer {KEY}"] * 8 + ["Bearer nope", "Basic x", "Bearer "]),
        },
        optional={
            "x-pd-route": st.sampled_from(["tilert", "native", "auto", "TILERT", "bogus", ""]),
            "X-Request-Id": st.text(
                alphabet=st.characters(min_codepoint=33, max_codepoint=126), max_size=140
            ),
        },
    ),
    _bodies(),
)


def _exchange(
    port: int, method: str, path: str, headers: dict[str, str], body: bytes
) -> tuple[int, str, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request(
            method,
            path,
            body=body if method != "GET" else None,
            headers={"Content-Type": "application/json", **headers},
        )
        resp = conn.getresponse()
        return resp.status, resp.getheader("Content-Type") or "", resp.read()
    finally:
        conn.close()


def _check(path: str, status: int, ctype: str, raw: bytes) -> None:
    if status == 200:
        if ctype.startswith("text/event-stream"):
            assert raw.rstrip().endswith(b"data: [DONE]"), raw[-300:]
        elif path != "/metrics":
            json.loads(raw)
        return
    if status == 503 and path == "/ready":
        return
    assert 400 <= status < 500, (status, raw[:500])
    err = json.loads(raw)["error"]
    assert (
        set(err) == {"message", "type", "param", "code"}
        and isinstance(err["message"], str)
        and err["message"]
    )


def _one(r: _Running, request: tuple[tuple[str, str], dict[str, str], bytes]) -> None:
    (method, path), headers, body = request
    status, ctype, raw = _exchange(r.port, method, path, headers, body)
    _check(path, status, ctype, raw)
    # Alive, and no TileRT slot left held (the router frees it with the node's done or a cancel).
    assert _exchange(r.port, "GET", "/health", {}, b"")[0] == 200
    deadline = time.monotonic() + 10
    while any(n.in_use for n in r.state.pools.tilert.values()) or r.node.tickets:
        assert time.monotonic() < deadline, "a TileRT slot stayed held (by the router or on the node)"
        time.sleep(0.01)


_SETTINGS = settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@_SETTINGS
@given(request=_requests)
def test_every_request_is_served_or_refused_in_shape_and_the_router_survives(router_in_thread, request):
    _one(router_in_thread, request)


_completions = st.tuples(
    st.sampled_from([("POST", "/v1/completions"), ("POST", "/v1/chat/completions")]),
    st.fixed_dictionaries(
        {"Authorization": st.just(f"Bearer {KEY}")},
        optional={"x-pd-route": st.sampled_from(["tilert", "native", "auto"])},
    ),
    _bodies(),
)


@_SETTINGS
@given(request=_completions)
def test_authenticated_completions_are_served_or_refused_in_shape(router_in_thread, request):
    _one(router_in_thread, request)
