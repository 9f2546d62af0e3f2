"""CUDA extraction: one Triton launch per plane copies a request's blocks of every layer from vLLM's
paged caches into staging.

Within a paged block a plane's rows are contiguous, so the copy works on whole blocks (41,984 bytes
of MLA rows or one 8,448-byte indexer page for GLM-5), 16-byte words, no per-token indexing; the last
block copies only the request's rows. The per-layer token-level index_select in extract.py is the
reference (and the CPU path) it is tested and benchmarked against (bench/extract).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tilert_serve.layouts import Placement

_WORD = 4  # bytes moved per element; rows and pages of every layout are multiples of 16 bytes
#: Words per program (None: one program per block, its size rounded up to a power of two) and warps
#: per program: picked on an H200 with `bench/extract/run.py --tune`.
CHUNK_WORDS: int | None = 8192
NUM_WARPS = 8


@triton.jit
def _gather_blocks_kernel(src0, src_table, block_ids, dst, dst_off, units_per_block, unit_words, n_units,
                          block_words, layer0, CHUNK: tl.constexpr):
    j = tl.program_id(0)
    # layer0 > 0 with a grid of one layer: a single layer of the table (layer-wise handoff).
    layer = layer0 + tl.program_id(1)
    chunk = tl.program_id(2)
    # Layer caches are addressed relative to the first one, a pointer argument Triton knows is 16-byte
    # aligned; with the offsets' alignment stated too, loads and stores compile to 16-byte vectors.
    src = src0 + tl.multiple_of(tl.load(src_table + layer), 4)
    bid = tl.load(block_ids + j)
    units_here = tl.minimum(units_per_block, n_units - j * units_per_block)
    words_here = units_here * unit_words
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    mask = offs < words_here
    vals = tl.load(src + bid * block_words + offs, mask=mask)
    out = dst + tl.multiple_of(tl.load(dst_off + layer), 4) + j.to(tl.int64) * units_per_block * unit_words
    tl.store(out + offs, vals, mask=mask)


class PlaneGather:
    """A fused gather for one plane across a list of layers' caches (fixed at registration)."""

    def __init__(self, caches: list[torch.Tensor], layers: list[int], plane: str, staging: Placement,
                 block_size: int, shard: int) -> None:
        p = staging.layout.plane(plane)
        self.units_per_block = block_size if p.unit_tokens == 1 else 1
        self.unit_tokens = p.unit_tokens
        if p.unit_bytes % _WORD:
            raise ValueError(f"{plane} units of {p.unit_bytes} bytes are not whole {_WORD}-byte words")
        self.unit_words = p.unit_bytes // _WORD
        self.block_words = self.units_per_block * self.unit_words
        dev = caches[0].device
        for c in caches:
            if c[0].numel() * c.element_size() != self.block_words * _WORD:
                raise ValueError(f"a {plane} cache block holds {c[0].numel() * c.element_size()} bytes, "
                                 f"expected {self.block_words * _WORD}")
        base = caches[0].data_ptr()
        if any((c.data_ptr() - base) % 16 for c in caches):
            raise ValueError(f"{plane} caches are not 16-byte aligned relative to each other")
        #: Word offsets of every layer's cache from the first (which is passed as a pointer).
        self.src_table = torch.tensor([(c.data_ptr() - base) // _WORD for c in caches], dtype=torch.int64,
                                      device=dev)
        self.src0 = caches[0].view(torch.int32) if caches[0].is_contiguous() else caches[0]
        offs = []
        for lid in layers:
            s, off = staging.offset(plane, lid)
            if s != shard or off % 16:
                raise ValueError(f"layer {lid} {plane} staging offset {off} is not a 16-byte multiple on shard {shard}")
            offs.append(off // _WORD)
        self.dst_off = torch.tensor(offs, dtype=torch.int64, device=dev)
        self.num_layers = len(caches)
        self._index = {lid: i for i, lid in enumerate(layers)}

    def __call__(self, block_ids: torch.Tensor, num_tokens: int, region: torch.Tensor,
                 chunk: int | None = CHUNK_WORDS, num_warps: int = NUM_WARPS, layer: int | None = None) -> int:
        """Gather every layer of the table, or only `layer` (0 bytes if it is not in the table)."""
        first, count = 0, self.num_layers
        if layer is not None:
            if layer not in self._index:
                return 0
            first, count = self._index[layer], 1
        chunk = chunk or triton.next_power_of_2(self.block_words)
        n_units = (num_tokens + self.unit_tokens - 1) // self.unit_tokens
        n_blocks = (n_units + self.units_per_block - 1) // self.units_per_block
        grid = (n_blocks, count, triton.cdiv(self.block_words, chunk))
        _gather_blocks_kernel[grid](self.src0, self.src_table, block_ids, region.view(torch.int32), self.dst_off,
                                    self.units_per_block, self.unit_words, n_units, self.block_words, first,
                                    CHUNK=chunk, num_warps=num_warps)
        return n_units * self.unit_words * _WORD * count
