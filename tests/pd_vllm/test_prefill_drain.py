"""A prefill pod scaled down with a handoff still in flight (vLLM on CPU with TileRTConnector, a real
decode node): vLLM has answered the request (the client has its first token) while the handoff's
control connection is still held (a relay in this test holds it, as a slow network or a busy node
would). `tilert-pd wait-idle`, the preStop hook, must not return meanwhile; vLLM, sent SIGTERM with
--shutdown-timeout as the operator renders it, must keep the staged state until it was sent; and the
request then decodes on the node. Also checks, against real vLLM, that the generation the connector
advertises is the node's when both name the same model and revision."""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import signal
import urllib.request
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.e2e.procs import PY, Proc
from tilert_serve import vllm_cpu
from tilert_serve.local.runner import free_port
from tilert_serve.pd_vllm import pending

pytestmark = pytest.mark.slow

MAX_SEQ_LEN = 512
MTP = json.dumps({"method": "mtp", "num_speculative_tokens": 1, **vllm_cpu.drafter_config()})


@dataclass
class Pair:
    root: Path
    prefill: Proc
    prefill_url: str
    node: Proc
    node_url: str
    ctrl_port: int
    pending_dir: Path


def _post(url: str, body: dict, timeout: float = 120) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())  # type: ignore[no-any-return]


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    from tilert_serve.tinymodel.generate import TinySpec, generate

    root = tmp_path_factory.mktemp("prefill-drain")
    model_dir = root / "tiny"
    generate(TinySpec(), model_dir)
    secret = root / "secret"
    secret.write_text(secrets.token_hex(32))
    pending_dir = root / "pending"
    http, ctrl, port = free_port(), free_port(), free_port()
    node = Proc(
        "node",
        [
            *(PY, "-m", "tilert_serve.cli", "decode-node", "--model-dir", str(model_dir)),
            *("--tilert-model", "mla", "--engine", "reference", "--slots", "2"),
            *("--max-seq-len", str(MAX_SEQ_LEN), "--host", "127.0.0.1", "--advertise-host", "127.0.0.1"),
            *("--ctrl-port", str(ctrl), "--http-port", str(http), "--secret-file", str(secret)),
            *("--dtype", "float32", "--api-token-file", "", "--served-model-name", "tiny"),
        ],
        root,
    )
    connector = {
        "kv_connector": "TileRTConnector",
        "kv_connector_module_path": "tilert_serve.pd_vllm.prefill_connector",
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {
            "tilert_model": "mla",
            "tilert_max_seq_len": MAX_SEQ_LEN,
            "tilert_secret_path": str(secret),
            "tilert_local_host": "127.0.0.1",
            "tilert_timeout_s": 120,
            "tilert_pending_dir": str(pending_dir),
        },
    }
    prefill = Proc(
        "prefill",
        [
            *(PY, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir)),
            *("--served-model-name", "tiny", "--host", "127.0.0.1", "--port", str(port)),
            *("--dtype", "float32", "--enforce-eager", "--max-model-len", str(MAX_SEQ_LEN)),
            *("--gpu-memory-utilization", "0.3", "--kv-cache-memory-bytes", str(256 << 20)),
            *("--speculative-config", MTP, *vllm_cpu.serve_args()),
            *("--kv-transfer-config", json.dumps(connector), "--shutdown-timeout", "120"),
        ],
        root,
        # As the operator renders a prefill: vLLM's executor gives its workers this long to exit after
        # the engine drained (default 5 s) before it terminates them, handoffs still sending or not.
        {**vllm_cpu.serve_env(), "VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS": "40"},
    )
    try:
        node.wait_ready(f"http://127.0.0.1:{http}/ready", 120)
        prefill.wait_ready(f"http://127.0.0.1:{port}/health", 600)
        yield Pair(
            root, prefill, f"http://127.0.0.1:{port}", node, f"http://127.0.0.1:{http}", ctrl, pending_dir
        )
    finally:
        prefill.stop()
        node.stop()


@contextlib.asynccontextmanager
async def held_relay(target_port: int) -> AsyncIterator[tuple[int, asyncio.Event, asyncio.Event]]:
    """A TCP relay to the node's control port that holds each connection until `release` is set:
    (its port, `connected`, `release`)."""
    connected, release = asyncio.Event(), asyncio.Event()
    tasks: set[asyncio.Task[None]] = set()

    async def pipe(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError):
            while data := await r.read(65536):
                w.write(data)
                await w.drain()
        w.close()

    async def handle(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        connected.set()
        await release.wait()
        nr, nw = await asyncio.open_connection("127.0.0.1", target_port)
        both = [asyncio.create_task(pipe(r, nw)), asyncio.create_task(pipe(nr, w))]
        tasks.update(both)
        await asyncio.gather(*both, return_exceptions=True)

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    try:
        yield server.sockets[0].getsockname()[1], connected, release
    finally:
        release.set()
        server.close()
        for t in tasks:
            t.cancel()


async def _until_logged(proc: Proc, text: str, timeout: float = 120) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while text not in proc.log.read_text(errors="replace"):
        assert loop.time() < deadline, f"{proc.name} never logged {text!r}:\n{proc.tail()}"
        await asyncio.sleep(0.1)


async def _line_with(stream: asyncio.StreamReader, text: str, timeout: float = 120) -> str:
    while True:
        line = (await asyncio.wait_for(stream.readline(), timeout)).decode()
        assert line, f"the stream ended before a line with {text!r}"
        if text in line:
            return line


async def test_sigterm_with_a_handoff_in_flight_keeps_the_state_until_it_is_sent(pair: Pair) -> None:
    node_compat = _get(f"{pair.node_url}/v1/status")["compat"]
    admitted = await asyncio.to_thread(_post, f"{pair.node_url}/v1/admit", {"request_id": "draining"})
    async with held_relay(pair.ctrl_port) as (relay_port, connected, release):
        answer = await asyncio.to_thread(
            _post,
            f"{pair.prefill_url}/v1/completions",
            {
                "model": "tiny",
                "prompt": "The capital of France is",
                "max_tokens": 1,
                "temperature": 0,
                "kv_transfer_params": {
                    "tilert_host": "127.0.0.1",
                    "tilert_ctrl_port": relay_port,
                    "tilert_ticket": admitted["ticket"],
                },
            },
        )
        params = answer["kv_transfer_params"]
        assert params["tilert_status"] == "queued", params
        # The connector's generation, derived from vLLM's config, is the node's (same name, revision).
        assert params["compat"] == node_compat, (params, node_compat)
        await asyncio.wait_for(connected.wait(), 60)
        assert sum(pending.read(pair.pending_dir).values()) == 1

        hook = await asyncio.create_subprocess_exec(
            *(PY, "-m", "tilert_serve.cli", "wait-idle", "--url", pair.prefill_url),
            *("--pending-dir", str(pair.pending_dir), "--min-wait", "0", "--timeout", "300"),
            *("--interval", "0.2"),
            stderr=asyncio.subprocess.PIPE,
        )
        assert hook.stderr is not None
        try:
            # vLLM is idle, the handoff is not done: the pod must not go yet.
            await _line_with(hook.stderr, "0 running, 0 waiting, 1 handoff(s) to send")
            assert hook.returncode is None
            # The kubelet's SIGTERM (to the container's first process) before the handoff went out.
            pair.prefill.popen.send_signal(signal.SIGTERM)
            # vLLM drained its engine and is tearing its worker down, the handoff still held: the
            # worker keeps its staged state for it.
            await _until_logged(pair.prefill, "finishing 1 handoff(s) still to send before exiting")
            assert pair.prefill.popen.poll() is None
            release.set()
            assert "idle after" in await _line_with(hook.stderr, "idle")
            assert await asyncio.wait_for(hook.wait(), 60) == 0
        finally:
            if hook.returncode is None:
                hook.kill()
    # The state arrived whole: the node decodes the request from the prefill's first token.
    first = int(params["tilert_first_token"])
    body = json.dumps({"ticket": admitted["ticket"], "first_token": first, "max_tokens": 8}).encode()
    req = urllib.request.Request(f"{pair.node_url}/v1/generate", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        events = [json.loads(ln[6:]) for ln in r.read().decode().splitlines() if ln.startswith("data: ")]
    assert events[-1]["done"] and events[-1]["finish_reason"] == "length", events[-2:]
    await asyncio.to_thread(pair.prefill.popen.wait, 120)  # and the prefill is gone
