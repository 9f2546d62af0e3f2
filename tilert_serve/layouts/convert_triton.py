"""CUDA conversion of received fp8_ds_mla state into the engine's bf16 tensors, in one pass.

Two Triton kernels, each over every layer in one launch:
  - MLA rows (656 B: 512 fp8 latent values, 4 fp32 block scales, 64 bf16 RoPE values) -> kv [L, n, 512]
    and pe [L, n, 64] in bf16;
  - indexer pages (64 tokens x 128 fp8 values, then 64 fp32 scales) -> dequantised, multiplied by the
    orthonormal Hadamard matrix on the tensor cores, stored as ki [L, n, 128] bf16.
Each byte of the wire is read once and each output written once, so the conversion runs near the
device's copy bandwidth (bench/convert). The torch path in convert.py is the reference it is
tested against.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from tilert_serve.layouts.convert import hadamard_matrix
from tilert_serve.layouts.placement import Placement
from tilert_serve.layouts.registry import FP8_DS_MLA_ROW_BYTES, INDEXER_PAGE_BYTES
from tilert_serve.layouts.state import InjectedState, LayerState

_ROW = FP8_DS_MLA_ROW_BYTES
_PAGE = INDEXER_PAGE_BYTES
#: Tokens per program and warps: picked on an H200 with `bench/convert/run.py --tune`.
BLOCK_T = 16
NUM_WARPS = 4


@triton.jit
def _mla_rows_kernel(src, layer_off, kv_out, pe_out, n, layer0, ROW: tl.constexpr, BLOCK_T: tl.constexpr):
    pid_t = tl.program_id(0)
    layer = tl.program_id(1)  # output layer; its input is entry layer0 + layer of the offset table
    t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    tmask = t < n
    # Offsets are multiples of 16 bytes (rows are 656 = 16 x 41 bytes): saying so lets loads vectorize.
    rows = src + tl.multiple_of(tl.load(layer_off + layer0 + layer), 16) + t.to(tl.int64) * ROW  # one pointer per token
    g = tl.arange(0, 4)
    c = tl.arange(0, 128)
    col = g[:, None] * 128 + c[None, :]  # [4, 128]
    vptr = (rows[:, None, None] + col[None, :, :]).to(tl.pointer_type(tl.float8e4nv), bitcast=True)
    vals = tl.load(vptr, mask=tmask[:, None, None], other=0.0).to(tl.float32)
    sptr = (rows + 512).to(tl.pointer_type(tl.float32), bitcast=True)
    scales = tl.load(sptr[:, None] + g[None, :], mask=tmask[:, None], other=0.0)
    kv = (vals * scales[:, :, None]).to(tl.bfloat16)
    out_row = layer.to(tl.int64) * n + t.to(tl.int64)
    tl.store(kv_out + out_row[:, None, None] * 512 + col[None, :, :], kv, mask=tmask[:, None, None])
    d = tl.arange(0, 64)
    pptr = (rows + 528).to(tl.pointer_type(tl.bfloat16), bitcast=True)
    pe = tl.load(pptr[:, None] + d[None, :], mask=tmask[:, None], other=0.0)
    tl.store(pe_out + out_row[:, None] * 64 + d[None, :], pe, mask=tmask[:, None])


@triton.jit
def _indexer_pages_kernel(src, layer_off, hadamard, ki_out, n, layer0, PAGE: tl.constexpr):
    page = tl.program_id(0)
    layer = tl.program_id(1)
    base = src + tl.multiple_of(tl.load(layer_off + layer0 + layer), 16) + page.to(tl.int64) * PAGE
    r = tl.arange(0, 64)
    c = tl.arange(0, 128)
    vptr = (base + r[:, None] * 128 + c[None, :]).to(tl.pointer_type(tl.float8e4nv), bitcast=True)
    vals = tl.load(vptr).to(tl.float32)
    scales = tl.load((base + 8192).to(tl.pointer_type(tl.float32), bitcast=True) + r)
    x = (vals * scales[:, None]).to(tl.bfloat16)
    h = tl.load(hadamard + c[:, None] * 128 + c[None, :])
    y = tl.dot(x, h)
    t = page * 64 + r
    out_row = layer.to(tl.int64) * n + t.to(tl.int64)
    tl.store(ki_out + out_row[:, None] * 128 + c[None, :], y.to(tl.bfloat16), mask=(t < n)[:, None])


@functools.cache
def _layer_offsets(placement: Placement, plane: str, shard: int, device: torch.device) -> torch.Tensor:
    """Byte offset of each of `shard`'s layers' plane in its region (cached: one placement per node)."""
    offs = [placement.offset(plane, lid)[1] for lid in _shard_layers(placement, shard)]
    return torch.tensor(offs, dtype=torch.int64, device=device)


def _shard_layers(placement: Placement, shard: int) -> list[int]:
    return [lid for lid in range(placement.layout.num_layers) if placement.shard_of(lid) == shard]


@functools.cache
def _hadamard(dim: int, device: torch.device) -> torch.Tensor:
    return hadamard_matrix(dim).to(device=device, dtype=torch.bfloat16)


def _convert_shard(region: torch.Tensor, placement: Placement, shard: int, n: int, block_t: int,
                   num_warps: int, first: int = 0, count: int | None = None) -> list[LayerState]:
    """Layers `first` .. `first + count - 1` of one shard's own (all of them by default), converted on
    that shard's GPU (two launches whatever the count)."""
    layout, dev = placement.layout, region.device
    if count is None:
        count = len(_shard_layers(placement, shard)) - first
    kv = torch.empty(count, n, layout.kv_lora_rank, dtype=torch.bfloat16, device=dev)
    pe = torch.empty(count, n, layout.rope_dim, dtype=torch.bfloat16, device=dev)
    _mla_rows_kernel[(triton.cdiv(n, block_t), count)](
        region, _layer_offsets(placement, "mla", shard, dev), kv, pe, n, first, ROW=_ROW, BLOCK_T=block_t,
        num_warps=num_warps)
    if not layout.index_head_dim:
        return [LayerState(kv=k, pe=p) for k, p in zip(kv.unbind(0), pe.unbind(0), strict=True)]
    ki = torch.empty(count, n, layout.index_head_dim, dtype=torch.bfloat16, device=dev)
    _indexer_pages_kernel[(triton.cdiv(n, 64), count)](
        region, _layer_offsets(placement, "indexer", shard, dev), _hadamard(layout.index_head_dim, dev), ki,
        n, first, PAGE=_PAGE, num_warps=num_warps)
    # unbind: one call for every layer's views instead of three indexing operations per layer.
    return [LayerState(kv=k, pe=p, ki=i) for k, p, i in zip(kv.unbind(0), pe.unbind(0), ki.unbind(0), strict=True)]


def _check(regions: list[torch.Tensor], placement: Placement) -> None:
    if placement.layout.kv_cache_dtype != "fp8_ds_mla":
        raise ValueError(f"the CUDA conversion handles fp8_ds_mla, not {placement.layout.kv_cache_dtype}")
    if len(regions) != placement.shards:
        raise ValueError(f"{len(regions)} regions for a placement of {placement.shards} shards")


def to_layer_state(regions: list[torch.Tensor], placement: Placement, layer: int, num_tokens: int, *,
                   block_t: int = BLOCK_T, num_warps: int = NUM_WARPS) -> LayerState:
    """One layer of a slot's received fp8_ds_mla bytes -> bf16, on the GPU of the layer's shard; bit for
    bit what `to_injected_state` gives for it (the same kernels, one layer's grid)."""
    _check(regions, placement)
    if not 0 <= layer < placement.layout.num_layers:
        raise ValueError(f"layer {layer} is outside 0..{placement.layout.num_layers - 1}")
    shard = placement.shard_of(layer)
    # A shard holds layers shard, shard + shards, ...: this one is its (layer // shards)-th.
    return _convert_shard(regions[shard], placement, shard, num_tokens, block_t, num_warps,
                          layer // placement.shards, 1)[0]


def to_injected_state(regions: list[torch.Tensor], placement: Placement, num_tokens: int, last_prompt_token: int,
                      *, block_t: int = BLOCK_T, num_warps: int = NUM_WARPS) -> InjectedState:
    """One slot's received fp8_ds_mla bytes (a uint8 CUDA tensor per shard) -> bf16 engine state.

    Each shard converts on its own GPU, so a node that spreads layers over 8 GPUs converts them in
    parallel; layer `lid` comes back as views on the GPU of shard `lid % shards`, where TileRT's
    injection copies from.
    """
    _check(regions, placement)
    per_shard = [iter(_convert_shard(r, placement, s, num_tokens, block_t, num_warps)) for s, r in enumerate(regions)]
    layers = [next(per_shard[placement.shard_of(lid)]) for lid in range(placement.layout.num_layers)]
    return InjectedState(layers=layers, seq_len=num_tokens, last_prompt_token=last_prompt_token)
