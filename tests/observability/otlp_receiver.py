"""An OTLP/HTTP trace receiver for tests: aiohttp on 127.0.0.1 in a thread of its own (so that a
synchronous test, or one whose stack runs in other processes, can hold it), decoding each
`ExportTraceServiceRequest` (opentelemetry-proto) into plain `Span` records. Tests wait on it for the
spans they expect (`wait_for`), never for a fixed time."""

from __future__ import annotations

import asyncio
import gzip
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from tilert_serve.local.runner import free_port


@dataclass(frozen=True)
class Span:
    trace_id: str
    span_id: str
    parent_id: str
    name: str
    start_ns: int
    end_ns: int
    service: str
    attributes: dict[str, Any] = field(default_factory=dict)

    @property
    def duration_ns(self) -> int:
        return self.end_ns - self.start_ns


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind in ("string_value", "bool_value", "int_value", "double_value") else None


def decode(body: bytes) -> list[Span]:
    req = ExportTraceServiceRequest()
    req.ParseFromString(body)
    out = []
    for rs in req.resource_spans:
        res = {a.key: _value(a.value) for a in rs.resource.attributes}
        for ss in rs.scope_spans:
            for s in ss.spans:
                out.append(
                    Span(
                        trace_id=s.trace_id.hex(),
                        span_id=s.span_id.hex(),
                        parent_id=s.parent_span_id.hex(),
                        name=s.name,
                        start_ns=s.start_time_unix_nano,
                        end_ns=s.end_time_unix_nano,
                        service=str(res.get("service.name", "")),
                        attributes={a.key: _value(a.value) for a in s.attributes},
                    )
                )
    return out


class Receiver:
    """POST /v1/traces on 127.0.0.1:<free port>; `url` is what an exporter is given."""

    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/v1/traces"
        self._spans: list[Span] = []
        self._cond = threading.Condition()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self._thread: threading.Thread | None = None
        self.errors: list[str] = []

    async def _export(self, request: web.Request) -> web.Response:
        body = await request.read()
        if request.headers.get("Content-Encoding") == "gzip":
            body = gzip.decompress(body)
        try:
            spans = decode(body)
        except Exception as exc:  # a body that is not OTLP: the test reports it
            self.errors.append(f"{type(exc).__name__}: {exc}")
            return web.Response(status=400)
        with self._cond:
            self._spans.extend(spans)
            self._cond.notify_all()
        return web.Response(
            body=ExportTraceServiceResponse().SerializeToString(), content_type="application/x-protobuf"
        )

    def start(self) -> Receiver:
        ready = threading.Event()

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            app = web.Application(client_max_size=64 << 20)
            app.router.add_post("/v1/traces", self._export)
            self._runner = web.AppRunner(app, access_log=None)
            loop.run_until_complete(self._runner.setup())
            loop.run_until_complete(web.TCPSite(self._runner, "127.0.0.1", self.port).start())
            ready.set()
            loop.run_forever()
            loop.run_until_complete(self._runner.cleanup())
            loop.close()

        self._thread = threading.Thread(target=run, name="otlp-receiver", daemon=True)
        self._thread.start()
        assert ready.wait(30), "the OTLP receiver did not start"
        return self

    def stop(self) -> None:
        if self._loop is not None and self._thread is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(30)

    def spans(self) -> list[Span]:
        with self._cond:
            return list(self._spans)

    def wait_for(self, what: str, pred: Callable[[list[Span]], bool], timeout: float = 60.0) -> list[Span]:
        """The spans once `pred` holds for them; fails naming `what` and what arrived after `timeout`
        (far above what an export takes: the batch processors flush within a second)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while not pred(list(self._spans)):
                left = deadline - time.monotonic()
                assert left > 0, (
                    f"{what} not received within {timeout} s; got {[s.name for s in self._spans]}"
                )
                self._cond.wait(left)
            return list(self._spans)
