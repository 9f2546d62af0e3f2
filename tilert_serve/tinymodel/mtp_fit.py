"""Measure (and optionally fit) the tiny model's MTP layer on the main model's own greedy text.

A random MTP layer almost never predicts what the main model says next, so speculative decoding
would accept nothing and tests of the draft/verify path would only exercise rejection. The
generator therefore starts MTP as a copy of the last main layer (see ``generate._mtp_start``), which
drafts about half of the tokens right; this module measures that on held-out greedy continuations.

``fit`` can also train the MTP layer by gradient descent (seeded, full batch, fixed data) to predict
token p+2 from the main model's hidden state at p and the embedding of token p+1. With the data a
few seconds of CPU allow, it overfits (train loss near 0, held-out accuracy flat or lower), so the
generator's default is 0 steps. Deterministic for a seed on a given machine (single-threaded math).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, fields
from typing import Any

import torch
import torch.nn.functional as F

from tilert_serve.decode.engines import reference_model as rm

PROMPT_LEN = 8
GEN_LEN = 40
TRAIN_SEQUENCES = 48
EVAL_SEQUENCES = 16
LEARNING_RATE = 1e-3


@dataclass(frozen=True)
class FitReport:
    steps: int
    #: Share of generated positions where MTP's argmax equals the main model's next-next token,
    #: on held-out sequences: about the acceptance rate of one greedy draft token.
    accuracy_before: float
    accuracy_after: float
    final_loss: float


@contextmanager
def _single_thread() -> Iterator[None]:
    # Results must not depend on how many cores the machine has.
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(prev)


def greedy_sequences(weights: rm.ModelWeights, prompts: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """Prompts [B, P] followed by ``new_tokens`` greedy tokens of the main model: [B, P + new]."""
    c = weights.config
    b, p = prompts.shape
    total = p + new_tokens
    rope = rm.Rope.build(c, total, dtype=weights.dtype, device=weights.device)
    caches = [torch.zeros(b, total, c.latent_dim) for _ in weights.layers]
    out = torch.empty(b, total, dtype=torch.long)
    out[:, :p] = prompts
    hidden, _ = rm.forward_main(weights, prompts, rope, 0, caches)
    for pos in range(p, total):
        out[:, pos] = rm.logits(weights, hidden[:, -1]).argmax(dim=-1)
        if pos + 1 < total:
            hidden, _ = rm.forward_main(weights, out[:, pos : pos + 1], rope, pos, caches)
    return out


def _trainable(mtp: rm.MTPWeights) -> list[torch.Tensor]:
    params: list[torch.Tensor] = []

    def collect(obj: Any) -> None:
        if isinstance(obj, torch.Tensor):
            params.append(obj)
        elif isinstance(obj, list):
            for item in obj:
                collect(item)
        elif obj is not None and hasattr(obj, "__dataclass_fields__"):
            for f in fields(obj):
                if f.name != "bias":  # the routing bias is a statistic, not a trained weight
                    collect(getattr(obj, f.name))

    collect(mtp)
    return params


def _mtp_logits(
    weights: rm.ModelWeights, seqs: torch.Tensor, hidden: torch.Tensor, rope: rm.Rope
) -> torch.Tensor:
    """MTP logits at positions 0..L-2 (input token p+1, hidden p): predictions of tokens 2..L."""
    out, _ = rm.forward_mtp(weights, 0, seqs[:, 1:], hidden[:, :-1], rope, 0, None)
    return rm.logits(weights, out)


def _accuracy(logits: torch.Tensor, seqs: torch.Tensor) -> float:
    # Position p predicts token p+2; score only tokens the main model generated itself.
    pred = logits[:, PROMPT_LEN - 2 : -1].argmax(dim=-1)
    return float((pred == seqs[:, PROMPT_LEN:]).float().mean())


def fit(
    config: dict[str, Any], tensors: dict[str, torch.Tensor], *, steps: int, seed: int, avoid: set[int]
) -> FitReport:
    """Measure the MTP layer's draft accuracy and, with ``steps`` > 0, train its tensors in
    ``tensors`` in place (name -> float32 tensor). ``avoid``: token ids never used in prompts."""
    cfg = rm.ModelConfig.from_dict(config)
    with _single_thread():
        weights = rm.build_weights(cfg, {k: v.clone() for k, v in tensors.items()})
        gen = torch.Generator().manual_seed(seed + 1)
        allowed = torch.tensor([t for t in range(cfg.vocab_size) if t not in avoid])
        n = EVAL_SEQUENCES + (TRAIN_SEQUENCES if steps > 0 else 0)
        prompts = allowed[torch.randint(len(allowed), (n, PROMPT_LEN), generator=gen)]
        rope = rm.Rope.build(cfg, PROMPT_LEN + GEN_LEN, dtype=torch.float32, device="cpu")
        with torch.no_grad():
            seqs = greedy_sequences(weights, prompts, GEN_LEN)
            hidden, _ = rm.forward_main(weights, seqs, rope, 0, None)
        eval_s, train_s = seqs[:EVAL_SEQUENCES], seqs[EVAL_SEQUENCES:]
        eval_h, train_h = hidden[:EVAL_SEQUENCES], hidden[EVAL_SEQUENCES:]
        with torch.no_grad():
            before = _accuracy(_mtp_logits(weights, eval_s, eval_h, rope), eval_s)
        if steps == 0:
            return FitReport(steps=0, accuracy_before=before, accuracy_after=before, final_loss=float("nan"))

        mtp = weights.mtp[0]
        params = _trainable(mtp)
        for p in params:
            p.requires_grad_(True)
        opt = torch.optim.Adam(params, lr=LEARNING_RATE)
        targets = train_s[:, PROMPT_LEN:]
        loss = torch.tensor(0.0)
        for _ in range(steps):
            opt.zero_grad(set_to_none=True)
            lg = _mtp_logits(weights, train_s, train_h, rope)[:, PROMPT_LEN - 2 : -1]
            loss = F.cross_entropy(lg.reshape(-1, lg.shape[-1]), targets.reshape(-1))
            loss.backward()  # type: ignore[no-untyped-call]  # torch 2.13 leaves Tensor.backward unannotated
            opt.step()
        for p in params:
            p.requires_grad_(False)
        with torch.no_grad():
            after = _accuracy(_mtp_logits(weights, eval_s, eval_h, rope), eval_s)
        tensors.update(export_layer(cfg, cfg.num_hidden_layers, mtp))
    return FitReport(
        steps=steps, accuracy_before=before, accuracy_after=after, final_loss=float(loss.detach())
    )


def export_layer(cfg: rm.ModelConfig, idx: int, mtp: rm.MTPWeights) -> dict[str, torch.Tensor]:
    """The MTP layer's tensors under their checkpoint names (inverse of ``build_weights``)."""
    p = f"model.layers.{idx}"
    out: dict[str, torch.Tensor] = {
        f"{p}.enorm.weight": mtp.enorm,
        f"{p}.hnorm.weight": mtp.hnorm,
        f"{p}.eh_proj.weight": mtp.eh_proj,
        f"{p}.shared_head.norm.weight": mtp.head_norm,
        f"{p}.input_layernorm.weight": mtp.block.input_norm,
        f"{p}.post_attention_layernorm.weight": mtp.block.post_attn_norm,
    }
    a = mtp.block.attn
    if a.q_a is not None and a.q_a_norm is not None:
        out[f"{p}.self_attn.q_a_proj.weight"] = a.q_a
        out[f"{p}.self_attn.q_a_layernorm.weight"] = a.q_a_norm
        out[f"{p}.self_attn.q_b_proj.weight"] = a.q_b
    else:
        out[f"{p}.self_attn.q_proj.weight"] = a.q_b
    kv_b = torch.cat([a.w_uk, a.w_uv.transpose(1, 2)], dim=1)  # [heads, nope + v, kv_lora]
    out.update(
        {
            f"{p}.self_attn.kv_a_proj_with_mqa.weight": a.kv_a,
            f"{p}.self_attn.kv_a_layernorm.weight": a.kv_a_norm,
            f"{p}.self_attn.kv_b_proj.weight": kv_b.reshape(-1, cfg.kv_lora_rank),
            f"{p}.self_attn.o_proj.weight": a.o_proj,
        }
    )

    def mlp(prefix: str, w: rm.MLPWeights) -> None:
        gate, up = w.gate_up.chunk(2, dim=0)
        out[f"{prefix}.gate_proj.weight"] = gate
        out[f"{prefix}.up_proj.weight"] = up
        out[f"{prefix}.down_proj.weight"] = w.down

    ffn = mtp.block.mlp
    if isinstance(ffn, rm.MoEWeights):
        out[f"{p}.mlp.gate.weight"] = ffn.gate
        if ffn.bias is not None:
            out[f"{p}.mlp.gate.e_score_correction_bias"] = ffn.bias
        for e, expert in enumerate(ffn.experts):
            mlp(f"{p}.mlp.experts.{e}", expert)
        if ffn.shared is not None:
            mlp(f"{p}.mlp.shared_experts", ffn.shared)
    else:
        mlp(f"{p}.mlp", ffn)
    return {k: v.detach().clone().contiguous() for k, v in out.items()}
