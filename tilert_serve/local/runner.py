"""Starting, watching and stopping a local stack's processes (the I/O edge of `tilert-pd local`).

Each component runs in its own process session, detached from the terminal, with its log in the
state directory; state.json records what runs where, so `status` and `down` work from any shell.
A recorded PID may belong to another process by the time `down` runs (the stack died, the machine
rebooted): a process is ours only if its start time is the one recorded (Linux's /proc), and only
ours are signalled.
"""

from __future__ import annotations

import json
import os
import random
import resource
import secrets
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from tilert_operator import constants
from tilert_serve.local.plan import Component

STATE_FILE = "state.json"


@dataclass
class Running:
    name: str
    kind: str
    pid: int
    url: str
    ready_url: str
    log: str
    #: The process's start time (/proc/PID/stat, clock ticks after boot): with the PID it names one
    #: process. None when it could not be read, and in state files written before it was recorded.
    started: int | None = None
    #: What `apply` needs to play the controllers (rollout.py): the pod's workload (the rendered
    #: Deployment or StatefulSet), the revision of its pod template, its ordinal (a StatefulSet's, or
    #: a Deployment's creation sequence), a TileRT node's control port, and how the kubelet stops it
    #: (terminationGracePeriodSeconds, the preStop exec). Empty in state files from before `apply`.
    workload: str = ""
    revision: str = ""
    ordinal: int = 0
    ctrl_port: int | None = None
    grace_s: float = 30.0
    pre_stop: list[str] | None = None
    #: The pod's compatibility generation (tilert_operator.render.generations): the slot its workload
    #: is rendered in (a or b; "" for the router, and in state files from before generations, which
    #: mean slot a), its fingerprint, and what the router's endpoint list gives it as `compat`.
    slot: str = ""
    generation: str = ""
    compat: str | None = None


#: File names of a local stack's credentials in its state directory.
HANDOFF_SECRET_FILE = "handoff-secret"
NODE_API_TOKEN_FILE = "node-api-token"


def write_secret_file(path: Path, content: str) -> Path:
    """Write a credential readable by its owner only, from the moment it exists.

    The file is created under a temporary name with mode 0600 (O_CREAT | O_EXCL: never an existing
    file, never through a symlink; the umask can only take bits away), written, then renamed over
    `path`, so no reader ever sees it with wider permissions or half written.
    """
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(content)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def write_secrets(state_dir: Path) -> tuple[Path, Path]:
    """A local stack's handoff secret and node API token, fresh random values in 0600 files:
    (handoff secret file, node API token file)."""
    return (
        write_secret_file(state_dir / HANDOFF_SECRET_FILE, secrets.token_hex(32)),
        write_secret_file(state_dir / NODE_API_TOKEN_FILE, secrets.token_hex(32)),
    )


#: Where `free_port` picks from: below the kernel's ephemeral range, which every outgoing connection
#: (and every bind to port 0) draws from, so a port handed to a server about to start is not taken by
#: some client's connection meanwhile. Ports here can still be taken by another server; a component
#: that cannot bind fails its start, with its log.
_LISTEN_PORTS = range(20000, 32768)


def _ephemeral_start() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now, outside the ephemeral range when the kernel's range allows."""
    candidates = range(_LISTEN_PORTS.start, min(_LISTEN_PORTS.stop, _ephemeral_start()))
    rng = random.SystemRandom()
    for _ in range(64 if len(candidates) > 1000 else 0):
        port = rng.choice(candidates)
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def port_in_use(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket() as s:
        return s.connect_ex((host, port)) == 0


def with_side_channel(c: Component) -> Component:
    """Each vLLM on this host needs its own NIXL side-channel port (the default 5600 would clash)."""
    if c.kind in (constants.PREFILL, constants.NATIVE):
        return replace(c, env={**c.env, "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())})
    return c


def start(component: Component, state_dir: Path, *, boot_idle: bool = False) -> Running:
    """Start `component` in a session of its own. `boot_idle`: at idle CPU priority until `promote`
    (a pod added by a change: on a cluster it boots on CPUs of its own; here its minute of vLLM
    start-up would otherwise take the two cores from the pods serving meanwhile)."""
    log = state_dir / f"{component.name}.log"
    env = {**os.environ, **component.env}
    if "PYTHONPATH" in component.env and os.environ.get("PYTHONPATH"):
        env["PYTHONPATH"] = os.pathsep.join((component.env["PYTHONPATH"], os.environ["PYTHONPATH"]))
    with log.open("wb") as fh:
        proc = subprocess.Popen(
            component.argv,
            stdout=fh,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            env=env,
        )
    if boot_idle and can_promote():
        # Popen returns once the exec succeeded: the interpreter has no other thread yet, and every
        # thread and process it makes inherits the policy.
        _set_policy(proc.pid, os.SCHED_IDLE)
    return Running(
        component.name,
        component.kind,
        proc.pid,
        component.url,
        component.ready_url,
        str(log),
        started=start_time(proc.pid),
        ctrl_port=component.ctrl_port,
    )


def can_promote() -> bool:
    """Whether this process may give an idle thread the normal policy back: with CAP_SYS_NICE (root
    here), or where RLIMIT_NICE allows nice 0 (sched(7)); elsewhere pods boot at the normal policy,
    as a pod left idle for good would serve at the mercy of every other process."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NICE)
    return (
        os.geteuid() == 0 or soft == resource.RLIM_INFINITY or soft >= 20 - os.getpriority(os.PRIO_PROCESS, 0)
    )


def _set_policy(tid: int, policy: int) -> bool:
    try:
        os.sched_setscheduler(tid, policy, os.sched_param(0))
    except (ProcessLookupError, PermissionError):  # gone, or not ours to change
        return False
    return True


def _stat(pid: int) -> list[str] | None:
    """/proc/PID/stat's fields from the third (state) on, or None if there is no such process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # Field 2 (the command name) is in parentheses and may hold spaces: count fields after its end.
    return stat[stat.rindex(")") + 2 :].split()


def _session(pid: int) -> int | None:
    fields = _stat(pid)
    return int(fields[3]) if fields else None


def session_threads(p: Running) -> list[int]:
    """The threads of every process in the session p leads (vLLM's engine core and workers too)."""
    if not ours(p):
        return []
    tids: list[int] = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit() and _session(int(proc.name)) == p.pid:
            try:
                tids += [int(t.name) for t in (proc / "task").iterdir()]
            except OSError:  # exited meanwhile
                continue
    return tids


def promote(p: Running) -> int:
    """Give every thread of p's session the normal CPU policy again (its pod is ready: it serves
    now); the number of threads changed. Repeats while it finds idle ones, as a thread started
    during a pass may have copied the idle policy from its creator."""
    changed = 0
    for _ in range(3):
        idle = [t for t in session_threads(p) if _policy(t) == os.SCHED_IDLE]
        if not idle:
            break
        changed += sum(_set_policy(t, os.SCHED_OTHER) for t in idle)
    return changed


def _policy(tid: int) -> int | None:
    try:
        return os.sched_getscheduler(tid)
    except (ProcessLookupError, PermissionError):
        return None


def start_time(pid: int) -> int | None:
    """When the process started (clock ticks after boot), or None if there is no such process."""
    fields = _stat(pid)
    return int(fields[19]) if fields else None


def ours(p: Running) -> bool:
    """Whether p's PID still names the process we started, or the process group it led."""
    if p.started is None:
        return False
    now = start_time(p.pid)
    if now is not None:
        return now == p.started
    # The leader is gone. Its group may live on (vLLM's workers): Linux does not hand a PID to a new
    # process while a process group still holds it, so a live group with this id is ours.
    return _group_alive(p.pid)


def running(p: Running) -> bool:
    return ours(p) and alive(p.pid)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie child of this process counts as gone.
    try:
        done, _ = os.waitpid(pid, os.WNOHANG)
        return done == 0
    except ChildProcessError:
        return True


def probe(url: str, timeout: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            status: int = r.status
            return status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def tail(path: str, lines: int = 40) -> str:
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


class StartFailed(RuntimeError):
    def __init__(self, running: Running, why: str) -> None:
        super().__init__(f"{running.name} {why}; its log ({running.log}) ends with:\n{tail(running.log)}")
        self.running = running


def wait_ready(procs: list[Running], timeout: float, report: Callable[[str], None]) -> None:
    """Wait for every process to answer its readiness URL, reporting progress; StartFailed otherwise."""
    t0 = time.monotonic()
    pending = {p.name: p for p in procs}
    last_report = 0.0
    while pending:
        for name, p in list(pending.items()):
            if not alive(p.pid):
                raise StartFailed(p, "exited during start")
            if probe(p.ready_url):
                report(f"  ready  {name:<10} {p.url}  ({time.monotonic() - t0:.0f} s)")
                del pending[name]
        elapsed = time.monotonic() - t0
        if pending and elapsed > timeout:
            raise StartFailed(next(iter(pending.values())), f"was not ready after {timeout:.0f} s")
        if pending and elapsed - last_report >= 10:
            report(
                f"  waiting for {', '.join(sorted(pending))} ({elapsed:.0f} s; vLLM takes ~30-60 s on a CPU)"
            )
            last_report = elapsed
        time.sleep(0.5)


def stop(procs: list[Running], grace_s: float = 15.0) -> list[Running]:
    """SIGTERM every process group that is still ours, wait, then SIGKILL what is left; returns the
    processes left alone because their PID now names another process."""
    mine = [p for p in procs if ours(p)]
    for p in mine:
        _signal_group(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(alive(p.pid) or _group_alive(p.pid) for p in mine):
        time.sleep(0.2)
    for p in mine:
        if ours(p):  # checked again: during the grace period the PID may have gone to someone else
            _signal_group(p.pid, signal.SIGKILL)
    return [p for p in procs if p not in mine and start_time(p.pid) is not None]


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def save(state_dir: Path, meta: dict[str, object], procs: list[Running]) -> None:
    data = {**meta, "components": [asdict(p) for p in procs]}
    tmp = state_dir / (STATE_FILE + ".tmp")
    tmp.write_text(json.dumps(data, indent=2))
    tmp.replace(state_dir / STATE_FILE)


def save_raw(state_dir: Path, data: dict[str, object]) -> None:
    """Write a state file as is (the docker runtime's, which records pods rather than processes)."""
    tmp = state_dir / (STATE_FILE + ".tmp")
    tmp.write_text(json.dumps(data, indent=2))
    tmp.replace(state_dir / STATE_FILE)


def load(state_dir: Path) -> tuple[dict[str, object], list[Running]]:
    path = state_dir / STATE_FILE
    if not path.exists():
        raise FileNotFoundError(
            f"no local stack recorded in {state_dir}; start one with `tilert-pd local up -f FILE`"
        )
    data = json.loads(path.read_text())
    procs = [Running(**c) for c in data.pop("components")]
    return data, procs
