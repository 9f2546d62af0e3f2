"""A request's attention state in the engine's layout: what conversion produces and engines take."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LayerState:
    """One attention layer's prompt state, already in the engine's layout and dtype."""

    #: [seq_len, kv_lora_rank]: the normalised MLA latent (what vLLM caches as kv_c).
    kv: torch.Tensor
    #: [seq_len, qk_rope_head_dim]: the rotary key, RoPE already applied (as vLLM caches it).
    pe: torch.Tensor
    #: [seq_len, index_head_dim]: sparse-attention indexer keys, Hadamard-rotated; None without an indexer.
    ki: torch.Tensor | None = None


@dataclass(frozen=True)
class InjectedState:
    """A prefilled request's state: every main layer, then the MTP draft layers."""

    layers: list[LayerState]
    #: Number of prompt tokens whose state is in `layers` (positions 0 .. seq_len-1).
    seq_len: int
    #: The prompt's last token id (position seq_len-1): MTP's warm start recomputes that position.
    last_prompt_token: int
