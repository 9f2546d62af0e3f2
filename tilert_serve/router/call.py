"""One client request in flight: its parsed body, its id, and the response being written to it.

Both paths write through `Call`, which knows whether the first byte has gone out: before it, a
failure may be retried or answered with a JSON error; after it, only an SSE error event can end the
stream (errors.STREAMING tells the middleware to stay out of it).
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from types import TracebackType
from typing import TYPE_CHECKING, Any

import aiohttp
from aiohttp import web

from tilert_serve import tracing, tracing_otel
from tilert_serve.compat import compatible
from tilert_serve.router import sse
from tilert_serve.router.config import RouterConfig
from tilert_serve.router.errors import STREAMING, ClientGone
from tilert_serve.router.metrics import bounded_kind
from tilert_serve.router.openai_request import ParsedRequest
from tilert_serve.router.pools import Endpoint
from tilert_serve.router.state import RouterState
from tilert_serve.router.upstream import UpstreamError, client_error, post_json

if TYPE_CHECKING:
    from opentelemetry.trace import Span

log = logging.getLogger(__name__)
#: The router's tracer (None: no tracing), made once from the config the router started with.
TRACER: web.AppKey[tracing_otel.Tracer | None] = web.AppKey("tracer")
_NO_HEADERS: dict[str, str] = {}


@dataclass
class RequestTrace:
    """The router's spans of one request: the server span every leg is a child of."""

    tracer: tracing_otel.Tracer
    root: Span


class Leg:
    """One leg of a request as a child span (admission, prefill, decode) for the `with` block; while
    it runs, `call.upstream_headers` carry its traceparent to the upstream it calls."""

    def __init__(self, call: Call, name: str, attributes: dict[str, str | int]) -> None:
        self.call = call
        self.name = name
        self.attributes = attributes
        self.span: Span | None = None

    def __enter__(self) -> Leg:
        trace = self.call.trace
        assert trace is not None
        self.span = trace.tracer.start(self.name, trace.root, attributes=self.attributes)
        self.call.trace_headers = {tracing.TRACEPARENT: tracing_otel.header_of(self.span)}
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        assert self.span is not None
        if exc is not None:
            self.span.set_attribute("error.type", type(exc).__name__)
        self.span.end()
        self.call.trace_headers = _NO_HEADERS


class _NoLeg:
    """What `Call.leg` gives without tracing: nothing to do, nothing allocated."""

    def __enter__(self) -> _NoLeg:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


_NO_LEG = _NoLeg()

#: On every answer the router gives a routed request: how many attempts it took (1 when the first
#: served it; retries ran the request again from the prefill).
ATTEMPTS_HEADER = "X-PD-Attempts"


@dataclass
class Call:
    request: web.Request
    state: RouterState
    #: The config in force when the request arrived; a reload does not change it for this request.
    cfg: RouterConfig
    req: ParsedRequest
    request_id: str
    t0: float = field(default_factory=time.perf_counter)
    #: Endpoints that failed this request: a retry goes elsewhere.
    exclude: set[str] = field(default_factory=set)
    #: The SSE response once prepared (first byte sent).
    response: web.StreamResponse | None = None
    path: str = ""
    #: The prefill the current attempt uses: a retry prefers another, whichever side failed.
    prefill_url: str | None = None
    #: A decode pool without a pairable server was counted for this request (no_compatible_pair_total).
    unpaired_counted: bool = False
    #: Attempts so far (handlers._route counts them); sent as ATTEMPTS_HEADER.
    attempts: int = 0
    #: When this request stops waiting for a TileRT node to come back (monotonic; None: it has not
    #: waited): one bound over all its attempts (policy.tilert_wait_s).
    tilert_wait_until: float | None = None
    #: This request's spans; None when the router does not trace.
    trace: RequestTrace | None = None
    #: The traceparent of the leg running now (Call.leg), for the upstream call it makes; {} otherwise.
    trace_headers: dict[str, str] = field(default_factory=lambda: _NO_HEADERS)
    _last_write: float = 0.0

    def leg(self, name: str, **attributes: str | int) -> Leg | _NoLeg:
        """`with call.leg("router.prefill"):` times that leg as a child of the request's span."""
        return _NO_LEG if self.trace is None else Leg(self, name, attributes)

    @property
    def upstream_headers(self) -> dict[str, str]:
        # vLLM takes X-Request-Id as its own request id, so logs line up across router, prefill, decode;
        # inside a leg, its traceparent makes the upstream's span that leg's child.
        return {"X-Request-Id": self.request_id, **self.trace_headers}

    def upstream_body(self) -> dict[str, Any]:
        """A copy of the client's body with the model name vLLM serves, without the client's own
        kv_transfer_params."""
        body = dict(self.req.body)
        body["model"] = self.cfg.upstream_model or self.cfg.model
        # kv_transfer_params steer vLLM's connectors: which blocks to keep, whose KV to pull from
        # which host. Only the router may set them; vLLM also reads them from vllm_xargs (its
        # to_sampling_params copies the field into extra_args, where the engine looks).
        body.pop("kv_transfer_params", None)
        # An SDK option (its contents belong at the top level), sent literally: vLLM ignores the field,
        # so nothing the router has not looked at travels inside it.
        body.pop("extra_body", None)
        xargs = body.get("vllm_xargs")
        if isinstance(xargs, dict) and "kv_transfer_params" in xargs:
            body["vllm_xargs"] = {k: v for k, v in xargs.items() if k != "kv_transfer_params"}
        return body

    def prefill_body(self, kv_transfer_params: dict[str, Any]) -> dict[str, Any]:
        """The prefill leg, either path: the client's request cut to its first token, not streamed (vLLM
        returns kv_transfer_params only on non-streamed responses), marked for the decode side."""
        body = self.upstream_body()
        body["max_tokens"] = 1
        if self.req.kind == "chat":
            body["max_completion_tokens"] = 1
        body["stream"] = False
        body.pop("stream_options", None)
        # min_tokens > 1 would contradict max_tokens=1; the decode gets the client's value back.
        body.pop("min_tokens", None)
        body.pop("min_completion_tokens", None)
        body["kv_transfer_params"] = kv_transfer_params
        return body

    async def prefill(
        self, ep: Endpoint, body: dict[str, Any], headers: dict[str, str] | None = None
    ) -> dict[str, Any]:
        """Run the prefill leg on `ep` (counted in flight while it runs, so the next pick sees it) and
        return vLLM's answer. A refusal by vLLM is the client's error (RouterError); transport failures
        and 5xx raise UpstreamError, for a retry elsewhere."""
        t0 = time.perf_counter()
        self.prefill_url = ep.url
        ep.inflight += 1
        try:
            with self.leg("router.prefill", endpoint=ep.url):
                status, answer = await self._post_prefill(ep, body, headers)
        finally:
            ep.inflight -= 1
        self.state.metrics.prefill.labels(self.path).observe(time.perf_counter() - t0)
        ep.breaker_ok()  # it answered (a 4xx is the client's fault, not the server's)
        if status != 200:
            raise client_error(status, answer)
        return answer

    async def _post_prefill(
        self, ep: Endpoint, body: dict[str, Any], headers: dict[str, str] | None
    ) -> tuple[int, dict[str, Any]]:
        t = self.cfg.timeouts
        return await post_json(
            self.state.http_for(ep.url, self.exclude),
            "prefill",
            ep.url,
            self.api_path,
            body,
            headers={**self.upstream_headers, **(headers or {})},
            timeout=aiohttp.ClientTimeout(total=t.prefill_s, sock_connect=t.connect_s),
        )

    def check_generation(self, prefill: Endpoint, answer: dict[str, Any], decode: Endpoint) -> None:
        """The prefill's answer names its generation (kv_transfer_params `compat`): a state of another
        generation than the chosen decode's is not decoded there (UpstreamError compat_mismatch, retried
        on another pair). The prefill is remembered as advertising it, so pairing sees it from now on."""
        kvp = answer.get("kv_transfer_params")
        said = kvp.get("compat") if isinstance(kvp, dict) else None
        if not isinstance(said, str) or not said:
            return
        was = prefill.compat_mismatch
        prefill.advertised = said
        if prefill.compat_mismatch and not was:
            self.state.metrics.compat_mismatches.labels("prefill").inc()
            log.warning(
                "prefill %s advertises generation %s, configured %s: not routed to until it matches",
                prefill.url,
                said,
                prefill.compat,
            )
        if not compatible(said, decode.generation):
            raise UpstreamError(
                "prefill",
                prefill.url,
                "compat_mismatch",
                f"the prefill's state is of generation {said}, the {decode.pool} decode "
                f"{decode.url} runs {decode.generation}",
            )

    @property
    def api_path(self) -> str:
        return "/v1/chat/completions" if self.req.kind == "chat" else "/v1/completions"

    @property
    def started(self) -> bool:
        return self.response is not None

    async def start_stream(self) -> web.StreamResponse:
        resp = web.StreamResponse(
            headers={
                "Content-Type": "text/event-stream",
                "Cache-Control": "no-cache",
                "X-Request-Id": self.request_id,
                "X-PD-Route": self.path,
                ATTEMPTS_HEADER: str(self.attempts),
            }
        )
        self.request[STREAMING] = True
        try:
            await resp.prepare(self.request)
        except ConnectionResetError as exc:
            raise ClientGone(str(exc)) from exc
        self.response = resp
        return resp

    async def write(self, data: bytes, *, tokens: bool = True) -> None:
        """Write stream bytes; `tokens` = they carry generated text (counted for TTFT and ITL)."""
        assert self.response is not None
        try:
            await self.response.write(data)
        except ConnectionResetError as exc:  # aiohttp's ClientConnectionResetError is one too
            raise ClientGone(str(exc)) from exc
        if tokens:
            self._observe_token()

    async def end(self, data: bytes = b"") -> None:
        """Write the stream's last bytes and close it."""
        assert self.response is not None
        try:
            if data:
                await self.response.write(data)
            await self.response.write_eof()
        except ConnectionResetError as exc:
            raise ClientGone(str(exc)) from exc

    def _observe_token(self) -> None:
        now = time.perf_counter()
        m = self.state.metrics
        if self._last_write == 0.0:
            m.ttft.labels(self.path).observe(now - self.t0)
        else:
            m.itl.labels(self.path).observe(now - self._last_write)
        self._last_write = now

    def observe_first_token_unstreamed(self) -> None:
        """Non-streamed requests: TTFT is when the router had the first token (it holds it back)."""
        self._observe_token()

    async def fail_stream(self, message: str, kind: str) -> None:
        """End a started stream that its decode can no longer continue: an error event naming what
        happened (`kind`), then [DONE]; counted in stream_errors_total."""
        assert self.response is not None
        self.state.metrics.stream_errors.labels(self.path, kind).inc()
        code = bounded_kind(kind)
        try:
            await self.response.write(sse.error(message, "upstream_error", code) + sse.DONE)
            await self.response.write_eof()
        except ConnectionResetError as exc:
            raise ClientGone(str(exc)) from exc

    def json(self, obj: dict[str, Any], status: int = 200) -> web.Response:
        return web.Response(
            status=status,
            body=json.dumps(obj, separators=(",", ":")).encode(),
            content_type="application/json",
            headers={
                "X-Request-Id": self.request_id,
                "X-PD-Route": self.path,
                ATTEMPTS_HEADER: str(self.attempts),
            },
        )
