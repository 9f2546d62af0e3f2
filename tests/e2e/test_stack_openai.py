"""The local stack as an OpenAI client sees it: through the router, both decode routes answer what
vLLM alone answers for the same model, text included, for completions and chat, streamed and not.

The stack is `tilert-pd local up -f examples/tiny-cpu.yaml` (the operator's rendered commands); the
baseline is a plain vLLM (no connector) on the same generated checkpoint. Short greedy generations
that end anywhere (EOS allowed, max_tokens 1..8) catch a detokenizer that drops or adds the text of
the last tokens; the TileRT route gets the whole matrix, the native route (slow on CPU: vLLM's NIXL
connector costs it a step) a sample of it.

The stack runs with `spec.observability.tracing.endpoint` set to an OTLP/HTTP receiver in the test
(tests/observability/otlp_receiver.py), so the same rendering that traces in a cluster traces here,
and one TileRT-route request with a client's traceparent must come back as one trace:

    router.request (a child of the client's span)
      router.admission -> tilert.admit                      (the node's admission)
      router.prefill   -> llm_request                       (vLLM's own span)
      router.decode    -> tilert.generate -> tilert.layers, tilert.state (-> its digest and
                                             conversion pieces), tilert.injection,
                                             tilert.first_step, tilert.decode

each span inside its parent's interval and the children of each adding up to no more than it. The
spans come from four processes on one host: their clocks are the same wall clock, read a few
microseconds apart, so intervals are compared within CLOCK_SLACK_NS. What the router does without an
endpoint (nothing exported, no traceparent upstream) is tests/router/test_router_tracing.py's.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest
import yaml

from bench.load import references
from bench.load.client import Target
from bench.load.harness import Load
from bench.load.plan import ROUTES, LoadPlan, Mix, PromptSet
from tests.e2e.conftest import EXAMPLE, EXAMPLE_MODEL, Plain
from tests.e2e.procs import PY
from tests.observability.otlp_receiver import Receiver, Span
from tilert_serve.local.runner import free_port

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
MODEL = EXAMPLE_MODEL
PROMPTS: list[str | list[int]] = [[10, 20, 30], "Prefill is compute-bound; de", "Once upon a time there"]
CHAT = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "What is a token?"}]
TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
CLIENT_SPAN = "b7ad6b7169203331"
#: Cross-process comparisons of span times: the same host's wall clock, converted from perf_counter
#: on the node (tilert_serve/tracing.wall_ns), a microsecond or so apart.
CLOCK_SLACK_NS = 1_000_000
NODE_STAGES = {"tilert.layers", "tilert.state", "tilert.injection", "tilert.first_step", "tilert.decode"}


@dataclass
class Clients:
    router: openai.OpenAI
    plain: openai.OpenAI
    router_url: str
    plain_url: str
    receiver: Receiver


@pytest.fixture(scope="module")
def clients(tmp_path_factory: pytest.TempPathFactory, plain_vllm: Plain) -> Iterator[Clients]:
    # The baseline is the session's plain vLLM (tests/e2e/conftest.py): the same checkpoint as the
    # stack's (`tilert-pd tiny-model` writes TinySpec()'s bytes) and dtype, also served under the stack's
    # model name. It boots beside the stack.
    receiver = Receiver().start()
    home = tmp_path_factory.mktemp("stack-home")
    doc = copy.deepcopy(yaml.safe_load(EXAMPLE.read_text()))
    doc["spec"]["observability"] = {"tracing": {"endpoint": receiver.url}}
    spec_file = home / "traced.yaml"
    spec_file.write_text(yaml.safe_dump(doc))
    port = free_port()
    local = [PY, "-m", "tilert_serve.cli", "local"]
    up = subprocess.run(
        [*local, "up", "-f", str(spec_file), "--home", str(home), "--router-port", str(port)],
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
            receiver,
        )
    finally:
        subprocess.run(
            [*local, "down", "--home", str(home)],
            capture_output=True,
            timeout=120,
            cwd=ROOT,
            env={**os.environ},
        )
        receiver.stop()


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


def _traced_complete(url: str, headers: dict[str, str]) -> dict:
    body = {"model": MODEL, "prompt": "Once upon a time there", "max_tokens": 6, "temperature": 0}
    req = urllib.request.Request(
        url + "/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "x-pd-route": "tilert", **headers},
    )
    with urllib.request.urlopen(req, timeout=300) as resp:
        assert resp.headers["X-PD-Route"] == "tilert"
        return json.loads(resp.read())


def _complete_tree(spans: list[Span]) -> bool:
    names = {s.name for s in spans if s.trace_id == TRACE_ID}
    return {"router.request", "tilert.admit", "tilert.generate", "llm_request"} <= names


def test_one_request_is_one_trace_across_router_prefill_and_node(clients: Clients) -> None:
    answer = _traced_complete(clients.router_url, {"traceparent": f"00-{TRACE_ID}-{CLIENT_SPAN}-01"})
    assert answer["choices"][0]["text"]
    got = clients.receiver.wait_for(
        "the request's trace from router, vLLM and node", _complete_tree, timeout=120
    )
    assert not clients.receiver.errors
    # vLLM starts no trace of its own (OTEL_TRACES_SAMPLER in its env): the router's handoff probes,
    # which ran while the stack came up, left no root spans.
    assert all(s.parent_id for s in got if s.name == "llm_request"), [s for s in got if not s.parent_id]
    ours = [s for s in got if s.trace_id == TRACE_ID]
    by_id = {s.span_id: s for s in ours}
    assert len(by_id) == len(ours), "a span id was reused"
    kids: dict[str, list[Span]] = {}
    for s in ours:
        kids.setdefault(s.parent_id, []).append(s)

    def only(parent: Span, name: str) -> Span:
        found = [k for k in kids.get(parent.span_id, []) if k.name == name]
        assert len(found) == 1, f"{parent.name} has {[k.name for k in kids.get(parent.span_id, [])]}"
        return found[0]

    # The tree, by parent ids: every span of the trace hangs from the client's span.
    (root,) = kids[CLIENT_SPAN]
    assert root.name == "router.request" and root.service == "tilert-router"
    assert sorted(k.name for k in kids[root.span_id]) == [
        "router.admission",
        "router.decode",
        "router.prefill",
    ]
    admit = only(only(root, "router.admission"), "tilert.admit")
    assert admit.service == "tilert-decode" and admit.attributes["tilert.outcome"] == "admitted"
    vllm = only(only(root, "router.prefill"), "llm_request")
    assert vllm.attributes["gen_ai.usage.completion_tokens"] == 1  # the prefill leg: one token
    generate = only(only(root, "router.decode"), "tilert.generate")
    assert generate.service == "tilert-decode"
    stages = {k.name for k in kids[generate.span_id]}
    assert stages == NODE_STAGES, stages
    state = only(generate, "tilert.state")
    assert {k.name for k in kids.get(state.span_id, [])} <= {"tilert.digest", "tilert.conversion"}
    # What happened before the decode leg (the handshake, the bytes landing) is on the node's span.
    assert generate.attributes["tilert.accept_to_ready_ms"] >= 0
    assert generate.attributes["tilert.admit_to_accept_ms"] > 0
    # Every span of the trace is reachable from the root: none is left dangling.
    reach, todo = set(), [root.span_id]
    while todo:
        sid = todo.pop()
        reach.add(sid)
        todo += [k.span_id for k in kids.get(sid, [])]
    assert reach == set(by_id), [by_id[s].name for s in set(by_id) - reach]

    # Times: each child inside its parent, the children of each adding up to no more than it.
    for s in ours:
        if s is root:
            continue
        p = by_id[s.parent_id]
        assert s.start_ns <= s.end_ns
        assert p.start_ns - CLOCK_SLACK_NS <= s.start_ns and s.end_ns <= p.end_ns + CLOCK_SLACK_NS, (
            f"{s.name} [{s.start_ns}, {s.end_ns}] not inside {p.name} [{p.start_ns}, {p.end_ns}]"
        )
    for pid, children in kids.items():
        if pid == CLIENT_SPAN:
            continue
        p = by_id[pid]
        total = sum(c.duration_ns for c in children)
        assert total <= p.duration_ns + CLOCK_SLACK_NS, f"{p.name}: children {total} ns > {p.duration_ns} ns"
    # The router's legs run one after the other, in order.
    legs = sorted(kids[root.span_id], key=lambda s: s.start_ns)
    assert [s.name for s in legs] == ["router.admission", "router.prefill", "router.decode"]
    print(
        "trace:",
        ", ".join(f"{s.name} {s.duration_ns / 1e6:.1f} ms" for s in sorted(ours, key=lambda s: s.start_ns)),
    )
