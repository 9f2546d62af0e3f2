"""The router's shutdown (tilert_serve/draining.py): on SIGTERM readiness turns false and the port
closes, a stream in flight finishes, and one that outlasts --drain-timeout is cancelled (its TileRT
ticket with it) before the process exits."""

from __future__ import annotations

import asyncio
import json
import signal
import time
from typing import Any

import aiohttp
from router_fakes import start_router, until

from tilert_serve import draining
from tilert_serve.local.runner import free_port
from tilert_serve.router import config
from tilert_serve.router.app import bound_port, make_app, start


async def _router(s: Any, tmp_path: Any, drain_timeout: float) -> tuple[asyncio.subprocess.Process, str]:
    path = tmp_path / "config.yaml"
    path.write_text(config.dump(s.cfg))
    port = free_port()
    proc = await start_router(
        path,
        port,
        "--no-health-checks",
        "--drain-timeout",
        str(drain_timeout),
        log_level="INFO",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    async with aiohttp.ClientSession() as http:
        for _ in range(400):
            try:
                async with http.get(url + "/health") as resp:
                    if resp.status == 200:
                        break
            except aiohttp.ClientError:
                await asyncio.sleep(0.05)
    return proc, url


async def _stream(url: str, max_tokens: int, first: asyncio.Event) -> tuple[list[str], str | None]:
    """A streamed TileRT completion: its texts and finish reason (None if it broke off)."""
    texts: list[str] = []
    finish = None
    body = {"model": "tiny", "prompt": "a", "max_tokens": max_tokens, "stream": True}
    async with (
        aiohttp.ClientSession() as http,
        http.post(url + "/v1/completions", json=body, headers={"x-pd-route": "tilert"}) as resp,
    ):
        assert resp.status == 200, await resp.text()
        try:
            async for line in resp.content:
                if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                    continue
                choice = json.loads(line[6:])["choices"][0]
                texts.append(choice["text"])
                finish = choice.get("finish_reason") or finish
                first.set()
        except aiohttp.ClientPayloadError:
            return texts, None
    return texts, finish


async def _refused(url: str) -> bool:
    try:
        async with (
            aiohttp.ClientSession() as http,
            http.get(url + "/ready", timeout=aiohttp.ClientTimeout(total=2)) as resp,
        ):
            return resp.status == 503
    except aiohttp.ClientConnectionError:
        return True


async def test_sigterm_finishes_the_stream_in_flight(make_stack: Any, tmp_path: Any) -> None:
    s = await make_stack()
    s.node.token_interval_s = 0.05  # 20 tokens: about a second of stream after the SIGTERM
    proc, url = await _router(s, tmp_path, drain_timeout=20)
    try:
        first = asyncio.Event()
        stream = asyncio.create_task(_stream(url, 20, first))
        await asyncio.wait_for(first.wait(), 10)
        proc.send_signal(signal.SIGTERM)
        # A draining router must not look ready or take new connections (from when it handled SIGTERM).
        deadline = time.monotonic() + 10
        while not await _refused(url):
            assert time.monotonic() < deadline, "the router still looks ready 10 s after SIGTERM"
            await asyncio.sleep(0.02)
        texts, finish = await asyncio.wait_for(stream, 15)
        assert finish == "length" and len("".join(texts).split()) == 20, (texts, finish)
        assert await asyncio.wait_for(proc.wait(), 10) == 0
        assert s.node.cancels == [], "a stream that finished has no ticket to cancel"
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_a_stream_past_the_drain_timeout_is_cancelled(make_stack: Any, tmp_path: Any) -> None:
    s = await make_stack()
    s.node.token_interval_s = 0.05
    s.node.stall_after = 2  # the node stops sending: only the drain timeout ends this stream
    proc, url = await _router(s, tmp_path, drain_timeout=1)
    try:
        first = asyncio.Event()
        stream = asyncio.create_task(_stream(url, 50, first))
        await asyncio.wait_for(first.wait(), 10)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 15) == 0
        assert time.monotonic() - t0 < 10
        _, finish = await asyncio.wait_for(stream, 10)
        assert finish != "length", "the stream was cut, not finished"
        # The router cancelled the TileRT ticket on its way out (the node frees the slot at once).
        await until(lambda: len(s.node.cancels) == 1, timeout=5)
        out = (await proc.stdout.read()).decode() if proc.stdout else ""
        assert "drain timeout" in out, out
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_ready_answers_503_while_draining_and_requests_in_flight_are_served(make_stack: Any) -> None:
    """In process, the port kept open: /ready turns 503 at once; /health stays 200."""
    s = await make_stack()
    app = make_app(s.cfg, health_checks=False)
    drain = draining.Drain(10)
    app.middlewares.append(drain.middleware)
    runner = await start(app, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{bound_port(runner)}"
    try:
        s.node.go.clear()  # hold the stream until the drain has begun
        first = asyncio.Event()
        stream = asyncio.create_task(_stream(url, 3, first))
        await until(lambda: bool(drain.inflight) and s.node.active == 1)
        run = asyncio.create_task(drain.run(runner, stop_listening=False))
        await until(lambda: drain.draining)
        async with aiohttp.ClientSession() as http:
            async with http.get(url + "/ready") as resp:
                assert resp.status == 503 and (await resp.json())["reason"] == "draining"
            async with http.get(url + "/health") as resp:
                assert resp.status == 200
        assert not run.done(), "the drain waits for the stream in flight"
        s.node.go.set()
        texts, finish = await asyncio.wait_for(stream, 10)
        assert finish == "length" and "".join(texts) == " hello w0 w1", texts
        assert await asyncio.wait_for(run, 5) == "drained"
    finally:
        await runner.cleanup()
