"""The PD stack on CPU for end-to-end tests: a tiny generated model, a TileRT decode node on the
reference engine, a vLLM prefill with MultiConnector[TileRTConnector, NixlConnector] and MTP, and a
plain vLLM (no connector) as the baseline. Started once per module: vLLM takes ~30 s to boot here."""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.e2e.procs import PY, Proc
from tilert_serve import vllm_cpu
from tilert_serve.local.runner import free_port

MAX_SEQ_LEN = 512
MTP = json.dumps({"method": "mtp", "num_speculative_tokens": 1, **vllm_cpu.drafter_config()})


@dataclass
class Stack:
    model_dir: Path
    secret_file: Path
    prefill_url: str
    plain_url: str
    node_url: str
    ctrl_port: int
    procs: dict[str, Proc]
    log_dir: Path


def vllm_argv(model_dir: Path, port: int, kv_transfer_config: dict | None) -> list[str]:
    argv = [PY, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir), "--served-model-name", "tiny",
            "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--enforce-eager",
            "--max-model-len", str(MAX_SEQ_LEN), "--gpu-memory-utilization", "0.3",
            "--kv-cache-memory-bytes", str(256 << 20), "--speculative-config", MTP, *vllm_cpu.serve_args()]
    if kv_transfer_config is not None:
        argv += ["--kv-transfer-config", json.dumps(kv_transfer_config)]
    return argv


def prefill_kv_config(secret_file: Path) -> dict:
    tilert = {"kv_connector": "TileRTConnector", "kv_connector_module_path": "tilert_serve.pd_vllm.prefill_connector",
              "kv_role": "kv_producer",
              "kv_connector_extra_config": {"tilert_model": "mla", "tilert_max_seq_len": MAX_SEQ_LEN,
                                            "tilert_secret_path": str(secret_file), "tilert_local_host": "127.0.0.1",
                                            "tilert_timeout_s": 5, "tilert_staging_requests": 2}}
    native = {"kv_connector": "NixlConnector", "kv_role": "kv_producer", "kv_buffer_device": "cpu"}
    return {"kv_connector": "MultiConnector", "kv_role": "kv_producer",
            "kv_connector_extra_config": {"connectors": [tilert, native]}}


def start_node(stack_dir: Path, model_dir: Path, secret_file: Path, name: str, slots: int = 4) -> tuple[Proc, str, int]:
    http, ctrl = free_port(), free_port()
    proc = Proc(name, [PY, "-m", "tilert_serve.cli", "decode-node", "--model-dir", str(model_dir), "--tilert-model", "mla",
                       "--engine", "reference", "--slots", str(slots), "--max-seq-len", str(MAX_SEQ_LEN),
                       "--host", "127.0.0.1", "--advertise-host", "127.0.0.1", "--ctrl-port", str(ctrl),
                       "--http-port", str(http), "--secret-file", str(secret_file), "--dtype", "float32",
                       "--name", name], stack_dir)
    return proc, f"http://127.0.0.1:{http}", ctrl


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    from tilert_serve.tinymodel.generate import TinySpec, generate

    root = tmp_path_factory.mktemp("pd-stack")
    model_dir = root / "tiny"
    generate(TinySpec(), model_dir)
    secret_file = root / "secret"
    secret_file.write_text(secrets.token_hex(32))
    procs: dict[str, Proc] = {}
    try:
        node, node_url, ctrl = start_node(root, model_dir, secret_file, "decode-node")
        procs["node"] = node
        p_port, b_port = free_port(), free_port()
        procs["prefill"] = Proc("prefill", vllm_argv(model_dir, p_port, prefill_kv_config(secret_file)), root,
                                vllm_cpu.serve_env())
        procs["plain"] = Proc("plain", vllm_argv(model_dir, b_port, None), root)
        node.wait_ready(f"{node_url}/ready", 120)
        procs["prefill"].wait_ready(f"http://127.0.0.1:{p_port}/health", 300)
        procs["plain"].wait_ready(f"http://127.0.0.1:{b_port}/health", 300)
        yield Stack(model_dir, secret_file, f"http://127.0.0.1:{p_port}", f"http://127.0.0.1:{b_port}", node_url,
                    ctrl, procs, root)
    finally:
        for p in procs.values():
            p.stop()
