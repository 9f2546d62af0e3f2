"""Scale-down without loss for vLLM pods: `tilert-pd wait-idle` (the preStop hook) returns only once
the local vLLM runs and queues nothing and, on a prefill, the connector has no handoff left to send
(pending.py's owner-only count files, which the worker keeps as handoffs are queued and end)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from aiohttp import web

from tests.pd_vllm.test_worker_blocks import _until, job, stand_in
from tilert_serve.handoff.sender import HandoffResult
from tilert_serve.local.runner import free_port
from tilert_serve.pd_vllm import pending
from tilert_serve.pd_vllm.config import ConnectorConfig
from tilert_serve.pd_vllm.wait_idle import Poll, decide, parse_gauges, wait
from tilert_serve.pd_vllm.worker import TileRTWorker

METRICS = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{engine="0",model_name="tiny"}} {r0}
vllm:num_requests_running{{engine="1",model_name="tiny"}} {r1}
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{{engine="0",model_name="tiny"}} {w}
# HELP vllm:num_requests_waiting_by_reason Waiting by reason.
# TYPE vllm:num_requests_waiting_by_reason gauge
vllm:num_requests_waiting_by_reason{{engine="0",model_name="tiny",reason="capacity"}} 7.0
"""


def test_gauges_are_summed_over_engines_and_nothing_else_counts() -> None:
    assert parse_gauges(METRICS.format(r0=2.0, r1=1.0, w=3.0)) == (3.0, 3.0)
    assert parse_gauges(METRICS.format(r0=0.0, r1=0.0, w=0.0)) == (0.0, 0.0)


@pytest.mark.parametrize(
    ("poll", "elapsed", "code"),
    [
        (Poll(0, 0, 0), 1.0, None),  # idle, but Services may still send: min-wait first
        (Poll(0, 0, 0), 5.0, 0),
        (Poll(0, 0, 0, "gone"), 5.0, 0),  # nothing listens: nothing runs there
        (Poll(1, 0, 0), 5.0, None),
        (Poll(0, 1, 0), 5.0, None),
        (Poll(0, 0, 1), 5.0, None),  # a handoff still to send holds the pod
        (Poll(0, 0, 0, "timed out"), 5.0, None),  # an unreadable /metrics is not idle
        (Poll(1, 0, 0), 30.0, 2),
    ],
)
def test_decide(poll: Poll, elapsed: float, code: int | None) -> None:
    assert decide(poll, elapsed, min_wait=5.0, timeout=30.0) == code


def test_wait_reports_progress_and_what_was_left_at_the_timeout() -> None:
    now = [0.0]
    polls = iter([Poll(2, 1, 1), Poll(2, 1, 1), Poll(0, 0, 1), Poll(0, 0, 1)])
    said: list[str] = []

    def sleep(s: float) -> None:
        now[0] += s

    code = wait(
        lambda: next(polls),
        min_wait=0,
        timeout=1.5,
        interval=0.5,
        say=said.append,
        clock=lambda: now[0],
        sleep=sleep,
    )
    assert code == 2
    assert said[0] == "wait-idle: 0.0 s: 2 running, 1 waiting, 1 handoff(s) to send"
    assert len([s for s in said if "running" in s]) == 3, said  # one line per change, not per poll
    assert "still busy after --timeout 1.5 s (0 running, 0 waiting, 1 handoff(s) to send)" in said[-1]


def test_pending_files_are_owner_only_and_dead_processes_do_not_count(tmp_path: Path) -> None:
    d = tmp_path / "pending"
    p = pending.PendingSends(d)
    assert p.path is not None
    assert oct(d.stat().st_mode & 0o777) == "0o700" and oct(p.path.stat().st_mode & 0o777) == "0o600"
    p.add(2)
    assert pending.read(d) == {os.getpid(): 2}
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    (d / f"sends-{int(dead.stdout)}").write_text("5\n")
    assert pending.read(d) == {os.getpid(): 2}
    p.add(-2)
    assert pending.read(d) == {os.getpid(): 0}
    p.close()
    assert pending.read(d) == {} and pending.read(tmp_path / "never-made") == {}


def test_a_directory_others_can_write_is_refused(tmp_path: Path) -> None:
    d = tmp_path / "shared"
    d.mkdir()
    d.chmod(0o777)
    with pytest.raises(pending.UnsafeDirectory, match="writable by others"):
        pending.read(d)
    assert pending.PendingSends(d).path is None  # the worker goes on without the count, and says so


def test_the_worker_counts_a_handoff_pending_until_it_ends(tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_text("0123456789abcdef0123456789abcdef")
    d = tmp_path / "pending"
    cfg = ConnectorConfig.from_extra_config(
        {
            "tilert_model": "mla",
            "tilert_max_seq_len": 64,
            "tilert_local_host": "127.0.0.1",
            "tilert_secret_path": str(secret),
            "tilert_pending_dir": str(d),
        }
    )
    w = TileRTWorker(cfg, rank=0, world_size=1, group_of={}, block_size_of={0: 16}, num_hidden_layers=2)
    w.register({f"model.layers.{i}.self_attn.attn": torch.randn(8, 1, 16, 576) for i in range(3)})
    sending, release = threading.Event(), threading.Event()

    def send(host, port, req, error=None, layers=None):  # type: ignore[no-untyped-def]
        sending.set()
        assert release.wait(30)
        return HandoffResult(True, nbytes=1)

    try:
        stand_in(w, send)
        a = job("a", free_port())
        w.expect([a])
        w.step([a])
        assert sending.wait(10)
        assert sum(pending.read(d).values()) == 1
        # vLLM is done with the request (its blocks are free), the handoff is not: the pod must wait.
        assert w.finished({"a"}) == {"a"}
        assert sum(pending.read(d).values()) == 1
        release.set()
        _until(lambda: sum(pending.read(d).values()) == 0)
    finally:
        release.set()
        w.shutdown()
    assert pending.read(d) == {}  # the file goes with the worker


async def test_the_command_waits_for_vllm_and_the_pending_handoffs(tmp_path: Path) -> None:
    """`tilert-pd wait-idle` as the preStop hook runs it, against a stand-in vLLM /metrics."""
    state = {"r0": 1.0, "r1": 0.0, "w": 0.0}

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(text=METRICS.format(**state), content_type="text/plain")

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    d = tmp_path / "pending"
    sends = pending.PendingSends(d)
    sends.add(1)
    proc = await asyncio.create_subprocess_exec(
        *(sys.executable, "-m", "tilert_serve.cli", "wait-idle", "--url", f"http://127.0.0.1:{port}"),
        *("--pending-dir", str(d), "--min-wait", "0", "--timeout", "120", "--interval", "0.05"),
        stderr=asyncio.subprocess.PIPE,
    )
    assert proc.stderr is not None
    try:

        async def line_with(text: str) -> str:
            while True:
                line = (await asyncio.wait_for(proc.stderr.readline(), 60)).decode()  # type: ignore[union-attr]
                assert line, "wait-idle exited early"
                if text in line:
                    return line

        await line_with("1 running, 0 waiting, 1 handoff(s) to send")
        state["r0"] = 0.0  # vLLM is done; the handoff is not
        await line_with("0 running, 0 waiting, 1 handoff(s) to send")
        assert proc.returncode is None
        sends.add(-1)
        assert "idle after" in await line_with("idle")
        assert await asyncio.wait_for(proc.wait(), 30) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
        sends.close()
        await runner.cleanup()
