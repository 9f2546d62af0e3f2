"""The router in front of a real vLLM (CPU) OpenAI server serving a tiny random-weight Llama.

One vLLM server per test session plays both the prefill and the native decode: without a KV
connector it ignores kv_transfer_params (and returns none), so the native path runs prefill then a
whole decode on it, as vLLM's toy proxy would; that checks the bodies the router sends are ones vLLM
accepts and that what comes back through the router is what vLLM says directly. The TileRT path's
prefill body is sent to it too: with no TileRT connector there is no handoff, so the router must
cancel the ticket and serve the request on the native pool.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator

import aiohttp
import openai
import pytest
import tiny_llama
from router_fakes import FakeNode, until

from tilert_serve.local.runner import free_port
from tilert_serve.router import config
from tilert_serve.router.app import bound_port, make_app, start

pytestmark = pytest.mark.slow

MODEL = "tiny"


@pytest.fixture(scope="session")
def vllm_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    base = tmp_path_factory.mktemp("vllm")
    model = tiny_llama.write(base / "tiny-llama")
    port = free_port()
    log = open(base / "vllm.log", "wb")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(model),
            "--served-model-name",
            MODEL,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--load-format",
            "dummy",
            "--max-model-len",
            "256",
            "--enforce-eager",
            "--gpu-memory-utilization",
            "0.3",
            "--kv-cache-memory-bytes",
            str(256 * 1024 * 1024),
            "--max-num-batched-tokens",
            "256",
            "--dtype",
            "float32",
            "--seed",
            "0",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, "VLLM_LOGGING_LEVEL": "WARNING"},
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240
        while True:
            if proc.poll() is not None:
                pytest.fail(f"vLLM exited with {proc.returncode}: {(base / 'vllm.log').read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.fail("vLLM did not become healthy in 240 s")
            time.sleep(1)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


@pytest.fixture
async def router(vllm_url):
    node = await FakeNode("t0", slots=2).start()
    cfg = config.RouterConfig(
        model=MODEL,
        prefill=[vllm_url],
        native=[vllm_url],
        tilert=[config.TileRTNode(name="t0", http_url=node.url, ctrl_host="127.0.0.1", slots=2)],
    )
    app = make_app(cfg, health_checks=True)
    runner = await start(app, "127.0.0.1", 0)
    client = openai.AsyncOpenAI(
        base_url=f"http://127.0.0.1:{bound_port(runner)}/v1", api_key="x", max_retries=0, timeout=60
    )
    direct = openai.AsyncOpenAI(base_url=vllm_url + "/v1", api_key="x", max_retries=0, timeout=60)
    yield client, direct, node, f"http://127.0.0.1:{bound_port(runner)}"
    await client.close()
    await direct.close()
    await runner.cleanup()
    await node.stop()


PROMPT = "The quick brown fox jumps over the lazy dog. A router sends"


async def test_native_completion_matches_direct(router):
    client, direct, _node, _ = router
    want = await direct.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0)
    got = await client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, extra_headers={"x-pd-route": "native"}
    )
    assert got.choices[0].text == want.choices[0].text
    assert got.usage.prompt_tokens == want.usage.prompt_tokens
    assert got.usage.completion_tokens == 12


async def test_native_chat_streamed_matches_direct(router):
    client, direct, _node, _ = router
    msgs = [{"role": "user", "content": "hello world, stream tokens"}]
    want = await direct.chat.completions.create(model=MODEL, messages=msgs, max_tokens=10, temperature=0)
    stream = await client.chat.completions.create(
        model=MODEL,
        messages=msgs,
        max_tokens=10,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_headers={"x-pd-route": "native"},
    )
    parts, usage, finish = [], None, None
    async for ch in stream:
        usage = ch.usage or usage
        for c in ch.choices:
            parts.append(c.delta.content or "")
            finish = c.finish_reason or finish
    assert "".join(parts) == want.choices[0].message.content
    assert usage.completion_tokens == 10 and finish == "length"


async def test_tilert_without_connector_falls_back_native(router):
    """vLLM accepts the TileRT prefill body; with no connector there is no handoff, so the router
    cancels the ticket and serves the request natively (retry before the first byte)."""
    client, direct, node, _ = router
    want = await direct.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0)
    got = await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0)
    assert got.choices[0].text == want.choices[0].text
    assert len(node.admits) == 1 and len(node.cancels) == 1 and node.active == 0


async def test_vllm_client_error_passes_through(router):
    client, _direct, _node, _ = router
    with pytest.raises(openai.BadRequestError) as ei:
        await client.completions.create(
            model=MODEL, prompt="word " * 400, max_tokens=4, extra_headers={"x-pd-route": "native"}
        )
    assert ei.value.status_code == 400


async def test_ready_with_real_vllm(router):
    *_, url = router
    async with aiohttp.ClientSession() as http:
        for _ in range(100):
            async with http.get(url + "/ready") as resp:
                if resp.status == 200:
                    break
            await asyncio.sleep(0.05)
        assert resp.status == 200


@pytest.mark.parametrize("route", ["native", "tilert"])
async def test_context_length_answers_as_vllm_alone(router, route):
    """vLLM runs with --max-model-len 256. Past it, the router answers what vLLM alone answers: a
    max_tokens or a prompt past it is the same 400 body, a prompt + max_tokens past it ends as length."""
    client, direct, node, _ = router
    headers = {"x-pd-route": route}
    for kw in ({"prompt": PROMPT, "max_tokens": 300}, {"prompt": "word " * 400, "max_tokens": 4}):
        with pytest.raises(openai.BadRequestError) as want:
            await direct.completions.create(model=MODEL, **kw)
        with pytest.raises(openai.BadRequestError) as got:
            await client.completions.create(model=MODEL, extra_headers=headers, **kw)
        assert got.value.body == want.value.body
    long = [5] * 200
    want_ok = await direct.completions.create(
        model=MODEL, prompt=long, max_tokens=100, temperature=0, extra_body={"ignore_eos": True}
    )
    got_ok = await client.completions.create(
        model=MODEL,
        prompt=long,
        max_tokens=100,
        temperature=0,
        extra_body={"ignore_eos": True},
        extra_headers=headers,
    )
    assert want_ok.choices[0].finish_reason == got_ok.choices[0].finish_reason == "length"
    assert got_ok.usage.completion_tokens == want_ok.usage.completion_tokens == 256 - 200
    await until(lambda: node.active == 0)  # a ticket taken on the TileRT route is given back
