"""TileRTConnector end to end on CPU: vLLM prefills, the state crosses Mooncake over TCP into a
decode node on the reference engine, and decode continues with MTP from its first step.

What cannot happen here: chunked prefill (vLLM's CPU MLA backend forces it off; the scheduler-side
chunk tracking is covered in tests/pd_vllm/test_connector_units.py) and TP > 1.
"""

from __future__ import annotations

import os
import random
import socket
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.e2e.conftest import Stack, start_node
from tests.e2e.procs import metric, post_json, sse_events
from tilert_serve.local.runner import free_port

pytestmark = pytest.mark.slow

LENGTHS = [3, 5, 8, 12, 15, 16, 17, 20, 31, 32, 33, 47, 64, 65, 90, 120, 150, 200, 255, 300]
NEW_TOKENS = 12
rng = random.Random(1234)
PROMPTS = [[rng.randrange(2, 512) for _ in range(n)] for n in LENGTHS]


def baseline(stack: Stack, prompt: list[int]) -> list[int]:
    """vLLM's own greedy output, from a server without any connector."""
    out = post_json(
        f"{stack.plain_url}/v1/completions",
        {
            "model": "tiny",
            "prompt": prompt,
            "max_tokens": NEW_TOKENS,
            "temperature": 0,
            "return_token_ids": True,
        },
    )
    return out["choices"][0]["token_ids"]


def prefill(
    stack: Stack, prompt: list[int], host: str, port: int, ticket: str | None, layerwise: bool | None = None
) -> dict:
    params = {"tilert_host": host, "tilert_ctrl_port": port, "tilert_ticket": ticket}
    if layerwise is not None:  # else the connector's tilert_layerwise (on by default)
        params["tilert_layerwise"] = layerwise
    return post_json(
        f"{stack.prefill_url}/v1/completions",
        {"model": "tiny", "prompt": prompt, "max_tokens": 1, "temperature": 0, "kv_transfer_params": params},
    )


def pd(
    stack: Stack,
    prompt: list[int],
    node_url: str | None = None,
    ctrl_port: int | None = None,
    layerwise: bool | None = None,
) -> tuple[list[int], dict]:
    """The TileRT path as the router drives it: admit, prefill with the mark, stream the rest."""
    node_url, ctrl_port = node_url or stack.node_url, ctrl_port or stack.ctrl_port
    adm = post_json(
        f"{node_url}/v1/admit", {"request_id": "e2e", "prompt_tokens": len(prompt), "max_tokens": NEW_TOKENS}
    )
    out = prefill(stack, prompt, "127.0.0.1", ctrl_port, adm["ticket"], layerwise)
    params = out["kv_transfer_params"]
    assert params["tilert_status"] == "queued" and params["tilert_num_tokens"] == len(prompt), params
    first = params["tilert_first_token"]
    events = sse_events(
        f"{node_url}/v1/generate",
        {"ticket": adm["ticket"], "first_token": first, "max_tokens": NEW_TOKENS - 1},
    )
    assert events[-1]["done"], events[-1]
    return [first] + [t for e in events[:-1] for t in e["token_ids"]], events[-1]


def kv_usage(stack: Stack) -> float:
    return metric(stack.prefill_url, "vllm:kv_cache_usage_perc")


def test_pd_output_equals_vllm_greedy_with_mtp(stack: Stack):
    want = [baseline(stack, p) for p in PROMPTS]
    drafted = accepted = 0
    for prompt, expected in zip(PROMPTS, want, strict=True):
        got, done = pd(stack, prompt)  # the connector's default: layer-wise
        assert got == expected, f"{len(prompt)}-token prompt: PD {got} != vLLM {expected}"
        drafted += done["mtp"]["drafted"]
        accepted += done["mtp"]["accepted"]
        timings = done["timings"]
        assert set(timings) >= {
            "wire_wait_ms",
            "convert_ms",
            "inject_ms",
            "decode_ms",
            "tpot_ms",
            "layerwise",
            "layers_early",
            "hidden_convert_ms",
        }
        # Every layer came one by one, the main layers during the forward (save_kv_layer), before the
        # MTP layer (after the drafter).
        assert timings["layerwise"] == 1.0 and timings["layers_layerwise"] == 3, timings
        assert timings["layers_early"] >= 1, timings
    assert drafted > 0 and accepted > 0, "MTP never accepted a draft"
    print(f"MTP acceptance over {len(PROMPTS)} requests: {accepted}/{drafted} = {accepted / drafted:.2f}")
    _wait_for(
        lambda: metric(stack.prefill_url, "vllm:tilert_handoffs_total", outcome="ok") >= len(PROMPTS),
        "handoffs to be counted on vLLM's /metrics",
        extra_request=lambda: _flush(stack),
    )


def test_pd_output_equals_vllm_greedy_with_layerwise_off(stack: Stack):
    """The whole-state handoff (tilert_layerwise off for these requests) stays equal too."""
    for prompt in PROMPTS[::4]:
        got, done = pd(stack, prompt, layerwise=False)
        assert got == baseline(stack, prompt), f"{len(prompt)}-token prompt"
        assert done["timings"]["layerwise"] == 0.0, done["timings"]


def test_unclaimed_requests_in_the_same_batches_are_untouched(stack: Stack):
    want = {i: baseline(stack, p) for i, p in enumerate(PROMPTS[:8])}

    def plain(i: int) -> list[int]:
        out = post_json(
            f"{stack.prefill_url}/v1/completions",
            {
                "model": "tiny",
                "prompt": PROMPTS[i],
                "max_tokens": NEW_TOKENS,
                "temperature": 0,
                "return_token_ids": True,
            },
        )
        assert "kv_transfer_params" not in out or not any(
            k.startswith("tilert_") for k in (out.get("kv_transfer_params") or {})
        )
        return out["choices"][0]["token_ids"]

    with ThreadPoolExecutor(8) as pool:
        claimed = [pool.submit(pd, stack, PROMPTS[i]) for i in range(4)]
        unclaimed = {i: pool.submit(plain, i) for i in range(8)}
        for i, fut in unclaimed.items():
            assert fut.result() == want[i]
        for i, fut in enumerate(claimed):
            assert fut.result()[0] == want[i]


def _dying_ctrl_server() -> tuple[int, threading.Event]:
    """A 'node' that sends its challenge, reads the answer, and dies (closes) mid-handshake."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(16)
    stop = threading.Event()

    def serve() -> None:
        from tilert_serve.handoff import framing, messages

        srv.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
            except TimeoutError:
                continue
            conn.sendall(framing.encode(messages.Challenge(nonce="ab" * 32, node="dying")))
            conn.recv(4096)
            conn.close()
        srv.close()

    threading.Thread(target=serve, daemon=True).start()
    return srv.getsockname()[1], stop


def test_failed_handoffs_leave_vllm_serving_and_free_its_blocks(stack: Stack, tmp_path):
    dying_port, stop = _dying_ctrl_server()
    closed_port = free_port()
    # A node that is killed between admission and handoff.
    doomed, doomed_url, doomed_ctrl = start_node(
        tmp_path, stack.model_dir, stack.secret_file, "doomed-node", slots=1
    )
    doomed.wait_ready(f"{doomed_url}/ready", 120)
    adm = post_json(f"{doomed_url}/v1/admit", {"request_id": "doomed"})
    doomed.kill()
    try:
        for port, ticket in ((dying_port, None), (closed_port, None), (doomed_ctrl, adm["ticket"])):
            out = prefill(stack, PROMPTS[10], "127.0.0.1", port, ticket)
            assert out["choices"][0]["text"] is not None  # the prefill itself still answers
        # vLLM goes on serving, through both paths, with correct output.
        assert pd(stack, PROMPTS[11])[0] == baseline(stack, PROMPTS[11])
        _wait_for(lambda: kv_usage(stack) == 0.0, "KV blocks to return")
        _wait_for(
            lambda: (
                sum(
                    metric(stack.prefill_url, "vllm:tilert_handoffs_total", outcome=o)
                    for o in ("unreachable", "protocol", "timeout")
                    if _has(stack, o)
                )
                >= 3
            ),
            "the three failures to be counted",
            extra_request=lambda: _flush(stack),
        )
    finally:
        stop.set()


def test_a_thousand_failed_handoffs_leak_nothing(stack: Stack):
    port = free_port()
    before_rss = _group_rss_mb(stack.procs["prefill"].popen.pid)
    before = (
        metric(stack.prefill_url, "vllm:tilert_handoffs_total", outcome="unreachable")
        if _has(stack, "unreachable")
        else 0.0
    )

    def one(i: int) -> None:
        prefill(stack, PROMPTS[i % 6], "127.0.0.1", port, None)

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(one, range(1000)))
    assert pd(stack, PROMPTS[2])[0] == baseline(stack, PROMPTS[2])  # still serving; also flushes stats
    _wait_for(
        lambda: (
            metric(stack.prefill_url, "vllm:tilert_handoffs_total", outcome="unreachable") - before >= 1000
        ),
        "1000 failures to be counted",
        extra_request=lambda: _flush(stack),
    )
    _wait_for(lambda: kv_usage(stack) == 0.0, "KV blocks to return")
    growth = _group_rss_mb(stack.procs["prefill"].popen.pid) - before_rss
    assert growth < 100, f"prefill processes grew by {growth:.0f} MB over 1000 failed handoffs"


# -- helpers -------------------------------------------------------------------------------------


def _flush(stack: Stack) -> None:
    """One more engine step: connector stats reach vLLM's /metrics with the step after a handoff."""
    post_json(f"{stack.prefill_url}/v1/completions", {"model": "tiny", "prompt": [5, 6], "max_tokens": 1})


def _has(stack: Stack, outcome: str) -> bool:
    try:
        metric(stack.prefill_url, "vllm:tilert_handoffs_total", outcome=outcome)
        return True
    except KeyError:
        return False


def _wait_for(cond, what: str, timeout: float = 30, extra_request=None) -> None:
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if cond():
                return
        except KeyError:
            pass
        if extra_request is not None:
            extra_request()  # connector stats reach the API server with the next engine step
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}")


def _group_rss_mb(pgid: int) -> float:
    total = 0
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            if os.getpgid(int(pid)) != pgid:
                continue
            with open(f"/proc/{pid}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1])
        except (ProcessLookupError, FileNotFoundError, PermissionError):
            continue
    return total / 1024
