"""DeepSeek-V3-style model math in plain PyTorch: MLA over the latent cache, dense MLP, MoE, MTP.

Pure functions over weight dataclasses, written to follow vLLM's DeepseekV2/V3 and DeepSeek MTP
code (vllm/model_executor/models/deepseek_v2.py, deepseek_mtp.py) so that greedy tokens agree with
vLLM in float32:

* MLA: q through q_a_proj -> q_a_layernorm -> q_b_proj (or q_proj without q-LoRA); the latent row
  cached per token is ``kv_a_layernorm(kv_c) || rope(k_pe)`` (576 values for DeepSeek-V3), the same
  row vLLM's MLA cache holds. Attention uses the absorbed form (q_nope @ W_UK against the latent,
  output through W_UV), softmax scale ``qk_head_dim ** -0.5`` (times YaRN's mscale squared).
* RoPE: GPT-J style (interleaved pairs, vLLM ``is_neox_style=False``) on the last 64 dims only;
  DeepSeek's YaRN scaling when config.json asks for it (frequencies, cos/sin magnitude, softmax scale).
* MoE: vLLM's grouped top-k with sigmoid or softmax scores, ``e_score_correction_bias`` steering only
  the choice (weights are the unbiased scores), optional renormalisation, then
  ``shared(x) + routed_scaling_factor * routed(x)``.
* MTP: embedding zeroed at position 0, ``eh_proj(enorm(embed) || hnorm(prev_hidden))``, one decoder
  layer, ``shared_head.norm``; the target's embedding and lm_head are shared, as vLLM does.

Every function takes ``x`` as ``[batch, tokens, ...]`` so the same code serves the engine (batch 1,
writing into a cache) and training (a batch of whole sequences, no cache, autograd on).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
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
        high = min(math.ceil(correction_dim(self.beta_slow)), rotary_dim - 1)
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
        scale = self.qk_head_dim**-0.5
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


# ---------------------------------------------------------------------------------------------
# Weights
# ---------------------------------------------------------------------------------------------


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
        w_uk, w_uv = kv_b.split([c.qk_nope_head_dim, c.v_head_dim], dim=1)
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


# ---------------------------------------------------------------------------------------------
# Math
# ---------------------------------------------------------------------------------------------


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # float32 statistics whatever the activation dtype, as vLLM's RMSNorm.
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (xf * weight.float()).to(x.dtype)


def rope_tables(
    length: int,
    rotary_dim: int,
    theta: float,
    *,
    dtype: torch.dtype,
    device: torch.device | str,
    yarn: YarnScaling | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [length, rotary_dim // 2], built in float32 then cast (vLLM's cos_sin_cache)."""
    if yarn is None:
        inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float) / rotary_dim))
        scale = 1.0
    else:
        inv_freq, scale = yarn.inv_freq(rotary_dim, theta), yarn.cos_sin_scale
    t = torch.arange(length, dtype=torch.float)
    freqs = torch.einsum("i,j -> ij", t, inv_freq)
    cos, sin = freqs.cos(), freqs.sin()
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    return cos.to(device=device, dtype=dtype), sin.to(device=device, dtype=dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """GPT-J (interleaved) rotation of x [..., T, heads, d] with cos/sin [T, d/2]."""
    cos = cos.unsqueeze(-2)
    sin = sin.unsqueeze(-2)
    x1 = x[..., ::2]
    x2 = x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)


@dataclass(frozen=True)
class Rope:
    cos: torch.Tensor
    sin: torch.Tensor

    @classmethod
    def build(
        cls, config: ModelConfig, length: int, *, dtype: torch.dtype, device: torch.device | str
    ) -> Rope:
        cos, sin = rope_tables(
            length, config.qk_rope_head_dim, config.rope_theta, dtype=dtype, device=device, yarn=config.yarn
        )
        return cls(cos=cos, sin=sin)

    def at(self, start: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        if start + count > self.cos.shape[0]:
            raise ValueError(
                f"position {start + count - 1} is past the RoPE table ({self.cos.shape[0]} positions)"
            )
        return self.cos[start : start + count], self.sin[start : start + count]


def mla_attention(
    config: ModelConfig,
    w: AttentionWeights,
    x: torch.Tensor,
    rope: Rope,
    start: int,
    cache: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """MLA over x [B, T, H] at positions start..start+T-1.

    With ``cache`` ([B, S, latent], S >= start + T) the new latent rows are written at those
    positions and the queries attend to rows 0..start+T-1; without it (training, start == 0) they
    attend to the new rows only. Returns (output [B, T, H], the new latent rows [B, T, latent]).
    """
    c = config
    b, t, _ = x.shape
    heads = c.num_attention_heads
    if w.q_a is not None:
        assert w.q_a_norm is not None
        q = F.linear(rms_norm(F.linear(x, w.q_a), w.q_a_norm, c.rms_norm_eps), w.q_b)
    else:
        q = F.linear(x, w.q_b)
    q = q.view(b, t, heads, c.qk_head_dim)
    q_nope, q_pe = q.split([c.qk_nope_head_dim, c.qk_rope_head_dim], dim=-1)
    kv = F.linear(x, w.kv_a)
    kv_c, k_pe = kv.split([c.kv_lora_rank, c.qk_rope_head_dim], dim=-1)
    cos, sin = rope.at(start, t)
    q_pe = apply_rope(q_pe, cos, sin)
    k_pe = apply_rope(k_pe.unsqueeze(-2), cos, sin).squeeze(-2)
    latent = torch.cat([rms_norm(kv_c, w.kv_a_norm, c.rms_norm_eps), k_pe], dim=-1)

    if cache is None:
        if start != 0:
            raise ValueError("attention without a cache must start at position 0")
        keys = latent
    else:
        cache[:, start : start + t] = latent
        keys = cache[:, : start + t]
    s = keys.shape[1]

    # Absorb W_UK into the query so scores are taken directly against the latent rows.
    q_lat = torch.einsum("bthp,hpl->bthl", q_nope, w.w_uk)
    q_full = torch.cat([q_lat, q_pe], dim=-1).reshape(b, t * heads, c.latent_dim)
    scores = torch.matmul(q_full, keys.transpose(1, 2)).float() * c.softmax_scale  # [B, T*h, S]
    if t > 1:  # a single query sees every row up to itself: no mask to build
        q_pos = torch.arange(start, start + t, device=x.device).repeat_interleave(heads)
        visible = torch.arange(s, device=x.device)[None, :] <= q_pos[:, None]
        scores = scores.masked_fill(~visible, float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(x.dtype)
    o_lat = torch.matmul(probs, keys[..., : c.kv_lora_rank]).view(b, t, heads, c.kv_lora_rank)
    o = torch.einsum("bthl,hlv->bthv", o_lat, w.w_uv).reshape(b, t, heads * c.v_head_dim)
    return F.linear(o, w.o_proj), latent


def dense_mlp(w: MLPWeights, x: torch.Tensor) -> torch.Tensor:
    gate, up = F.linear(x, w.gate_up).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, w.down)


def route(config: ModelConfig, w: MoEWeights, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's grouped top-k: (weights [N, k] float32, expert ids [N, k]) for x [N, H]."""
    logits = F.linear(x, w.gate).float()
    scores = torch.sigmoid(logits) if config.scoring_func == "sigmoid" else torch.softmax(logits, dim=-1)
    n, e = scores.shape
    g = config.n_group
    original = scores
    if w.bias is not None:
        scores = scores + w.bias.unsqueeze(0)
        group_scores = scores.view(n, g, -1).topk(2, dim=-1)[0].sum(dim=-1)
    else:
        group_scores = scores.view(n, g, -1).max(dim=-1).values
    group_idx = torch.topk(group_scores, k=config.topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1.0)
    score_mask = group_mask.unsqueeze(-1).expand(n, g, e // g).reshape(n, e)
    masked = scores.masked_fill(~score_mask.bool(), float("-inf"))
    k = config.num_experts_per_tok
    if w.bias is not None:
        ids = torch.topk(masked, k=k, dim=-1, sorted=False)[1]
        weights = original.gather(1, ids)
    else:
        weights, ids = torch.topk(masked, k=k, dim=-1, sorted=False)
    if config.norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def moe(config: ModelConfig, w: MoEWeights, x: torch.Tensor) -> torch.Tensor:
    shape = x.shape
    flat = x.reshape(-1, shape[-1])
    weights, ids = route(config, w, flat)
    k = ids.shape[1]
    # Group (token, slot) pairs by expert so each expert runs one matmul over its tokens; the one
    # host read (counts) sizes those slices. Results go back to (token, slot) order and are summed
    # over slots, which keeps the reduction order fixed (no atomics) on every device.
    flat_ids = ids.flatten()
    order = torch.argsort(flat_ids, stable=True)
    counts = torch.bincount(flat_ids, minlength=len(w.experts)).tolist()
    rows = flat[order // k]
    out_sorted = torch.empty_like(rows)
    begin = 0
    for e, count in enumerate(counts):
        if count:
            out_sorted[begin : begin + count] = dense_mlp(w.experts[e], rows[begin : begin + count])
            begin += count
    per_slot = torch.empty_like(out_sorted)
    per_slot[order] = out_sorted
    routed = (per_slot.view(-1, k, shape[-1]).float() * weights.unsqueeze(-1)).sum(dim=1).to(x.dtype)
    routed = routed * config.routed_scaling_factor
    if w.shared is not None:
        routed = dense_mlp(w.shared, flat) + routed
    return routed.view(shape)


def decoder_layer(
    config: ModelConfig,
    w: LayerWeights,
    x: torch.Tensor,
    residual: torch.Tensor | None,
    rope: Rope,
    start: int,
    cache: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One pre-norm block with vLLM's fused residual convention: returns (out, residual, latent)."""
    eps = config.rms_norm_eps
    residual = x if residual is None else x + residual
    h = rms_norm(residual, w.input_norm, eps)
    h, latent = mla_attention(config, w.attn, h, rope, start, cache)
    residual = h + residual
    h = rms_norm(residual, w.post_attn_norm, eps)
    h = moe(config, w.mlp, h) if isinstance(w.mlp, MoEWeights) else dense_mlp(w.mlp, h)
    return h, residual, latent


def forward_main(
    weights: ModelWeights,
    tokens: torch.Tensor,
    rope: Rope,
    start: int,
    caches: list[torch.Tensor] | None,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Main model over tokens [B, T] at positions start.. -> (final-normed hidden [B, T, H],
    the new latent rows of every layer). ``caches``: one [B, S, latent] tensor per main layer."""
    c = weights.config
    x = F.embedding(tokens, weights.embed)
    residual: torch.Tensor | None = None
    latents = []
    for i, layer in enumerate(weights.layers):
        x, residual, latent = decoder_layer(
            c, layer, x, residual, rope, start, None if caches is None else caches[i]
        )
        latents.append(latent)
    assert residual is not None
    return rms_norm(x + residual, weights.norm, c.rms_norm_eps), latents


def forward_mtp(
    weights: ModelWeights,
    index: int,
    tokens: torch.Tensor,
    prev_hidden: torch.Tensor,
    rope: Rope,
    start: int,
    cache: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """MTP layer ``index`` at positions start..: ``tokens`` [B, T] are the tokens one position
    ahead, ``prev_hidden`` [B, T, H] the hidden state at each position (the target's final-normed
    hidden, or the previous draft step's output). Returns (post-norm hidden, which both feeds
    lm_head and the next recursive step, and the new latent rows)."""
    c = weights.config
    m = weights.mtp[index]
    eps = c.rms_norm_eps
    emb = F.embedding(tokens, weights.embed)
    positions = torch.arange(start, start + tokens.shape[1], device=tokens.device)
    emb = torch.where((positions == 0).view(1, -1, 1), torch.zeros_like(emb), emb)
    h = F.linear(
        torch.cat([rms_norm(emb, m.enorm, eps), rms_norm(prev_hidden, m.hnorm, eps)], dim=-1), m.eh_proj
    )
    h, residual, latent = decoder_layer(c, m.block, h, None, rope, start, cache)
    return rms_norm(residual + h, m.head_norm, eps), latent


def logits(weights: ModelWeights, hidden: torch.Tensor) -> torch.Tensor:
    return F.linear(hidden, weights.lm_head).float()
