"""The router's HTTP server against request-smuggling shapes and connection floods:
what aiohttp's parser refuses is a 400 in the OpenAI error shape that quotes nothing, with no traceback
in the log; a body that breaks its chunked encoding after the headers is a 400 too, not a 500; past its
connection cap the router closes idle connections to make room, so /health and /ready still answer."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import logging
from typing import Any

import pytest
from router_fakes import until

from tilert_serve import httpserver

MARKER = b"SMUGGLED-MARKER-7f3a"


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


async def _raw(port: int, *parts: bytes, timeout: float = 30.0, between: Any = None) -> bytes:
    """Send `parts` on a fresh connection, awaiting `between()` after each but the last; read until the
    router closes the connection."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        for i, part in enumerate(parts):
            writer.write(part)
            await writer.drain()
            if between is not None and i < len(parts) - 1:
                await between()
        return await asyncio.wait_for(reader.read(), timeout)
    finally:
        writer.close()


def _status_and_error(answer: bytes) -> tuple[int, dict[str, object]]:
    head, _, body = answer.partition(b"\r\n\r\n")
    status = int(head.split(b"\r\n")[0].split(b" ")[1])
    err = json.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    return status, err


SMUGGLING = [
    (
        "content-length and chunked",
        [
            b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Length: 4\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n" + MARKER
        ],
    ),
    (
        "bad chunk size",
        [
            b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nTransfer-Encoding: chunked\r\n\r\n"
            b"zz" + MARKER + b"\r\n{}\r\n0\r\n\r\n"
        ],
    ),
    (
        "bad chunk after the headers",
        [
            b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nTransfer-Encoding: chunked\r\n"
            b'Content-Type: application/json\r\n\r\n2\r\n{"\r\n',
            b"zz" + MARKER + b"\r\n\r\n",
        ],
    ),
    ("over-long request line", [b"GET /" + MARKER + b"A" * 20000 + b" HTTP/1.1\r\nHost: r\r\n\r\n"]),
    ("over-long header", [b"GET /health HTTP/1.1\r\nHost: r\r\nX-A: " + MARKER + b"B" * 20000 + b"\r\n\r\n"]),
    (
        "two content-lengths",
        [
            b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Length: 2\r\n"
            b"Content-Length: 3\r\n\r\n" + MARKER
        ],
    ),
    (
        "chunked not last",
        [b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nTransfer-Encoding: chunked, gzip\r\n\r\n" + MARKER],
    ),
]


@pytest.mark.parametrize("name, parts", SMUGGLING, ids=[n for n, _ in SMUGGLING])
async def test_malformed_requests_are_json_400s_without_echo_or_traceback(make_stack, caplog, name, parts):
    s = await make_stack()
    caplog.set_level(logging.DEBUG)
    server = s.runner.server
    assert server is not None

    async def handler_reading_the_body() -> None:
        # The body's bad chunk must reach a handler already reading it (aiohttp's parser then queues
        # its refusal behind that request): wait for the request to be in progress.
        await until(lambda: any(getattr(h, "_request_in_progress", False) for h in server.connections))

    answer = await _raw(_port(s.router_url), *parts, between=handler_reading_the_body)
    assert MARKER not in answer, answer[:400]
    status, err = _status_and_error(answer)
    assert status == 400, answer[:400]
    assert "malformed" in str(err["message"]), err
    tracebacks = [r for r in caplog.records if r.exc_info or "Traceback" in r.getMessage()]
    assert not tracebacks, [r.getMessage() for r in tracebacks]
    assert not any(MARKER.decode() in r.getMessage() for r in caplog.records)
    assert sum(r.levelno >= logging.INFO for r in caplog.records) <= 1, [
        r.getMessage() for r in caplog.records
    ]
    # Still serving.
    c = s.client()
    r = await c.completions.create(model="tiny", prompt="a", max_tokens=2)
    assert r.choices[0].text


async def test_past_the_connection_cap_idle_connections_make_room(make_stack):
    s = await make_stack(limits={"max_client_connections": 20})
    port = _port(s.router_url)
    for ep in s.state.pools.all():
        ep.healthy = True  # no probes in this stack: /ready answers 200 once every pool is up
    conns: list[asyncio.StreamWriter] = []
    try:
        for i in range(60):
            _, w = await asyncio.open_connection("127.0.0.1", port)
            if i % 2:
                w.write(b"GET /ready HTTP/1.1\r\nHost: r\r\n")  # headers never finished
            conns.append(w)
        for path in ("/health", "/ready"):
            answer = await _raw(port, f"GET {path} HTTP/1.1\r\nHost: r\r\nConnection: close\r\n\r\n".encode())
            assert answer.startswith(b"HTTP/1.1 200"), answer[:300]
        # The router holds at most its cap (plus the connection being admitted).
        assert s.runner.server is not None and len(s.runner.server.connections) <= 21
    finally:
        for w in conns:
            with contextlib.suppress(Exception):
                w.close()


async def test_past_the_cap_with_every_connection_busy_a_new_one_gets_a_json_503(make_stack):
    s = await make_stack(node_slots=(2,), limits={"max_client_connections": 2})
    s.node.go.clear()  # both streams wait before their first token: two requests in progress
    c = s.client()
    streams = [
        await c.completions.create(
            model="tiny", prompt="a", max_tokens=3, stream=True, extra_headers={"x-pd-route": "tilert"}
        )
        for _ in range(2)
    ]
    try:
        answer = await _raw(_port(s.router_url), b"GET /health HTTP/1.1\r\nHost: r\r\n\r\n")
        status, err = _status_and_error(answer)
        assert status == 503 and b"Retry-After: 1" in answer, answer
        assert "too many connections" in str(err["message"])
    finally:
        s.node.go.set()
        for st in streams:
            async for _ in st:
                pass
    # The busy connections finished: the router takes new ones again.
    r = await c.completions.create(model="tiny", prompt="a", max_tokens=2)
    assert r.choices[0].text


def test_accept_errors_are_logged_once_per_interval(caplog):
    loop = asyncio.new_event_loop()
    try:
        httpserver.throttle_accept_errors(loop)
        caplog.set_level(logging.INFO)
        for _ in range(1000):
            loop.call_exception_handler(
                {
                    "message": "socket.accept() out of system resource",
                    "exception": OSError(errno.EMFILE, "Too many open files"),
                }
            )
        loop.call_exception_handler({"message": "something else", "exception": RuntimeError("kept")})
    finally:
        loop.close()
    accept = [r for r in caplog.records if "accept" in r.getMessage()]
    assert len(accept) == 1 and "1 time(s)" in accept[0].getMessage() and not accept[0].exc_info
    assert any("something else" in r.getMessage() for r in caplog.records)  # other errors as before
