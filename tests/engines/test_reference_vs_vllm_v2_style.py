"""The reference engine against vLLM on a DeepSeek-V2-Lite-style variant of the tiny model.

The default tiny model covers DeepSeek-V3's choices (query LoRA, sigmoid routing with a correction
bias, plain RoPE). This variant flips every one the engine branches on: no query LoRA (q_proj), YaRN
RoPE scaling (frequencies, cos/sin magnitude and softmax scale), softmax routing without bias or
renormalisation over two expert groups, another routed scaling factor. One more vLLM instance.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tilert_serve.decode.engines.base import Sampling
from tilert_serve.decode.engines.reference import ReferenceEngine, ReferenceSettings
from tilert_serve.tinymodel.generate import TinySpec, generate

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
LENGTHS = [1, 6, 17, 40]


def _v2_style_model(out: Path) -> None:
    generate(TinySpec(seed=5, q_lora_rank=0), out)
    cfg = json.loads((out / "config.json").read_text())
    cfg.update(
        rope_scaling={
            "type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 512,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,  # != mscale_all_dim: cos/sin get scaled too
            "mscale_all_dim": 0.707,
        },
        scoring_func="softmax",
        topk_method="greedy",
        norm_topk_prob=False,
        n_group=2,
        topk_group=2,
        routed_scaling_factor=1.5,
    )
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    # Without noaux_tc there is no correction-bias parameter: vLLM would reject the tensor.
    tensors = load_file(out / "model.safetensors")
    kept = {k: v for k, v in tensors.items() if "e_score_correction_bias" not in k}
    save_file(kept, str(out / "model.safetensors"), metadata={"format": "pt"})


@pytest.mark.slow
def test_v2_style_variant_matches_vllm(tmp_path: Path) -> None:
    model = tmp_path / "model"
    _v2_style_model(model)
    rng = random.Random(3)
    prompts = [[rng.randrange(2, 512) for _ in range(n)] for n in LENGTHS]
    (tmp_path / "request.json").write_text(
        json.dumps(
            {"prompts": prompts, "max_tokens": 16, "num_speculative_tokens": 1, "dump_prompts": prompts[1:3]}
        )
    )
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run(
        [
            sys.executable,
            str(HERE / "vllm_run.py"),
            str(model),
            str(tmp_path / "request.json"),
            str(tmp_path),
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, f"vLLM run failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}"
    result = json.loads((tmp_path / "result.json").read_text())
    rows = torch.load(tmp_path / "cache_rows.pt")

    engine = ReferenceEngine(
        ReferenceSettings(model_dir=str(model), max_seq_len=128, num_speculative_tokens=1)
    )
    engine.load()
    assert engine.config.yarn is not None and engine.weights.layers[0].attn.q_a is None
    for prompt, want in zip(prompts, result["outputs"], strict=True):
        state, first = engine.prefill(prompt)
        seq = engine.start(state)
        try:
            got = [first] + [t for step in seq.decode(first, Sampling(), 15) for t in step.token_ids]
        finally:
            seq.close()
        assert got == want, f"prompt of {len(prompt)} tokens"
    for prompt, dumped in zip(prompts[1:3], rows, strict=True):
        state, _ = engine.prefill(prompt)
        names = sorted(dumped, key=lambda n: int(n.split(".")[2]))
        for layer, name in zip(state.layers, names, strict=True):
            err = float((torch.cat([layer.kv, layer.pe], dim=-1) - dumped[name]).abs().max())
            assert err < 1e-4, f"{name}: max abs difference {err}"
