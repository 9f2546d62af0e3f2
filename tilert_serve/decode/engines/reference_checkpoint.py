"""DeepSeek-V3-style checkpoints for the reference engine: config.json fields and weight tensors.

Reads the HF layout vLLM loads (``model.layers.<i>.*``, the MTP layer as
``model.layers.<num_hidden_layers>.*``) into weight dataclasses shaped for the math in
``reference_model``: gate and up projections merged (vLLM's gate_up_proj), ``kv_b_proj`` split into
W_UK and W_UV for the absorbed attention.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open


class CheckpointError(ValueError):
    """The checkpoint directory does not hold a model this engine can run."""


def yarn_get_mscale(scale: float, mscale: float) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


@dataclass(frozen=True)
class YarnScaling:
    """DeepSeek's YaRN RoPE scaling, as vLLM applies it (DeepseekScalingRotaryEmbedding)."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32
    beta_slow: float = 1
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    #: vLLM scales the softmax by yarn_get_mscale(factor, mscale_all_dim) ** 2 ("deepseek_yarn"),
    #: except when the config sets attention_factor 1.0 ("deepseek_llama_scaling").
    scales_softmax: bool = True

    @classmethod
    def from_config(cls, rope: dict[str, Any]) -> YarnScaling | None:
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind == "default":
            return None
        if kind not in ("yarn", "deepseek_yarn"):
            raise CheckpointError(
                f"config.json rope_scaling type {kind!r} is not supported by the reference engine "
                "(supported: none, or DeepSeek's 'yarn')"
            )
        try:
            return cls(
                factor=float(rope["factor"]),
                original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
                beta_fast=float(rope.get("beta_fast", 32)),
                beta_slow=float(rope.get("beta_slow", 1)),
                mscale=float(rope.get("mscale", 1.0)),
                mscale_all_dim=float(rope.get("mscale_all_dim", 0.0)),
                scales_softmax=rope.get("attention_factor") != 1.0,
            )
        except KeyError as e:
            raise CheckpointError(f"config.json rope_scaling (yarn) is missing {e.args[0]!r}") from e

    def inv_freq(self, rotary_dim: int, theta: float) -> torch.Tensor:
        pos_freqs = theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float) / rotary_dim)
        extrapolation = 1.0 / pos_freqs
        interpolation = 1.0 / (self.factor * pos_freqs)

        def correction_dim(rotations: float) -> float:
            return (
                rotary_dim * math.log(self.original_max_position_embeddings / (rotations * 2 * math.pi))
            ) / (2 * math.log(theta))

        low = max(math.floor(correction_dim(self.beta_fast)), 0)
        high: float = min(math.ceil(correction_dim(self.beta_slow)), rotary_dim - 1)
        if low == high:
            high += 0.001
        ramp = torch.clamp((torch.arange(rotary_dim // 2, dtype=torch.float) - low) / (high - low), 0, 1)
        keep = 1 - ramp  # 1: extrapolate (high frequencies), 0: interpolate
        return interpolation * (1 - keep) + extrapolation * keep

    @property
    def cos_sin_scale(self) -> float:
        return yarn_get_mscale(self.factor, self.mscale) / yarn_get_mscale(self.factor, self.mscale_all_dim)


@dataclass(frozen=True)
class ModelConfig:
    """The config.json fields the math needs (DeepseekV3ForCausalLM naming)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    n_routed_experts: int | None
    n_shared_experts: int | None
    num_experts_per_tok: int
    first_k_dense_replace: int
    moe_layer_freq: int
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    scoring_func: str
    topk_method: str
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    num_nextn_predict_layers: int
    eos_token_id: int | None = None
    #: None for plain RoPE, else DeepSeek's YaRN scaling (config.json rope_scaling type "yarn").
    yarn: YarnScaling | None = None

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Width of one cached row: kv_lora_rank + qk_rope_head_dim."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        scale: float = self.qk_head_dim**-0.5  # as vLLM computes it, bit for bit
        if self.yarn is not None and self.yarn.scales_softmax:
            m = yarn_get_mscale(self.yarn.factor, self.yarn.mscale_all_dim)
            scale = scale * m * m
        return scale

    def is_moe_layer(self, layer_idx: int) -> bool:
        # vLLM's rule, applied to the MTP layer's index too (it is num_hidden_layers + i).
        return (
            self.n_routed_experts is not None
            and layer_idx >= self.first_k_dense_replace
            and layer_idx % self.moe_layer_freq == 0
        )

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        if raw.get("hidden_act", "silu") != "silu":
            raise CheckpointError(f"config.json hidden_act={raw['hidden_act']!r}: only 'silu' is supported")
        rope = raw.get("rope_scaling") or raw.get("rope_parameters") or {}
        yarn = YarnScaling.from_config(rope)
        rope_theta = raw.get("rope_theta", rope.get("rope_theta", 10000.0))
        eos = raw.get("eos_token_id")
        if isinstance(eos, list):
            eos = eos[0] if eos else None
        scoring = raw.get("scoring_func", "softmax")
        if scoring not in ("softmax", "sigmoid"):
            raise CheckpointError(f"config.json scoring_func={scoring!r}: expected 'softmax' or 'sigmoid'")
        try:
            return cls(
                vocab_size=int(raw["vocab_size"]),
                hidden_size=int(raw["hidden_size"]),
                intermediate_size=int(raw["intermediate_size"]),
                moe_intermediate_size=int(raw.get("moe_intermediate_size", raw["intermediate_size"])),
                num_hidden_layers=int(raw["num_hidden_layers"]),
                num_attention_heads=int(raw["num_attention_heads"]),
                q_lora_rank=None if raw.get("q_lora_rank") is None else int(raw["q_lora_rank"]),
                kv_lora_rank=int(raw["kv_lora_rank"]),
                qk_nope_head_dim=int(raw["qk_nope_head_dim"]),
                qk_rope_head_dim=int(raw["qk_rope_head_dim"]),
                v_head_dim=int(raw["v_head_dim"]),
                n_routed_experts=None
                if raw.get("n_routed_experts") is None
                else int(raw["n_routed_experts"]),
                n_shared_experts=None
                if raw.get("n_shared_experts") is None
                else int(raw["n_shared_experts"]),
                num_experts_per_tok=int(raw.get("num_experts_per_tok", 1)),
                first_k_dense_replace=int(raw.get("first_k_dense_replace", 0)),
                moe_layer_freq=int(raw.get("moe_layer_freq", 1)),
                n_group=int(raw.get("n_group") or 1),
                topk_group=int(raw.get("topk_group") or 1),
                norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
                routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.0)),
                scoring_func=scoring,
                topk_method=str(raw.get("topk_method", "greedy")),
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                rope_theta=float(rope_theta),
                max_position_embeddings=int(raw.get("max_position_embeddings", 8192)),
                num_nextn_predict_layers=int(raw.get("num_nextn_predict_layers", 0)),
                eos_token_id=None if eos is None else int(eos),
                yarn=yarn,
            )
        except KeyError as e:
            raise CheckpointError(f"config.json is missing {e.args[0]!r}") from e


@dataclass
class AttentionWeights:
    q_a: torch.Tensor | None  # [q_lora, H]; None without q-LoRA
    q_a_norm: torch.Tensor | None  # [q_lora]
    q_b: torch.Tensor  # [heads * qk_head_dim, q_lora or H]
    kv_a: torch.Tensor  # [kv_lora + rope, H]
    kv_a_norm: torch.Tensor  # [kv_lora]
    w_uk: torch.Tensor  # [heads, qk_nope, kv_lora]: absorbed into q
    w_uv: torch.Tensor  # [heads, kv_lora, v_head]: applied to the attention output
    o_proj: torch.Tensor  # [H, heads * v_head]


@dataclass
class MLPWeights:
    gate_up: torch.Tensor  # [2 * I, H], gate rows first (vLLM's merged gate_up_proj)
    down: torch.Tensor  # [H, I]


@dataclass
class MoEWeights:
    gate: torch.Tensor  # [E, H]
    #: [E] float32 (vLLM keeps it in float32); None unless topk_method == "noaux_tc".
    bias: torch.Tensor | None
    experts: list[MLPWeights]
    shared: MLPWeights | None


@dataclass
class LayerWeights:
    input_norm: torch.Tensor
    post_attn_norm: torch.Tensor
    attn: AttentionWeights
    mlp: MLPWeights | MoEWeights


@dataclass
class MTPWeights:
    enorm: torch.Tensor
    hnorm: torch.Tensor
    eh_proj: torch.Tensor  # [H, 2H]: input is embed || previous hidden
    block: LayerWeights
    head_norm: torch.Tensor  # shared_head.norm


@dataclass
class ModelWeights:
    config: ModelConfig
    embed: torch.Tensor  # [V, H]
    layers: list[LayerWeights]
    norm: torch.Tensor
    lm_head: torch.Tensor  # [V, H]
    mtp: list[MTPWeights] = field(default_factory=list)

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    @property
    def device(self) -> torch.device:
        return self.embed.device


def read_config(model_dir: str | Path) -> ModelConfig:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{path} not found: the model directory needs a config.json")
    return ModelConfig.from_dict(json.loads(path.read_text()))


def read_tensors(model_dir: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of every *.safetensors file in the directory, on CPU, as stored."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors file in {model_dir}")
    out: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as fh:
            for name in fh.keys():
                out[name] = fh.get_tensor(name)
    return out


def build_weights(
    config: ModelConfig,
    tensors: dict[str, torch.Tensor],
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    with_mtp: bool = True,
) -> ModelWeights:
    """Arrange checkpoint tensors (HF DeepSeek-V3 names) into weight dataclasses on device/dtype."""

    def get(name: str, keep_dtype: torch.dtype | None = None) -> torch.Tensor:
        try:
            t = tensors[name]
        except KeyError:
            raise CheckpointError(f"checkpoint tensor {name!r} is missing") from None
        return t.to(device=device, dtype=keep_dtype or dtype).contiguous()

    def has(name: str) -> bool:
        return name in tensors

    def mlp(prefix: str) -> MLPWeights:
        gate_up = torch.cat([get(f"{prefix}.gate_proj.weight"), get(f"{prefix}.up_proj.weight")], dim=0)
        return MLPWeights(gate_up=gate_up, down=get(f"{prefix}.down_proj.weight"))

    def attention(prefix: str) -> AttentionWeights:
        c = config
        kv_b = get(f"{prefix}.kv_b_proj.weight")  # [heads * (nope + v), kv_lora]
        kv_b = kv_b.view(c.num_attention_heads, c.qk_nope_head_dim + c.v_head_dim, c.kv_lora_rank)
        w_uk, w_uv = torch.split(kv_b, [c.qk_nope_head_dim, c.v_head_dim], dim=1)
        if c.q_lora_rank is not None:
            q_a, q_a_norm, q_b = (
                get(f"{prefix}.q_a_proj.weight"),
                get(f"{prefix}.q_a_layernorm.weight"),
                get(f"{prefix}.q_b_proj.weight"),
            )
        else:
            q_a, q_a_norm, q_b = None, None, get(f"{prefix}.q_proj.weight")
        return AttentionWeights(
            q_a=q_a,
            q_a_norm=q_a_norm,
            q_b=q_b,
            kv_a=get(f"{prefix}.kv_a_proj_with_mqa.weight"),
            kv_a_norm=get(f"{prefix}.kv_a_layernorm.weight"),
            w_uk=w_uk.contiguous(),
            w_uv=w_uv.transpose(1, 2).contiguous(),
            o_proj=get(f"{prefix}.o_proj.weight"),
        )

    def layer(idx: int) -> LayerWeights:
        p = f"model.layers.{idx}"
        ffn: MLPWeights | MoEWeights
        if config.is_moe_layer(idx):
            assert config.n_routed_experts is not None
            bias = None
            if config.topk_method == "noaux_tc":
                bias = get(f"{p}.mlp.gate.e_score_correction_bias", torch.float32)
            shared = mlp(f"{p}.mlp.shared_experts") if config.n_shared_experts else None
            ffn = MoEWeights(
                gate=get(f"{p}.mlp.gate.weight"),
                bias=bias,
                experts=[mlp(f"{p}.mlp.experts.{e}") for e in range(config.n_routed_experts)],
                shared=shared,
            )
        else:
            ffn = mlp(f"{p}.mlp")
        return LayerWeights(
            input_norm=get(f"{p}.input_layernorm.weight"),
            post_attn_norm=get(f"{p}.post_attention_layernorm.weight"),
            attn=attention(f"{p}.self_attn"),
            mlp=ffn,
        )

    lm_head_name = "lm_head.weight" if has("lm_head.weight") else "model.embed_tokens.weight"
    weights = ModelWeights(
        config=config,
        embed=get("model.embed_tokens.weight"),
        layers=[layer(i) for i in range(config.num_hidden_layers)],
        norm=get("model.norm.weight"),
        lm_head=get(lm_head_name),
    )
    if with_mtp:
        for i in range(config.num_nextn_predict_layers):
            idx = config.num_hidden_layers + i
            p = f"model.layers.{idx}"
            weights.mtp.append(
                MTPWeights(
                    enorm=get(f"{p}.enorm.weight"),
                    hnorm=get(f"{p}.hnorm.weight"),
                    eh_proj=get(f"{p}.eh_proj.weight"),
                    block=layer(idx),
                    head_norm=get(f"{p}.shared_head.norm.weight"),
                )
            )
    return weights


def load_weights(
    model_dir: str | Path,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    with_mtp: bool = True,
) -> ModelWeights:
    config = read_config(model_dir)
    return build_weights(config, read_tensors(model_dir), dtype=dtype, device=device, with_mtp=with_mtp)
