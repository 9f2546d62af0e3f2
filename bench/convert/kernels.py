"""Plain Triton kernels the conversion and extraction benchmarks measure against: an empty launch, a
1:1 copy, and the conversion's read:write mix with no arithmetic (bench/convert/run.py, explore.py,
bench/extract/run.py)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def empty_kernel(x):
    pass


@triton.jit
def copy_kernel(src, dst, words, BLOCK_W: tl.constexpr):
    """A plain 1:1 copy in Triton: the same launch machinery as our kernels, no indexing."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK_W + tl.arange(0, BLOCK_W)
    mask = offs < words
    tl.store(dst + offs, tl.load(src + offs, mask=mask, eviction_policy="evict_first"), mask=mask)


@triton.jit
def mix_kernel(src, dst_a, dst_b, tiles, BLOCK_W: tl.constexpr, EXTRA_W: tl.constexpr):
    """The conversion's traffic with no arithmetic: each tile reads BLOCK_W words and writes them, then
    EXTRA_W of them again elsewhere (BLOCK_W + EXTRA_W written per BLOCK_W read: 1.79 like GLM-5's
    788 wire bytes -> 1,408 bf16 bytes a token), all contiguous 16-byte vectors."""
    tile = tl.program_id(0).to(tl.int64)
    r = tl.arange(0, BLOCK_W)
    x = tl.load(src + tile * BLOCK_W + r, eviction_policy="evict_first")
    tl.store(dst_a + tile * BLOCK_W + r, x)
    tl.store(dst_b + tile * EXTRA_W + r, x, mask=r < EXTRA_W)
