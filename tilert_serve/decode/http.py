"""The decode node's HTTP API: admission, the token stream, cancel, health, readiness, metrics.

    POST /v1/admit     {"request_id", "prompt_tokens"?, "max_tokens"?} -> ticket | 429 node_full | 400 too_long
    POST /v1/generate  {"ticket", "first_token", "max_tokens", "sampling"?, "stop_token_ids"?, "ignore_eos"?}
                       -> text/event-stream of {"token_ids", "text"} events, then {"done": true, ...}
    POST /v1/cancel    {"ticket"} -> {"cancelled": bool}   (only the ticket that owns the request)
    GET  /health, /ready, /metrics, /v1/status

/v1/* take the cluster's node-API bearer token when the node has one (api_auth.py); /health, /ready and
/metrics are open and carry no request ids or addresses. Errors are {"error": {"type", "message"}}
(aiohttp's own 404/405/413 too); once a stream has started, an error is an SSE `error` event that ends
it, and a stream cancelled by its ticket ends with an `error` event of type "cancelled".

The handlers see the node only through `NodeAPI` (node.py implements it): its phase, admission and
the ticket's lifecycle, the stream, its status and metrics.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from collections.abc import AsyncGenerator, Callable
from typing import Annotated, Any, Protocol

from aiohttp import web
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError

from tilert_serve import httpserver, pydantic_errors, tracing, tracing_otel
from tilert_serve.bearer import TokenFile
from tilert_serve.compat import Compat
from tilert_serve.decode import api_auth
from tilert_serve.decode.engines.base import InvalidRequest, Sampling
from tilert_serve.decode.engines.sampling import vllm_temperature
from tilert_serve.decode.node import Admission, GenerateParams, NodePhase, NotReady, TooLong
from tilert_serve.decode.pipeline import HandoffFailed
from tilert_serve.decode.record import GenerateStamps, stage_spans
from tilert_serve.decode.slots import AlreadyClaimed, NodeFull, Slot, UnknownTicket


class NodeAPI(Protocol):
    """What the HTTP API uses of the decode node."""

    @property
    def phase(self) -> NodePhase: ...

    @property
    def failed(self) -> str | None: ...

    @property
    def ended(self) -> str | None: ...

    @property
    def compat(self) -> Compat: ...

    def admit(self, request_id: str, need: int) -> Admission: ...

    def claim(self, ticket: str) -> Slot: ...

    async def wait_for_state(self, slot: Slot) -> None: ...

    def decode(self, slot: Slot, p: GenerateParams) -> AsyncGenerator[dict[str, Any], None]: ...

    def cancel_ticket(self, ticket: str) -> bool: ...

    def render_metrics(self) -> bytes: ...

    def status(self, with_request_ids: bool) -> dict[str, Any]: ...

    async def start(self) -> None: ...

    def start_failed(self, why: str) -> None: ...

    async def stop(self) -> None: ...


log = logging.getLogger(__name__)
NODE: web.AppKey[NodeAPI] = web.AppKey("node")
#: The node's tracer (None: no tracing). A call's spans are made only when the router sent a valid
#: traceparent: the node starts no trace of its own (its calls are always one leg of a router's request).
TRACER: web.AppKey[tracing_otel.Tracer | None] = web.AppKey("tracer")
MAX_BODY = 1 << 20
#: A body must arrive this long after its headers: one sent a byte at a time holds a handler for nothing.
BODY_TIMEOUT_S = 30.0
#: Seeds are 64-bit, as vLLM's (and the router's check) take them.
_INT64 = 2**63


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class AdmitBody(_Body):
    request_id: str = Field(min_length=1, max_length=256)
    prompt_tokens: int | None = Field(default=None, ge=0)
    max_tokens: int | None = Field(default=None, ge=0)


class SamplingBody(_Body):
    #: Taken as vLLM takes it (a positive one below 0.01 is 0.01), as the prefill did for the first token.
    temperature: Annotated[float, AfterValidator(vllm_temperature)] = Field(default=0.0, ge=0.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    #: 0 or -1 (vLLM's and the OpenAI extensions' spelling) mean no top-k.
    top_k: int = Field(default=0, ge=-1)
    seed: int | None = Field(default=None, ge=-_INT64, lt=_INT64)


class GenerateBody(_Body):
    ticket: str
    request_id: str | None = None
    first_token: int = Field(ge=0)
    max_tokens: int = Field(ge=0)
    sampling: SamplingBody = SamplingBody()
    stop_token_ids: list[int] = []
    ignore_eos: bool = False


class CancelBody(_Body):
    #: Only the ticket cancels: whoever admitted the request holds it (a request id is not a secret).
    ticket: str = Field(min_length=1, max_length=256)


def error_body(status: int, message: str) -> dict[str, Any]:
    """The node's error shape, for answers the HTTP server gives before a handler runs (httpserver.py)."""
    kind = "bad_request" if status < 500 else ("overloaded" if status == 503 else "internal_error")
    return {"error": {"type": kind, "message": message}}


def _error(status: int, kind: str, message: str, headers: dict[str, str] | None = None) -> web.Response:
    return web.json_response({"error": {"type": kind, "message": message}}, status=status, headers=headers)


async def _read(request: web.Request) -> bytes:
    try:
        async with asyncio.timeout(BODY_TIMEOUT_S):
            return await request.read()
    except TimeoutError:
        raise web.HTTPRequestTimeout(
            text=json.dumps(
                error_body(408, f"request body not received within {BODY_TIMEOUT_S:g} s of its headers")
            ),
            content_type="application/json",
        ) from None
    except httpserver.BadBody:
        raise web.HTTPBadRequest(
            text=json.dumps(error_body(400, httpserver.BAD_BODY)), content_type="application/json"
        ) from None


async def _parse(request: web.Request, model: type[BaseModel]) -> Any:
    raw = await _read(request)
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # bad JSON or UTF-8, 5000-digit numbers, 100k-deep nesting
        raise web.HTTPBadRequest(
            text=json.dumps({"error": {"type": "invalid_json", "message": str(exc)}}),
            content_type="application/json",
        ) from exc
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        msg = pydantic_errors.summary(exc, top="body")
        raise web.HTTPBadRequest(
            text=json.dumps({"error": {"type": "invalid_request", "message": msg}}),
            content_type="application/json",
        ) from exc


def _traced(request: web.Request) -> tuple[tracing_otel.Tracer, tracing.TraceParent] | None:
    """The tracer and the router's span this call belongs to; None when either is missing (a malformed
    traceparent is ignored, never an error: it is used for nothing but the trace)."""
    tracer = request.app[TRACER]
    if tracer is None:
        return None
    parent = tracing.parent_of(request.headers)
    return None if parent is None else (tracer, parent)


async def admit(request: web.Request) -> web.Response:
    traced = _traced(request)
    start_ns = time.time_ns() if traced is not None else 0
    node = request.app[NODE]
    body: AdmitBody = await _parse(request, AdmitBody)
    outcome = "admitted"
    try:
        admission = node.admit(body.request_id, (body.prompt_tokens or 0) + (body.max_tokens or 0))
    except NotReady as exc:
        outcome = "not_ready"
        return _error(503, "not_ready", str(exc))
    except TooLong as exc:
        outcome = "too_long"
        return _error(400, "too_long", str(exc))
    except NodeFull as exc:
        outcome = "full"
        return _error(429, "node_full", str(exc), headers={"Retry-After": "1"})
    finally:
        if traced is not None:
            tracer, parent = traced
            tracer.record(
                "tilert.admit", parent, start_ns, time.time_ns(), {"tilert.outcome": outcome}, kind="server"
            )
    return web.json_response(dataclasses.asdict(admission))


async def generate(request: web.Request) -> web.StreamResponse:
    traced = _traced(request)
    stamps = GenerateStamps(time.perf_counter()) if traced is not None else None
    try:
        return await _generate(request, stamps)
    finally:
        if traced is not None and stamps is not None:
            stamps.ended = stamps.ended or time.perf_counter()
            _export(*traced, stamps)


def _export(tracer: tracing_otel.Tracer, parent: tracing.TraceParent, stamps: GenerateStamps) -> None:
    """The call's stage spans (record.stage_spans), from the stamps taken on the way."""
    perf, wall = tracing.now()
    spans: list[Any] = []
    for st in stage_spans(stamps):
        spans.append(
            tracer.record(
                st.name,
                parent if st.parent is None else spans[st.parent],
                tracing.wall_ns(st.start, perf, wall),
                tracing.wall_ns(st.end, perf, wall),
                st.attributes,
                kind="server" if st.parent is None else "internal",
            )
        )


async def _generate(request: web.Request, stamps: GenerateStamps | None) -> web.StreamResponse:
    node = request.app[NODE]
    body: GenerateBody = await _parse(request, GenerateBody)
    try:
        slot = node.claim(body.ticket)
    except UnknownTicket as exc:
        return _error(404, "unknown_ticket", str(exc))
    except AlreadyClaimed as exc:
        return _error(409, "already_generating", str(exc))
    try:
        await node.wait_for_state(slot)
    except HandoffFailed as exc:
        return _error(
            504 if exc.timeout else 502, "handoff_timeout" if exc.timeout else "handoff_failed", str(exc)
        )
    if stamps is not None:
        stamps.landed = time.perf_counter()
        # Before this call, on the slot's clock: admission to Accept, Accept to the last Done.
        stamps.before = {
            "admit_to_accept_ms": max(slot.t_accept - slot.t_admit, 0.0) * 1e3,
            "accept_to_ready_ms": max(slot.t_ready - slot.t_accept, 0.0) * 1e3,
        }
    params = GenerateParams(
        first_token=body.first_token,
        max_tokens=body.max_tokens,
        sampling=Sampling(**(body.sampling.model_dump() | {"top_k": max(body.sampling.top_k, 0)})),
        stop_token_ids=frozenset(body.stop_token_ids),
        ignore_eos=body.ignore_eos,
        stamps=stamps,
    )
    events = node.decode(slot, params)
    try:
        # The first event comes after the digest check, conversion and injection: a refused state is
        # still an HTTP error, not a stream.
        first: dict[str, Any] | None = await anext(events)
    except HandoffFailed as exc:
        return _error(502, "handoff_failed", str(exc))
    except InvalidRequest as exc:
        return _error(400, "invalid_request", str(exc))
    except Exception as exc:
        log.exception("decode of slot %d failed before its first event", slot.index)
        return _error(500, "decode_failed", f"{type(exc).__name__}: {exc}")
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)
    try:
        event = first
        while event is not None:
            if stamps is not None and event.get("done"):
                # The call's span ends as its done event leaves: the caller's leg ends once it has read it.
                stamps.ended = time.perf_counter()
            if event.get("done") and event.get("finish_reason") == "cancelled":
                # Not an OpenAI finish reason: the stream was cancelled by its ticket, or cut because the
                # node's drain period ended; it did not finish.
                err = (
                    {"error": {"type": "shutting_down", "message": node.ended}}
                    if node.ended is not None
                    else {
                        "error": {"type": "cancelled", "message": "the request was cancelled by its ticket"}
                    }
                )
                await resp.write(f"event: error\ndata: {json.dumps(err)}\n\n".encode())
            else:
                await resp.write(f"data: {json.dumps(event)}\n\n".encode())
            event = await anext(events, None)
    except (ConnectionResetError, ConnectionError):
        log.info("client of slot %d went away; decode cancelled", slot.index)
    except Exception as exc:
        if isinstance(exc, InvalidRequest):
            err = {"error": {"type": "invalid_request", "message": str(exc)}}
        else:
            log.exception("decode stream of slot %d failed", slot.index)
            err = {"error": {"type": "decode_failed", "message": f"{type(exc).__name__}: {exc}"}}
        try:
            await resp.write(f"event: error\ndata: {json.dumps(err)}\n\n".encode())
        except ConnectionError:
            pass
    finally:
        await events.aclose()
    return resp


async def cancel(request: web.Request) -> web.Response:
    node = request.app[NODE]
    body: CancelBody = await _parse(request, CancelBody)
    return web.json_response({"cancelled": node.cancel_ticket(body.ticket)})


async def health(request: web.Request) -> web.Response:
    node = request.app[NODE]
    if node.failed:
        return web.json_response(
            {"status": "failed", "reason": api_auth.public_reason(node.failed)}, status=500
        )
    return web.json_response({"status": "ok"})


async def ready(request: web.Request) -> web.Response:
    node = request.app[NODE]
    if node.phase is NodePhase.READY:
        # The compatibility generation (tilert_serve/compat.py): what the router checks against the
        # generation it was configured with for this node.
        return web.json_response({"ready": True, "compat": node.compat.fingerprint})
    reason = (
        api_auth.public_reason(node.failed)
        if node.failed
        else (
            "stopping"
            if node.phase in (NodePhase.STOPPING, NodePhase.STOPPED)
            else "engine loading or buffers not registered yet"
        )
    )
    return web.json_response({"ready": False, "reason": reason}, status=503)


async def metrics(request: web.Request) -> web.Response:
    return web.Response(body=request.app[NODE].render_metrics(), content_type="text/plain")


async def status(request: web.Request) -> web.Response:
    # Request ids only to a caller that showed the node's token (never on a node without one).
    return web.json_response(request.app[NODE].status(request.get(api_auth.AUTHENTICATED, False)))


def make_app(
    node: NodeAPI, api_tokens: TokenFile | None = None, tracer: tracing_otel.Tracer | None = None
) -> web.Application:
    """The node's app. `api_tokens`: the node-API token file /v1/* require; None = an open API (tests,
    or a node started with `--api-token-file ''`, which logs a warning). `tracer`: where the spans of
    traced calls go (None: none); the app shuts it down when it stops."""
    app = web.Application(client_max_size=MAX_BODY, middlewares=api_auth.middlewares(api_tokens))
    app[NODE] = node
    app[TRACER] = tracer
    app.add_routes(
        [
            web.post("/v1/admit", admit),
            web.post("/v1/generate", generate),
            web.post("/v1/cancel", cancel),
            web.get("/health", health),
            web.get("/ready", ready),
            web.get("/metrics", metrics),
            web.get("/v1/status", status),
        ]
    )

    async def lifecycle(app: web.Application):  # type: ignore[no-untyped-def]
        # Start in the background so /health answers while the engine loads (minutes for big models).
        starting = asyncio.create_task(node.start(), name="node-start")
        starting.add_done_callback(_report_start_failure(node))
        yield
        if not starting.done():
            starting.cancel()
        await node.stop()
        if tracer is not None:
            await asyncio.to_thread(tracer.shutdown)  # exports what is queued

    app.cleanup_ctx.append(lifecycle)
    return app


def _report_start_failure(node: NodeAPI) -> Callable[[asyncio.Task[None]], None]:
    def done(task: asyncio.Task[None]) -> None:
        if not task.cancelled() and (exc := task.exception()) is not None:
            node.start_failed(f"start failed: {type(exc).__name__}: {exc}")

    return done
