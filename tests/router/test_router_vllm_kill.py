"""A real vLLM (CPU) native decode SIGKILLed mid-stream: the client's stream through the router ends
with vLLM's error event and [DONE] at once, not a silent cut, and new requests meet an open breaker
instead of the dead server. Slow: starts its own vLLM, which it kills."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator

import aiohttp
import pytest
import tiny_llama

from tilert_serve.local.runner import free_port
from tilert_serve.router import config
from tilert_serve.router.app import bound_port, make_app, start
from tilert_serve.router.state import STATE

pytestmark = pytest.mark.slow

MODEL = "tiny"


@pytest.fixture
def doomed_vllm(tmp_path) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """A vLLM OpenAI server on CPU (the same arguments as test_router_vllm_real.py's), to be killed."""
    model = tiny_llama.write(tmp_path / "tiny-llama")
    port = free_port()
    log = open(tmp_path / "vllm.log", "wb")
    # fmt: off
    argv = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
        "--served-model-name", MODEL, "--host", "127.0.0.1", "--port", str(port), "--load-format", "dummy",
        "--max-model-len", "256", "--enforce-eager", "--gpu-memory-utilization", "0.3",
        "--kv-cache-memory-bytes", str(256 * 1024 * 1024), "--max-num-batched-tokens", "256",
        "--dtype", "float32", "--seed", "0",
    ]
    # fmt: on
    proc = subprocess.Popen(
        argv,
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, "VLLM_LOGGING_LEVEL": "WARNING"},
        start_new_session=True,  # its engine core is a child: the kill below takes the whole group
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 400
        while True:
            if proc.poll() is not None:
                pytest.fail(
                    f"vLLM exited with {proc.returncode}: {(tmp_path / 'vllm.log').read_text()[-3000:]}"
                )
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, "vLLM did not become healthy in 400 s"
            time.sleep(1)
        yield proc, url
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        log.close()


async def test_a_real_vllm_killed_mid_stream_ends_the_clients_stream_cleanly(doomed_vllm):
    proc, url = doomed_vllm
    cfg = config.RouterConfig(model=MODEL, prefill=[url], native=[url], endpoint_breaker={"open_s": 60.0})
    app = make_app(cfg, health_checks=False)
    runner = await start(app, "127.0.0.1", 0)
    router = f"http://127.0.0.1:{bound_port(runner)}"
    try:
        async with aiohttp.ClientSession() as http:
            resp = await http.post(
                router + "/v1/completions",
                json={
                    "model": MODEL,
                    "prompt": "The quick brown fox",
                    "max_tokens": 240,
                    "ignore_eos": True,
                    "temperature": 0,
                    "stream": True,
                },
                headers={"x-pd-route": "native"},
            )
            assert resp.status == 200
            first = await resp.content.readuntil(b"\n\n")
            assert first.startswith(b"data: {")
            os.killpg(proc.pid, signal.SIGKILL)  # the decode dies mid-stream
            t_kill = time.monotonic()
            rest = await resp.read()
            took = time.monotonic() - t_kill
            events = [e for e in (first + rest).split(b"\n\n") if e]
            assert events[-1] == b"data: [DONE]"
            error = json.loads(events[-2][len(b"data: ") :])["error"]
            assert "decode failed mid-stream" in error["message"] and error["code"] in (
                "stream_broken",
                "timeout",
            )
            print(f"\nreal vLLM killed mid-stream: error event + [DONE] {took * 1e3:.0f} ms after the kill")
            # New requests meet the refused connection (the prefill is the same server), which opens its
            # breaker at once; with no other server to go to they fail fast, as a clean 502.
            for _ in range(2):
                t0 = time.monotonic()
                async with http.post(
                    router + "/v1/completions",
                    json={"model": MODEL, "prompt": "a", "max_tokens": 4},
                    headers={"x-pd-route": "native"},
                ) as r:
                    body = await r.json()
                    assert r.status == 502 and body["error"]["code"] == "connect", body
                assert time.monotonic() - t0 < 5.0
            state = app[STATE]
            assert state.pools.prefill[url].breaker == "open"
            assert state.metrics.stream_errors.labels("native", error["code"])._value.get() == 1
    finally:
        await runner.cleanup()
