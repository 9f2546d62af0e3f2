"""The native path end to end on CPU: the router in front of a vLLM prefill running
MultiConnector[TileRTConnector, NixlConnector] (as the operator renders it) and a native vLLM decode
reading the KV with NixlConnector. The decode must not recompute the prompt (its prompt-token counters
by source say where each token came from) and must answer what vLLM alone answers, token for token.

MooncakeConnector is not run here: on vLLM 0.32's CPU build its worker raises at once
(`torch.accelerator.current_device_index()` on a torch without an accelerator). With that one call
answered (device 0), the prefill side ran (bootstrap registry, the router's /query, the prefill leg),
but the decode's worker then blocked on its receiver loop in get_finished and never queried the
prefill's registry, so no KV moved. What the router sends for it is checked against vLLM's own
MooncakeConnectorScheduler in tests/router/test_router_native_connectors.py.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from tests.e2e.conftest import prefill_kv_config, vllm_argv
from tests.e2e.procs import PY, Proc, metric, post_json
from tilert_serve import vllm_cpu
from tilert_serve.local.runner import free_port

pytestmark = pytest.mark.slow

# vLLM's CPU build pays ~0.5 s a step with a connector loaded: short generations.
NEW_TOKENS = 6
rng = random.Random(99)
PROMPTS = [[rng.randrange(2, 512) for _ in range(n)] for n in (5, 33, 140)]

@dataclass
class Native:
    connector: str
    router_url: str
    prefill_url: str
    decode_url: str
    procs: dict[str, Proc]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    from tilert_serve.tinymodel.generate import TinySpec, generate

    root = tmp_path_factory.mktemp("native-model")
    generate(TinySpec(), root / "tiny")
    (root / "secret").write_text("00" * 32)
    return root / "tiny", root / "secret"


@pytest.fixture(scope="module")
def plain(model: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = free_port()
    proc = Proc("plain", vllm_argv(model[0], port, None), tmp_path_factory.mktemp("plain"))
    try:
        proc.wait_ready(f"http://127.0.0.1:{port}/health", 600)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.stop()


def _with_native(kv: dict, native: dict) -> dict:
    kv = json.loads(json.dumps(kv))
    kv["kv_connector_extra_config"]["connectors"][1] = native
    return kv


@pytest.fixture(scope="module")
def native(model: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Native]:
    connector = "NixlConnector"
    model_dir, secret = model
    root = tmp_path_factory.mktemp(connector)
    extra = {"kv_buffer_device": "cpu"}
    router_extra = {"native_connector": connector}
    # Own side-channel ports: vLLM's default (5600) may be taken by another stack on this machine.
    # As the operator renders a CPU pool's environment (vllm_cpu.serve_env: a core left for the engine).
    p_env = {"VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1", "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port()),
             **vllm_cpu.serve_env()}
    d_env = {"VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1", "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port()),
             **vllm_cpu.serve_env()}
    p_port, d_port, r_port = free_port(), free_port(), free_port()
    p_kv = _with_native(prefill_kv_config(secret), {"kv_connector": connector, "kv_role": "kv_producer", **extra})
    d_kv = {"kv_connector": connector, "kv_role": "kv_consumer", **extra}
    procs: dict[str, Proc] = {}
    try:
        procs["prefill"] = Proc("prefill", vllm_argv(model_dir, p_port, p_kv), root, p_env)
        procs["decode"] = Proc("decode", vllm_argv(model_dir, d_port, d_kv), root, d_env)
        cfg = {"model": "tiny", "prefill": [f"http://127.0.0.1:{p_port}"], "native": [f"http://127.0.0.1:{d_port}"],
               "policy": {"default": "native"}, **router_extra}
        (root / "router.yaml").write_text(yaml.safe_dump(cfg))
        procs["router"] = Proc("router", [PY, "-m", "tilert_serve.router.cli", "--config", str(root / "router.yaml"),
                                          "--host", "127.0.0.1", "--port", str(r_port)], root)
        procs["prefill"].wait_ready(f"http://127.0.0.1:{p_port}/health", 600)
        procs["decode"].wait_ready(f"http://127.0.0.1:{d_port}/health", 600)
        procs["router"].wait_ready(f"http://127.0.0.1:{r_port}/health", 60)
        yield Native(connector, f"http://127.0.0.1:{r_port}", f"http://127.0.0.1:{p_port}",
                     f"http://127.0.0.1:{d_port}", procs)
    finally:
        for p in procs.values():
            p.stop()


def _by_source(url: str) -> dict[str, float]:
    return {s: metric(url, "vllm:prompt_tokens_by_source_total", source=s)
            for s in ("local_compute", "local_cache_hit", "external_kv_transfer")}


def test_native_path_hands_the_kv_over_and_equals_vllm(native: Native, plain: str) -> None:
    for prompt in PROMPTS:
        body = {"model": "tiny", "prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0,
                "return_token_ids": True, "ignore_eos": True}
        expected = post_json(f"{plain}/v1/completions", body)["choices"][0]["token_ids"]
        before = _by_source(native.decode_url)
        out = post_json(f"{native.router_url}/v1/completions", body, timeout=300)
        after = _by_source(native.decode_url)
        got = {s: after[s] - before[s] for s in after}
        logs = "\n".join(p.tail(40) for p in native.procs.values())
        assert out["choices"][0]["token_ids"] == expected, logs
        # The decode computed at most the prompt's last token itself; the rest came over the connector.
        assert got["external_kv_transfer"] >= len(prompt) - 1, (got, logs)
        assert got["local_compute"] <= 1, (got, logs)
