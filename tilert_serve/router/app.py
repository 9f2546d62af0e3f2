"""The router's aiohttp application: `make_app(config)` for tests, the CLI and `tilert-pd local`.

Run it with `handler_cancellation=True` (as `run_router` does): a client that disconnects then
cancels its handler at once, which aborts the prefill call and cancels the TileRT ticket; without it
aiohttp would only notice the disconnect at the next write.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from pathlib import Path

from aiohttp import web

from tilert_serve import httpserver, tracing, tracing_otel
from tilert_serve.router import canary, discovery, handlers, health, native_warmup, reload, upstream
from tilert_serve.router.call import TRACER
from tilert_serve.router.config import RouterConfig
from tilert_serve.router.errors import error_middleware
from tilert_serve.router.metrics import Metrics
from tilert_serve.router.pools import Pools
from tilert_serve.router.state import STATE, RouterState, token_file

log = logging.getLogger(__name__)


async def _session_ctx(app: web.Application) -> AsyncIterator[None]:
    state = app[STATE]
    state.session = upstream.new_session(state.config.limits)
    state.fresh = upstream.fresh_session()
    yield
    # Let cancels already sent finish (they free TileRT slots), then close the pool.
    if state.background:
        await asyncio.wait(list(state.background), timeout=state.config.timeouts.cancel_s)
    await state.session.close()
    await state.fresh.close()
    state.session = state.fresh = None


async def _tracer_ctx(app: web.Application) -> AsyncIterator[None]:
    yield
    tracer = app[TRACER]
    if tracer is not None:
        # Exports what the last requests left queued; off the loop (it waits on the network).
        await asyncio.to_thread(tracer.shutdown)


def make_app(
    config: RouterConfig,
    *,
    config_path: str | Path | None = None,
    health_checks: bool = True,
    resolver: discovery.Resolver = discovery.resolve,
) -> web.Application:
    """Build the router. `config_path`: the file `config` came from, watched and reloaded;
    `health_checks=False` leaves every endpoint routable (tests that script failures themselves);
    `resolver` looks up TileRT nodes when the config asks for discovery (tests pass their own)."""
    state = RouterState(
        config=config,
        config_path=Path(config_path) if config_path is not None else None,
        pools=Pools(config),
        metrics=Metrics(),
        api_keys=token_file(config.api_keys_file),
        node_token=token_file(config.tilert_api_token_file),
        metrics_token=token_file(config.metrics_token_file),
    )
    app = web.Application(middlewares=[error_middleware], client_max_size=config.limits.max_body_bytes)
    app[STATE] = state
    t = config.tracing
    app[TRACER] = tracing_otel.make_tracer(tracing.TracingConfig(t.endpoint, t.sample_ratio, t.service_name))
    app.cleanup_ctx.append(_session_ctx)
    app.cleanup_ctx.append(_tracer_ctx)
    if health_checks:
        state.health_checks = True
        app.cleanup_ctx.append(health.health_ctx)
        # Probes need probed endpoints (they run on healthy nodes only); off unless the config asks.
        app.cleanup_ctx.append(canary.canary_ctx)
        # Warm-ups too: they go to pairs of probed-healthy endpoints only (off unless the config asks).
        app.cleanup_ctx.append(native_warmup.warmup_ctx)
    app.cleanup_ctx.append(reload.reload_ctx)
    app.cleanup_ctx.append(discovery.discovery_ctx(resolver))
    app.add_routes(handlers.routes())
    return app


async def start(
    app: web.Application, host: str, port: int, *, reuse_port: bool = False, replica_port: int | None = None
) -> web.AppRunner:
    """Start the app on host:port (0 = any free port) with handler cancellation on; returns the runner
    (its `addresses` give the bound port; `await runner.cleanup()` stops it).

    The server is set up as the decode node's (tilert_serve/httpserver.py): a connection without a
    request in progress (idle keep-alive, or headers still arriving) is closed after
    `timeouts.client_idle_s`, connections are capped at `limits.max_client_connections`, and requests
    aiohttp's parser refuses get a JSON 400. `reuse_port` and `replica_port`: replicas sharing one
    port on one host (httpserver.start)."""
    cfg = app[STATE].config
    return await httpserver.start(
        app,
        host,
        port,
        idle_s=cfg.timeouts.client_idle_s,
        error_body=httpserver.openai_error,
        handler_cancellation=True,
        max_connections=cfg.limits.max_client_connections,
        reuse_port=reuse_port,
        replica_port=replica_port,
    )


def bound_port(runner: web.AppRunner) -> int:
    return int(runner.addresses[0][1])
