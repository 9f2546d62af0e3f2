"""The tiny model generator: deterministic per seed, complete, and loadable.

That vLLM loads it (real weights, float32, MTP speculative config) and agrees with the reference
engine token for token is checked in tests/engines/test_reference_vs_vllm.py (marked slow).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoTokenizer

from tilert_serve import cli
from tilert_serve.decode.engines import reference_model as rm
from tilert_serve.tinymodel import mtp_fit
from tilert_serve.tinymodel.generate import TinySpec, generate, model_config, random_tensors


def _files(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


def test_same_seed_gives_identical_files_and_other_seeds_differ(tmp_path: Path) -> None:
    generate(TinySpec(seed=3), tmp_path / "a")
    generate(TinySpec(seed=3), tmp_path / "b")
    generate(TinySpec(seed=4), tmp_path / "c")
    a, b, c = _files(tmp_path / "a"), _files(tmp_path / "b"), _files(tmp_path / "c")
    assert set(a) >= {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    }
    assert a == b
    assert a["model.safetensors"] != c["model.safetensors"]
    assert a["tokenizer.json"] == c["tokenizer.json"]  # the tokenizer does not depend on the seed


def test_checkpoint_is_a_deepseek_v3_with_one_mtp_layer(tmp_path: Path) -> None:
    report = generate(TinySpec(), tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["architectures"] == ["DeepseekV3ForCausalLM"]
    assert (cfg["kv_lora_rank"], cfg["qk_rope_head_dim"]) == (512, 64)
    assert cfg["num_nextn_predict_layers"] == 1
    assert "rope_scaling" not in cfg
    assert cfg["first_k_dense_replace"] == 1 and cfg["n_shared_experts"] == 1
    hf = AutoConfig.from_pretrained(tmp_path)  # what vLLM reads
    assert (hf.scoring_func, hf.topk_method, hf.rope_parameters["rope_type"]) == (
        "sigmoid",
        "noaux_tc",
        "default",
    )

    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
    mtp = f"model.layers.{cfg['num_hidden_layers']}"
    for suffix in (
        "enorm.weight",
        "hnorm.weight",
        "eh_proj.weight",
        "shared_head.norm.weight",
        "shared_head.head.weight",
        "embed_tokens.weight",
        "self_attn.kv_b_proj.weight",
        "mlp.gate.e_score_correction_bias",
        "mlp.experts.3.down_proj.weight",
        "mlp.shared_experts.up_proj.weight",
    ):
        assert f"{mtp}.{suffix}" in names
    assert "model.layers.0.mlp.gate_proj.weight" in names  # the first layer is dense
    assert "model.layers.1.mlp.gate.weight" in names  # then MoE

    weights = rm.load_weights(tmp_path)  # the reference engine's loader takes every tensor
    assert len(weights.layers) == 2 and len(weights.mtp) == 1
    # The MTP layer drafts usefully: it predicts the main model's next-next greedy token often.
    assert report.mtp.accuracy_after > 0.3

    tok = AutoTokenizer.from_pretrained(tmp_path)
    assert tok.eos_token == "<|eos|>" and tok.eos_token_id == cfg["eos_token_id"]
    text = "The quick brown fox jumps over the lazy dog."
    ids = tok(text).input_ids
    assert max(ids) < cfg["vocab_size"] and tok.decode(ids) == text
    assert len(tok) == cfg["vocab_size"]  # every id the model can emit decodes
    gen = json.loads((tmp_path / "generation_config.json").read_text())
    assert gen["eos_token_id"] == cfg["eos_token_id"]


def test_cli_writes_a_model_and_rejects_bad_flags(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        cli.main(
            ["tiny-model", "--out", str(tmp_path / "m"), "--seed", "5", "--experts", "8", "--top-k", "3"]
        )
        == 0
    )
    assert "MTP draft accuracy" in capsys.readouterr().out
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    assert (cfg["n_routed_experts"], cfg["num_experts_per_tok"]) == (8, 3)
    assert (
        cli.main(["tiny-model", "--out", str(tmp_path / "v"), "--vocab", "1024", "--mtp-fit-steps", "0"]) == 0
    )
    assert len(AutoTokenizer.from_pretrained(tmp_path / "v")) == 1024
    assert cli.main(["tiny-model", "--out", str(tmp_path / "x"), "--experts", "4", "--top-k", "5"]) == 2
    assert "--top-k 5" in capsys.readouterr().out


def test_mtp_export_inverts_the_loader_and_fitting_runs() -> None:
    spec = TinySpec(hidden=64, vocab=300)
    config = model_config(spec, 0, 1)
    tensors = random_tensors(spec)
    cfg = rm.ModelConfig.from_dict(config)
    mtp = rm.build_weights(cfg, tensors).mtp[0]
    exported = mtp_fit.export_layer(cfg, cfg.num_hidden_layers, mtp)
    for name, t in exported.items():
        assert torch.equal(t, tensors[name]), name
    trained = dict(tensors)
    report = mtp_fit.fit(config, trained, steps=2, seed=0, avoid={0, 1})
    assert report.steps == 2 and report.final_loss == report.final_loss  # not NaN
    changed = [n for n in exported if not torch.equal(trained[n], tensors[n])]
    assert "model.layers.2.eh_proj.weight" in changed
    assert all(torch.equal(trained[n], tensors[n]) for n in tensors if not n.startswith("model.layers.2."))


def test_the_tokenizer_speaks_chat_and_an_older_generation_is_stale(tmp_path: Path) -> None:
    from tilert_serve import tinymodel

    assert not tinymodel.is_current(tmp_path)
    generate(TinySpec(), tmp_path)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    text = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert text == "<|bos|><|user|>\nhi\n<|assistant|>\n"
    assert tinymodel.is_current(tmp_path)
    record = json.loads((tmp_path / tinymodel.SPEC_FILE).read_text())
    (tmp_path / tinymodel.SPEC_FILE).write_text(json.dumps({**record, "generator": 1}))
    assert not tinymodel.is_current(tmp_path)  # `tilert-pd local up` generates it again
