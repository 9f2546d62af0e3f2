"""Write a tiny DeepSeek-V3-style checkpoint (MLA + MoE + one MTP layer) that vLLM's CPU build loads.

Everything is generated locally from a seed: config.json, model.safetensors (float32, every weight
including the MTP layer as ``model.layers.<num_hidden_layers>.*``), a byte-level BPE tokenizer and
generation_config.json. The same seed and spec give byte-identical files on the same machine.

Shapes are fixed where vLLM's CPU backend insists: the MLA latent must be 576 wide (kv_lora_rank 512 +
qk_rope_head_dim 64) and the prefill attention needs head dims the CPU kernels accept (nope 128,
v 128). Random weights are scaled so that attention and the MLP move the residual stream as much as
the token embedding does (greedy text then depends on context instead of cycling through a fixed
token map) and so that logits are spread wide, keeping greedy choices far from ties: the tests
compare exact token ids between vLLM and the reference engine in float32.

The MTP layer starts as a copy of the last main layer fed the next token's embedding, so that it
computes roughly what the main model computes one position later and its drafts are accepted about
half the time; ``mtp_fit`` measures that on the main model's own greedy text (and can fit it further).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from tilert_serve.tinymodel import GENERATOR_VERSION, SPEC_FILE, mtp_fit
from tilert_serve.tinymodel.tokenizer import BOS, EOS, train_tokenizer, write_tokenizer

ARCHITECTURE = "DeepseekV3ForCausalLM"
#: vLLM's CPU MLA backend only accepts a 576-wide latent (csrc/cpu/mla_decode.cpp).
KV_LORA_RANK = 512
QK_ROPE_HEAD_DIM = 64
QK_NOPE_HEAD_DIM = 128
V_HEAD_DIM = 128
#: Output scale of attention and MLP blocks relative to the unit-RMS token embedding. Larger makes
#: the text depend more on context but harder to draft; at 0.4/0.3 continuations stay varied
#: (about 21 distinct tokens in 24) while a copy of the last layer already drafts about half right.
ATTN_GAIN = 0.4
MLP_GAIN = 0.3


@dataclass(frozen=True)
class TinySpec:
    """What `tilert-pd tiny-model` can change. Defaults give a ~3 M parameter model."""

    seed: int = 0
    layers: int = 2  # main layers: the first is dense, the rest MoE
    hidden: int = 256
    #: vLLM on CPU needs ``vllm_cpu.VLLM_CPU_COMPILATION_CONFIG`` for correct RoPE with any head
    #: count (its rotary kernel mis-strides MLA's query and key views).
    heads: int = 2
    q_lora_rank: int = 64  # 0: no query LoRA (q_proj), as DeepSeek-V2-Lite
    intermediate: int = 512  # dense MLP width
    moe_intermediate: int = 128  # per expert
    experts: int = 4
    top_k: int = 2
    vocab: int = 512
    max_positions: int = 2048
    #: Gradient steps that fit the MTP layer after its copy-of-last-layer start (see mtp_fit: the
    #: start drafts better than what a few seconds of fitting reach, so 0 by default).
    mtp_fit_steps: int = 0

    def validate(self) -> None:
        if self.layers < 1:
            raise ValueError(f"--layers {self.layers}: need at least 1 main layer")
        if self.experts < 2 or self.top_k < 1 or self.top_k > self.experts:
            raise ValueError(
                f"--experts {self.experts} --top-k {self.top_k}: need 2 <= experts and 1 <= top_k <= experts"
            )
        if self.hidden % 2 or self.hidden < 16:
            raise ValueError(f"--hidden {self.hidden}: must be even and at least 16")
        if self.q_lora_rank < 0:
            raise ValueError(f"--q-lora-rank {self.q_lora_rank}: must be >= 0 (0 = no query LoRA)")
        if self.heads < 1:
            raise ValueError(f"--heads {self.heads}: need at least 1")


def model_config(spec: TinySpec, bos_id: int, eos_id: int) -> dict[str, Any]:
    """config.json for DeepseekV3ForCausalLM. No rope_scaling: plain RoPE."""
    return {
        "architectures": [ARCHITECTURE],
        "model_type": "deepseek_v3",
        "vocab_size": spec.vocab,
        "hidden_size": spec.hidden,
        "intermediate_size": spec.intermediate,
        "moe_intermediate_size": spec.moe_intermediate,
        "num_hidden_layers": spec.layers,
        "num_attention_heads": spec.heads,
        "num_key_value_heads": spec.heads,
        "q_lora_rank": spec.q_lora_rank or None,
        "kv_lora_rank": KV_LORA_RANK,
        "qk_nope_head_dim": QK_NOPE_HEAD_DIM,
        "qk_rope_head_dim": QK_ROPE_HEAD_DIM,
        "v_head_dim": V_HEAD_DIM,
        "n_routed_experts": spec.experts,
        "n_shared_experts": 1,
        "num_experts_per_tok": spec.top_k,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "n_group": 1,
        "topk_group": 1,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": spec.max_positions,
        "num_nextn_predict_layers": 1,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "torch_dtype": "float32",
        "use_cache": True,
    }


def _normal(gen: torch.Generator, *shape: int, std: float) -> torch.Tensor:
    return torch.randn(*shape, generator=gen, dtype=torch.float32) * std


def _norm_weight(gen: torch.Generator, n: int) -> torch.Tensor:
    # Near 1 but not exactly: a wrong norm weight then changes the output.
    return 1.0 + _normal(gen, n, std=0.1)


def _layer_tensors(spec: TinySpec, gen: torch.Generator, idx: int, moe: bool) -> dict[str, torch.Tensor]:
    h, heads = spec.hidden, spec.heads
    p = f"model.layers.{idx}"
    qk = QK_NOPE_HEAD_DIM + QK_ROPE_HEAD_DIM
    t: dict[str, torch.Tensor] = {
        f"{p}.input_layernorm.weight": _norm_weight(gen, h),
        f"{p}.post_attention_layernorm.weight": _norm_weight(gen, h),
    }
    # x2 on the query: sharper attention, so the context (not only the last token) shapes the output.
    if spec.q_lora_rank > 0:
        t[f"{p}.self_attn.q_a_proj.weight"] = _normal(gen, spec.q_lora_rank, h, std=h**-0.5)
        t[f"{p}.self_attn.q_a_layernorm.weight"] = _norm_weight(gen, spec.q_lora_rank)
        t[f"{p}.self_attn.q_b_proj.weight"] = _normal(
            gen, heads * qk, spec.q_lora_rank, std=2.0 * spec.q_lora_rank**-0.5
        )
    else:  # DeepSeek-V2-Lite style: no query LoRA
        t[f"{p}.self_attn.q_proj.weight"] = _normal(gen, heads * qk, h, std=2.0 * h**-0.5)
    t |= {
        f"{p}.self_attn.kv_a_proj_with_mqa.weight": _normal(
            gen, KV_LORA_RANK + QK_ROPE_HEAD_DIM, h, std=h**-0.5
        ),
        f"{p}.self_attn.kv_a_layernorm.weight": _norm_weight(gen, KV_LORA_RANK),
        f"{p}.self_attn.kv_b_proj.weight": _normal(
            gen, heads * (QK_NOPE_HEAD_DIM + V_HEAD_DIM), KV_LORA_RANK, std=KV_LORA_RANK**-0.5
        ),
        f"{p}.self_attn.o_proj.weight": _normal(
            gen, h, heads * V_HEAD_DIM, std=ATTN_GAIN * (heads * V_HEAD_DIM) ** -0.5
        ),
    }

    def mlp(prefix: str, width: int, gain: float) -> None:
        t[f"{prefix}.gate_proj.weight"] = _normal(gen, width, h, std=h**-0.5)
        t[f"{prefix}.up_proj.weight"] = _normal(gen, width, h, std=h**-0.5)
        t[f"{prefix}.down_proj.weight"] = _normal(gen, h, width, std=gain * width**-0.5)

    if moe:
        t[f"{p}.mlp.gate.weight"] = _normal(gen, spec.experts, h, std=2.0 * h**-0.5)
        t[f"{p}.mlp.gate.e_score_correction_bias"] = _normal(gen, spec.experts, std=0.1)
        for e in range(spec.experts):
            mlp(f"{p}.mlp.experts.{e}", spec.moe_intermediate, MLP_GAIN)
        mlp(f"{p}.mlp.shared_experts", spec.moe_intermediate, MLP_GAIN)
    else:
        mlp(f"{p}.mlp", spec.intermediate, MLP_GAIN)
    return t


def random_tensors(spec: TinySpec) -> dict[str, torch.Tensor]:
    """Every checkpoint tensor, seeded; MTP layer included (random until fitted)."""
    gen = torch.Generator().manual_seed(spec.seed)
    h, v = spec.hidden, spec.vocab
    embed = _normal(gen, v, h, std=1.0)
    # Logits spread with std ~6 over the vocabulary: wide gaps between the best two tokens.
    lm_head = _normal(gen, v, h, std=6.0 * h**-0.5)
    tensors: dict[str, torch.Tensor] = {"model.embed_tokens.weight": embed}
    for i in range(spec.layers):
        tensors.update(_layer_tensors(spec, gen, i, moe=i >= 1))
    tensors["model.norm.weight"] = _norm_weight(gen, h)
    tensors["lm_head.weight"] = lm_head
    tensors.update(_mtp_start(spec, gen, tensors))
    return tensors


def _mtp_start(
    spec: TinySpec, gen: torch.Generator, main: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """The MTP layer before fitting: a copy of the last main layer behind an ``eh_proj`` that passes
    the (normalised) next-token embedding through. It then computes roughly what the main model
    computes one position later, which already drafts well; fitting refines it."""
    h, m = spec.hidden, spec.layers
    p = f"model.layers.{m}"
    own = _layer_tensors(spec, gen, m, moe=True)
    last = f"model.layers.{m - 1}."
    for name in own:
        copied = name.replace(f"{p}.", last)
        if copied in main and main[copied].shape == own[name].shape:
            own[name] = main[copied].clone()
    own[f"{p}.enorm.weight"] = torch.ones(h)
    own[f"{p}.hnorm.weight"] = _norm_weight(gen, h)
    own[f"{p}.eh_proj.weight"] = torch.cat([torch.eye(h), _normal(gen, h, h, std=0.01 * h**-0.5)], dim=1)
    own[f"{p}.shared_head.norm.weight"] = main["model.norm.weight"].clone()
    # vLLM shares the target's embedding and lm_head with MTP; the checkpoint carries copies, as
    # DeepSeek-V3's does, so that a loader that does not share them still computes the same thing.
    own[f"{p}.embed_tokens.weight"] = main["model.embed_tokens.weight"].clone()
    own[f"{p}.shared_head.head.weight"] = main["lm_head.weight"].clone()
    return own


@dataclass(frozen=True)
class GenerateReport:
    out_dir: Path
    seconds: float
    num_parameters: int
    mtp: mtp_fit.FitReport


def generate(spec: TinySpec, out_dir: str | Path) -> GenerateReport:
    spec.validate()
    started = time.monotonic()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    tokenizer = train_tokenizer(spec.vocab)
    ids = tokenizer.convert_tokens_to_ids([BOS, EOS])
    assert isinstance(ids, list)  # a list in, a list out
    bos_id, eos_id = ids
    config = model_config(spec, bos_id, eos_id)
    tensors = random_tensors(spec)
    report = mtp_fit.fit(config, tensors, steps=spec.mtp_fit_steps, seed=spec.seed, avoid={bos_id, eos_id})

    write_tokenizer(tokenizer, out)
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    generation = {"bos_token_id": bos_id, "eos_token_id": eos_id, "_from_model_config": True}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2, sort_keys=True) + "\n")
    record = {**asdict(spec), "generator": GENERATOR_VERSION}
    (out / SPEC_FILE).write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
    save_file(
        {k: v.contiguous() for k, v in sorted(tensors.items())},
        str(out / "model.safetensors"),
        metadata={"format": "pt"},
    )
    return GenerateReport(
        out_dir=out,
        seconds=time.monotonic() - started,
        num_parameters=sum(t.numel() for t in tensors.values()),
        mtp=report,
    )
