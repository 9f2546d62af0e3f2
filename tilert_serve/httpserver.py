"""How the serving path's aiohttp servers (the router, the TileRT decode node) listen: one setup for both.

aiohttp's defaults suit a server behind a trusted proxy, not one a party without credentials can reach:

- an idle keep-alive connection, or one whose request line and headers trickle in (slow-loris), stays
  open for 3,630 s. `idle_s` bounds both: aiohttp arms its keep-alive timer when a connection opens and
  after each response, and only a complete request line and headers disarm it;
- connections are not capped: past RLIMIT_NOFILE every accept(), upstream connect and file open fails,
  the readiness probe with them, and asyncio logs a traceback per failed accept. Here the soft limit is
  raised to the hard one, connections are capped well below it (`max_connections`), and a connection
  past the cap takes the place of the connection idle the longest (requests in progress are never cut);
  only when every connection has a request in progress is the new one refused with a 503. Either way
  one log line per interval says how many, and asyncio's accept errors are throttled the same way;
- a request aiohttp's parser refuses (bad chunked encoding, Content-Length with Transfer-Encoding, an
  over-long line) is answered in plain text that quotes the offending bytes, after a traceback in the
  log. Here it gets the app's JSON error shape (`error_body`), names the class of defect only, and
  the log gets one short line per interval.

The hooks are aiohttp's request handler and low-level server; `tests/decode/test_http_dos.py` and
`tests/router/test_router_http_server.py` pin the behaviour, so an aiohttp upgrade that moves them fails
there rather than in production.
"""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import resource
import time
from collections.abc import Callable
from typing import Any

from aiohttp import web, web_protocol, web_server
from aiohttp.web_request import BaseRequest

log = logging.getLogger(__name__)

#: The body of an error answer: (HTTP status, message) -> the app's JSON error object.
ErrorBody = Callable[[int, str], dict[str, Any]]

#: Seconds between two log lines about the same kind of trouble (refusals, malformed requests, accept
#: failures): an attack is counted, not transcribed.
LOG_INTERVAL_S = 10.0
#: File descriptors kept free of client connections: upstream connections, the control plane, files.
FD_RESERVE = 256


def openai_error(status: int, message: str) -> dict[str, Any]:
    """The router's error shape (OpenAI's)."""
    return {
        "error": {
            "message": message,
            "type": "invalid_request_error" if status < 500 else "internal_error",
            "param": None,
            "code": "malformed_http" if status == 400 else None,
        }
    }


#: A request body aiohttp could not decode (bad chunked encoding, a body cut short): what
#: `request.read()` raises, after the headers were fine.
BadBody = web_protocol.RequestPayloadError
#: What to tell a client whose body was malformed (never the parser's message: it quotes the bytes).
BAD_BODY = (
    "malformed HTTP request body (invalid chunked encoding, or fewer bytes than its Content-Length); "
    "nothing was processed: send a well-formed body"
)


class Throttle:
    """Logs one line per `interval_s` for a recurring event, with the count since the last line."""

    def __init__(self, logger: logging.Logger, interval_s: float = LOG_INTERVAL_S) -> None:
        self.logger = logger
        self.interval_s = interval_s
        self.count = 0
        self._since = 0
        self._last = -1e18

    def hit(self, level: int, message: str) -> None:
        self.count += 1
        self._since += 1
        now = time.monotonic()
        if now - self._last >= self.interval_s:
            self.logger.log(
                level,
                "%s (%d time(s) since the last such line; at most one per %.0f s)",
                message,
                self._since,
                self.interval_s,
            )
            self._last = now
            self._since = 0


def raise_nofile_limit() -> int:
    """Raise the soft RLIMIT_NOFILE to the hard one (a container's soft limit is often 1,024 under a hard
    limit of 1M); returns the soft limit in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as exc:  # a hard limit the kernel's nr_open caps lower
            log.warning("could not raise the open-file limit from %d to %d: %s", soft, target, exc)
    return soft


def connection_cap(nofile: int) -> int:
    """Client connections allowed with `nofile` descriptors: half of them, and FD_RESERVE left free."""
    return max(16, min(nofile // 2, nofile - FD_RESERVE))


class _Handler(web_protocol.RequestHandler):
    """aiohttp's request handler with the connection cap and JSON parse errors."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        manager = self._manager
        if isinstance(manager, _Server):
            manager.admit(self)

    def data_received(self, data: bytes) -> None:
        queued = len(self._messages)
        super().data_received(data)
        request = self._current_request
        if (
            request is None
            or len(self._messages) <= queued
            or not isinstance(self._messages[-1][0], web_protocol._ErrInfo)
        ):
            return
        # The parser refused the body of the request in progress (a bad chunk after good headers). aiohttp
        # queues the refusal behind that request, whose handler would wait for the rest of its body for
        # ever: fail the body (the handler answers a 400), answer here too, and drop the connection.
        manager = self._manager
        assert isinstance(manager, _Server)
        manager.malformed.hit(logging.INFO, "malformed HTTP request body(ies) refused with 400")
        request._cancel(BadBody("malformed body"))
        if self.transport is not None:
            self.transport.write(manager.bad_body)
        self.force_close()

    @property
    def idle(self) -> bool:
        """No request in progress nor parsed and waiting (headers still arriving count as idle)."""
        return not self._request_in_progress and not self._messages

    @property
    def idle_since(self) -> float:
        # The keep-alive deadline moves with the last response: the smallest one is the oldest idle.
        return self._next_keepalive_close_time

    def handle_error(
        self,
        request: BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        if request.writer.output_size > 0:
            raise ConnectionError("response already started: the connection is dropped")
        manager = self._manager
        assert isinstance(manager, _Server)
        # Never the parser's message: it quotes the request's bytes.
        kind = type(exc).__name__ if exc is not None else "error"
        if isinstance(exc, ConnectionError | BadBody):
            # The connection went while the handler ran (closed above, or by the client): nobody to tell.
            log.debug("request ended by its connection: %s", kind)
        elif status == 400:
            text = (
                f"malformed HTTP request ({kind}); nothing was processed. Send HTTP/1.1 with one "
                "Content-Length or a valid chunked Transfer-Encoding, not both, and request and header "
                "lines under 8 KiB"
            )
            manager.malformed.hit(logging.INFO, f"malformed HTTP request(s) refused with 400; last: {kind}")
        else:
            text = "internal server error"
            manager.failed.hit(
                logging.ERROR, f"request failed outside the app's error handling: {kind}: {exc}"
            )
        resp = web.Response(
            status=status, text=json.dumps(manager.error_body(status, text)), content_type="application/json"
        )
        resp.force_close()
        return resp


def _canned(status: str, body: dict[str, Any], extra: bytes = b"") -> bytes:
    """A whole HTTP response, for a connection answered outside any request handler."""
    raw = json.dumps(body).encode()
    return (
        f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\n".encode()
        + extra
        + b"Connection: close\r\nContent-Length: "
        + str(len(raw)).encode()
        + b"\r\n\r\n"
        + raw
    )


class _Server(web_server.Server):
    def __init__(
        self, base: web_server.Server, *, max_connections: int, error_body: ErrorBody, kwargs: dict[str, Any]
    ) -> None:
        super().__init__(
            base.request_handler,
            request_factory=base.request_factory,
            handler_cancellation=base.handler_cancellation,
            **kwargs,
        )
        self.max_connections = max_connections
        self.error_body = error_body
        #: What a connection past the cap gets when no idle connection can make room for it.
        self.refusal = _canned(
            "503 Service Unavailable",
            error_body(503, "too many connections to this server; retry shortly"),
            b"Retry-After: 1\r\n",
        )
        self.bad_body = _canned("400 Bad Request", error_body(400, BAD_BODY))
        self.evicted = Throttle(log)
        self.refused = Throttle(log)
        self.malformed = Throttle(log)
        self.failed = Throttle(log)

    def __call__(self) -> web_protocol.RequestHandler:
        return _Handler(self, loop=self._loop, **self._kwargs)

    def admit(self, handler: _Handler) -> None:
        """Called with each new connection, already counted: past the cap, close the connection idle
        the longest, or, when every one has a request in progress, refuse this one."""
        conns = self._connections
        if len(conns) <= self.max_connections:
            return
        victims = [h for h in conns if h is not handler and isinstance(h, _Handler) and h.idle]
        if victims:
            min(victims, key=lambda h: h.idle_since).force_close()
            self.evicted.hit(
                logging.WARNING,
                f"connection limit {self.max_connections} reached: idle connection(s) closed to make room",
            )
            return
        transport = handler.transport
        if transport is not None:
            transport.write(self.refusal)
        handler.force_close()
        self.refused.hit(
            logging.WARNING,
            f"connection limit {self.max_connections} reached with every connection "
            "busy: new connection(s) refused with 503",
        )


class Runner(web.AppRunner):
    """An AppRunner whose server is `_Server` (the cap and the JSON parse errors)."""

    def __init__(
        self, app: web.Application, *, max_connections: int, error_body: ErrorBody, **kwargs: Any
    ) -> None:
        super().__init__(app, **kwargs)
        self._max_connections = max_connections
        self._error_body = error_body

    async def _make_server(self) -> web_server.Server:
        base = await super()._make_server()
        kwargs = dict(base._kwargs)
        kwargs["loop"] = base._loop
        return _Server(
            base, max_connections=self._max_connections, error_body=self._error_body, kwargs=kwargs
        )

    @property
    def connections(self) -> int:
        server = self.server
        return len(server.connections) if server is not None else 0


class _AcceptErrors:
    """The loop's exception handler, with asyncio's accept() failures (EMFILE, ENFILE: one traceback per
    failed accept, each retried after a second per listening socket) throttled to one line per interval."""

    def __init__(
        self, previous: Callable[[asyncio.AbstractEventLoop, dict[str, Any]], object] | None
    ) -> None:
        self.previous = previous
        self.throttle = Throttle(log)

    def __call__(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        exc = context.get("exception")
        if (
            "accept" in str(context.get("message", ""))
            and isinstance(exc, OSError)
            and exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)
        ):
            self.throttle.hit(
                logging.ERROR, f"accept() failed: {exc.strerror}; new connections wait in the backlog"
            )
            return
        if self.previous is not None:
            self.previous(loop, context)
        else:
            loop.default_exception_handler(context)


def throttle_accept_errors(loop: asyncio.AbstractEventLoop) -> None:
    current = loop.get_exception_handler()
    if not isinstance(current, _AcceptErrors):
        loop.set_exception_handler(_AcceptErrors(current))


async def start(
    app: web.Application,
    host: str,
    port: int,
    *,
    idle_s: float,
    error_body: ErrorBody = openai_error,
    handler_cancellation: bool = False,
    max_connections: int | None = None,
    backlog: int = 2048,
    reuse_port: bool = False,
    replica_port: int | None = None,
) -> Runner:
    """Serve `app` on host:port (0 = any free port); returns the runner (`runner.addresses` gives the
    port, `await runner.cleanup()` stops it). `idle_s` bounds idle and slow-header connections;
    `max_connections` defaults to `connection_cap` of the open-file limit, raised first to the hard one.

    `reuse_port`: share host:port with other processes of this user that set it too (SO_REUSEPORT: the
    kernel spreads new connections over the live listeners, as a Service spreads them over ready pods,
    and stops sending any to a listener the moment it closes or its process dies). `replica_port`: also
    listen on a port of this process alone, so a prober can reach this replica and not its peers."""
    nofile = raise_nofile_limit()
    cap = max_connections if max_connections is not None else connection_cap(nofile)
    throttle_accept_errors(asyncio.get_running_loop())
    runner = Runner(
        app,
        max_connections=cap,
        error_body=error_body,
        handler_cancellation=handler_cancellation,
        access_log=None,
        keepalive_timeout=idle_s,
    )
    await runner.setup()
    await web.TCPSite(runner, host, port, backlog=backlog, reuse_port=reuse_port or None).start()
    if replica_port is not None:
        await web.TCPSite(runner, host, replica_port, backlog=backlog).start()
    return runner
