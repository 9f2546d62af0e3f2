"""The decode node's shutdown (decode/cli.py, tilert_serve/draining.py): on SIGTERM /ready turns 503 and
/v1/admit refuses, while a ticket admitted before keeps its handoff and its stream; the node stops once
no slot is active, or when the drain timeout is up."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
from aiohttp import web

from tests.decode import synthetic
from tests.decode.conftest import SECRET, SENDER_ENV, RecordingEngine, RunningNode, node_transfer, serve_node
from tilert_serve import draining
from tilert_serve.decode import cli
from tilert_serve.decode.http import make_app
from tilert_serve.decode.node import DecodeNode, NodeConfig
from tilert_serve.local.runner import free_port

CASE = "mla-f32"
LAYOUT = synthetic.layout_for(CASE)


def _node(slots: int = 1, http_port: int = 0) -> DecodeNode:
    for key in ("UCX_TLS", "UCX_NET_DEVICES", "UCX_MODULES"):
        os.environ.setdefault(key, SENDER_ENV[key])
    config = NodeConfig(
        name="node-0",
        max_seq_len=256,
        slots=slots,
        host="127.0.0.1",
        ctrl_port=0,
        http_port=http_port,
        shards=1,
        devices=("cpu",),
        ticket_ttl_s=30.0,
        handoff_timeout_s=30.0,
        quarantine_s=30.0,
    )
    return DecodeNode(
        config,
        layout=LAYOUT,
        engine=RecordingEngine(LAYOUT, 256, slots),
        transfer=node_transfer(),
        secret=SECRET,
    )


@contextlib.asynccontextmanager
async def draining_node(
    secret_file: Path, timeout_s: float
) -> AsyncIterator[tuple[RunningNode, draining.Drain, web.AppRunner]]:
    node = _node()
    app = make_app(node)
    drain = cli.drain_for(node, timeout_s)
    app.middlewares.append(drain.middleware)
    runner, url = await serve_node(app, node)
    async with aiohttp.ClientSession() as session:
        try:
            yield RunningNode(node, node.engine, url, secret_file, session), drain, runner  # type: ignore[arg-type]
        finally:
            await runner.cleanup()


async def test_draining_refuses_admissions_and_finishes_the_admitted_request(secret_file: Path) -> None:
    async with draining_node(secret_file, timeout_s=30) as (n, drain, runner):
        status, adm = await n.admit("before-sigterm")
        assert status == 200
        run = asyncio.create_task(drain.run(runner, stop_listening=False, idle=lambda: cli.node_idle(n.node)))
        while True:  # until the drain has begun (the task runs at the next await)
            async with n.session.get(f"{n.url}/ready") as r:
                if r.status == 503:
                    assert (await r.json())["reason"] == "draining"
                    break
            await asyncio.sleep(0.01)
        status, body = await n.admit("after-sigterm")
        assert (
            status == 503 and body["error"]["type"] == "not_ready" and "draining" in body["error"]["message"]
        )
        assert not run.done(), "an admitted ticket holds the drain"
        # The ticket admitted before the SIGTERM still gets its handoff and its whole stream.
        result = json.loads(
            (await n.send(CASE, 20, 1, "mooncake", adm["ticket"], request_id="before-sigterm"))[7:]
        )
        assert result["ok"], result
        status, events = await n.generate(adm["ticket"], max_tokens=6)
        assert status == 200 and events[-1]["done"] and events[-1]["finish_reason"] == "length"
        assert await asyncio.wait_for(run, 5) == "drained"


async def test_a_ticket_never_used_ends_the_drain_at_its_timeout(secret_file: Path) -> None:
    async with draining_node(secret_file, timeout_s=0.5) as (n, drain, runner):
        assert (await n.admit("abandoned"))[0] == 200
        assert (
            await asyncio.wait_for(
                drain.run(runner, stop_listening=False, idle=lambda: cli.node_idle(n.node)), 5
            )
            == "timeout"
        )


async def test_sigterm_stops_an_idle_node_at_once() -> None:
    """cli.serve, as `tilert-pd decode-node` runs it: SIGTERM with nothing in flight stops the node."""
    port = free_port()
    node = _node(http_port=port)
    served = asyncio.create_task(cli.serve(make_app(node), node, "127.0.0.1", port, 30.0))
    async with aiohttp.ClientSession() as http:
        for _ in range(200):
            with contextlib.suppress(aiohttp.ClientError):
                async with http.get(f"http://127.0.0.1:{port}/ready") as r:
                    if r.status == 200:
                        break
            await asyncio.sleep(0.02)
    os.kill(os.getpid(), signal.SIGTERM)
    assert await asyncio.wait_for(served, 10) == "drained"
    assert node.stopping and not node.ready
