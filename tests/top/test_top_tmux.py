"""`tilert-pd top` driven in a terminal: the real `tilert-pd` command in a tmux pane, watching the real
router (its CLI, in its own process, as a pod runs it) in front of the scripted upstreams of
tests/router/router_fakes.py. The TileRT node is the fake node serving the node's real metrics class
(`NodeMetrics`) from its own state: a real node needs a prefill that hands it a real state
(tests/decode/test_attacks_stack.py), which costs torch, Mooncake and a tiny model for no figure top
reads differently. A second node URL nobody listens on shows as down.

The test reads the screen as a user would (`tmux capture-pane`), waits for each figure it expects
(polling the pane, no fixed sleeps), and ends top with Ctrl-C, which must exit 0."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import signal
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path

import aiohttp
from aiohttp import web

from tests.router.router_fakes import (
    MODEL,
    FakeNative,
    FakeNode,
    FakePrefill,
    stack_config,
    start_router,
    until,
)
from tilert_serve.decode.metrics import NodeMetrics
from tilert_serve.router import config

#: Bytes each fake handoff reports, as a node counts a complete handoff's state.
HANDOFF_BYTES = 1_000_000
#: Far above what any wait takes on an idle machine: only a hang fails on it.
WAIT_S = 90.0


class MeteredNode(FakeNode):
    """The fake node, with the real node's metrics registry on /metrics, kept as the node keeps it."""

    def __init__(self, name: str, slots: int) -> None:
        super().__init__(name, slots=slots)
        self.metrics = NodeMetrics(slots)

    def handoff(self, ticket: str, num_tokens: int = 0) -> bool:
        ok = super().handoff(ticket, num_tokens)
        if ok:
            self.metrics.handoffs.labels("complete").inc()
            self.metrics.handoff_bytes.inc(HANDOFF_BYTES)
            self.metrics.handoff_seconds.observe(0.002)
        return ok

    async def health(self, request: web.Request) -> web.Response:
        if request.path != "/metrics":
            return await super().health(request)
        self.metrics.slots_busy.set(self.active)
        return web.Response(body=self.metrics.render(), content_type="text/plain")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Pane:
    """One tmux session on a private server socket (the user's own tmux is never touched)."""

    def __init__(self, tmux: str, socket_path: Path) -> None:
        self.tmux = tmux
        self.socket = socket_path
        self.last = ""

    async def _run(self, *args: str) -> str:
        proc = await asyncio.create_subprocess_exec(
            self.tmux,
            "-S",
            str(self.socket),
            *args,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        out, err = await proc.communicate()
        assert proc.returncode == 0, f"tmux {' '.join(args)}: {err.decode()}"
        return out.decode()

    async def start(self, command: str, cwd: Path) -> None:
        await self._run("new-session", "-d", "-s", "top", "-x", "160", "-y", "50", "-c", str(cwd), command)

    async def screen(self) -> str:
        self.last = await self._run("capture-pane", "-p", "-t", "top")
        return self.last

    async def wait_for(self, what: str, check: Callable[[str], bool]) -> str:
        deadline = time.monotonic() + WAIT_S
        while True:
            text = await self.screen()
            if check(text):
                return text
            assert time.monotonic() < deadline, f"the screen never showed {what}; it shows:\n{text}"
            await asyncio.sleep(0.1)

    async def keys(self, *keys: str) -> None:
        await self._run("send-keys", "-t", "top", *keys)

    async def kill(self) -> None:
        with contextlib.suppress(AssertionError):
            await self._run("kill-server")


def rows(text: str, header: str) -> dict[str, list[str]]:
    """The rows of the table whose header line starts with `header`, by their first cell."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith(header)), None)
    out: dict[str, list[str]] = {}
    if start is None:
        return out
    for line in lines[start + 1 :]:
        if not line.strip():
            break
        cells = line.split()
        out[cells[0]] = cells
    return out


def route(text: str, name: str) -> list[str]:
    return rows(text, "ROUTE").get(name, [])


def node(text: str, name: str) -> list[str]:
    return rows(text, "NODE").get(name, [])


async def _request(http: aiohttp.ClientSession, url: str, path: str) -> int:
    async with http.post(
        url + "/v1/completions",
        json={"model": MODEL, "prompt": "a", "max_tokens": 4, "temperature": 0},
        headers={"x-pd-route": path},
    ) as resp:
        await resp.read()
        return resp.status


async def test_top_in_a_terminal_shows_the_stack_live_and_exits_0_on_ctrl_c(tmp_path: Path):
    tmux = shutil.which("tmux")
    assert tmux, "tmux not found: run make setup (it installs tmux), or apt-get install tmux"
    nodes = [await MeteredNode("t0", slots=4).start()]
    prefill = await FakePrefill(nodes).start()
    native = await FakeNative().start()
    cfg = config.RouterConfig.model_validate(
        stack_config([prefill.url], [native.url], [("t0", nodes[0].url, 4)])
    )
    (tmp_path / "router.yaml").write_text(config.dump(cfg))
    port, dead = _free_port(), _free_port()
    url = f"http://127.0.0.1:{port}"
    router = await start_router(tmp_path / "router.yaml", port)
    pane = Pane(tmux, tmp_path / "tmux.sock")
    status = tmp_path / "top.status"
    tilert_pd = Path(sys.executable).with_name("tilert-pd")
    held: list[asyncio.Task[int]] = []
    load_stop = asyncio.Event()
    load: list[asyncio.Task[None]] = []
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:

            async def ready() -> bool:
                try:
                    async with http.get(url + "/ready") as resp:
                        return resp.status == 200
                except aiohttp.ClientError:
                    return False

            async with asyncio.timeout(WAIT_S):
                while not await ready():
                    await asyncio.sleep(0.05)

            await pane.start(
                # A COLUMNS/LINES left in this process's environment would make rich draw for that size.
                f"env -u COLUMNS -u LINES {tilert_pd} top --router {url} --node t0={nodes[0].url} --node http://127.0.0.1:{dead} "
                f"--interval 0.5; echo $? > {status}",
                tmp_path,
            )
            # Two TileRT requests that hold their slots until released.
            nodes[0].go.clear()
            held = [asyncio.create_task(_request(http, url, "tilert")) for _ in range(2)]
            await until(lambda: nodes[0].active == 2, timeout=WAIT_S)
            text = await pane.wait_for(
                "two slots busy on t0, held by the router, two tilert requests in flight, every pool healthy",
                lambda t: (
                    node(t, "t0")[1:2] == ["2/4"]
                    and "router holds slots: t0 2" in t
                    and route(t, "tilert")[1:2] == ["up"]
                    and route(t, "tilert")[4:5] == ["2"]
                    and rows(t, "POOL").get("prefill", [])[1:2] == ["1/1"]
                    and rows(t, "POOL").get("tilert", [])[1:2] == ["1/1"]
                    and rows(t, "POOL").get("native", [])[1:2] == ["1/1"]
                ),
            )
            assert node(text, "127.0.0.1:" + str(dead))[1:2] == ["DOWN:"], text
            assert "Connection refused" in text

            nodes[0].go.set()
            assert await asyncio.gather(*held) == [200, 200]
            # Load on both paths, the native one failing: rates and errors over the last interval.
            native.fail_status = 500
            results: dict[str, list[int]] = {"tilert": [], "native": []}

            async def loop(path: str) -> None:
                while not load_stop.is_set():
                    results[path].append(await _request(http, url, path))

            load = [asyncio.create_task(loop(p)) for p in ("tilert", "native")]
            text = await pane.wait_for(
                "tilert requests served with a TTFT and handoffs on t0; native requests failing",
                lambda t: (
                    float(route(t, "tilert")[2:3][0] if route(t, "tilert")[2:3] else 0) > 0
                    and route(t, "tilert")[3:4] == ["0.0"]
                    and route(t, "tilert")[5:6] != ["-"]
                    and float(route(t, "native")[3:4][0] if route(t, "native")[3:4] else 0) > 0
                    and float(node(t, "t0")[2:3][0] if node(t, "t0")[2:3] else 0) > 0
                    and "MB/s" in " ".join(node(t, "t0"))
                ),
            )
            print("\nthe screen under load:\n" + text.rstrip())
            assert set(results["tilert"]) == {200}, results["tilert"]
            assert results["native"] and 200 not in results["native"], results["native"]
            load_stop.set()
            await asyncio.gather(*load)
            # Rates are over the last interval, not since start: with the load gone they fall to 0.
            await pane.wait_for(
                "the rates back at 0 with no load",
                lambda t: (
                    route(t, "tilert")[2:4] == ["0.0", "0.0"] and route(t, "native")[2:4] == ["0.0", "0.0"]
                ),
            )
            await pane.keys("C-c")
            async with asyncio.timeout(WAIT_S):
                while not status.exists() or not status.read_text().strip():
                    await asyncio.sleep(0.05)
            assert status.read_text().strip() == "0", pane.last
    finally:
        load_stop.set()
        for task in [*held, *load]:
            task.cancel()
        await pane.kill()
        if router.returncode is None:
            router.send_signal(signal.SIGTERM)
            await router.wait()
        for fake in [*nodes, prefill, native]:
            await fake.stop()
