"""A scripted OpenAI-compatible server for the harness's own tests and for scenario tests that need a
server whose failures they choose: each request is answered as a `script` function says (a text, an
error status, an error event or a cut after some chunks, a route header, a delay).

It listens on 127.0.0.1 only and requires a bearer token (fresh per server; `Target(api_key=...)`).
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from multidict import CIMultiDict

from bench.load.client import ATTEMPTS_HEADER, SERVED_HEADER


@dataclass(frozen=True)
class Reply:
    """How to answer one request."""

    text: str = "hello world"
    status: int = 200
    #: For an error status or event: the OpenAI error's type.
    error_type: str = "upstream_error"
    #: Streams: send this many text chunks, then an error event and [DONE] (the router's way to fail
    #: after the first byte).
    error_after: int | None = None
    #: Streams: send this many text chunks, then drop the connection (no [DONE], no error event).
    cut_after: int | None = None
    #: Sent as X-PD-Route (None: no header, as vLLM alone).
    route: str | None = "tilert"
    #: Sent as the attempts header when set.
    attempts: int | None = None
    #: Seconds before the response starts, and between stream chunks.
    delay_s: float = 0.0
    gap_s: float = 0.0


def chunks_of(text: str) -> list[str]:
    """The text as stream pieces: a word (with its leading space) each, one per token."""
    words = text.split(" ")
    return [w if i == 0 else " " + w for i, w in enumerate(words)]


@dataclass
class Seen:
    path: str
    body: dict[str, Any]
    #: Case-insensitive, as HTTP headers are.
    headers: CIMultiDict[str]
    at: float


@dataclass
class FakeOpenAI:
    #: How to answer each request, given what arrived (the harness's X-Request-Id names the record).
    script: Callable[[Seen], Reply] = lambda _seen: Reply()
    api_key: str = field(default_factory=lambda: secrets.token_urlsafe(16), repr=False)
    requests: list[Seen] = field(default_factory=list)
    url: str = ""
    _runner: web.AppRunner | None = None

    async def start(self) -> FakeOpenAI:
        app = web.Application()
        app.router.add_post("/v1/completions", self._handle)
        app.router.add_post("/v1/chat/completions", self._handle)
        # A client that goes away cancels its handler (a scripted delay must not outlive the test).
        self._runner = web.AppRunner(
            app, handle_signals=False, handler_cancellation=True, shutdown_timeout=1.0
        )
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = self._runner.addresses[0][1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def __aenter__(self) -> FakeOpenAI:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        if request.headers.get("Authorization") != f"Bearer {self.api_key}":
            return _error(401, "invalid or missing API key", "authentication_error", {})
        body = await request.json()
        seen = Seen(request.path, body, CIMultiDict(request.headers), time.monotonic())
        self.requests.append(seen)
        reply = self.script(seen)
        headers = {}
        if reply.route is not None:
            headers[SERVED_HEADER] = reply.route
        if reply.attempts is not None:
            headers[ATTEMPTS_HEADER] = str(reply.attempts)
        if reply.delay_s:
            await asyncio.sleep(reply.delay_s)
        if reply.status != 200:
            return _error(reply.status, f"scripted {reply.status}", reply.error_type, headers)
        chat = request.path.endswith("chat/completions")
        if not body.get("stream"):
            choice: dict[str, Any] = (
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": reply.text},
                    "finish_reason": "length",
                }
                if chat
                else {"index": 0, "text": reply.text, "finish_reason": "length"}
            )
            n = len(chunks_of(reply.text))
            usage = {"prompt_tokens": 3, "completion_tokens": n, "total_tokens": 3 + n}
            return web.json_response({"id": "x", "choices": [choice], "usage": usage}, headers=headers)
        return await self._stream(request, reply, chat, headers)

    async def _stream(
        self, request: web.Request, reply: Reply, chat: bool, headers: dict[str, str]
    ) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", **headers})
        await resp.prepare(request)
        pieces = chunks_of(reply.text)
        for i, piece in enumerate(pieces):
            if reply.cut_after is not None and i == reply.cut_after:
                assert request.transport is not None
                request.transport.close()  # mid-chunked-body: the client sees an incomplete payload
                return resp
            if reply.error_after is not None and i == reply.error_after:
                err = {
                    "error": {
                        "message": "scripted failure",
                        "type": reply.error_type,
                        "param": None,
                        "code": None,
                    }
                }
                await resp.write(b"event: error\ndata: " + json.dumps(err).encode() + b"\n\ndata: [DONE]\n\n")
                await resp.write_eof()
                return resp
            delta = {"delta": {"content": piece}} if chat else {"text": piece}
            await resp.write(_data({"id": "x", "choices": [{"index": 0, **delta, "finish_reason": None}]}))
            if reply.gap_s:
                await asyncio.sleep(reply.gap_s)
        usage = {"prompt_tokens": 3, "completion_tokens": len(pieces), "total_tokens": 3 + len(pieces)}
        await resp.write(_data({"id": "x", "choices": [], "usage": usage}))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


def _data(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def _error(status: int, message: str, type_: str, headers: dict[str, str]) -> web.Response:
    body = {"error": {"message": message, "type": type_, "param": None, "code": None}}
    return web.json_response(body, status=status, headers=headers)
