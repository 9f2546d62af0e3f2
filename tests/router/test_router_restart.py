"""The router restarted under load: SIGKILL the router process while a request loop
runs through it, start it again on the same port; only the requests in flight on the killed process
fail, and the new one serves within 2 s of its start, counted from when it listens (the interpreter's
own start and imports, about a second and more on a loaded 2-core box, are printed beside it). The
upstreams are the scripted fakes; the router is the real CLI in its own process, as a pod runs it."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp
from router_fakes import MODEL, WORDS, start_router, until

from tilert_serve.router import config

#: The bound on "serves again", from the new process listening to its first answered request.
SERVES_WITHIN_S = 2.0


@dataclass
class Outcome:
    started: float
    ended: float
    ok: bool
    what: str


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def _router(cfg_path: Path, port: int, *extra: str) -> asyncio.subprocess.Process:
    return await start_router(cfg_path, port, *extra, env={**os.environ, "PYTHONUNBUFFERED": "1"})


async def _listening(port: int) -> float:
    """When the port first accepts a connection (monotonic)."""
    while True:
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
        except OSError:
            await asyncio.sleep(0.005)
            continue
        t = time.monotonic()
        writer.close()
        return t


async def _worker(
    url: str, route: str, out: list[Outcome], stop: asyncio.Event, refused: list[float] | None = None
) -> None:
    """Send requests one after another; a refused connection (no router listening: what a Service
    with no ready endpoint gives) is not a request sent, and is tried again at once. One connection per
    request: a pooled keep-alive connection to the killed process would fail the next request too, a
    request the router never received (a client library retries those; a count of what the router
    lost must not include them)."""
    connector = aiohttp.TCPConnector(force_close=True)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=30)) as http:
        while not stop.is_set():
            t0 = time.monotonic()
            try:
                async with http.post(
                    url + "/v1/completions",
                    json={"model": MODEL, "prompt": "a", "max_tokens": 6, "temperature": 0},
                    headers={"x-pd-route": route},
                ) as resp:
                    body = await resp.json()
                    text = body["choices"][0]["text"] if resp.status == 200 else ""
                    expected = "".join(WORDS[:6]) if route == "native" else " hello" + "".join(WORDS[:5])
                    ok = resp.status == 200 and text == expected
                    out.append(Outcome(t0, time.monotonic(), ok, f"{resp.status} {text!r}"))
            except aiohttp.ClientConnectorError:
                if refused is not None:
                    refused.append(time.monotonic())
                await asyncio.sleep(0.005)  # nothing listens: not a request; ask again
            except (aiohttp.ClientError, TimeoutError) as exc:
                out.append(Outcome(t0, time.monotonic(), False, type(exc).__name__))


async def test_a_router_killed_under_load_loses_only_its_in_flight_requests(make_stack, tmp_path):
    s = await make_stack(node_slots=(8,), n_native=1)
    s.node.token_interval_s = s.native.token_interval_s = 0.02  # each request takes ~0.1 s
    s.native.tokens = 6
    cfg_path = tmp_path / "config.yaml"
    cfg_path.write_text(config.dump(s.cfg))
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    out: list[Outcome] = []
    stop = asyncio.Event()
    first = await _router(cfg_path, port)
    workers = [
        asyncio.create_task(_worker(url, route, out, stop))
        for route in ("tilert", "native", "tilert", "native")
    ]
    second: asyncio.subprocess.Process | None = None
    try:
        await until(lambda: sum(o.ok for o in out) >= 20, timeout=60)
        # Kill while requests are in flight (each worker has one out nearly all the time).
        await until(lambda: s.node.active + s.native.active >= 2, timeout=30)
        t_kill = time.monotonic()
        first.send_signal(signal.SIGKILL)
        await first.wait()
        t_dead = t_start = time.monotonic()
        second = await _router(cfg_path, port)
        t_listen = await asyncio.wait_for(_listening(port), 60)
        await until(lambda: any(o.ok and o.started >= t_start for o in out), timeout=60)
        t_served = min(o.ended for o in out if o.ok and o.started >= t_start)
        await until(lambda: sum(o.ok and o.started >= t_start for o in out) >= 20, timeout=60)
    finally:
        stop.set()
        await asyncio.gather(*workers)
        for proc in (first, second):
            if proc is not None and proc.returncode is None:
                proc.send_signal(signal.SIGKILL)
                with contextlib.suppress(ProcessLookupError):
                    await proc.wait()
    failed = [o for o in out if not o.ok]
    # In flight on the killed process: sent before it was gone, not answered when the kill was sent.
    in_flight = [o for o in out if o.started < t_kill < o.ended]
    dying = [o for o in failed if t_kill <= o.started < t_dead]
    print(
        f"\nrouter SIGKILL under load: {len(out)} requests, {len(failed)} failed: {len(in_flight)} in flight "
        f"at the kill, {len(dying)} sent in the {(t_dead - t_kill) * 1e3:.0f} ms before the kill was seen "
        f"(taken by the dying process's listen backlog, then reset); the new process served {t_served - t_listen:.2f} s "
        f"after it listened ({t_served - t_start:.2f} s after its exec, {t_listen - t_start:.2f} s of "
        "interpreter start and imports)"
    )
    # Only the requests in flight on the killed process failed, each with a cut connection.
    # (A worker whose request was cut may send another that the dying process's listen backlog still
    # takes: in flight on it as well.)
    assert all(o.started < t_dead and o.ended > t_kill for o in failed), failed
    # Every request sent to the new process was served, with the same greedy text.
    assert all(o.ok for o in out if o.started >= t_start)
    assert t_served - t_listen <= SERVES_WITHIN_S, (t_served - t_listen, t_listen - t_start)


async def _ready(http: aiohttp.ClientSession, port: int) -> bool:
    try:
        async with http.get(f"http://127.0.0.1:{port}/ready") as resp:
            return resp.status == 200
    except aiohttp.ClientError:
        return False


async def test_two_replicas_sharing_a_port_lose_only_the_killed_ones_in_flight(make_stack, tmp_path):
    """Two router processes share one port (--reuse-port), each also on a port of its own (probes):
    the local runtime's stand-in for a Service over router pods. One is SIGKILLed under load: new
    connections go to the other at once (no refused connection, no gap), and every request sent after
    the kill is served."""
    s = await make_stack(node_slots=(8,), n_native=1)
    s.node.token_interval_s = s.native.token_interval_s = 0.02
    s.native.tokens = 6
    cfg_path = tmp_path / "config.yaml"
    cfg_path.write_text(config.dump(s.cfg))
    port, own = _free_port(), [_free_port(), _free_port()]
    url = f"http://127.0.0.1:{port}"
    out: list[Outcome] = []
    refused: list[float] = []
    stop = asyncio.Event()
    procs = [await _router(cfg_path, port, "--reuse-port", "--replica-port", str(p)) for p in own]
    workers: list[asyncio.Task[None]] = []
    try:
        async with aiohttp.ClientSession() as http:
            async with asyncio.timeout(60):
                for p in own:  # each replica ready, asked on its own port
                    while not await _ready(http, p):
                        await asyncio.sleep(0.05)
            workers = [
                asyncio.create_task(_worker(url, route, out, stop, refused))
                for route in ("tilert", "native") * 2
            ]
            await until(lambda: sum(o.ok for o in out) >= 20, timeout=60)
            await until(lambda: s.node.active + s.native.active >= 2, timeout=30)
            t_kill = time.monotonic()
            procs[0].send_signal(signal.SIGKILL)
            await procs[0].wait()
            t_dead = time.monotonic()
            await until(lambda: sum(o.ok and o.started >= t_dead for o in out) >= 30, timeout=60)
            assert await _ready(http, own[1]) and not await _ready(http, own[0])
    finally:
        stop.set()
        await asyncio.gather(*workers)
        for proc in procs:
            if proc.returncode is None:
                proc.send_signal(signal.SIGKILL)
                with contextlib.suppress(ProcessLookupError):
                    await proc.wait()
    failed = [o for o in out if not o.ok]
    print(
        f"\ntwo router replicas, one SIGKILLed: {len(out)} requests, {len(failed)} failed, {len(refused)} refused"
    )
    assert all(o.started < t_dead and o.ended > t_kill for o in failed), failed
    assert all(o.ok for o in out if o.started >= t_dead)
    assert not [t for t in refused if t >= t_dead], "a connection was refused after the kill"
