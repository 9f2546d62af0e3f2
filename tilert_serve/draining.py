"""Graceful shutdown of the aiohttp servers on the serving path (router, TileRT decode node).

In a pod, the kubelet runs the preStop sleep first (the endpoints controller and the proxies take the
pod out of its Services meanwhile), then sends SIGTERM, then SIGKILL when terminationGracePeriodSeconds
is up. On SIGTERM a `Drain`:

1. turns readiness false at once (`GET /ready` answers 503 "draining") and refuses what must not start
   any more (the node's admissions: a router then takes another node);
2. optionally stops listening (the router: new connections go elsewhere; the node keeps its port, since
   a ticket it admitted before SIGTERM still needs its /v1/generate);
3. lets requests in flight finish, and waits for what `idle` says (the node: no slot between admission
   and the end of its stream), up to `timeout_s`;
4. at the deadline, calls `on_deadline` (the node: every stream still running ends with a clean
   `shutting_down` error event, every ticket not yet streaming fails with that reason) and gives the
   handlers CLOSE_S to finish their answers;
5. cancels what is left (a cancelled router request cancels its TileRT ticket), then the caller cleans
   the app up and exits.

Responses started while draining carry `Connection: close`, so keep-alive clients move on.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import time
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

log = logging.getLogger(__name__)

#: Probe paths: never counted as work in flight.
PROBES = frozenset({"/health", "/ready", "/metrics"})
#: Seconds the handlers get after `on_deadline` to end their answers themselves (an SSE error event
#: written and the response closed) before their tasks are cancelled, which cuts a stream mid-way.
CLOSE_S = 2.0


def _never(request: web.Request) -> bool:
    return False


def _always_idle() -> bool:
    return True


class Drain:
    """Tracks requests in flight and answers for the app while it drains (install `middleware`)."""

    def __init__(
        self,
        timeout_s: float,
        *,
        refuse: Callable[[web.Request], bool] = _never,
        refuse_body: dict[str, Any] | None = None,
        on_deadline: Callable[[], None] | None = None,
    ) -> None:
        self.timeout_s = timeout_s
        #: Called once when the drain's time is up with work left: ends that work with a clean error.
        self.on_deadline = on_deadline
        self.refuse = refuse
        self.refuse_body = refuse_body or {
            "error": {"type": "draining", "message": "shutting down; retry elsewhere"}
        }
        self.draining = False
        self.inflight: set[asyncio.Task[Any]] = set()
        #: Set when the drain ended: "drained" or "timeout" (tests and logs).
        self.outcome: str | None = None

    @web.middleware
    async def middleware(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        if self.draining:
            if request.path == "/ready":
                return web.json_response(
                    {"ready": False, "reason": "draining", "reasons": ["draining: shutting down"]}, status=503
                )
            if self.refuse(request):
                return web.Response(
                    status=503,
                    text=json.dumps(self.refuse_body),
                    content_type="application/json",
                    headers={"Retry-After": "1", "Connection": "close"},
                )
        task = asyncio.current_task()
        track = task is not None and request.path not in PROBES
        if track:
            assert task is not None
            self.inflight.add(task)
        try:
            resp = await handler(request)
            if self.draining and not resp.prepared:
                resp.force_close()
            return resp
        finally:
            if track:
                assert task is not None
                self.inflight.discard(task)

    async def run(
        self, runner: web.AppRunner, *, stop_listening: bool, idle: Callable[[], bool] = _always_idle
    ) -> str:
        """Drain (see the module's docstring); returns "drained" or "timeout". The caller then runs
        `runner.cleanup()`."""
        self.draining = True
        started = time.monotonic()
        log.info(
            "draining: readiness is false; waiting up to %.0f s for %d request(s) in flight",
            self.timeout_s,
            len(self.inflight),
        )
        if stop_listening:
            for site in list(runner.sites):
                await site.stop()
        deadline = started + self.timeout_s
        while (self.inflight or not idle()) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        self.outcome = "drained" if not self.inflight and idle() else "timeout"
        if self.outcome == "timeout" and self.on_deadline is not None:
            log.info("drain period over: ending %d request(s) in flight with an error", len(self.inflight))
            self.on_deadline()
            closing = time.monotonic() + CLOSE_S
            while self.inflight and time.monotonic() < closing:
                await asyncio.sleep(0.02)
        left = list(self.inflight)
        for task in left:
            task.cancel()
        for task in left:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await asyncio.wait_for(asyncio.shield(task), timeout=5.0)
        log.info(
            "drain %s after %.1f s (%d request(s) cancelled)",
            self.outcome,
            time.monotonic() - started,
            len(left),
        )
        return self.outcome


async def serve_until_signal(
    runner: web.AppRunner,
    drain: Drain,
    *,
    stop_listening: bool,
    idle: Callable[[], bool] = _always_idle,
    signals: tuple[signal.Signals, ...] = (signal.SIGTERM, signal.SIGINT),
) -> str:
    """Wait for SIGTERM or SIGINT, drain, clean the app up; returns the drain's outcome."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in signals:
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
        return await drain.run(runner, stop_listening=stop_listening, idle=idle)
    finally:
        for sig in signals:
            loop.remove_signal_handler(sig)
        await runner.cleanup()
