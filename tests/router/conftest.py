"""Fixtures: a router (the real app, on port 0) in front of scripted upstreams."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import openai
import pytest
from aiohttp import web
from router_fakes import FakeNative, FakeNode, FakePrefill, stack_config

from tilert_serve.router import config
from tilert_serve.router.app import bound_port, make_app, start
from tilert_serve.router.state import STATE, RouterState


@dataclass
class Stack:
    router_url: str
    app: web.Application
    runner: web.AppRunner
    nodes: list[FakeNode]
    prefills: list[FakePrefill]
    natives: list[FakeNative]
    cfg: config.RouterConfig
    clients: list[openai.AsyncOpenAI] = field(default_factory=list)

    @property
    def state(self) -> RouterState:
        return self.app[STATE]

    @property
    def node(self) -> FakeNode:
        return self.nodes[0]

    @property
    def prefill(self) -> FakePrefill:
        return self.prefills[0]

    @property
    def native(self) -> FakeNative:
        return self.natives[0]

    def client(self, **kw: Any) -> openai.AsyncOpenAI:
        c = openai.AsyncOpenAI(
            base_url=self.router_url + "/v1",
            api_key=kw.pop("api_key", "none"),
            max_retries=0,
            timeout=kw.pop("timeout", 20.0),
            **kw,
        )
        self.clients.append(c)
        return c


StackFactory = Callable[..., Awaitable[Stack]]


@pytest.fixture
async def make_stack() -> AsyncIterator[StackFactory]:
    stacks: list[Stack] = []

    async def build(
        *,
        node_slots: tuple[int, ...] = (1,),
        n_prefill: int = 1,
        n_native: int = 1,
        health_checks: bool = False,
        resolver: Any = None,
        context: int | None = None,
        node_token: str | None = None,
        **overrides: Any,
    ) -> Stack:
        """`context`: one context length for every server, as the operator renders it (vLLM's
        --max-model-len, the nodes' --max-seq-len and max_seq_len in the router's config)."""
        nodes = [
            await FakeNode(
                f"t{i}", slots=s, token=node_token, **({"max_seq_len": context} if context else {})
            ).start()
            for i, s in enumerate(node_slots)
        ]
        prefills = [await FakePrefill(nodes).start() for _ in range(n_prefill)]
        natives = [await FakeNative().start() for _ in range(n_native)]
        for v in [*prefills, *natives]:
            v.max_model_len = context
        raw = stack_config(
            [p.url for p in prefills],
            [n.url for n in natives],
            [(n.name, n.url, n.slots) for n in nodes],
            max_seq_len=context,
        )
        for key, value in overrides.items():
            if isinstance(value, dict) and isinstance(raw.get(key), dict):
                raw[key] = {**raw[key], **value}
            else:
                raw[key] = value
        cfg = config.RouterConfig.model_validate(raw)
        app = make_app(cfg, health_checks=health_checks, **({"resolver": resolver} if resolver else {}))
        runner = await start(app, "127.0.0.1", 0)
        stack = Stack(f"http://127.0.0.1:{bound_port(runner)}", app, runner, nodes, prefills, natives, cfg)
        stacks.append(stack)
        return stack

    yield build
    for s in stacks:
        for c in s.clients:
            await c.close()
        await s.runner.cleanup()
        for f in [*s.nodes, *s.prefills, *s.natives]:
            await f.stop()
