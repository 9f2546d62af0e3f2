"""What one router app holds: the config in force, the pools, the metrics, the upstream session.

Stored under one typed AppKey (aiohttp's "no singletons" advice); handlers read `state.config` once
per request, so a reload never changes a request half-way through.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from tilert_serve.bearer import TokenFile
from tilert_serve.router.config import RouterConfig, TileRTNode, with_discovered
from tilert_serve.router.metrics import Metrics
from tilert_serve.router.pools import Node, Pools
from tilert_serve.router.retry_budget import RetryBudget

log = logging.getLogger(__name__)


def token_file(path: str | None, current: TokenFile | None = None) -> TokenFile | None:
    """The TokenFile for `path` (None: no file): `current` re-read when it is the same file, else a new
    one (TokenFileError when it cannot be read)."""
    if not path:
        return None
    if current is not None and current.path == Path(path):
        current.refresh(force=True)
        return current
    return TokenFile(path)


@dataclass
class RouterState:
    config: RouterConfig
    #: The file the config came from, watched for changes; None = fixed config (tests, embedding).
    config_path: Path | None
    pools: Pools
    metrics: Metrics
    #: The clients' API keys (config.api_keys_file); None = no authentication.
    api_keys: TokenFile | None
    #: The TileRT nodes' API token (config.tilert_api_token_file); None = none sent.
    node_token: TokenFile | None = None
    #: Tokens accepted for GET /metrics only (config.metrics_token_file); None = none.
    metrics_token: TokenFile | None = None
    #: Set by the session cleanup_ctx; every upstream call goes through this one pooled session.
    session: aiohttp.ClientSession | None = None
    #: Set beside it: no pooled connections, no DNS cache (upstream.fresh_session), for a retry on the
    #: endpoint that failed the same request.
    fresh: aiohttp.ClientSession | None = None
    #: Fire-and-forget work (TileRT cancels) that must outlive the request that started it.
    background: set[asyncio.Task[Any]] = field(default_factory=set)
    #: Wall-clock start, for /v1/models' `created`.
    started: float = field(default_factory=time.time)
    #: TileRT nodes found through DNS (discovery.py); merged into every config applied.
    discovered: list[TileRTNode] = field(default_factory=list)
    #: The config as loaded, before discovered nodes were merged in.
    base_config: RouterConfig = field(init=False)
    #: When a request last found the TileRT pool full (monotonic): probes wait while users want slots.
    tilert_full_at: float = -1e18
    #: Retries before the first byte, as a share of recent requests (retry_budget.py says why).
    retry_budget: RetryBudget = field(init=False)
    #: The active health checks run (health.py); off, endpoints are judged only by the traffic.
    health_checks: bool = False

    def __post_init__(self) -> None:
        self.base_config = self.config
        p = self.config.policy
        self.retry_budget = RetryBudget(p.retry_budget_ratio, p.retry_budget_min, p.retry_budget_window_s)

    def node_headers(self, headers: dict[str, str]) -> dict[str, str]:
        """`headers` plus the node-API token, for calls to a TileRT node's /v1/* (never to vLLM)."""
        token = self.node_token.first() if self.node_token is not None else None
        return {**headers, "Authorization": f"Bearer {token}"} if token else headers

    @property
    def http(self) -> aiohttp.ClientSession:
        assert self.session is not None, "router used outside its app's lifetime"
        return self.session

    def http_for(self, url: str, failed: set[str]) -> aiohttp.ClientSession:
        """The session for a call to `url`: the fresh one when `url` already failed this request."""
        if url in failed and self.fresh is not None:
            return self.fresh
        return self.http

    def apply(self, config: RouterConfig) -> None:
        """Swap in a new config; the pools keep the state of endpoints that stay."""
        keys = token_file(config.api_keys_file, self.api_keys)
        node_token = token_file(config.tilert_api_token_file, self.node_token)
        self.metrics_token = token_file(config.metrics_token_file, self.metrics_token)
        effective = with_discovered(config, self.discovered)
        self.pools.apply(effective)
        self.api_keys = keys
        self.node_token = node_token
        self.base_config = config
        self.config = effective
        p = config.policy
        b = self.retry_budget
        b.ratio, b.min_retries, b.window_s = p.retry_budget_ratio, p.retry_budget_min, p.retry_budget_window_s
        # Gauges of endpoints that left (DNS churn gives every new pod a new address) would otherwise
        # report their last value for ever; a renamed node reports under its new name at once.
        self.metrics.healthy.keep_only({(ep.pool, ep.url) for ep in self.pools.all()})
        self.metrics.endpoint_breaker_open.keep_only({(ep.pool, ep.url) for ep in self.pools.all()})
        self.metrics.slots.keep_only({(name,) for name in self.pools.tilert})
        for node in self.pools.tilert.values():
            self.note_slots(node)

    def note_slots(self, node: Node) -> None:
        """Report the slots held on `node`, unless it has left the pool (a request in flight may still
        hold it) and with it its gauge."""
        if self.pools.tilert.get(node.spec.name) is node:
            self.metrics.slots.labels(node.spec.name).set(node.in_use)

    def set_discovered(self, nodes: list[TileRTNode]) -> None:
        self.discovered = nodes
        self.apply(self.base_config)

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coro)
        self.background.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task[Any]) -> None:
        self.background.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("background task failed", exc_info=task.exception())


STATE = web.AppKey("tilert_router_state", RouterState)


def task_ctx(
    run: Callable[[RouterState], Coroutine[Any, Any, None]],
) -> Callable[[web.Application], AsyncIterator[None]]:
    """A cleanup_ctx running `run(state)` as long as the app: cancelled and awaited on shutdown, so that
    a loop never outlives the upstream session it uses."""

    async def ctx(app: web.Application) -> AsyncIterator[None]:
        task = asyncio.get_running_loop().create_task(run(app[STATE]))
        yield
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    return ctx
