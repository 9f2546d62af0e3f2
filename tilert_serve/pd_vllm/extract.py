"""Gathering a request's state out of vLLM's paged caches into a staging region. Pure tensor code.

A paged cache holds, per block, `block_size` rows of one token each (MLA) or one page of
`block_size` tokens (the DSA indexer). Token t of a request lives in block block_ids[t // block_size]
at row t % block_size. One gather per (layer, plane) writes the rows straight into the staging
bytes laid out by the layout's placement, with no intermediate copy.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tilert_serve.layouts import Layout, Placement


@dataclass(frozen=True)
class PagedCache:
    """One layer's cache for one plane, viewed as [num_blocks * block_size, row_elems] (or pages)."""

    name: str
    layer: int
    plane: str
    tensor: torch.Tensor
    block_size: int
    #: KV-cache group whose block table addresses this cache.
    group: int

    @property
    def rows(self) -> torch.Tensor:
        if self.plane == "indexer":  # one page per block
            return self.tensor.view(self.tensor.shape[0], -1)
        return self.tensor.view(self.tensor.shape[0] * self.block_size, -1)


def check_cache(cache: PagedCache, layout: Layout) -> None:
    """The tensor's per-token (or per-page) bytes must equal the layout's unit, or nothing else will."""
    plane = layout.plane(cache.plane)
    t = cache.tensor
    if not t.is_contiguous():
        raise ValueError(f"KV cache {cache.name} is not contiguous (shape {tuple(t.shape)}, stride {t.stride()})")
    per_block = t[0].numel() * t.element_size()
    unit = plane.unit_bytes * (cache.block_size if plane.unit_tokens == 1 else 1)
    if plane.unit_tokens not in (1, cache.block_size):
        raise ValueError(f"{cache.name}: indexer pages cover {plane.unit_tokens} tokens but blocks hold "
                         f"{cache.block_size}; run the prefill with --block-size {plane.unit_tokens}")
    if per_block != unit:
        raise ValueError(f"KV cache {cache.name} has {per_block} bytes per block (shape {tuple(t.shape)}, "
                         f"{t.dtype}); layout {layout.model}/{layout.kv_cache_dtype} expects {unit}: check "
                         "--kv-cache-dtype and tilert_model")


def slot_indices(block_ids: list[int], num_tokens: int, block_size: int, device: torch.device) -> torch.Tensor:
    """Row index in the flattened cache of each of the request's first `num_tokens` tokens."""
    blocks = torch.tensor(block_ids, dtype=torch.int64, device=device)
    t = torch.arange(num_tokens, dtype=torch.int64, device=device)
    return blocks[t // block_size] * block_size + t % block_size


def gather(caches: list[PagedCache], block_ids: tuple[list[int], ...], num_tokens: int, staging: Placement,
           region: list[torch.Tensor]) -> int:
    """Copy each cache's rows for the request into `region` (uint8, one tensor per staging shard).

    Returns the bytes written. `caches` may be a subset of the layers (a TP rank's share).
    """
    written = 0
    index_cache: dict[tuple[int, int, str], torch.Tensor] = {}
    for c in caches:
        plane = staging.layout.plane(c.plane)
        units = plane.units(num_tokens)
        shard, off = staging.offset(c.plane, c.layer)
        nbytes = units * plane.unit_bytes
        src = c.rows
        dst = region[shard][off:off + nbytes].view(src.dtype).view(units, src.shape[1])
        key = (c.group, c.block_size if c.plane != "indexer" else 0, c.plane)
        idx = index_cache.get(key)
        if idx is None:
            if c.plane == "indexer":
                idx = torch.tensor(block_ids[c.group][:units], dtype=torch.int64, device=src.device)
            else:
                idx = slot_indices(block_ids[c.group], num_tokens, c.block_size, src.device)
            index_cache[key] = idx
        torch.index_select(src, 0, idx, out=dst)
        written += nbytes
    return written


class Gatherer:
    """The gather a worker runs every job: the fused Triton kernels on CUDA, `gather` elsewhere.

    Called with `layer`, it gathers only that layer's planes (for layer-wise handoff, as each layer's
    forward finishes); a layer this rank does not hold writes nothing and returns 0.
    """

    def __init__(self, caches: list[PagedCache], staging: Placement, shard: int) -> None:
        self.caches, self.staging, self.shard = caches, staging, shard
        self._by_layer: dict[int, list[PagedCache]] = {}
        for c in caches:
            self._by_layer.setdefault(c.layer, []).append(c)
        self._fused: list[tuple[int, int, object]] = []
        if caches and caches[0].tensor.is_cuda:
            from tilert_serve.pd_vllm.extract_triton import PlaneGather

            for plane in staging.layout.planes:
                mine = [c for c in caches if c.plane == plane.name]
                if mine:
                    # A block holds block_size tokens: as rows, or as one page (pages are blocks).
                    fused = PlaneGather([c.tensor for c in mine], [c.layer for c in mine], plane.name, staging,
                                        mine[0].block_size, shard)
                    self._fused.append((mine[0].group, mine[0].block_size, fused))

    @property
    def layers(self) -> frozenset[int]:
        """The layers whose caches this rank holds (and so gathers)."""
        return frozenset(self._by_layer)

    def __call__(self, block_ids: tuple[list[int], ...], num_tokens: int, region: list[torch.Tensor],
                 layer: int | None = None) -> int:
        if layer is not None and layer not in self._by_layer:
            return 0
        if not self._fused:
            caches = self.caches if layer is None else self._by_layer[layer]
            return gather(caches, block_ids, num_tokens, self.staging, region)
        written = 0
        device = self.caches[0].tensor.device
        for group, tokens_per_block, fused in self._fused:
            blocks = (num_tokens + tokens_per_block - 1) // tokens_per_block
            # Pinned (torch's caching host allocator keeps it alive until the copy is done): the copy is
            # then truly asynchronous instead of a staged one the host waits for.
            ids = torch.tensor(block_ids[group][:blocks], dtype=torch.int64, pin_memory=True)
            written += fused(ids.to(device, non_blocking=True), num_tokens, region[self.shard],  # type: ignore[operator]
                             layer=layer)
        return written
