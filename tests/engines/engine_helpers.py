"""Helpers shared by the engine tests: prompts, a prefill + decode round trip, and the one driver
that runs vLLM (vllm_run.py) in a subprocess and checks the engine's prefill state against it."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from tilert_serve.decode.engines.base import Sampling
from tilert_serve.decode.engines.reference import ReferenceEngine

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
GREEDY = Sampling()


def prompts(count: int, seed: int = 7) -> list[list[int]]:
    """Token-id prompts of varied lengths (1 to 40), skipping the BOS/EOS ids 0 and 1."""
    rng = random.Random(seed)
    lengths = [1, 2, 5, 16, 17, 23, 40, 9, 31, 3, 12, 28][:count]
    return [[rng.randrange(2, 512) for _ in range(n)] for n in lengths]


def decode(
    engine: ReferenceEngine, prompt: list[int], sampling: Sampling, max_new: int
) -> tuple[list[int], int, int]:
    """prefill + decode; returns (first token + new tokens, drafted, accepted)."""
    state, first = engine.prefill(prompt)
    seq = engine.start(state)
    try:
        tokens, drafted, accepted = [first], 0, 0
        for step in seq.decode(first, sampling, max_new):
            tokens += step.token_ids
            drafted += step.drafted
            accepted += step.accepted
        assert len(tokens) == max_new + 1
        return tokens, drafted, accepted
    finally:
        seq.close()


def run_vllm(
    model_dir: Path,
    work: Path,
    *,
    prompts: list[list[int]],
    max_tokens: int,
    num_speculative_tokens: int,
    dump_prompts: list[list[int]],
) -> dict[str, Any]:
    """vllm_run.py on `model_dir`: its result.json (greedy outputs, first tokens, MTP counters) with
    the cache rows of each dump prompt under "cache_rows"."""
    request = work / "request.json"
    request.write_text(
        json.dumps(
            {
                "prompts": prompts,
                "max_tokens": max_tokens,
                "num_speculative_tokens": num_speculative_tokens,
                "dump_prompts": dump_prompts,
            }
        )
    )
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run(
        [sys.executable, str(HERE / "vllm_run.py"), str(model_dir), str(request), str(work)],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, f"vLLM run failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}"
    result: dict[str, Any] = json.loads((work / "result.json").read_text())
    result["cache_rows"] = torch.load(work / "cache_rows.pt")
    print(f"vLLM init {result['seconds_init']:.1f} s, generate {result['seconds_generate']:.2f} s")
    return result


def assert_prefill_state_equals(
    engine: ReferenceEngine, prompt: list[int], rows: dict[str, torch.Tensor]
) -> int:
    """The engine's prefill state for `prompt` equals the cache rows vLLM wrote (kv_c || k_pe per
    layer, main layers and the MTP layer); returns the engine's first token."""
    state, first = engine.prefill(prompt)
    names = sorted(rows, key=lambda n: int(n.split(".")[2]))  # model.layers.<i>.self_attn.attn
    assert len(names) == engine.num_layers == len(state.layers), names
    for layer, name in zip(state.layers, names, strict=True):
        got = torch.cat([layer.kv, layer.pe], dim=-1)
        want = rows[name]
        assert want.shape == got.shape == (len(prompt), 576)
        err = float((got - want).abs().max())
        assert err < 1e-4, f"prompt of {len(prompt)} tokens, {name}: max abs difference {err}"
    return first
