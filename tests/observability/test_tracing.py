"""One request's trace across router, prefill and TileRT node, received by an OTLP/HTTP receiver in
the test (tests/observability/otlp_receiver.py).

The stack is `tilert-pd local up` with the tiny example, its `spec.observability.tracing.endpoint`
set to the receiver (and one TileRT node, no native pool, to keep it light): the same rendering as in
a cluster, so this also checks that a local run traces. One TileRT-route request with a client's
traceparent must come back as one trace:

    router.request (a child of the client's span)
      router.admission -> tilert.admit                      (the node's admission)
      router.prefill   -> llm_request                       (vLLM's own span)
      router.decode    -> tilert.generate -> tilert.layers, tilert.state (-> its digest and
                                             conversion pieces), tilert.injection,
                                             tilert.first_step, tilert.decode

each span inside its parent's interval and the children of each adding up to no more than it. The
spans come from four processes on one host: their clocks are the same wall clock, read a few
microseconds apart, so intervals are compared within CLOCK_SLACK_NS. What the router does without an
endpoint (nothing exported, no traceparent upstream) is tests/router/test_router_tracing.py's."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from tests.e2e.conftest import EXAMPLE, EXAMPLE_MODEL
from tests.e2e.procs import PY
from tests.observability.otlp_receiver import Receiver, Span
from tilert_serve.local.runner import free_port

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
CLIENT_SPAN = "b7ad6b7169203331"
#: Cross-process comparisons of span times: the same host's wall clock, converted from perf_counter
#: on the node (tilert_serve/tracing.wall_ns), a microsecond or so apart.
CLOCK_SLACK_NS = 1_000_000
NODE_STAGES = {"tilert.layers", "tilert.state", "tilert.injection", "tilert.first_step", "tilert.decode"}


@dataclass
class Traced:
    receiver: Receiver
    router_url: str


@pytest.fixture(scope="module")
def traced(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Traced]:
    receiver = Receiver().start()
    home = tmp_path_factory.mktemp("traced-home")
    doc = copy.deepcopy(yaml.safe_load(EXAMPLE.read_text()))
    spec = doc["spec"]
    spec["observability"] = {"tracing": {"endpoint": receiver.url}}
    spec["decode"]["tilert"]["replicas"] = 1
    spec["decode"]["native"]["replicas"] = 0
    path = home / "traced.yaml"
    path.write_text(yaml.safe_dump(doc))
    port = free_port()
    local = [PY, "-m", "tilert_serve.cli", "local"]
    up = subprocess.run(
        [*local, "up", "-f", str(path), "--home", str(home), "--router-port", str(port)],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=ROOT,
    )
    try:
        assert up.returncode == 0, up.stdout[-3000:] + up.stderr[-3000:]
        yield Traced(receiver, f"http://127.0.0.1:{port}")
    finally:
        subprocess.run(
            [*local, "down", "--home", str(home)],
            capture_output=True,
            timeout=120,
            cwd=ROOT,
            env={**os.environ},
        )
        receiver.stop()


def _complete(url: str, headers: dict[str, str]) -> dict:
    body = {"model": EXAMPLE_MODEL, "prompt": "Once upon a time there", "max_tokens": 6, "temperature": 0}
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


def test_one_request_is_one_trace_across_router_prefill_and_node(traced: Traced) -> None:
    answer = _complete(traced.router_url, {"traceparent": f"00-{TRACE_ID}-{CLIENT_SPAN}-01"})
    assert answer["choices"][0]["text"]
    got = traced.receiver.wait_for(
        "the request's trace from router, vLLM and node", _complete_tree, timeout=120
    )
    assert not traced.receiver.errors
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
