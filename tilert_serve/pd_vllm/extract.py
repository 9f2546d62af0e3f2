"""Gathering a request's state out of vLLM's paged caches into a staging region. Pure tensor code.

A paged cache holds, per block, `block_size` rows of one token each (MLA) or one page of
`block_size` tokens (the DSA indexer). Token t of a request lives in block block_ids[t // block_size]
at row t % block_size. One gather per (layer, plane) writes the rows straight into the staging
bytes laid out by the layout's placement, with no intermediate copy.
"""

from __future__ import annotations

from array import array
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
        raise ValueError(
            f"KV cache {cache.name} is not contiguous (shape {tuple(t.shape)}, stride {t.stride()})"
        )
    per_block = t[0].numel() * t.element_size()
    unit = plane.unit_bytes * (cache.block_size if plane.unit_tokens == 1 else 1)
    if plane.unit_tokens not in (1, cache.block_size):
        raise ValueError(
            f"{cache.name}: indexer pages cover {plane.unit_tokens} tokens but blocks hold "
            f"{cache.block_size}; run the prefill with --block-size {plane.unit_tokens}"
        )
    if per_block != unit:
        raise ValueError(
            f"KV cache {cache.name} has {per_block} bytes per block (shape {tuple(t.shape)}, "
            f"{t.dtype}); layout {layout.model}/{layout.kv_cache_dtype} expects {unit}: check "
            "--kv-cache-dtype and tilert_model"
        )


def slot_indices(
    block_ids: list[int], num_tokens: int, block_size: int, device: torch.device, start: int = 0
) -> torch.Tensor:
    """Row index in the flattened cache of each of the request's tokens `start` to `num_tokens`."""
    blocks = torch.tensor(block_ids, dtype=torch.int64, device=device)
    t = torch.arange(start, num_tokens, dtype=torch.int64, device=device)
    return blocks[t // block_size] * block_size + t % block_size


def gather(
    caches: list[PagedCache],
    block_ids: tuple[list[int], ...],
    num_tokens: int,
    staging: Placement,
    region: list[torch.Tensor],
    start: int = 0,
) -> int:
    """Copy each cache's rows for the request's tokens `start` to `num_tokens` into `region` (uint8,
    one tensor per staging shard), where the whole request's gather puts them (a page holding
    `start` is copied whole).

    Returns the bytes written. `caches` may be a subset of the layers (a TP rank's share).
    """
    written = 0
    if start >= num_tokens:
        return written
    index_cache: dict[tuple[int, int, str], torch.Tensor] = {}
    for c in caches:
        plane = staging.layout.plane(c.plane)
        first, units = start // plane.unit_tokens, plane.units(num_tokens)
        shard, off = staging.offset(c.plane, c.layer)
        nbytes = (units - first) * plane.unit_bytes
        src = c.rows
        begin = off + first * plane.unit_bytes
        dst = region[shard][begin : begin + nbytes].view(src.dtype).view(units - first, src.shape[1])
        key = (c.group, c.block_size if c.plane != "indexer" else 0, c.plane)
        idx = index_cache.get(key)
        if idx is None:
            if c.plane == "indexer":
                idx = torch.tensor(block_ids[c.group][first:units], dtype=torch.int64, device=src.device)
            else:
                idx = slot_indices(block_ids[c.group], num_tokens, c.block_size, src.device, first)
            index_cache[key] = idx
        torch.index_select(src, 0, idx, out=dst)
        written += nbytes
    return written


class Gatherer:
    """The gather a worker runs every job: the fused Triton kernel on CUDA, `gather` elsewhere.

    Called with `layer`, it gathers only that layer's planes (for layer-wise handoff, as each layer's
    forward finishes); a layer this rank does not hold writes nothing and returns 0. With `start`, only
    tokens from `start` on (a chunk-wise handoff: this step's chunk; earlier chunks are staged).
    """

    def __init__(self, caches: list[PagedCache], staging: Placement, shard: int) -> None:
        self.caches, self.staging, self.shard = caches, staging, shard
        self._by_layer: dict[int, list[PagedCache]] = {}
        for c in caches:
            self._by_layer.setdefault(c.layer, []).append(c)
        self._fused = None
        #: The block-id rows last sent to the device and their device copy: a layer-wise handoff
        #: gathers the same request layer after layer and pays the host-to-device copy once.
        self._ids: tuple[list[list[int]], torch.Tensor] | None = None
        if caches and caches[0].tensor.is_cuda:
            from tilert_serve.pd_vllm.extract_triton import FusedGather

            self._slot = 0
            self._pinned: list[tuple[torch.Tensor, torch.cuda.Event]] = [
                (torch.empty(0, dtype=torch.int32), torch.cuda.Event())  # type: ignore[no-untyped-call]
                for _ in range(4)
            ]
            self._fused = FusedGather(
                [c.tensor for c in caches],
                [c.layer for c in caches],
                [c.plane for c in caches],
                [c.group for c in caches],
                [c.block_size for c in caches],
                staging,
                shard,
            )

    @property
    def layers(self) -> frozenset[int]:
        """The layers whose caches this rank holds (and so gathers)."""
        return frozenset(self._by_layer)

    def __call__(
        self,
        block_ids: tuple[list[int], ...],
        num_tokens: int,
        region: list[torch.Tensor],
        layer: int | None = None,
        start: int = 0,
    ) -> int:
        if layer is not None and layer not in self._by_layer:
            return 0
        if self._fused is None:
            caches = self.caches if layer is None else self._by_layer[layer]
            return gather(caches, block_ids, num_tokens, self.staging, region, start)
        return self._fused(
            self._device_ids(block_ids, num_tokens), num_tokens, region[self.shard], layer, start=start
        )

    def _device_ids(self, block_ids: tuple[list[int], ...], num_tokens: int) -> torch.Tensor:
        assert self._fused is not None
        blocks = self._fused.blocks(num_tokens)
        rows = [block_ids[g][:blocks] for g in self._fused.groups]
        if self._ids is not None and self._ids[0] == rows:
            return self._ids[1]
        for g, r in zip(self._fused.groups, rows, strict=True):
            if len(r) < blocks:
                raise ValueError(f"{num_tokens} tokens need {blocks} blocks; group {g} lists {len(r)}")
        flat = array("i")
        for r in rows:
            flat.extend(r)  # C speed; torch.tensor of nested lists costs tens of microseconds
        # A reused pinned buffer (a ring of them): the copy is then asynchronous, not staged through a
        # driver buffer, and no pinned allocation is made per request. A slot is rewritten only once
        # the copy that last read it has run.
        self._slot = (self._slot + 1) % len(self._pinned)
        buf, done = self._pinned[self._slot]
        if buf.numel() < len(flat):
            buf = torch.empty(2 * len(flat), dtype=torch.int32, pin_memory=True)
        done.synchronize()
        host = buf[: len(flat)]
        host.copy_(torch.frombuffer(flat, dtype=torch.int32))
        ids = host.view(len(rows), blocks).to(self.caches[0].tensor.device, non_blocking=True)
        done.record()
        self._pinned[self._slot] = (buf, done)
        self._ids = (rows, ids)
        return ids
