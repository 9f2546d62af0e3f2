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

from dataclasses import dataclass

import torch
import torch.nn.functional as F

# The checkpoint side lives in its own module; re-exported so callers see one model API.
from tilert_serve.decode.engines.reference_checkpoint import (
    AttentionWeights,
    CheckpointError,
    LayerWeights,
    MLPWeights,
    ModelConfig,
    ModelWeights,
    MoEWeights,
    MTPWeights,
    YarnScaling,
    build_weights,
    load_weights,
    read_config,
    read_tensors,
    yarn_get_mscale,
)

__all__ = [
    "AttentionWeights",
    "CheckpointError",
    "LayerWeights",
    "MLPWeights",
    "MTPWeights",
    "MoEWeights",
    "ModelConfig",
    "ModelWeights",
    "Rope",
    "YarnScaling",
    "apply_rope",
    "build_weights",
    "decoder_layer",
    "dense_mlp",
    "forward_main",
    "forward_mtp",
    "load_weights",
    "logits",
    "mla_attention",
    "moe",
    "read_config",
    "read_tensors",
    "rms_norm",
    "rope_tables",
    "route",
    "yarn_get_mscale",
]


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
    q_nope, q_pe = torch.split(q, [c.qk_nope_head_dim, c.qk_rope_head_dim], dim=-1)
    kv = F.linear(x, w.kv_a)
    kv_c, k_pe = torch.split(kv, [c.kv_lora_rank, c.qk_rope_head_dim], dim=-1)
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
