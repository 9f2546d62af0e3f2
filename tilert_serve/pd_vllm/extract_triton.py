"""CUDA extraction: one Triton launch copies a request's blocks of every plane of every layer (or of one
layer) from vLLM's paged caches into staging.

Within a paged block a plane's rows are contiguous, so the copy works on whole blocks (41,984 bytes
of MLA rows or one 8,448-byte indexer page for GLM-5), 16-byte words, no per-token indexing; the last
block copies only the request's rows. Every (layer, plane) is a *segment* of one table, ordered by
layer then plane, so the whole request is one launch (a 0.5 GB request at 8k tokens takes ~0.25 ms,
where each launch and each kernel's tail is a visible share) and one layer is the same launch over
that layer's segments. Every layout here has the same planes in every layer, so the kernel taken is
_gather_planes_kernel, whose plane geometry is compile-time constant (one dependent load fewer before
a block's bytes move, which is most of a one-layer launch's cost over a plain copy: bench/extract);
_gather_kernel reads it from the segment table and serves any other set of caches. Launches go
through convert_triton.Launcher (the compiled kernel's launcher, not JITFunction's ~20 us Python
path): a layer-wise handoff gathers once per layer in vLLM's forward thread. The per-layer
token-level index_select in extract.py is the reference (and the CPU path) it is tested and
benchmarked against (bench/extract).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tilert_serve.layouts import Placement
from tilert_serve.layouts.convert_triton import Launcher

_WORD = 4  # bytes per element moved; rows and pages of every layout are multiples of 16 bytes
_FIELDS = 6  # per segment: src offset, dst offset, block words, unit words, unit tokens, block-id row
#: Words per loop step and warps per program: picked on an H200 with `bench/extract/run.py --tune`.
CHUNK_WORDS = 1024
NUM_WARPS = 8
#: Programs a launch should have at least (a few per multiprocessor): a one-layer launch at 8k tokens
#: has only ~256 blocks, so each block is then split over several programs.
MIN_PROGRAMS = 1024
#: Most programs a block is split over (an MLA block is ~10 chunks).
MAX_SPLIT = 8
#: A layer gathered alone (layer-wise handoff): words per step, warps, and programs a block is split
#: over. A layer at 8k tokens is 256 blocks of two planes: more, thinner programs start sooner.
LAYER_CHUNK_WORDS = 1024
LAYER_WARPS = 4
LAYER_SPLIT = 11
#: Take _gather_planes_kernel (geometry as constants) when every layer has the same planes.
PLANES_KERNEL = True


def _cdiv(a: int, b: int) -> int:
    # Not triton.cdiv: that is a ConstexprFunction, ~3.5 us a call from Python, hundreds per launch.
    return -(-a // b)


@triton.jit
def _copy(src, out, words_here, split, splits, CHUNK: tl.constexpr):
    """Chunks split, split + splits, ... of a block's `words_here` words, src to out."""
    for c in range(split * CHUNK, words_here, splits * CHUNK):
        offs = c + tl.arange(0, CHUNK)
        mask = offs < words_here
        tl.store(out + offs, tl.load(src + offs, mask=mask, eviction_policy="evict_first"), mask=mask)


@triton.jit
def _gather_kernel(src0, table, block_ids, ids_stride, dst, num_tokens, seg0, j0, CHUNK: tl.constexpr):
    j = j0 + tl.program_id(0)  # the request's j-th block (from block j0: a chunk-wise gather)
    split = tl.program_id(2)  # this program copies chunks split, split + splits, ... of the block
    splits = tl.num_programs(2)
    row = table + (seg0 + tl.program_id(1)) * 6
    block_words = tl.load(row + 2)
    unit_words = tl.load(row + 3)
    unit_tokens = tl.load(row + 4)
    units_per_block = block_words // unit_words
    n_units = (num_tokens + unit_tokens - 1) // unit_tokens
    # Planes differ in blocks per request (rows vs pages): the grid covers the largest, so a program
    # past its own plane's last block has nothing to do.
    words_here = tl.multiple_of(tl.minimum(units_per_block, n_units - j * units_per_block) * unit_words, 4)
    if words_here > 0:
        bid = tl.load(block_ids + tl.load(row + 5) * ids_stride + j).to(tl.int64)
        # Offsets in words, all multiples of 4 (16 bytes): stated, loads and stores become 16-byte vectors.
        src = src0 + tl.multiple_of(tl.load(row) + bid * block_words, 4)
        out = dst + tl.multiple_of(tl.load(row + 1) + j.to(tl.int64) * block_words, 4)
        _copy(src, out, words_here, split, splits, CHUNK)


@triton.jit
def _gather_planes_kernel(
    src0,
    table,
    block_ids,
    ids_stride,
    dst,
    num_tokens,
    seg0,
    j0,
    CHUNK: tl.constexpr,
    BW0: tl.constexpr,
    UW0: tl.constexpr,
    UT0: tl.constexpr,
    G0: tl.constexpr,
    BW1: tl.constexpr,
    UW1: tl.constexpr,
    UT1: tl.constexpr,
    G1: tl.constexpr,
):
    """_gather_kernel where every layer has the same planes in the same order (every layout here): a
    plane's geometry (block words, unit words, unit tokens, block-id row) is a constant of the kernel,
    so a program's only load before its block's address is the block id (_gather_kernel first loads
    the segment's row, then the block id: two dependent loads before any byte moves), and the src
    and dst offsets load beside it. Segment s is plane s % 2 (one plane: BW1 = BW0, and so on)."""
    j = j0 + tl.program_id(0)
    split = tl.program_id(2)
    splits = tl.num_programs(2)
    seg = seg0 + tl.program_id(1)
    second = (seg % 2) == 1
    block_words = tl.where(second, BW1, BW0)
    unit_tokens = tl.where(second, UT1, UT0)
    units_per_block = tl.where(second, BW1 // UW1, BW0 // UW0)
    n_units = (num_tokens + unit_tokens - 1) // unit_tokens
    words_here = tl.multiple_of(
        tl.minimum(units_per_block, n_units - j * units_per_block) * tl.where(second, UW1, UW0), 4
    )
    if words_here > 0:
        row = table + seg * 6
        bid = tl.load(block_ids + tl.where(second, G1, G0) * ids_stride + j).to(tl.int64)
        src = src0 + tl.multiple_of(tl.load(row) + bid * block_words, 4)
        out = dst + tl.multiple_of(tl.load(row + 1) + j.to(tl.int64) * block_words, 4)
        _copy(src, out, words_here, split, splits, CHUNK)


_GATHER = Launcher(_gather_kernel)
_GATHER_PLANES = Launcher(_gather_planes_kernel)


class FusedGather:
    """The gather of a fixed set of caches (one per layer and plane, fixed at registration) into one
    staging shard: every layer in one launch, or one layer's planes in one launch."""

    def __init__(
        self,
        caches: list[torch.Tensor],
        layers: list[int],
        planes: list[str],
        groups: list[int],
        block_sizes: list[int],
        staging: Placement,
        shard: int,
    ) -> None:
        base = caches[0].data_ptr()
        order = sorted(
            range(len(caches)),
            key=lambda i: (layers[i], [p.name for p in staging.layout.planes].index(planes[i])),
        )
        self.groups = sorted(set(groups))
        rows: list[list[int]] = []
        #: layer -> (first segment, segments, [(unit tokens, units per block, unit bytes)])
        self._layer: dict[int, tuple[int, int, list[tuple[int, int, int]]]] = {}
        for seg, i in enumerate(order):
            c, lid, plane = caches[i], layers[i], staging.layout.plane(planes[i])
            units_per_block = block_sizes[i] if plane.unit_tokens == 1 else 1
            block_bytes = units_per_block * plane.unit_bytes
            if c[0].numel() * c.element_size() != block_bytes:
                raise ValueError(
                    f"a {plane.name} cache block holds {c[0].numel() * c.element_size()} bytes, "
                    f"expected {block_bytes}"
                )
            if plane.unit_bytes % 16 or (c.data_ptr() - base) % 16:
                raise ValueError(
                    f"layer {lid} {plane.name} cache is not 16-byte aligned relative to the first"
                )
            s, off = staging.offset(plane.name, lid)
            if s != shard or off % 16:
                raise ValueError(
                    f"layer {lid} {plane.name} staging offset {off} is not a 16-byte multiple on "
                    f"shard {shard}"
                )
            rows.append(
                [
                    (c.data_ptr() - base) // _WORD,
                    off // _WORD,
                    block_bytes // _WORD,
                    plane.unit_bytes // _WORD,
                    plane.unit_tokens,
                    self.groups.index(groups[i]),
                ]
            )
            first, count, geo = self._layer.get(lid, (seg, 0, []))
            self._layer[lid] = (
                first,
                count + 1,
                [*geo, (plane.unit_tokens, units_per_block, plane.unit_bytes)],
            )
        self.table = torch.tensor(rows, dtype=torch.int64, device=caches[0].device)
        self.src0 = caches[0].view(torch.int32)
        self.num_segments = len(rows)
        self._all = [g for _, _, geo in self._layer.values() for g in geo]
        self._geometries = sorted({(t, upb) for t, upb, _ in self._all})
        #: The constants of _gather_planes_kernel when segment s's geometry is plane s % 2's in every layer
        #: (one or two planes a layer, every layer the same), else None.
        self._planes: tuple[tuple[str, int], ...] | None = None
        geometry = [tuple(r[2:]) for r in rows]
        per_layer = {count for _, count, _ in self._layer.values()}
        if per_layer in ({1}, {2}):
            k = per_layer.pop()
            g0, g1 = geometry[0], geometry[k - 1]
            if all(g == (g0, g1)[s % k] for s, g in enumerate(geometry)) and (k == 2 or g0 == g1):
                self._planes = tuple(
                    zip(("BW0", "UW0", "UT0", "G0", "BW1", "UW1", "UT1", "G1"), (*g0, *g1), strict=True)
                )

    @property
    def layers(self) -> frozenset[int]:
        return frozenset(self._layer)

    def blocks(self, num_tokens: int) -> int:
        """Blocks of the request any plane reads (the block-id rows must hold at least these)."""
        return max(_cdiv(_cdiv(num_tokens, t), upb) for t, upb in self._geometries)

    def first_block(self, start: int) -> int:
        """The first block a gather from token `start` copies: in every plane it begins at or before
        `start` (rows before it in that block are copied again, the same bytes)."""
        return start // max(t * upb for t, upb in self._geometries)

    def __call__(
        self,
        block_ids: torch.Tensor,
        num_tokens: int,
        region: torch.Tensor,
        layer: int | None = None,
        chunk: int | None = None,
        num_warps: int | None = None,
        split: int | None = None,
        start: int = 0,
    ) -> int:
        """Gather every layer, or only `layer` (0 bytes if this gather holds none of it), tokens
        `start` (a chunk-wise handoff: the tokens of this step's chunk) to `num_tokens`.

        `block_ids`: int32 [len(groups), >= blocks(num_tokens)] on the device, row g = group groups[g].
        """
        if layer is None:
            first, count, geo = 0, self.num_segments, self._all
        elif layer in self._layer:
            first, count, geo = self._layer[layer]
        else:
            return 0
        j0 = self.first_block(start)
        blocks = self.blocks(num_tokens) - j0
        if blocks <= 0:
            return 0
        if chunk is None:
            chunk = CHUNK_WORDS if layer is None else LAYER_CHUNK_WORDS
        if num_warps is None:
            num_warps = NUM_WARPS if layer is None else LAYER_WARPS
        if split is None:
            split = min(MAX_SPLIT, _cdiv(MIN_PROGRAMS, blocks * count)) if layer is None else LAYER_SPLIT
        args = (
            self.src0,
            self.table,
            block_ids,
            block_ids.stride(0),
            region.view(torch.int32),
            num_tokens,
            first,
            j0,
        )
        if PLANES_KERNEL and self._planes is not None:
            _GATHER_PLANES((blocks, count, split), args, (("CHUNK", chunk), *self._planes), num_warps)
        else:
            _GATHER((blocks, count, split), args, (("CHUNK", chunk),), num_warps)
        return sum((_cdiv(num_tokens, t) - start // t) * b for t, _, b in geo)
