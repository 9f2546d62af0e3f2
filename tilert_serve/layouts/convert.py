"""Conversion of received wire bytes into the engine's per-layer tensors.

The wire holds vLLM's own cache bytes (see registry.py); engines take bf16/float tensors:
  - fp8_ds_mla rows -> latent kv = fp8 values x their per-128 fp32 block scale; RoPE part as is;
  - bf16 / float rows -> a view split into latent and RoPE parts;
  - indexer pages -> fp8 values x per-token fp32 scale, then Hadamard-rotated, because TileRT's
    indexer keys are rotated and vLLM stores them unrotated (docs/reference/tilert-api.md,
    "The engine's own cache").
Everything here is a pure function of tensors; no I/O.
"""

from __future__ import annotations

import functools
import math

import torch

from tilert_serve.layouts.base import Layout
from tilert_serve.layouts.placement import Placement
from tilert_serve.layouts.registry import INDEX_HEAD_DIM, INDEXER_PAGE_TOKENS
from tilert_serve.layouts.state import InjectedState, LayerState

_TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
_FP8_BLOCK = 128


def mla_rows_to_kv_pe(
    rows: torch.Tensor, layout: Layout, out_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """[n, row_bytes] uint8 rows -> (kv [n, kv_lora_rank], pe [n, rope_dim]) in `out_dtype`."""
    n = rows.shape[0]
    r, d = layout.kv_lora_rank, layout.rope_dim
    if layout.kv_cache_dtype == "fp8_ds_mla":
        values = rows[:, :r].contiguous().view(torch.float8_e4m3fn).to(torch.float32)
        scales = rows[:, r : r + 16].contiguous().view(torch.float32)  # [n, r / 128]
        kv = (values.view(n, r // _FP8_BLOCK, _FP8_BLOCK) * scales.unsqueeze(-1)).view(n, r)
        pe = rows[:, r + 16 : r + 16 + 2 * d].contiguous().view(torch.bfloat16)
        return kv.to(out_dtype), pe.to(out_dtype)
    flat = rows.contiguous().view(_TORCH_DTYPES[layout.kv_cache_dtype])
    return flat[:, :r].to(out_dtype), flat[:, r : r + d].to(out_dtype)


@functools.cache
def hadamard_matrix(dim: int) -> torch.Tensor:
    """The orthonormal (d^-1/2 scaled) Sylvester Hadamard matrix of size `dim` (a power of two)."""
    if dim < 1 or dim & (dim - 1):
        raise ValueError(f"Hadamard size must be a power of two, got {dim}")
    h = torch.ones(1, 1)
    while h.shape[0] < dim:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(dim)


def indexer_pages_to_keys(pages: torch.Tensor, num_tokens: int, out_dtype: torch.dtype) -> torch.Tensor:
    """[P, 8448] uint8 pages -> rotated indexer keys [num_tokens, 128] in `out_dtype`."""
    p = pages.shape[0]
    body = INDEXER_PAGE_TOKENS * INDEX_HEAD_DIM
    values = pages[:, :body].contiguous().view(torch.float8_e4m3fn).to(torch.float32)
    values = values.view(p * INDEXER_PAGE_TOKENS, INDEX_HEAD_DIM)
    scales = pages[:, body:].contiguous().view(torch.float32).reshape(p * INDEXER_PAGE_TOKENS, 1)
    keys = (values * scales)[:num_tokens]
    return (keys @ hadamard_matrix(INDEX_HEAD_DIM).to(keys.device)).to(out_dtype)


def _fused_cuda(region: list[torch.Tensor], placement: Placement, out_dtype: torch.dtype) -> bool:
    return (
        all(r.is_cuda for r in region)
        and out_dtype == torch.bfloat16
        and placement.layout.kv_cache_dtype == "fp8_ds_mla"
    )


def to_layer_state(
    region: list[torch.Tensor], placement: Placement, layer: int, num_tokens: int, out_dtype: torch.dtype
) -> LayerState:
    """One layer of one slot's received bytes in engine tensors: what `to_injected_state` gives for that
    layer, bit for bit (the node converts each layer as it lands when the handoff is layer-wise)."""
    layout = placement.layout
    if num_tokens > placement.max_tokens:
        raise ValueError(f"{num_tokens} tokens exceed the slot's capacity of {placement.max_tokens}")
    if _fused_cuda(region, placement, out_dtype):
        from tilert_serve.layouts import convert_triton

        return convert_triton.to_layer_state(region, placement, layer, num_tokens)
    mla = layout.plane("mla")
    shard, off = placement.offset("mla", layer)
    rows = region[shard][off : off + mla.nbytes(num_tokens)].view(num_tokens, mla.unit_bytes)
    kv, pe = mla_rows_to_kv_pe(rows, layout, out_dtype)
    ki = None
    if layout.index_head_dim:
        idx = layout.plane("indexer")
        shard, off = placement.offset("indexer", layer)
        pages = region[shard][off : off + idx.nbytes(num_tokens)].view(idx.units(num_tokens), idx.unit_bytes)
        ki = indexer_pages_to_keys(pages, num_tokens, out_dtype)
    return LayerState(kv=kv, pe=pe, ki=ki)


def to_injected_state(
    region: list[torch.Tensor],
    placement: Placement,
    num_tokens: int,
    last_prompt_token: int,
    out_dtype: torch.dtype,
) -> InjectedState:
    """Read one slot's received bytes (`region[shard]` = that shard's uint8 buffer) into engine tensors."""
    if num_tokens > placement.max_tokens:
        raise ValueError(f"{num_tokens} tokens exceed the slot's capacity of {placement.max_tokens}")
    if _fused_cuda(region, placement, out_dtype):
        from tilert_serve.layouts import convert_triton

        # One launch over every layer: faster than a launch per layer, and the same kernel, so each
        # layer equals its to_layer_state.
        return convert_triton.to_injected_state(region, placement, num_tokens, last_prompt_token)
    layers = [
        to_layer_state(region, placement, lid, num_tokens, out_dtype)
        for lid in range(placement.layout.num_layers)
    ]
    return InjectedState(layers=layers, seq_len=num_tokens, last_prompt_token=last_prompt_token)


# The mirror direction: engine tensors -> vLLM's cache bytes. vLLM writes these bytes on the prefill
# side; we need them to build synthetic requests (tests, benchmarks) that look exactly like its cache.

_FP8_MAX = 448.0


def kv_pe_to_mla_rows(kv: torch.Tensor, pe: torch.Tensor, layout: Layout) -> torch.Tensor:
    """(kv [n, r], pe [n, d]) -> [n, row_bytes] uint8 rows as vLLM stores them."""
    n, r = kv.shape
    if layout.kv_cache_dtype == "fp8_ds_mla":
        blocks = kv.float().view(n, r // _FP8_BLOCK, _FP8_BLOCK)
        scales = (blocks.abs().amax(-1) / _FP8_MAX).clamp(min=1e-12)  # [n, r/128]
        values = (blocks / scales.unsqueeze(-1)).view(n, r).to(torch.float8_e4m3fn)
        return torch.cat(
            [
                values.view(torch.uint8),
                scales.contiguous().view(torch.uint8).view(n, -1),
                pe.to(torch.bfloat16).contiguous().view(torch.uint8),
            ],
            dim=1,
        )
    dtype = _TORCH_DTYPES[layout.kv_cache_dtype]
    return torch.cat([kv.to(dtype), pe.to(dtype)], dim=1).contiguous().view(torch.uint8)


def keys_to_indexer_pages(keys: torch.Tensor) -> torch.Tensor:
    """Unrotated indexer keys [n, 128] -> [ceil(n/64), 8448] uint8 pages (fp8 + per-token scale)."""
    n = keys.shape[0]
    pages = math.ceil(n / INDEXER_PAGE_TOKENS)
    padded = torch.zeros(pages * INDEXER_PAGE_TOKENS, INDEX_HEAD_DIM, device=keys.device)
    padded[:n] = keys.float()
    scales = (padded.abs().amax(-1, keepdim=True) / _FP8_MAX).clamp(min=1e-12)
    values = (padded / scales).to(torch.float8_e4m3fn).view(torch.uint8)
    values = values.view(pages, INDEXER_PAGE_TOKENS * INDEX_HEAD_DIM)
    return torch.cat([values, scales.view(pages, INDEXER_PAGE_TOKENS).contiguous().view(torch.uint8)], dim=1)
