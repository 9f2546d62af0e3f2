"""`tilert-pd local down` signals only processes it started: a recorded PID is checked against the
process's start time before its group is signalled (the PID may have been reused since `up`)."""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tilert_serve.local import runner
from tilert_serve.local.plan import Component

pytestmark = pytest.mark.skipif(
    not Path("/proc/self/stat").exists(), reason="process identity is read from /proc"
)


def _component(code: str) -> Component:
    return Component("c", "router", [sys.executable, "-c", code], {}, "http://x", "http://x/ready")


def _wait(cond, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def _gone(pid: int) -> bool:
    """Exited: no process, or a zombie its new parent (init) has not reaped yet."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat[stat.rindex(")") + 2] == "Z"


@pytest.fixture
def started(tmp_path: Path) -> Iterator[list[runner.Running]]:
    """Processes a test starts; whatever is left of their groups is killed afterwards."""
    procs: list[runner.Running] = []
    yield procs
    for p in procs:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        runner.alive(p.pid)  # reaps the zombie


def test_down_stops_what_it_started(tmp_path: Path, started: list[runner.Running]) -> None:
    p = runner.start(_component("import time; time.sleep(60)"), tmp_path)
    started.append(p)
    assert p.started is not None and runner.ours(p) and runner.running(p)
    assert runner.stop([p], grace_s=5) == []
    assert not runner.alive(p.pid)


def test_a_reused_pid_is_left_alone(tmp_path: Path, started: list[runner.Running]) -> None:
    p = runner.start(_component("import time; time.sleep(60)"), tmp_path)
    started.append(p)
    # As recorded by an earlier `up` whose process ended: same PID, another start time.
    stale = dataclasses.replace(p, started=p.started - 1)
    assert not runner.ours(stale) and not runner.running(stale)
    assert runner.stop([stale], grace_s=0.2) == [stale]
    time.sleep(0.2)
    assert runner.alive(p.pid), "a process that is not ours was signalled"
    # A state file from before start times were recorded cannot prove the PID is ours either.
    assert not runner.ours(dataclasses.replace(p, started=None))


def test_a_group_that_outlives_its_leader_is_still_stopped(
    tmp_path: Path, started: list[runner.Running]
) -> None:
    # The leader starts a child in its process group and exits, as a crashed vLLM leaves its workers.
    child_pid_file = tmp_path / "child"
    code = (
        "import subprocess, sys, pathlib; "
        "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
        f"pathlib.Path({str(child_pid_file)!r}).write_text(str(c.pid))"
    )
    p = runner.start(_component(code), tmp_path)
    started.append(p)
    _wait(lambda: child_pid_file.exists() and child_pid_file.read_text() != "" and not runner.alive(p.pid))
    child = int(child_pid_file.read_text())
    assert runner.start_time(p.pid) is None and runner.ours(p)
    assert runner.stop([p], grace_s=5) == []
    _wait(lambda: _gone(child))


def test_free_ports_avoid_the_ephemeral_range() -> None:
    """A port handed to a server about to start is not one an outgoing connection may take meanwhile."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = {runner.free_port() for _ in range(20)}
    if low > 21000:  # the kernel leaves room below its ephemeral range
        assert all(p < low for p in ports), (low, sorted(ports))
    for p in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))  # still free


def test_a_booting_pod_runs_idle_with_its_children_until_promoted(
    tmp_path: Path, started: list[runner.Running]
) -> None:
    # The leader starts a worker (as vLLM starts its engine core) and a thread of its own, then waits.
    child_pid_file = tmp_path / "child"
    code = (
        "import subprocess, sys, pathlib, threading, time; "
        "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
        "threading.Thread(target=time.sleep, args=(60,), daemon=True).start(); "
        f"pathlib.Path({str(child_pid_file)!r}).write_text(str(c.pid)); time.sleep(60)"
    )
    p = runner.start(_component(code), tmp_path, boot_idle=True)
    started.append(p)
    _wait(lambda: child_pid_file.exists() and child_pid_file.read_text() != "")
    child = int(child_pid_file.read_text())
    tids = runner.session_threads(p)
    assert {p.pid, child} <= set(tids) and len(tids) >= 3
    if not runner.can_promote():  # not root and RLIMIT_NICE too low: it must not start idle for good
        assert {os.sched_getscheduler(t) for t in tids} == {os.SCHED_OTHER}
        return
    # The leader's two threads and the worker's: all inherited the idle policy.
    assert {os.sched_getscheduler(t) for t in tids} == {os.SCHED_IDLE}
    assert runner.promote(p) == len(tids)
    assert {os.sched_getscheduler(t) for t in runner.session_threads(p)} == {os.SCHED_OTHER}
    assert runner.promote(p) == 0  # nothing idle is left


def test_a_pod_started_for_up_runs_at_the_normal_policy(
    tmp_path: Path, started: list[runner.Running]
) -> None:
    p = runner.start(_component("import time; time.sleep(60)"), tmp_path)
    started.append(p)
    assert os.sched_getscheduler(p.pid) == os.SCHED_OTHER
    assert runner.promote(p) == 0
