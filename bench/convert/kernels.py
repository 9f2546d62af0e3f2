"""Plain Triton kernels the conversion and extraction benchmarks measure against: an empty launch, a
1:1 copy, and the conversion's read:write mix with no arithmetic (bench/convert/run.py, explore.py,
bench/extract/run.py), and `call_ms`, the call timing both benchmarks report."""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

from bench.common import median_ms


def call_ms(fn: Callable[[], object], device: torch.device) -> float:
    """The best of three medians of `fn` as a caller sees it (events around the call): the borrowed
    machine's host timings wander by up to 2x between back-to-back medians of the same call (bench/
    convert/explore.py's launch-cost lines: 40.5, 22.6, 22.2 us), the first usually the slowest."""
    return min(median_ms(fn, device) for _ in range(3))


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
