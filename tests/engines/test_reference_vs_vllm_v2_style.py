"""The reference engine against vLLM on a DeepSeek-V2-Lite-style variant of the tiny model.

The default tiny model covers DeepSeek-V3's choices (query LoRA, sigmoid routing with a correction
bias, plain RoPE). This variant flips every one the engine branches on: no query LoRA (q_proj), YaRN
RoPE scaling (frequencies, cos/sin magnitude and softmax scale), softmax routing without bias or
renormalisation over two expert groups, another routed scaling factor. One more vLLM instance.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from engine_helpers import GREEDY, assert_prefill_state_equals, decode, run_vllm
from safetensors.torch import load_file, save_file

from tilert_serve.decode.engines.reference import ReferenceEngine, ReferenceSettings
from tilert_serve.tinymodel.generate import TinySpec, generate

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
    result = run_vllm(
        model, tmp_path, prompts=prompts, max_tokens=16, num_speculative_tokens=1, dump_prompts=prompts[1:3]
    )

    engine = ReferenceEngine(
        ReferenceSettings(model_dir=str(model), max_seq_len=128, num_speculative_tokens=1)
    )
    engine.load()
    assert engine.config.yarn is not None and engine.weights.layers[0].attn.q_a is None
    for prompt, want in zip(prompts, result["outputs"], strict=True):
        assert decode(engine, prompt, GREEDY, 15)[0] == want, f"prompt of {len(prompt)} tokens"
    for prompt, rows in zip(prompts[1:3], result["cache_rows"], strict=True):
        assert_prefill_state_equals(engine, prompt, rows)
