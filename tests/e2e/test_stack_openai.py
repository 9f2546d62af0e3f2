"""The local stack as an OpenAI client sees it: through the router, both decode routes answer what
vLLM alone answers for the same model, text included, for completions and chat, streamed and not.

The stack is `tilert-pd local up -f examples/tiny-cpu.yaml` (the operator's rendered commands); the
baseline is a plain vLLM (no connector) on the same generated checkpoint. Short greedy generations
that end anywhere (EOS allowed, max_tokens 1..8) catch a detokenizer that drops or adds the text of
the last tokens; the TileRT route gets the whole matrix, the native route (slow on CPU: vLLM's NIXL
connector costs it a step) a sample of it.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest

from bench.load import references
from bench.load.client import Target
from bench.load.harness import Load
from bench.load.plan import ROUTES, LoadPlan, Mix, PromptSet
from tests.e2e.conftest import EXAMPLE, EXAMPLE_MODEL, Plain
from tests.e2e.procs import PY
from tilert_serve.local.runner import free_port

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
MODEL = EXAMPLE_MODEL
PROMPTS: list[str | list[int]] = [[10, 20, 30], "Prefill is compute-bound; de", "Once upon a time there"]
CHAT = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "What is a token?"}]


@dataclass
class Clients:
    router: openai.OpenAI
    plain: openai.OpenAI
    router_url: str
    plain_url: str


@pytest.fixture(scope="module")
def clients(tmp_path_factory: pytest.TempPathFactory, plain_vllm: Plain) -> Iterator[Clients]:
    # The baseline is the session's plain vLLM (tests/e2e/conftest.py): the same checkpoint as the
    # stack's (`tilert-pd tiny-model` writes TinySpec()'s bytes) and dtype, also served under the stack's
    # model name. It boots beside the stack.
    home = tmp_path_factory.mktemp("stack-home")
    port = free_port()
    local = [PY, "-m", "tilert_serve.cli", "local"]
    up = subprocess.run(
        [*local, "up", "-f", str(EXAMPLE), "--home", str(home), "--router-port", str(port)],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=ROOT,
    )
    try:
        assert up.returncode == 0, up.stdout[-3000:] + up.stderr[-3000:]
        yield Clients(
            openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0),
            openai.OpenAI(base_url=f"{plain_vllm.url}/v1", api_key="none", max_retries=0),
            f"http://127.0.0.1:{port}",
            plain_vllm.url,
        )
    finally:
        subprocess.run(
            [*local, "down", "--home", str(home)],
            capture_output=True,
            timeout=120,
            cwd=ROOT,
            env={**os.environ},
        )


def complete(
    client: openai.OpenAI, prompt: str | list[int], max_tokens: int, stream: bool, route: str | None = None
) -> tuple[str, str | None]:
    headers = {"x-pd-route": route} if route else None
    kw = dict(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0, extra_headers=headers)
    if not stream:
        r = client.completions.create(**kw)  # type: ignore[call-overload]
        return r.choices[0].text, r.choices[0].finish_reason
    text, finish = "", None
    for chunk in client.completions.create(stream=True, **kw):  # type: ignore[call-overload]
        if chunk.choices:
            text += chunk.choices[0].text
            finish = chunk.choices[0].finish_reason or finish
    return text, finish


def chat(client: openai.OpenAI, stream: bool, route: str | None = None) -> tuple[str, str | None]:
    headers = {"x-pd-route": route} if route else None
    kw = dict(model=MODEL, messages=CHAT, max_tokens=12, temperature=0, extra_headers=headers)
    if not stream:
        r = client.chat.completions.create(**kw)  # type: ignore[call-overload]
        assert r.choices[0].message.role == "assistant"
        return r.choices[0].message.content or "", r.choices[0].finish_reason
    text, finish = "", None
    for chunk in client.chat.completions.create(stream=True, **kw):  # type: ignore[call-overload]
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
    return text, finish


def test_tilert_route_text_equals_vllm_for_generations_ending_anywhere(clients: Clients) -> None:
    diffs = []
    for prompt in PROMPTS:
        for max_tokens in range(1, 9):
            expected = complete(clients.plain, prompt, max_tokens, stream=False)
            for stream in (False, True):
                got = complete(clients.router, prompt, max_tokens, stream, route="tilert")
                if got != expected:
                    diffs.append((prompt, max_tokens, stream, got, expected))
    assert not diffs, "\n".join(map(repr, diffs))


def test_native_route_text_equals_vllm(clients: Clients) -> None:
    for prompt, max_tokens, stream in ((PROMPTS[0], 4, False), (PROMPTS[1], 5, True)):
        expected = complete(clients.plain, prompt, max_tokens, stream=False)
        assert complete(clients.router, prompt, max_tokens, stream, route="native") == expected


@pytest.mark.parametrize("route", ["tilert", "native"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_chat_through_each_route_equals_vllm(clients: Clients, route: str, stream: bool) -> None:
    expected = chat(clients.plain, stream=False)
    assert expected[0], "the tiny model's chat answer should not be empty"
    assert chat(clients.router, stream, route=route) == expected


def test_official_client_sees_which_route_served(clients: Clients) -> None:
    raw = clients.router.completions.with_raw_response.create(
        model=MODEL, prompt="hello", max_tokens=2, temperature=0, extra_headers={"x-pd-route": "tilert"}
    )
    assert raw.headers.get("x-pd-route") == "tilert"
    assert raw.parse().usage is not None and raw.parse().usage.completion_tokens >= 1


async def test_the_load_harness_through_every_route_all_ok_and_equal_to_vllm_alone(
    clients: Clients, tmp_path: Path
) -> None:
    """bench/load's harness through this stack, vLLM alone as the reference: a handful of requests
    over every route, streamed and not, completions and chat, all answered and equal to vLLM alone's."""
    prompts = PromptSet(seed=7, n=3, max_tokens=(4, 10))
    plan = LoadPlan(rate=2.0, count=12, seed=7, prompts=prompts, mix=Mix(stream=0.5, chat=0.5))
    refs = await references.cached(
        tmp_path / "refs.json", Target("vLLM alone", clients.plain_url, MODEL, routes=False), prompts
    )
    assert (tmp_path / "refs.json").exists() and refs.covers(prompts)
    load = Load(Target("router", clients.router_url, MODEL), plan, references=refs)
    async with load:
        await load.finished()
    s = load.summary()
    assert s.total.requests == 12 and s.failed == 0, s.total.failures
    assert s.total.compared == 12 and s.mismatches == 0, [
        (r.route_asked, r.route_served, r.text) for r in load.records if r.greedy_match is False
    ]
    # The router says which path served each. A native request is served native; a TileRT one is
    # served by TileRT unless the router fell back (its policy may when no node can take it).
    assert {r.route_asked for r in load.records} <= set(ROUTES)
    for r in load.records:
        assert r.route_served in ("tilert", "native")
        if r.route_asked == "native":
            assert r.route_served == "native"
    assert s.total.served == {
        p: sum(r.route_served == p for r in load.records) for p in {r.route_served for r in load.records}
    }
    assert any(r.stream for r in load.records) and any(not r.stream for r in load.records)
    assert all(r.ttft is not None for r in load.records if r.stream)
