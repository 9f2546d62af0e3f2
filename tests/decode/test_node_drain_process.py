"""The node's drain as a pod sees it: a real process (drain_node_proc.py, served by cli.serve as
`tilert-pd decode-node` is) gets SIGTERM while it streams. The stream running then completes, a ticket
admitted before the SIGTERM still gets its handoff and its stream, an admission after it is refused
with 503 not_ready and Retry-After (which the router retries on another node), and the process exits
0 once idle; with a drain period shorter than the stream, the stream ends with a clean SSE error event
of type shutting_down and the process still exits."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from tests.decode import reuse

HERE = Path(__file__).parent
CASE = "mla-f32"


@dataclass
class NodeProc:
    proc: asyncio.subprocess.Process
    url: str
    ctrl_port: int
    secret_file: Path
    http: aiohttp.ClientSession

    async def admit(self, request_id: str) -> tuple[int, dict, dict[str, str]]:
        async with self.http.post(f"{self.url}/v1/admit", json={"request_id": request_id}) as r:
            return r.status, await r.json(), dict(r.headers)

    async def send(self, ticket: str, request_id: str) -> dict:
        args = [
            CASE,
            "20",
            "1",
            "mooncake",
            "127.0.0.1",
            str(self.ctrl_port),
            str(self.secret_file),
            request_id,
        ]
        rc, out = await reuse.zygote().run([*args, ticket], 60)
        line = next((ln for ln in out.splitlines() if ln.startswith("RESULT ")), None)
        assert line is not None, f"sender printed no result (rc {rc}): {out[-2000:]}"
        return json.loads(line[7:])  # type: ignore[no-any-return]

    async def outcome(self, timeout: float) -> str:
        assert self.proc.stdout is not None
        out = (await asyncio.wait_for(self.proc.stdout.read(), timeout)).decode()
        assert await asyncio.wait_for(self.proc.wait(), timeout) == 0
        return next(ln.split()[1] for ln in out.splitlines() if ln.startswith("OUTCOME "))


@contextlib.asynccontextmanager
async def node_proc(
    tmp_path: Path, secret_file: Path, drain_s: float, step_delay_s: float
) -> AsyncIterator[NodeProc]:
    log = (tmp_path / "node.log").open("wb")
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        str(HERE / "drain_node_proc.py"),
        str(drain_s),
        str(step_delay_s),
        str(secret_file),
        stdout=asyncio.subprocess.PIPE,
        stderr=log,
    )
    try:
        assert proc.stdout is not None
        line = (await asyncio.wait_for(proc.stdout.readline(), 120)).decode()
        assert line.startswith("PORTS "), line + (tmp_path / "node.log").read_text()[-3000:]
        http_port, ctrl_port = map(int, line.split()[1:])
        async with aiohttp.ClientSession() as http:
            yield NodeProc(proc, f"http://127.0.0.1:{http_port}", ctrl_port, secret_file, http)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        log.close()


async def _stream(
    n: NodeProc, ticket: str, max_tokens: int, started: asyncio.Event
) -> list[tuple[str, dict]]:
    """(event type, data) of every SSE event of the ticket's stream; `started` is set at the first."""
    body = {"ticket": ticket, "first_token": 100, "max_tokens": max_tokens}
    events: list[tuple[str, dict]] = []
    async with n.http.post(f"{n.url}/v1/generate", json=body) as r:
        assert r.status == 200, await r.text()
        kind = "message"
        async for raw in r.content:
            line = raw.decode().strip()
            if line.startswith("event: "):
                kind = line[7:]
            elif line.startswith("data: "):
                events.append((kind, json.loads(line[6:])))
                kind = "message"
                started.set()
    return events


async def _until_draining(n: NodeProc) -> None:
    """The process handled its SIGTERM: /ready says draining."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        async with n.http.get(f"{n.url}/ready") as r:
            if r.status == 503 and (await r.json()).get("reason") == "draining":
                return
        await asyncio.sleep(0.02)
    raise AssertionError("the node never started draining after SIGTERM")


async def test_sigterm_while_streaming_finishes_the_stream_and_the_ticket_admitted_before(
    tmp_path: Path, secret_file: Path
) -> None:
    async with node_proc(tmp_path, secret_file, drain_s=30, step_delay_s=0.05) as n:
        status, a, _ = await n.admit("streaming")
        assert status == 200
        assert (await n.send(a["ticket"], "streaming"))["ok"]
        status, b, _ = await n.admit("admitted-before")
        assert status == 200
        started = asyncio.Event()
        stream = asyncio.create_task(_stream(n, a["ticket"], 60, started))
        await asyncio.wait_for(started.wait(), 30)

        n.proc.send_signal(signal.SIGTERM)
        await _until_draining(n)
        assert not stream.done(), "the stream was cut by the SIGTERM"
        # A request sent now goes elsewhere: refused with a reason the router retries on another node.
        status, body, headers = await n.admit("after-sigterm")
        assert (status, body["error"]["type"]) == (503, "not_ready"), body
        assert "draining" in body["error"]["message"] and headers.get("Retry-After") == "1"
        # The ticket admitted before the SIGTERM still gets its handoff and its whole stream.
        assert (await n.send(b["ticket"], "admitted-before"))["ok"]
        b_events = await asyncio.wait_for(_stream(n, b["ticket"], 6, asyncio.Event()), 30)
        assert b_events[-1][1].get("finish_reason") == "length", b_events

        events = await asyncio.wait_for(stream, 60)
        assert [k for k, _ in events] == ["message"] * len(events), events
        done = events[-1][1]
        assert done["done"] and done["finish_reason"] == "length" and done["num_tokens"] == 60, done
        assert sum(len(e.get("token_ids", [])) for _, e in events) == 60
        assert await n.outcome(60) == "drained"


async def test_a_stream_longer_than_the_drain_period_ends_with_a_shutting_down_event(
    tmp_path: Path, secret_file: Path
) -> None:
    async with node_proc(tmp_path, secret_file, drain_s=1.0, step_delay_s=0.1) as n:
        status, a, _ = await n.admit("long")
        assert status == 200 and (await n.send(a["ticket"], "long"))["ok"]
        started = asyncio.Event()
        stream = asyncio.create_task(_stream(n, a["ticket"], 400, started))  # ~20 s of steps
        await asyncio.wait_for(started.wait(), 30)
        t0 = time.monotonic()
        n.proc.send_signal(signal.SIGTERM)
        events = await asyncio.wait_for(stream, 30)
        kind, last = events[-1]
        assert kind == "error" and last["error"]["type"] == "shutting_down", events[-3:]
        assert "drain period (1 s)" in last["error"]["message"]
        assert not any(e.get("done") for _, e in events), "a cut stream must not look finished"
        assert 0 < sum(len(e.get("token_ids", [])) for _, e in events) < 400
        assert await n.outcome(30) == "timeout"
        assert time.monotonic() - t0 < 15, "the node outlived its drain period by far"
