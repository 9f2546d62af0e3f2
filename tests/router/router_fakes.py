"""Scripted upstreams for the router tests: a vLLM prefill, a TileRT decode node and a native vLLM
decode, each a small aiohttp app on port 0 that records what it received and can be told to fail,
stall or die mid-stream. They follow the contracts in the router's issue (tilert_serve/router docs);
the real vLLM path is covered by test_router_vllm_real.py.

The fake prefill plays the TileRT connector too: when a request carries `tilert_ticket`, it marks
the ticket as handed off on the fake node it is linked to, as the real sender would over the wire.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web

#: The served model name in every scripted stack.
MODEL = "tiny"
WORDS = [f" w{i}" for i in range(1000)]


def vllm_error(message: str, param: str) -> dict[str, Any]:
    """The body vLLM 0.32 answers a request it refuses (a 400 BadRequestError naming the parameter)."""
    return {"error": {"message": message, "type": "BadRequestError", "param": param, "code": 400}}


def vllm_max_tokens_check(
    body: dict[str, Any], max_model_len: int | None, chat: bool = True
) -> dict[str, Any] | None:
    """vLLM 0.32 refuses a max_tokens past the context length up front, whatever the prompt; a prompt
    + max_tokens past it is not refused but clamped (get_max_tokens). Completions have no
    max_completion_tokens (vLLM ignores the field there)."""
    param = (
        "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    )
    mt = body.get(param)
    if max_model_len is None or mt is None or mt <= max_model_len:
        return None
    return vllm_error(
        f"{param}={mt} cannot be greater than max_model_len={max_model_len}. Please request fewer "
        f"output tokens. (parameter={param}, value={mt})",
        param,
    )


def stack_config(
    prefills: Sequence[str],
    natives: Sequence[str],
    nodes: Sequence[tuple[str, str, int]],
    max_seq_len: int | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """A router config (as its YAML reads, before validation) over fakes on 127.0.0.1: `nodes` as
    (name, HTTP URL, slots); `extra` adds top-level sections."""
    limit = {"max_seq_len": max_seq_len} if max_seq_len else {}
    return {
        "model": MODEL,
        "prefill": list(prefills),
        "native": list(natives),
        "tilert": [
            {"name": name, "http_url": url, "ctrl_host": "127.0.0.1", "slots": slots, **limit}
            for name, url, slots in nodes
        ],
        **extra,
    }


async def start_router(
    cfg_path: Path, port: int, *extra: str, log_level: str = "WARNING", **kwargs: Any
) -> asyncio.subprocess.Process:
    """`tilert-pd router` as a process serving `cfg_path` on 127.0.0.1:`port`; `extra`: more flags,
    `kwargs`: create_subprocess_exec's (the output's pipes)."""
    return await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "tilert_serve.router.cli",
        "--config",
        str(cfg_path),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--log-level",
        log_level,
        *extra,
        **kwargs,
    )


async def _start(app: web.Application) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    return runner, f"http://127.0.0.1:{port}"


async def until(cond: Any, timeout: float = 15.0, step: float = 0.01) -> None:
    """Wait for `cond()` (the router finishes some work after the client's response ends). The
    timeout only stops a test that would hang: it is far above what any wait takes on an idle machine,
    so a loaded one does not fail the test."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"condition not met within {timeout} s"
        await asyncio.sleep(step)


class Fake:
    url: str = ""
    runner: web.AppRunner | None = None

    def app(self) -> web.Application:
        raise NotImplementedError

    async def start(self) -> Fake:
        self.runner, self.url = await _start(self.app())
        return self

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None


@dataclass
class Ticket:
    id: str
    request_id: str
    created: float
    #: The prompt's length, told by the prefill with the KV state (the handoff's num_tokens).
    num_tokens: int = 0
    handed_off: asyncio.Event = field(default_factory=asyncio.Event)
    generating: bool = False


class FakeNode(Fake):
    """A TileRT decode node: /v1/admit, /v1/generate, /v1/cancel, /health, /ready, /metrics."""

    def __init__(
        self, name: str = "t0", slots: int = 1, max_seq_len: int = 4096, token: str | None = None
    ) -> None:
        self.name = name
        #: The node-API token /v1/* require (None: an open node), as the real node's api_auth does.
        self.token = token
        #: The Authorization header of every /v1/* call, refused or not.
        self.auth_seen: list[str | None] = []
        #: A decode's last event: the done event (None), or an old node's {"done", "finish_reason":
        #: "cancelled"} ("cancelled_done"), or the error event a cancelled stream ends with ("cancelled").
        self.end_with: str | None = None
        self.slots = slots
        self.max_seq_len = max_seq_len
        self.tickets: dict[str, Ticket] = {}
        self.max_active = 0
        self.admits: list[dict[str, Any]] = []
        self.generates: list[dict[str, Any]] = []
        self.cancels: list[tuple[float, dict[str, Any]]] = []
        self.rejected_full = 0
        self.completed = 0
        # Script.
        self.token_interval_s = 0.0
        self.default_tokens = 8  # tokens after the first when the router sends max_tokens=None
        self.stop_after: int | None = None  # finish "stop" after this many tokens (EOS)
        self.generate_status: int | None = None  # answer generate with this error status
        self.die_after: int | None = None  # drop the connection after this many token events
        self.stall_after: int | None = None  # stop sending (but keep the connection) after N events
        self.ready = True
        #: Cleared, /ready answers only once it is set again: a node (or a host) too busy to answer
        #: its probes in time.
        self.ready_gate = asyncio.Event()
        self.ready_gate.set()
        #: Answer every admission with this error status, as a node does that stops (503 not_ready).
        self.admit_status: int | None = None
        #: Called on each admission before it is answered (a test changes the world meanwhile).
        self.on_admit: Callable[[], None] | None = None
        #: Cleared, token streams wait before their first token until it is set again: a test holds a
        #: slot or a decode for as long as it needs instead of guessing with token intervals.
        self.go = asyncio.Event()
        self.go.set()
        #: Token events written, all streams together.
        self.tokens_sent = 0
        self.handoff_timeout_s = 5.0
        self.last_generate_closed: float | None = None
        #: The generation the node advertises in /ready and /v1/status (None: an older node, none).
        self.compat: str | None = None
        #: Put it in /ready's body (True) or only in /v1/status (False).
        self.compat_in_ready = True

    @property
    def active(self) -> int:
        return len(self.tickets)

    @web.middleware
    async def _auth(self, request: web.Request, handler: Any) -> web.StreamResponse:
        if request.path.startswith("/v1/"):
            self.auth_seen.append(request.headers.get("Authorization"))
            if self.token is not None and request.headers.get("Authorization") != f"Bearer {self.token}":
                return web.json_response(
                    {"error": {"type": "unauthorized", "message": "token"}},
                    status=401,
                    headers={"WWW-Authenticate": 'Bearer realm="tilert-decode-node"'},
                )
        return await handler(request)

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._auth])
        app.add_routes(
            [
                web.post("/v1/admit", self.admit),
                web.post("/v1/generate", self.generate),
                web.post("/v1/cancel", self.cancel),
                web.get("/health", self.health),
                web.get("/ready", self.readyz),
                web.get("/metrics", self.health),
                web.get("/v1/status", self.status),
            ]
        )
        return app

    def handoff(self, ticket: str, num_tokens: int = 0) -> bool:
        t = self.tickets.get(ticket)
        if t is None:
            return False
        t.num_tokens = num_tokens
        t.handed_off.set()
        return True

    async def admit(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.admits.append(body)
        if self.on_admit is not None:
            self.on_admit()
        if self.admit_status is not None:
            return web.json_response(
                {"error": {"type": "not_ready", "message": "the node is stopping"}}, status=self.admit_status
            )
        mt = body.get("max_tokens") or 0
        pt = body.get("prompt_tokens") or 0
        if mt + pt > self.max_seq_len:
            return web.json_response(
                {"error": {"type": "too_long", "message": f"{pt}+{mt} > {self.max_seq_len}"}}, status=400
            )
        if self.active >= self.slots:
            self.rejected_full += 1
            return web.json_response(
                {"error": {"type": "node_full", "message": "no free slot"}},
                status=429,
                headers={"Retry-After": "1"},
            )
        tid = uuid.uuid4().hex
        self.tickets[tid] = Ticket(tid, body["request_id"], time.monotonic())
        self.max_active = max(self.max_active, self.active)
        return web.json_response(
            {
                "ticket": tid,
                "slot": self.active - 1,
                "expires_in_s": 30.0,
                "ctrl_host": "127.0.0.1",
                "ctrl_port": 5556,
            }
        )

    async def generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.generates.append(body)
        t = self.tickets.get(body.get("ticket"))
        if t is None:
            return web.json_response(
                {"error": {"type": "unknown_ticket", "message": "no such ticket"}}, status=404
            )
        if t.generating:
            return web.json_response({"error": {"type": "already_generating", "message": "busy"}}, status=409)
        if self.generate_status is not None:
            self.tickets.pop(t.id, None)
            return web.json_response(
                {"error": {"type": "handoff_failed", "message": "scripted failure"}},
                status=self.generate_status,
            )
        t.generating = True
        try:
            await asyncio.wait_for(t.handed_off.wait(), self.handoff_timeout_s)
        except TimeoutError:
            self.tickets.pop(t.id, None)
            return web.json_response({"error": {"type": "handoff_timeout", "message": "no KV"}}, status=504)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        limit = body.get("max_tokens")
        n_max = self.default_tokens if limit is None else limit
        # As the real node does: the sequence cannot grow past max_seq_len, a longer ask ends as "length".
        n_max = max(0, min(n_max, self.max_seq_len - t.num_tokens - 1))
        sent = 0
        finish = "length"
        try:
            await self.go.wait()
            while sent < n_max:
                if self.token_interval_s:
                    await asyncio.sleep(self.token_interval_s)
                if self.die_after is not None and sent >= self.die_after:
                    self.tickets.pop(t.id, None)
                    assert request.transport is not None
                    request.transport.abort()
                    return resp
                if self.stall_after is not None and sent >= self.stall_after:
                    await asyncio.sleep(3600)
                if t.id not in self.tickets:  # cancelled meanwhile
                    return resp
                tok = 100 + sent
                await resp.write(
                    b"data: " + json.dumps({"token_ids": [tok], "text": WORDS[sent]}).encode() + b"\n\n"
                )
                sent += 1
                self.tokens_sent += 1
                if self.stop_after is not None and sent >= self.stop_after:
                    finish = "stop"
                    break
            self.tickets.pop(t.id, None)  # the slot is free before the done event goes out
            self.completed += 1
            if self.end_with == "cancelled":
                err = {"error": {"type": "cancelled", "message": "the request was cancelled by its ticket"}}
                await resp.write(b"event: error\ndata: " + json.dumps(err).encode() + b"\n\n")
                await resp.write_eof()
                return resp
            if self.end_with == "cancelled_done":
                finish = "cancelled"
            done = {
                "done": True,
                "finish_reason": finish,
                "num_tokens": sent,
                "timings": {
                    "wire_wait_ms": 0.1,
                    "convert_ms": 0.1,
                    "inject_ms": 0.1,
                    "decode_ms": 1.0,
                    "tpot_ms": 1.0,
                    "mtp_acceptance": 0.9,
                },
            }
            await resp.write(b"data: " + json.dumps(done).encode() + b"\n\n")
            await resp.write_eof()
        finally:
            # A client that went away frees the slot as the real node does.
            if t.id in self.tickets and self.tickets[t.id].generating:
                self.tickets.pop(t.id, None)
            self.last_generate_closed = time.monotonic()
        return resp

    async def cancel(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.cancels.append((time.monotonic(), body))
        t = self.tickets.pop(body.get("ticket", ""), None)
        return web.json_response({"cancelled": t is not None})

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    async def readyz(self, request: web.Request) -> web.Response:
        await self.ready_gate.wait()
        body: dict[str, Any] = {"ready": self.ready}
        if self.ready and self.compat is not None and self.compat_in_ready:
            body["compat"] = self.compat
        return web.json_response(body, status=200 if self.ready else 503)

    async def status(self, request: web.Request) -> web.Response:
        return web.json_response({"name": self.name, "ready": self.ready, "compat": self.compat})


class FakeVLLM(Fake):
    """What both vLLM fakes serve: completions (chat too) and /health."""

    healthy = True

    def app(self) -> web.Application:
        app = web.Application()
        app.add_routes(
            [
                web.post("/v1/completions", self.complete),
                web.post("/v1/chat/completions", self.complete),
                web.get("/health", self.health),
            ]
        )
        return app

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200 if self.healthy else 503)

    async def complete(self, request: web.Request) -> web.StreamResponse:
        raise NotImplementedError


class FakePrefill(FakeVLLM):
    """A vLLM prefill server answering max_tokens=1 requests like the OpenAI server does."""

    def __init__(self, nodes: list[FakeNode] | None = None) -> None:
        self.nodes = nodes or []
        self.bodies: list[dict[str, Any]] = []
        self.headers: list[dict[str, str]] = []
        #: The client address of each request (a new port: a new connection).
        self.peers: list[Any] = []
        self.fail_status: int | None = None
        self.fail_count = 0  # fail this many requests, then succeed (0 with fail_status = always)
        self.stall_s = 0.0
        self.first_text = " hello"
        self.first_token = 42
        self.finish_reason = "length"
        self.tilert_status = "queued"
        self.fail_handoffs = 0  # the first N TileRT requests report tilert_status "failed"
        #: Their `tilert_fault` ("prefill": this server ended them itself, as a vLLM shutting down does).
        self.handoff_fault: str | None = None
        self.handoffs_seen = 0
        self.cached_tokens: int | None = 3
        self.prompt_tokens = 7
        #: vLLM's --max-model-len: longer prompts are refused as vLLM refuses them (None: no limit).
        self.max_model_len: int | None = None
        self.kv_params: dict[str, Any] | None = {"remote_engine_id": "p0", "remote_block_ids": [1, 2]}
        self.aborted = 0
        self.healthy = True
        #: The generation the prefill names in its kv_transfer_params (None: an older prefill, none).
        self.compat: str | None = None

    async def complete(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.bodies.append(body)
        self.headers.append({k.lower(): v for k, v in request.headers.items()})
        self.peers.append(request.transport.get_extra_info("peername") if request.transport else None)
        if self.fail_status is not None and (self.fail_count == 0 or len(self.bodies) <= self.fail_count):
            return web.json_response(
                {"error": {"message": "scripted prefill failure", "type": "internal"}},
                status=self.fail_status,
            )
        if self.max_model_len is not None and self.prompt_tokens > self.max_model_len:
            return web.json_response(
                vllm_error(
                    f"This model's maximum context length is {self.max_model_len} tokens. However, your prompt "
                    f"contains {self.prompt_tokens} input tokens, which exceeds this limit even without any output "
                    f"tokens. Please reduce the length of the input prompt. (parameter=input_tokens, "
                    f"value={self.prompt_tokens})",
                    "input_tokens",
                ),
                status=400,
            )
        try:
            if self.stall_s:
                await asyncio.sleep(self.stall_s)
        except asyncio.CancelledError:
            self.aborted += 1
            raise
        kvp_in = body.get("kv_transfer_params") or {}
        chat = request.path.endswith("chat/completions")
        kvp_out: dict[str, Any] | None
        if "tilert_ticket" in kvp_in:
            self.handoffs_seen += 1
            status = "failed" if self.handoffs_seen <= self.fail_handoffs else self.tilert_status
            kvp_out = {
                "tilert_first_token": self.first_token,
                "tilert_num_tokens": self.prompt_tokens,
                "tilert_status": status,
                "tilert_error": None,
            }
            if status == "queued" and self.finish_reason != "stop":
                for n in self.nodes:
                    n.handoff(kvp_in["tilert_ticket"], self.prompt_tokens)
            else:
                kvp_out["tilert_error"] = "scripted handoff failure" if status != "queued" else None
                if status != "queued" and self.handoff_fault is not None:
                    kvp_out["tilert_fault"] = self.handoff_fault
        else:
            kvp_out = dict(self.kv_params) if self.kv_params is not None else None
        if self.compat is not None:
            kvp_out = {**(kvp_out or {}), "compat": self.compat}
        usage: dict[str, Any] = {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": 1,
            "total_tokens": self.prompt_tokens + 1,
        }
        if self.cached_tokens is not None:
            usage["prompt_tokens_details"] = {"cached_tokens": self.cached_tokens}
        if chat:
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": self.first_text},
                "finish_reason": self.finish_reason,
            }
        else:
            choice = {"index": 0, "text": self.first_text, "finish_reason": self.finish_reason}
        return web.json_response(
            {
                "id": "x",
                "object": "chat.completion" if chat else "text_completion",
                "created": 1,
                "model": body["model"],
                "choices": [choice],
                "usage": usage,
                "kv_transfer_params": kvp_out,
            }
        )


class FakeNative(FakeVLLM):
    """A native vLLM decode server: answers like vLLM's OpenAI server, streaming or not."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.headers: list[dict[str, str]] = []
        self.tokens = 5
        self.token_interval_s = 0.0
        self.fail_status: int | None = None
        self.die_after: int | None = None
        self.cached_tokens_reported = 7  # what a decode that pulled the whole prompt would say
        #: vLLM's --max-model-len (None: no limit); the prompt is always 7 tokens long.
        self.max_model_len: int | None = None
        self.active = 0
        self.max_active = 0
        self.healthy = True

    async def complete(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        self.headers.append({k.lower(): v for k, v in request.headers.items()})
        self.active += 1
        self.max_active = max(self.max_active, self.active)
        try:
            return await self._complete(request, body)
        finally:
            self.active -= 1

    async def _complete(self, request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        if self.fail_status is not None:
            return web.json_response(
                {"error": {"message": "scripted decode failure", "type": "internal"}}, status=self.fail_status
            )
        chat = request.path.endswith("chat/completions")
        refused = vllm_max_tokens_check(body, self.max_model_len, chat)
        if refused is not None:
            return web.json_response(refused, status=400)
        n = min(self.tokens, body.get("max_tokens") or self.tokens)
        if self.max_model_len is not None:
            n = min(n, self.max_model_len - 7)
        usage = {
            "prompt_tokens": 7,
            "completion_tokens": n,
            "total_tokens": 7 + n,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens_reported},
        }
        obj = "chat.completion" if chat else "text_completion"
        if not body.get("stream"):
            if self.token_interval_s:
                await asyncio.sleep(self.token_interval_s * n)
            text = "".join(WORDS[:n])
            choice = (
                {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "length"}
                if chat
                else {"index": 0, "text": text, "finish_reason": "length"}
            )
            return web.json_response(
                {
                    "id": "cmpl-d",
                    "object": obj,
                    "created": 1,
                    "model": body["model"],
                    "choices": [choice],
                    "usage": usage,
                }
            )
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        cobj = obj + ".chunk" if chat else obj
        for i in range(n):
            if self.token_interval_s:
                await asyncio.sleep(self.token_interval_s)
            if self.die_after is not None and i >= self.die_after:
                assert request.transport is not None
                request.transport.abort()
                return resp
            fin = "length" if i == n - 1 else None
            choice = (
                {"index": 0, "delta": {"content": WORDS[i]}, "finish_reason": fin}
                if chat
                else {"index": 0, "text": WORDS[i], "finish_reason": fin}
            )
            chunk = {
                "id": "cmpl-d",
                "object": cobj,
                "created": 1,
                "model": body["model"],
                "choices": [choice],
            }
            await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        if (body.get("stream_options") or {}).get("include_usage"):
            chunk = {
                "id": "cmpl-d",
                "object": cobj,
                "created": 1,
                "model": body["model"],
                "choices": [],
                "usage": usage,
            }
            await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp
