"""Synthetic request state, identical in every process for the same (layout, tokens, seed): vLLM-format
bytes built from seeded random latents, keys and RoPE parts."""

from __future__ import annotations

import torch

from tilert_serve import layouts
from tilert_serve.compat import Compat
from tilert_serve.layouts import convert

#: Layouts the wire tests cover: both DSA models in both cache formats, and the small-model layout.
LAYOUT_CASES = {
    "glm5-fp8": ("glm5", "fp8_ds_mla", None),
    "dsv32-bf16": ("deepseek_v3_2", "bfloat16", None),
    "mla-f32": ("mla", "float32", 3),
    "mla-bf16": ("mla", "bfloat16", 3),
}


def layout_for(case: str) -> layouts.Layout:
    model, dtype, num_layers = LAYOUT_CASES[case]
    return layouts.get(model, dtype, num_layers=num_layers)


def layer_bytes(layout: layouts.Layout, layer: int, num_tokens: int, seed: int) -> dict[str, torch.Tensor]:
    """plane name -> flat uint8 bytes of that layer's state."""
    g = torch.Generator().manual_seed(seed * 1000 + layer)
    kv = torch.randn(num_tokens, layout.kv_lora_rank, generator=g) * (1 + layer % 7)
    pe = torch.randn(num_tokens, layout.rope_dim, generator=g)
    out = {"mla": convert.kv_pe_to_mla_rows(kv, pe, layout).flatten()}
    if layout.index_head_dim:
        keys = torch.randn(num_tokens, layout.index_head_dim, generator=g)
        out["indexer"] = convert.keys_to_indexer_pages(keys).flatten()
    return out


def fill(placement: layouts.Placement, buffers: list[torch.Tensor], num_tokens: int, seed: int) -> None:
    """Write the synthetic state into buffers laid out by `placement`."""
    for lid in range(placement.layout.num_layers):
        for plane, data in layer_bytes(placement.layout, lid, num_tokens, seed).items():
            shard, off = placement.offset(plane, lid)
            buffers[shard][off : off + data.numel()] = data


def unnamed_compat(layout_fingerprint: str) -> str:
    """The compatibility fingerprint of a node run without --served-model-name and --model-revision
    (NodeConfig's defaults) on a layout: what a hand-built Request must name to be taken."""
    return Compat("", "", layout_fingerprint).fingerprint
