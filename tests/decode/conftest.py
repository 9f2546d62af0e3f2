"""A decode node in the test's event loop, with a recording engine double: the double keeps every
InjectedState it is handed (so tests can check conversion exactly) and emits predictable tokens."""

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
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest
import torch
from aiohttp import web

from tilert_serve import layouts, transfer
from tilert_serve.decode.engines.base import DecodeStep, InjectedState, Sampling
from tilert_serve.decode.http import make_app
from tilert_serve.decode.node import DecodeNode, NodeConfig

HERE = Path(__file__).parent
SENDER_ENV = {**os.environ, "UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo", "UCX_MODULES": "^ib",
              "MC_LOG_LEVEL": "ERROR"}
SECRET = b"0123456789abcdef0123456789abcdef"


class RecordingEngine:
    """Two tokens a step (one accepted MTP draft): first+1, first+2, ..."""

    name = "recording"

    def __init__(self, layout: layouts.Layout, max_seq_len: int, max_sequences: int) -> None:
        self.num_layers, self.num_mtp_layers = layout.num_layers, layout.num_mtp_layers
        self.max_seq_len, self.max_sequences = max_seq_len, max_sequences
        self.dtype = torch.float32
        self.started: list[InjectedState] = []
        self.step_delay_s = 0.0

    def load(self) -> None:
        pass

    def start(self, state: InjectedState) -> _Seq:
        self.started.append(state.__class__(
            layers=[type(layer)(kv=layer.kv.clone(), pe=layer.pe.clone(),
                                ki=None if layer.ki is None else layer.ki.clone()) for layer in state.layers],
            seq_len=state.seq_len, last_prompt_token=state.last_prompt_token))
        return _Seq(self)


@dataclass
class _Seq:
    engine: RecordingEngine
    closed: bool = False

    def decode(self, first_token: int, sampling: Sampling, max_new_tokens: int) -> Iterator[DecodeStep]:
        tok, produced = first_token, 0
        while produced < max_new_tokens:
            time.sleep(self.engine.step_delay_s)
            yield DecodeStep([tok + 1, tok + 2], drafted=1, accepted=1)
            tok, produced = tok + 2, produced + 2

    def close(self) -> None:
        self.closed = True


@dataclass
class RunningNode:
    node: DecodeNode
    engine: RecordingEngine
    url: str
    secret_file: Path
    session: aiohttp.ClientSession

    @property
    def ctrl_port(self) -> int:
        return self.node.ctrl_port

    async def admit(self, request_id: str = "r", **extra: object) -> tuple[int, dict]:
        async with self.session.post(f"{self.url}/v1/admit", json={"request_id": request_id, **extra}) as r:
            return r.status, await r.json()

    async def generate(self, ticket: str, first_token: int = 100, max_tokens: int = 6,
                       **extra: object) -> tuple[int, list[dict]]:
        body = {"ticket": ticket, "first_token": first_token, "max_tokens": max_tokens, **extra}
        async with self.session.post(f"{self.url}/v1/generate", json=body) as r:
            if r.status != 200:
                return r.status, [await r.json()]
            events = []
            async for line in r.content:
                if line.startswith(b"data: "):
                    import json
                    events.append(json.loads(line[6:]))
            return 200, events

    async def send(self, case: str, num_tokens: int, seed: int, engine: str, ticket: str | None,
                   *flags: str, request_id: str = "req-1", secret_file: Path | None = None) -> str:
        """Run a sender process; returns its RESULT/ACCEPTED line."""
        args = [case, str(num_tokens), str(seed), engine, "127.0.0.1", str(self.ctrl_port),
                str(secret_file or self.secret_file), request_id]
        if ticket:
            args.append(ticket)
        rc, out = await _zygote().run([*args, *flags], 60)
        lines = [ln for ln in out.splitlines() if ln.startswith(("RESULT ", "ACCEPTED"))]
        assert lines, f"sender printed nothing useful (rc {rc}): {out[-2000:]}"
        return lines[-1]


class _SenderZygote:
    """sender_zygote.py, started once per session: each `run` is a sender process of its own (a fork of
    a process that imported sender_proc's modules already; `python sender_proc.py` pays ~1.5 s of
    imports here, most of a handoff test's time)."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, str(HERE / "sender_zygote.py")], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, env=SENDER_ENV, text=True, bufsize=1)
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


def _in_decode(item: pytest.Item | None) -> bool:
    return item is not None and Path(str(item.path)).parent == HERE


def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """After the last decode test: the zygote ends and the pooled engines are torn down, rather than
    at the interpreter's exit beside the directories that run after this one."""
    if _in_decode(item) and not _in_decode(nextitem):
        if _ZYGOTE:
            _ZYGOTE.pop().close()
        while _IDLE_MOONCAKE:
            _IDLE_MOONCAKE.pop().close()


def _zygote() -> _SenderZygote:
    if not _ZYGOTE or _ZYGOTE[0].proc.poll() is not None:
        _ZYGOTE[:] = [_SenderZygote()]
        atexit.register(_ZYGOTE[0].close)
    return _ZYGOTE[0]


@contextlib.contextmanager
def converter_held(node: DecodeNode, index: int = 0) -> Iterator[None]:
    """Hold slot `index`'s converter thread (node.py converts as the state lands) until the block ends:
    what lands meanwhile is checked and converted only after, as if /generate had come first."""
    release, holding = threading.Event(), threading.Event()

    def hold() -> None:
        holding.set()
        release.wait(30)

    node._converters[index].submit(hold)
    assert holding.wait(10)
    try:
        yield
    finally:
        release.set()


@contextlib.contextmanager
def two_rank_staging(layout: layouts.Layout, num_tokens: int, seed: int,
                     role: str) -> Iterator[tuple[layouts.Placement, list[torch.Tensor], transfer.TransferEngine]]:
    """A TP=2 prefill's staging: two shards of `layout` holding synthetic state of `seed`, registered
    with one Mooncake engine (closed at the end)."""
    from tests.decode import synthetic

    staging = layouts.Placement(layout, max_tokens=num_tokens, shards=2)
    bufs = [torch.zeros(staging.shard_nbytes(s), dtype=torch.uint8) for s in range(2)]
    synthetic.fill(staging, bufs, num_tokens, seed)
    mover = transfer.create("mooncake", host="127.0.0.1", protocol="tcp", role=role)
    for b in bufs:
        mover.register(b.data_ptr(), b.numel())
    try:
        yield staging, bufs, mover
    finally:
        mover.close()


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
    engine = _IDLE_MOONCAKE.pop() if _IDLE_MOONCAKE else transfer.create(name, host="127.0.0.1", protocol="tcp",
                                                                         role="node")
    return _PooledMover(engine)  # type: ignore[return-value]


@pytest.fixture
def secret_file(tmp_path: Path) -> Path:
    path = tmp_path / "secret"
    path.write_bytes(SECRET)
    return path


@contextlib.asynccontextmanager
async def running_node(layout: layouts.Layout, secret_file: Path, *, transfer_name: str = "mooncake",
                       slots: int = 1, max_seq_len: int = 256, ticket_ttl_s: float = 30.0,
                       handoff_timeout_s: float = 30.0, shards: int = 1, tokenizer: object = None,
                       eos: frozenset[int] = frozenset(), quarantine_s: float = 30.0,
                       verify_digest: bool = True, secret: object = SECRET) -> AsyncIterator[RunningNode]:
    for key in ("UCX_TLS", "UCX_NET_DEVICES", "UCX_MODULES"):
        os.environ.setdefault(key, SENDER_ENV[key])
    engine = RecordingEngine(layout, max_seq_len, slots)
    config = NodeConfig(name="node-0", max_seq_len=max_seq_len, slots=slots, host="127.0.0.1", ctrl_port=0,
                        http_port=0, shards=shards, devices=("cpu",) * shards, ticket_ttl_s=ticket_ttl_s,
                        handoff_timeout_s=handoff_timeout_s, quarantine_s=quarantine_s,
                        verify_digest=verify_digest)
    mover = node_transfer(transfer_name)
    node = DecodeNode(config, layout=layout, engine=engine, transfer=mover, secret=secret, tokenizer=tokenizer,
                      eos_token_ids=eos)
    runner, url = await serve_node(make_app(node), node)
    async with aiohttp.ClientSession() as session:
        try:
            yield RunningNode(node, engine, url, secret_file, session)
        finally:
            await runner.cleanup()


async def serve_node(app: web.Application, node: DecodeNode) -> tuple[web.AppRunner, str]:
    """Serve a node's app on a free loopback port once the node is ready: (runner, base URL)."""
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    for _ in range(200):
        if node.ready:
            break
        await asyncio.sleep(0.02)
    assert node.ready, node.failed
    return runner, f"http://127.0.0.1:{port}"
