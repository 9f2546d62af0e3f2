"""A decode node in the test's event loop, with a recording engine double: the double keeps every
InjectedState it is handed (so tests can check conversion exactly) and emits predictable tokens."""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest
import torch
from aiohttp import web

from tests.decode import reuse
from tests.decode.reuse import SENDER_ENV, node_transfer
from tilert_serve import layouts, transfer
from tilert_serve.decode.engines.base import DecodeStep, InjectedState, Sampling
from tilert_serve.decode.http import make_app
from tilert_serve.decode.node import DecodeNode, NodeConfig

HERE = Path(__file__).parent
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
        self.started.append(
            state.__class__(
                layers=[
                    type(layer)(
                        kv=layer.kv.clone(),
                        pe=layer.pe.clone(),
                        ki=None if layer.ki is None else layer.ki.clone(),
                    )
                    for layer in state.layers
                ],
                seq_len=state.seq_len,
                last_prompt_token=state.last_prompt_token,
            )
        )
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

    async def generate(
        self, ticket: str, first_token: int = 100, max_tokens: int = 6, **extra: object
    ) -> tuple[int, list[dict]]:
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

    async def send(
        self,
        case: str,
        num_tokens: int,
        seed: int,
        engine: str,
        ticket: str | None,
        *flags: str,
        request_id: str = "req-1",
        secret_file: Path | None = None,
    ) -> str:
        """Run a sender process; returns its RESULT/ACCEPTED line."""
        args = [
            case,
            str(num_tokens),
            str(seed),
            engine,
            "127.0.0.1",
            str(self.ctrl_port),
            str(secret_file or self.secret_file),
            request_id,
        ]
        if ticket:
            args.append(ticket)
        rc, out = await reuse.zygote().run([*args, *flags], 60)
        lines = [ln for ln in out.splitlines() if ln.startswith(("RESULT ", "ACCEPTED"))]
        assert lines, f"sender printed nothing useful (rc {rc}): {out[-2000:]}"
        return lines[-1]


def _in_decode(item: pytest.Item | None) -> bool:
    return item is not None and Path(str(item.path)).parent == HERE


def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """After the last decode test: the sender zygote ends and the pooled engines go (reuse.py), rather
    than at the interpreter's exit beside the directories that run after this one."""
    if _in_decode(item) and not _in_decode(nextitem):
        reuse.release()


@contextlib.contextmanager
def converter_held(node: DecodeNode, index: int = 0) -> Iterator[None]:
    """Hold slot `index`'s converter thread (pipeline.py converts as the state lands) until the block ends:
    what lands meanwhile is checked and converted only after, as if /generate had come first."""
    release, holding = threading.Event(), threading.Event()

    def hold() -> None:
        holding.set()
        release.wait(30)

    node.pipeline.converter(index).submit(hold)
    assert holding.wait(10)
    try:
        yield
    finally:
        release.set()


@contextlib.contextmanager
def two_rank_staging(
    layout: layouts.Layout, num_tokens: int, seed: int, role: str
) -> Iterator[tuple[layouts.Placement, list[torch.Tensor], transfer.TransferEngine]]:
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


@pytest.fixture
def secret_file(tmp_path: Path) -> Path:
    path = tmp_path / "secret"
    path.write_bytes(SECRET)
    return path


@contextlib.asynccontextmanager
async def running_node(
    layout: layouts.Layout,
    secret_file: Path,
    *,
    transfer_name: str = "mooncake",
    slots: int = 1,
    max_seq_len: int = 256,
    ticket_ttl_s: float = 30.0,
    handoff_timeout_s: float = 30.0,
    shards: int = 1,
    tokenizer: object = None,
    eos: frozenset[int] = frozenset(),
    quarantine_s: float = 30.0,
    verify_digest: bool = True,
    secret: object = SECRET,
    model_name: str = "",
    model_revision: str = "",
) -> AsyncIterator[RunningNode]:
    for key in ("UCX_TLS", "UCX_NET_DEVICES", "UCX_MODULES"):
        os.environ.setdefault(key, SENDER_ENV[key])
    engine = RecordingEngine(layout, max_seq_len, slots)
    config = NodeConfig(
        name="node-0",
        max_seq_len=max_seq_len,
        slots=slots,
        host="127.0.0.1",
        ctrl_port=0,
        http_port=0,
        shards=shards,
        devices=("cpu",) * shards,
        ticket_ttl_s=ticket_ttl_s,
        handoff_timeout_s=handoff_timeout_s,
        quarantine_s=quarantine_s,
        verify_digest=verify_digest,
        model_name=model_name,
        model_revision=model_revision,
    )
    mover = node_transfer(transfer_name)
    node = DecodeNode(
        config,
        layout=layout,
        engine=engine,
        transfer=mover,
        secret=secret,
        tokenizer=tokenizer,
        eos_token_ids=eos,
    )
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
