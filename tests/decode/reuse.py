"""What the decode tests reuse across tests, in one module (conftest.py is imported twice: once by
pytest, once by the test files as tests.decode.conftest, and each copy would hold its own):

- Mooncake engines of stopped nodes (node_transfer): tearing one down takes ~1 s here (its destructor
  joins a periodic thread, holding the GIL), about half of a node test's time. A node that starts later
  takes one over: a new node with its own buffers, only the engine object is reused, and only once
  everything registered with it was unregistered.
- The sender zygote (sender_zygote.py): each sender run is a process of its own, forked from one that
  imported sender_proc's modules once (`python sender_proc.py` pays ~1.5 s of imports here).

release() ends both; conftest calls it after the last decode test."""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from tilert_serve import transfer

HERE = Path(__file__).parent
SENDER_ENV = {
    **os.environ,
    "UCX_TLS": "tcp",
    "UCX_NET_DEVICES": "lo",
    "UCX_MODULES": "^ib",
    "MC_LOG_LEVEL": "ERROR",
}


class _PooledMover:
    """A node's transfer engine from `node_transfer`: every call goes to the engine, and close() hands
    the engine back to the pool once everything registered with it was unregistered (a node's stop
    unregisters its receive buffers, then closes its transfer), else really closes it."""

    def __init__(self, engine: transfer.TransferEngine) -> None:
        self._inner: transfer.TransferEngine | None = engine
        self._registered: set[int] = set()

    def __getattr__(self, name: str) -> object:
        inner = self.__dict__.get("_inner")
        if inner is None:
            raise AttributeError(f"{name}: this transfer engine was closed")
        return getattr(inner, name)

    def register(self, addr: int, nbytes: int, device: str = "cpu") -> None:
        assert self._inner is not None, "register after close"
        self._inner.register(addr, nbytes, device)
        self._registered.add(addr)

    def unregister(self, addr: int) -> None:
        assert self._inner is not None, "unregister after close"
        self._inner.unregister(addr)
        self._registered.discard(addr)

    def close(self) -> None:
        inner, self._inner = self._inner, None
        if inner is None:
            return
        if self._registered:
            inner.close()
        else:
            _IDLE_MOONCAKE.append(inner)


#: Mooncake engines of stopped nodes, nothing registered: tearing one down takes ~1 s here (its
#: destructor joins a periodic thread, holding the GIL), most of a decode test's time; a node that
#: starts later takes one over (a new node, its own buffers; only the engine object is reused).
_IDLE_MOONCAKE: list[transfer.TransferEngine] = []


def node_transfer(name: str = "mooncake") -> transfer.TransferEngine:
    """The transfer engine for a test's decode node: a fresh NIXL agent, or a pooled Mooncake engine
    (_PooledMover). Senders always get fresh engines."""
    if name != "mooncake":
        return transfer.create(name, host="127.0.0.1", protocol="tcp", role="node")
    engine = (
        _IDLE_MOONCAKE.pop()
        if _IDLE_MOONCAKE
        else transfer.create(name, host="127.0.0.1", protocol="tcp", role="node")
    )
    return _PooledMover(engine)  # type: ignore[return-value]


class _SenderZygote:
    """sender_zygote.py, started once per session: each `run` is a sender process of its own (a fork of
    a process that imported sender_proc's modules already; `python sender_proc.py` pays ~1.5 s of
    imports here, most of a handoff test's time)."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(HERE / "sender_zygote.py")],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=SENDER_ENV,
            text=True,
            bufsize=1,
        )
        self.dir = Path(tempfile.mkdtemp(prefix="sender-zygote-"))
        self.ids = itertools.count()
        self.lock = threading.Lock()
        self.pids: dict[str, concurrent.futures.Future[int]] = {}
        self.exits: dict[str, concurrent.futures.Future[int]] = {}
        threading.Thread(target=self._read, daemon=True, name="sender-zygote").start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            kind, rid, value = line.split()
            with self.lock:
                (self.pids if kind == "PID" else self.exits)[rid].set_result(int(value))
        with self.lock:  # the zygote ended: nothing more will come
            for fut in [*self.pids.values(), *self.exits.values()]:
                if not fut.done():
                    fut.set_exception(RuntimeError(f"the sender zygote exited ({self.proc.poll()})"))

    async def run(self, args: list[str], timeout: float) -> tuple[int, str]:
        """(exit code, stdout) of one sender run; on `timeout` the sender is killed."""
        rid = str(next(self.ids))
        out = self.dir / f"{rid}.out"
        with self.lock:
            self.pids[rid], self.exits[rid] = concurrent.futures.Future(), concurrent.futures.Future()
            assert self.proc.stdin is not None
            self.proc.stdin.write(json.dumps({"id": rid, "args": args, "out": str(out)}) + "\n")
            self.proc.stdin.flush()
        pid = await asyncio.wait_for(asyncio.wrap_future(self.pids[rid]), 30)
        try:
            rc = await asyncio.wait_for(asyncio.wrap_future(self.exits[rid]), timeout)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            raise
        text = out.read_text(errors="replace")
        out.unlink()
        return rc, text

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()  # EOF: the zygote returns
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


_ZYGOTE: list[_SenderZygote] = []


def zygote() -> _SenderZygote:
    if not _ZYGOTE or _ZYGOTE[0].proc.poll() is not None:
        _ZYGOTE[:] = [_SenderZygote()]
    return _ZYGOTE[0]


def release() -> None:
    """The zygote ends; the pooled engines are torn down."""
    if _ZYGOTE:
        _ZYGOTE.pop().close()
    while _IDLE_MOONCAKE:
        _IDLE_MOONCAKE.pop().close()


atexit.register(release)  # a session that ends before the last decode test
