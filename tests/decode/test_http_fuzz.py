"""Fuzzed calls on the decode node's HTTP API, with a real oracle.

Each example is one call with a generated method, path, token and body: JSON objects built from the
fields of admit, generate and cancel with values of any type and size (NaN, Infinity, 64-bit edges,
5000-digit integers, nesting), the ticket of a slot really admitted in the example, or raw bytes. The
oracle, checked on every example:

- the answer is a 200 (JSON, or an SSE stream) or an error with the node's shape
  ({"error": {"type", "message"}}), a 401 carrying `WWW-Authenticate`; never a 500;
- afterwards the node is alive (/health 200, an authenticated /v1/status 200) and every slot the
  example admitted is freed by its ticket (cancel answers, the table is empty again).

The node runs in its own thread and loop (hypothesis drives synchronous examples), with a token.
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

from tests.decode.conftest import RunningNode
from tests.decode.test_http_auth import TOKEN, node_with_token
from tilert_serve.decode.slots import SlotState

TICKET = "<the admitted ticket>"
#: Stands for a 5000-digit integer (past Python's int-string limit), put in the body's text at the end.
BIG = "<a 5000-digit integer>"


@pytest.fixture(scope="module")
def node_in_thread(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[int, RunningNode]]:
    tmp: Path = tmp_path_factory.mktemp("node-http-fuzz")
    (tmp / "secret").write_bytes(b"0123456789abcdef0123456789abcdef")
    (tmp / "token").write_text(TOKEN + "\n")
    started, stop = threading.Event(), threading.Event()
    holder: dict[str, Any] = {}

    async def main() -> None:
        async with node_with_token(tmp / "secret", tmp / "token", slots=2) as n:
            # A generate on a ticket whose state never comes answers at the ticket's deadline: short.
            n.node.slots.ticket_ttl_s = 0.3
            holder["node"] = n
            started.set()
            while not stop.is_set():
                await asyncio.sleep(0.05)

    thread = threading.Thread(target=lambda: asyncio.run(main()), daemon=True)
    thread.start()
    assert started.wait(30)
    n = holder["node"]
    yield int(n.url.rsplit(":", 1)[1]), n
    stop.set()
    thread.join(10)


_numbers = st.one_of(
    st.integers(-3, 300),
    st.integers(),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([2**63 - 1, 2**63, -(2**63) - 1]),
)
_leaves = st.one_of(
    st.none(),
    st.booleans(),
    _numbers,
    st.text(max_size=10),
    st.just(TICKET),
    st.just(BIG),
    st.sampled_from(["\ud800", "x" * 300]),
)
_json = st.recursive(
    _leaves,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=8,
)
_FIELDS = {
    "/v1/admit": ["request_id", "prompt_tokens", "max_tokens"],
    "/v1/generate": [
        "ticket",
        "request_id",
        "first_token",
        "max_tokens",
        "sampling",
        "stop_token_ids",
        "ignore_eos",
    ],
    "/v1/cancel": ["ticket", "request_id"],
}
_SAMPLING = st.fixed_dictionaries({}, optional={k: _json for k in ("temperature", "top_p", "top_k", "seed")})


@st.composite
def _calls(draw: st.DrawFn) -> tuple[str, str, str | None, bytes, bool]:
    path = draw(
        st.sampled_from([*_FIELDS, *_FIELDS, "/v1/status", "/health", "/ready", "/metrics", "/v1/x", "/"])
    )
    method = draw(
        st.sampled_from(
            ["GET" if path in ("/v1/status", "/health", "/ready", "/metrics") else "POST"] * 6
            + ["GET", "POST", "DELETE"]
        )
    )
    token = draw(st.sampled_from([TOKEN] * 6 + [None, "wrong", ""]))
    admit_first = draw(st.booleans())
    kind = draw(st.sampled_from(["valid"] * 4 + ["fields"] * 4 + ["json", "raw"]))
    if kind == "raw":
        return method, path, token, draw(st.binary(max_size=48)), admit_first
    if kind == "json":
        return method, path, token, json.dumps(draw(_json)).encode(), admit_first
    body: dict[str, Any] = {}
    if kind == "valid":
        body = {
            "/v1/admit": {
                "request_id": draw(st.text(min_size=1, max_size=20)),
                "prompt_tokens": draw(st.integers(0, 300)),
                "max_tokens": draw(st.integers(0, 300)),
            },
            "/v1/generate": {
                "ticket": TICKET,
                "first_token": draw(st.integers(0, 50)),
                "max_tokens": draw(st.integers(0, 8)),
                "sampling": {"temperature": draw(st.floats(0, 2)), "seed": draw(st.integers())},
            },
            "/v1/cancel": {"ticket": TICKET},
        }.get(path, {})
        if draw(st.booleans()) and body:  # one field made wrong
            body[draw(st.sampled_from(sorted(body)))] = draw(_json)
        return method, path, token, json.dumps(body).encode(), admit_first or path != "/v1/admit"
    for name in draw(st.lists(st.sampled_from(_FIELDS.get(path, ["ticket"])), max_size=5, unique=True)):
        body[name] = draw(_SAMPLING) if name == "sampling" and draw(st.booleans()) else draw(_json)
    if draw(st.booleans()) and path in ("/v1/generate", "/v1/cancel"):
        body["ticket"] = TICKET
    return method, path, token, json.dumps(body).encode(), admit_first


def _http(
    port: int, method: str, path: str, token: str | None, body: bytes | None
) -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        headers = {"Content-Type": "application/json"}
        if token is not None:
            headers["Authorization"] = f"Bearer {token}"
        conn.request(method, path, body=body, headers=headers)
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(call=_calls())
def test_every_call_is_answered_in_shape_and_the_node_survives(node_in_thread, call):
    port, n = node_in_thread
    method, path, token, body, admit_first = call
    ticket = None
    if admit_first:
        status, _, raw = _http(port, "POST", "/v1/admit", TOKEN, b'{"request_id": "fuzz"}')
        assert status == 200, raw
        ticket = json.loads(raw)["ticket"]
    body = body.replace(json.dumps(TICKET).encode(), json.dumps(ticket or "no-such-ticket").encode())
    body = body.replace(json.dumps(BIG).encode(), b"9" * 5000)
    status, headers, raw = _http(port, method, path, token, body if method != "GET" else None)
    assert status != 500 and status < 600, (status, raw[:300])
    if status == 200:
        if headers.get("content-type", "").startswith("text/event-stream"):
            assert raw.endswith(b"\n\n")
        elif path != "/metrics":
            json.loads(raw)
    else:
        err = json.loads(raw)["error"]
        assert isinstance(err["type"], str) and isinstance(err["message"], str) and err["message"], raw
        if status == 401:
            assert headers["www-authenticate"].startswith("Bearer")
        assert status in (400, 401, 404, 405, 409, 413, 429, 502, 503, 504), (status, raw[:300])
    # Alive, and the example's slot freed by its ticket.
    assert _http(port, "GET", "/health", None, None)[0] == 200
    assert _http(port, "GET", "/v1/status", TOKEN, None)[0] == 200
    if ticket is not None:
        assert _http(port, "POST", "/v1/cancel", TOKEN, json.dumps({"ticket": ticket}).encode())[0] == 200
    deadline = time.monotonic() + 10
    while any(s.state is not SlotState.FREE for s in n.node.slots.slots):
        assert time.monotonic() < deadline, [s.state for s in n.node.slots.slots]
        time.sleep(0.01)
