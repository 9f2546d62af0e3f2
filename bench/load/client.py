"""One request against an OpenAI-compatible server, and how its answer turns into a Record: the
outcome class, the timings, the token counts and the text. The classification works on what the wire
showed (status, body, stream events, how the connection ended), never on the server's word alone."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from bench.load.plan import RequestSpec
from bench.load.record import Record
from tilert_serve.router.call import ATTEMPTS_HEADER
from tilert_serve.router.config import RoutingPolicy
from tilert_serve.router.sse import Decoder

#: The request header that picks the router's path (the router's default; a PDCluster may rename it).
ROUTE_HEADER: str = RoutingPolicy.model_fields["header"].default
#: The response header in which the router names the path that served the request.
SERVED_HEADER = "x-pd-route"
#: Error text kept per record (messages can be long; the class and type are what is counted).
_ERROR_CHARS = 300


@dataclass(frozen=True)
class Target:
    """An OpenAI-compatible endpoint: the router, or vLLM alone."""

    name: str
    base_url: str
    model: str
    #: Sent as `Authorization: Bearer ...` when set (a router with API keys).
    api_key: str | None = field(default=None, repr=False)
    #: Send the planned route in `route_header` (False for vLLM alone, which has no routes).
    routes: bool = True
    route_header: str = ROUTE_HEADER

    def headers(self, spec: RequestSpec, request_id: str = "") -> dict[str, str]:
        h = {"Content-Type": "application/json"}
        if request_id:
            h["X-Request-Id"] = request_id
        if self.api_key:
            h["Authorization"] = f"Bearer {self.api_key}"
        if self.routes:
            h[self.route_header] = spec.route
        return h


def _text(choice: dict[str, Any]) -> str:
    if "text" in choice:
        return str(choice.get("text") or "")
    part = choice.get("delta") or choice.get("message") or {}
    return str(part.get("content") or "")


def _error_of(obj: Any) -> tuple[str | None, str] | None:
    """(type, message) when `obj` is an OpenAI error body, else None."""
    if isinstance(obj, dict) and isinstance(obj.get("error"), dict):
        err = obj["error"]
        return (str(err["type"]) if err.get("type") else None), str(err.get("message") or "")[:_ERROR_CHARS]
    return None


def _usage(rec: Record, obj: dict[str, Any]) -> None:
    usage = obj.get("usage")
    if isinstance(usage, dict):
        rec.prompt_tokens = usage.get("prompt_tokens", rec.prompt_tokens)
        rec.completion_tokens = usage.get("completion_tokens", rec.completion_tokens)


async def send(
    http: aiohttp.ClientSession, target: Target, spec: RequestSpec, rec: Record, t0: float
) -> None:
    """Send `spec` and fill `rec` (times relative to `t0`, a time.monotonic() reading). Never raises
    for a failure of the server or the network: that is an outcome."""
    sent = time.monotonic()
    try:
        async with http.post(
            target.base_url.rstrip("/") + spec.path,
            json=spec.body(target.model),
            headers=target.headers(spec, rec.request_id),
        ) as resp:
            rec.status = resp.status
            rec.route_served = resp.headers.get(SERVED_HEADER)
            attempts = resp.headers.get(ATTEMPTS_HEADER, "")
            rec.retried = attempts.isdigit() and int(attempts) > 1
            if resp.status != 200:
                await _http_error(rec, resp)
            elif spec.stream:
                await _stream(rec, resp, sent)
            else:
                await _whole(rec, resp)
    except TimeoutError:
        rec.outcome, rec.error = "timeout", "no complete answer within the request's time limit"
    except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError) as exc:
        # After the headers a broken connection cuts the answer; before them there was no answer.
        rec.outcome = "stream_cut" if rec.status is not None else "connect_error"
        rec.error = f"{type(exc).__name__}: {exc}"[:_ERROR_CHARS]
    except aiohttp.ClientError as exc:
        rec.outcome = "connect_error" if rec.status is None else "stream_cut"
        rec.error = f"{type(exc).__name__}: {exc}"[:_ERROR_CHARS]
    finally:
        rec.end = time.monotonic() - t0
        if rec.outcome is None:  # cancelled: the run stopped waiting for it
            rec.outcome, rec.error = "abandoned", "the load run stopped before the answer was complete"


async def _http_error(rec: Record, resp: aiohttp.ClientResponse) -> None:
    raw = await resp.read()
    rec.outcome = "http_5xx" if resp.status >= 500 else "http_4xx"
    try:
        err = _error_of(json.loads(raw))
    except ValueError:
        err = None
    rec.error_type, rec.error = err if err else (None, raw[:_ERROR_CHARS].decode("utf-8", "replace"))


async def _whole(rec: Record, resp: aiohttp.ClientResponse) -> None:
    raw = await resp.read()
    try:
        obj = json.loads(raw)
    except ValueError:
        rec.outcome, rec.error = "bad_response", f"not JSON: {raw[:100]!r}"
        return
    err = _error_of(obj)
    if err is not None:
        rec.outcome, (rec.error_type, rec.error) = "bad_response", err
        return
    choices = obj.get("choices") if isinstance(obj, dict) else None
    if not choices:
        rec.outcome, rec.error = "bad_response", "a 200 without choices"
        return
    rec.text = _text(choices[0])
    _usage(rec, obj)
    rec.outcome = "ok"


async def _stream(rec: Record, resp: aiohttp.ClientResponse, sent: float) -> None:
    parts: list[str] = []
    try:
        await _read_stream(rec, resp, sent, parts)
    finally:
        rec.text = "".join(parts)  # what arrived, also when the stream broke


async def _read_stream(rec: Record, resp: aiohttp.ClientResponse, sent: float, parts: list[str]) -> None:
    decoder = Decoder()
    first = last = 0.0
    done = False
    async for raw in resp.content.iter_any():
        now = time.monotonic()
        for ev in decoder.feed(raw):
            if ev.data == "[DONE]":
                done = True
                continue
            try:
                obj = json.loads(ev.data)
            except ValueError:
                obj = None
            err = _error_of(obj)
            if ev.event == "error" or err is not None:
                # vLLM puts a mid-stream error in a plain data event; the router uses `event: error`.
                rec.outcome = "stream_error"
                rec.error_type, rec.error = err if err else (None, ev.data[:_ERROR_CHARS])
                continue
            if not isinstance(obj, dict):
                continue
            _usage(rec, obj)
            text = "".join(_text(c) for c in obj.get("choices") or ())
            if text:
                parts.append(text)
                if not first:
                    first = now
                    rec.ttft = now - sent
                last = now
    if rec.outcome == "stream_error":
        return
    if not done:
        rec.outcome, rec.error = "stream_cut", "the stream ended before [DONE]"
        return
    rec.outcome = "ok"
    tokens = rec.completion_tokens or len(parts)
    # Text that arrived in one read has no measurable gaps: no TPOT rather than 0.
    if tokens > 1 and last > first:
        rec.tpot = (last - first) / (tokens - 1)


def session(limit: int = 0, timeout_s: float = 120.0) -> aiohttp.ClientSession:
    """One session for a whole run: pooled connections (`limit` 0 = unbounded, as open-loop load
    needs), a total limit per request."""
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=limit, limit_per_host=0),
        timeout=aiohttp.ClientTimeout(total=timeout_s),
    )


async def one(target: Target, spec: RequestSpec, timeout_s: float = 120.0) -> Record:
    """A single request on its own session (references, smoke checks)."""
    rec = blank(spec, "-")
    async with session(timeout_s=timeout_s) as http:
        await send(http, target, spec, rec, time.monotonic())
    return rec


def blank(spec: RequestSpec, phase: str, start: float = 0.0, run_id: str = "one") -> Record:
    """The record of a request about to be sent (`start`: seconds after the run's start)."""
    return Record(
        request_id=f"load-{run_id}-{spec.seq}",
        seq=spec.seq,
        kind=spec.kind,
        stream=spec.stream,
        route_asked=spec.route,
        greedy=spec.greedy,
        prompt_index=spec.prompt.index,
        due=spec.offset_s,
        start=start,
        phase=phase,
    )
