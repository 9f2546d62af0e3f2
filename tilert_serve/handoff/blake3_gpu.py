"""BLAKE3 of byte ranges of CUDA buffers, on the GPU, in place: the same 32-byte digest as the `blake3`
package over the ranges' bytes concatenated in order (unkeyed), without copying them anywhere.

Why on the GPU: hashing a GPU state through host copies is bound by the device-to-host link (a whole
GLM-5 state at 128k tokens took 166 ms on an H200, bench/RESULTS.md's digest-cuda section), the
largest serial stage of a handoff; BLAKE3's compression is 32-bit adds, xors and rotations, which the
GPU does at 65-74% of the speed it copies the bytes (a whole GLM-5 state at 8k-128k tokens on an H200:
bench/RESULTS.md's digest-gpu section).

BLAKE3's tree, as used here: the message is cut into 1024-byte chunks; chunk i is 16 compressions of
64-byte blocks chained through an 8-word chaining value (CV), with counter i, CHUNK_START on its first
block, CHUNK_END on its last (the last chunk may be short: its last block is zero-padded, the block
length says how much is real; an empty message is one empty block). Parents compress two children's
CVs (left then right) with counter 0 and PARENT. The tree is left-complete, which is the same as
pairing the nodes of each level left to right, an odd last node going up unchanged. The top node
(the only chunk, or the last parent) carries ROOT too; its output words are the digest.

The work, in a few launches over the whole list of ranges:

- _fast_kernel: one lane per chunk, PER_PROGRAM chunks per program, every chunk's CV into a [chunks, 8]
  array. A lane whose chunk is whole, inside one range and 16-byte aligned (all of a GLM-5 state's:
  its rows and pages are multiples of 16 bytes and its planes of 1 KiB) loads each 64-byte block as
  four 16-byte words and compresses it; other lanes store nothing.
- _general_kernel: the chunks the host lists (_plan: a superset of those), byte by byte, whatever
  their ranges, alignment or length; none for a GLM-5 state, a few where rows cut 1 KiB chunks.
- _parent_kernel: PARENT_FANIN nodes a program reduced to their subtree's node (aligned groups of a
  power of two are subtrees), launch after launch until one is left, ROOT on the last parent.

Parents get a kernel of their own rather than being reduced inside the chunk programs: a level with
fewer nodes than lanes costs a whole compression per lane however few are real, and seven such levels
in a 128-chunk program cost ~40% on top of its 16 compressions per lane (measured: 42% of copy speed
with them, bench/digest/gpu.py). A parent program of one warp over 256 nodes wastes less, and parents
are a sixteenth of the work. Launches go through convert_triton.Launcher (the compiled kernel's own
launcher, not Triton's ~20 us per call Python path): a layer-wise node checks a digest per layer.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tilert_serve.layouts.convert_triton import Launcher

CHUNK = 1024
#: Chunks per program of the fast kernel (a power of two, one chunk per lane) and its warps; ROW_LOADS:
#: each lane loads its own chunk's 64-byte blocks, else the blocks are loaded coalesced and regrouped.
PER_PROGRAM = 128
NUM_WARPS = 4
ROW_LOADS = True
#: The general kernel: chunks per program (one per lane) and warps.
GENERAL_LANES = 32
GENERAL_WARPS = 1
#: CVs one parent program reduces (a power of two), and its warps.
PARENT_FANIN = 256
PARENT_WARPS = 1
#: Byte address alignment the fast kernel loads with.
_ALIGN = 16

_IV = (0x6A09E667, 0xBB67AE85, 0x3C6EF372, 0xA54FF53A, 0x510E527F, 0x9B05688C, 0x1F83D9AB, 0x5BE0CD19)
_START, _END, _PARENT, _ROOT = 1, 2, 4, 8


# -- the compression function (elementwise over a tensor of independent chunks or parents) ---------


@triton.jit
def _rotr(x, n: tl.constexpr):
    return (x >> n) | (x << (32 - n))


@triton.jit
def _g(a, b, c, d, mx, my):
    a = a + b + mx
    d = _rotr(d ^ a, 16)
    c = c + d
    b = _rotr(b ^ c, 12)
    a = a + b + my
    d = _rotr(d ^ a, 8)
    c = c + d
    b = _rotr(b ^ c, 7)
    return a, b, c, d


@triton.jit
def _compress(h, m, t_lo, t_hi, blen, flags):
    """The first 8 output words of BLAKE3's compression: `h` the 8-word chaining value and `m` the
    16-word block, as tuples, every word (and t_lo, t_hi, blen, flags) a uint32 tensor of one shape (or
    broadcastable to it). Tuples are a compile-time grouping: they cost no instructions."""
    s0, s1, s2, s3, s4, s5, s6, s7 = h
    m0, m1, m2, m3, m4, m5, m6, m7, m8, m9, m10, m11, m12, m13, m14, m15 = m
    s8 = tl.full(s0.shape, 0x6A09E667, tl.uint32)
    s9 = tl.full(s0.shape, 0xBB67AE85, tl.uint32)
    s10 = tl.full(s0.shape, 0x3C6EF372, tl.uint32)
    s11 = tl.full(s0.shape, 0xA54FF53A, tl.uint32)
    s12, s13, s14, s15 = t_lo, t_hi, blen, flags
    for _ in tl.static_range(7):
        s0, s4, s8, s12 = _g(s0, s4, s8, s12, m0, m1)
        s1, s5, s9, s13 = _g(s1, s5, s9, s13, m2, m3)
        s2, s6, s10, s14 = _g(s2, s6, s10, s14, m4, m5)
        s3, s7, s11, s15 = _g(s3, s7, s11, s15, m6, m7)
        s0, s5, s10, s15 = _g(s0, s5, s10, s15, m8, m9)
        s1, s6, s11, s12 = _g(s1, s6, s11, s12, m10, m11)
        s2, s7, s8, s13 = _g(s2, s7, s8, s13, m12, m13)
        s3, s4, s9, s14 = _g(s3, s4, s9, s14, m14, m15)
        # BLAKE3's message permutation, applied between rounds (a renaming: no instructions).
        m0, m1, m2, m3, m4, m5, m6, m7, m8, m9, m10, m11, m12, m13, m14, m15 = (
            m2, m6, m3, m10, m7, m0, m4, m13, m1, m11, m12, m5, m9, m14, m15, m8,
        )  # fmt: skip
    return s0 ^ s8, s1 ^ s9, s2 ^ s10, s3 ^ s11, s4 ^ s12, s5 ^ s13, s6 ^ s14, s7 ^ s15


@triton.jit
def _iv(like):
    """BLAKE3's IV as a tuple of 8 uint32 tensors of `like`'s shape."""
    return (
        tl.full(like.shape, 0x6A09E667, tl.uint32),
        tl.full(like.shape, 0xBB67AE85, tl.uint32),
        tl.full(like.shape, 0x3C6EF372, tl.uint32),
        tl.full(like.shape, 0xA54FF53A, tl.uint32),
        tl.full(like.shape, 0x510E527F, tl.uint32),
        tl.full(like.shape, 0x9B05688C, tl.uint32),
        tl.full(like.shape, 0x1F83D9AB, tl.uint32),
        tl.full(like.shape, 0x5BE0CD19, tl.uint32),
    )


@triton.jit
def _split16(w, C: tl.constexpr):
    """[C, 16] words -> 16 tensors [C], word j of each row (the regrouping goes through shared memory)."""
    x = tl.reshape(w, [C, 2, 2, 2, 2])
    e, o = tl.split(x)
    ee, eo = tl.split(e)
    oe, oo = tl.split(o)
    eee, eeo = tl.split(ee)
    eoe, eoo = tl.split(eo)
    oee, oeo = tl.split(oe)
    ooe, ooo = tl.split(oo)
    m0, m8 = tl.split(eee)
    m4, m12 = tl.split(eeo)
    m2, m10 = tl.split(eoe)
    m6, m14 = tl.split(eoo)
    m1, m9 = tl.split(oee)
    m5, m13 = tl.split(oeo)
    m3, m11 = tl.split(ooe)
    m7, m15 = tl.split(ooo)
    return m0, m1, m2, m3, m4, m5, m6, m7, m8, m9, m10, m11, m12, m13, m14, m15


@triton.jit
def _halves(h, N: tl.constexpr):
    """[N] -> (even-indexed, odd-indexed) [N // 2]: left and right children."""
    return tl.split(tl.reshape(h, [N // 2, 2]))


@triton.jit
def _tree(h0, h1, h2, h3, h4, h5, h6, h7, cnt, single, N: tl.constexpr, LOG2N: tl.constexpr):
    """Reduce N nodes (the first `cnt` real) pairwise, level by level, an odd last node carried up, to
    one; `single`: this is the whole tree, so the last parent is the root. Returns 8 scalars."""
    for lvl in tl.static_range(LOG2N):
        l0, r0 = _halves(h0, N >> lvl)
        l1, r1 = _halves(h1, N >> lvl)
        l2, r2 = _halves(h2, N >> lvl)
        l3, r3 = _halves(h3, N >> lvl)
        l4, r4 = _halves(h4, N >> lvl)
        l5, r5 = _halves(h5, N >> lvl)
        l6, r6 = _halves(h6, N >> lvl)
        l7, r7 = _halves(h7, N >> lvl)
        zero = tl.zeros(l0.shape, tl.uint32)
        root = (single & (cnt == 2)).to(tl.uint32)
        flags = zero + (4 + 8 * root)
        left = (l0, l1, l2, l3, l4, l5, l6, l7)
        m = (l0, l1, l2, l3, l4, l5, l6, l7, r0, r1, r2, r3, r4, r5, r6, r7)
        p = _compress(_iv(l0), m, zero, zero, zero + 64, flags)
        pair = 2 * tl.arange(0, N >> (lvl + 1)) + 1 < cnt
        h0, h1, h2, h3, h4, h5, h6, h7 = _where8(pair, p, left)
        cnt = (cnt + 1) // 2
    return (
        tl.sum(h0, axis=0),
        tl.sum(h1, axis=0),
        tl.sum(h2, axis=0),
        tl.sum(h3, axis=0),
        tl.sum(h4, axis=0),
        tl.sum(h5, axis=0),
        tl.sum(h6, axis=0),
        tl.sum(h7, axis=0),
    )


@triton.jit
def _where8(c, a, b):
    """tl.where over two 8-word tuples."""
    return (
        tl.where(c, a[0], b[0]),
        tl.where(c, a[1], b[1]),
        tl.where(c, a[2], b[2]),
        tl.where(c, a[3], b[3]),
        tl.where(c, a[4], b[4]),
        tl.where(c, a[5], b[5]),
        tl.where(c, a[6], b[6]),
        tl.where(c, a[7], b[7]),
    )


@triton.jit
def _store_cvs(out, idx, mask, h):
    """The 8 words of `h` as CV `idx` of `out` (a uint32 [n, 8] array), where `mask`."""
    o = out.to(tl.pointer_type(tl.uint32), bitcast=True) + idx * 8
    for k in tl.static_range(8):
        tl.store(o + k, h[k], mask=mask)


@triton.jit
def _range_of(starts, num_ranges, nsteps, pos):
    """Index of the range holding message byte `pos` (the last start <= pos), elementwise."""
    lo = (pos * 0).to(tl.int32)
    hi = lo + num_ranges - 1
    for _ in range(nsteps):
        mid = (lo + hi + 1) // 2
        go = tl.load(starts + mid) <= pos
        lo = tl.where(go, mid, lo)
        hi = tl.where(go, hi, mid - 1)
    return lo


# -- the kernels ----------------------------------------------------------------------------------------


@triton.jit
def _split4(q):
    """[C, 4] -> 4 tensors [C] (a lane's own 16 bytes: no data movement)."""
    e, o = tl.split(tl.reshape(q, [q.shape[0], 2, 2]))
    w0, w2 = tl.split(e)
    w1, w3 = tl.split(o)
    return w0, w1, w2, w3


@triton.jit
def _block_words(rows, b, ok, C: tl.constexpr, ROW_LOADS: tl.constexpr):
    """Block b's 16 words of every lane's chunk (`rows`: a uint32 pointer per chunk). ROW_LOADS: each lane
    loads its own 64 bytes (4 x 16 bytes); else the [C, 16] tile is loaded with consecutive lanes on
    consecutive 16-byte words and regrouped through shared memory."""
    if ROW_LOADS:
        k = tl.arange(0, 4)[None, :]
        m = ok[:, None]
        w0, w1, w2, w3 = _split4(
            tl.load(rows[:, None] + (b * 16 + k), mask=m, other=0, eviction_policy="evict_first")
        )
        w4, w5, w6, w7 = _split4(
            tl.load(rows[:, None] + (b * 16 + 4 + k), mask=m, other=0, eviction_policy="evict_first")
        )
        w8, w9, w10, w11 = _split4(
            tl.load(rows[:, None] + (b * 16 + 8 + k), mask=m, other=0, eviction_policy="evict_first")
        )
        w12, w13, w14, w15 = _split4(
            tl.load(rows[:, None] + (b * 16 + 12 + k), mask=m, other=0, eviction_policy="evict_first")
        )
    else:
        w = tl.load(
            rows[:, None] + (b * 16 + tl.arange(0, 16)[None, :]),
            mask=ok[:, None],
            other=0,
            eviction_policy="evict_first",
        )
        w0, w1, w2, w3, w4, w5, w6, w7, w8, w9, w10, w11, w12, w13, w14, w15 = _split16(w, C)
    return w0, w1, w2, w3, w4, w5, w6, w7, w8, w9, w10, w11, w12, w13, w14, w15


# Integer arguments are not specialised (on being 1 or a multiple of 16): each specialisation is another
# compilation of a large kernel, tens of seconds, for no gain here.
@triton.jit(do_not_specialize=["addrs_at", "num_ranges", "nsteps", "num_chunks", "base_mod"])
def _fast_kernel(
    base,
    starts,
    addrs_at,
    num_ranges,
    nsteps,
    num_chunks,
    base_mod,
    out,
    C: tl.constexpr,
    ROW_LOADS: tl.constexpr,
):
    """The CV of every whole chunk that lies inside one range at a 16-byte-aligned address; the other
    lanes store nothing (their chunks are the general kernel's). `starts` is the range table, the
    addresses `addrs_at` entries in."""
    addrs = starts + addrs_at
    chunk = tl.program_id(0).to(tl.int64) * C + tl.arange(0, C)
    pos = chunk * 1024
    r = _range_of(starts, num_ranges, nsteps, pos)
    s = tl.load(starts + r)
    rel = tl.load(addrs + r) + pos - s
    ok = (
        (chunk < num_chunks)
        & (tl.load(starts + r + 1) >= pos + 1024)
        & ((rel + base_mod) % 16 == 0)
        & (chunk * 0 + num_chunks > 1)
    )
    rows = (base + tl.multiple_of(tl.where(ok, rel, 0), 16)).to(tl.pointer_type(tl.uint32), bitcast=True)
    t_lo = chunk.to(tl.uint32)
    t_hi = (chunk >> 32).to(tl.uint32)
    zero = tl.zeros([C], tl.uint32)
    h0, h1, h2, h3, h4, h5, h6, h7 = _iv(zero)
    for b in range(16):
        m = _block_words(rows, b, ok, C, ROW_LOADS)
        flags = zero + (tl.where(b == 0, 1, 0) + tl.where(b == 15, 2, 0)).to(tl.uint32)
        h0, h1, h2, h3, h4, h5, h6, h7 = _compress(
            (h0, h1, h2, h3, h4, h5, h6, h7), m, t_lo, t_hi, zero + 64, flags
        )
    _store_cvs(out, chunk, ok, (h0, h1, h2, h3, h4, h5, h6, h7))


@triton.jit(
    do_not_specialize=["addrs_at", "chunks_at", "count", "num_ranges", "nsteps", "total", "num_chunks"]
)
def _general_kernel(
    base, starts, addrs_at, chunks_at, count, num_ranges, nsteps, total, num_chunks, out, C: tl.constexpr
):
    """The CVs of the listed chunks (`count` of them, `chunks_at` entries into the range table), any
    length, ranges and alignment, byte by byte; the only chunk of a message is the root."""
    addrs = starts + addrs_at
    chunks = starts + chunks_at
    i = tl.program_id(0).to(tl.int64) * C + tl.arange(0, C)
    valid = i < count
    chunk = tl.load(chunks + i, mask=valid, other=0)
    pos = chunk * 1024
    clen = tl.minimum(tl.maximum(total - pos, 0), 1024).to(tl.int32)
    r_first = _range_of(starts, num_ranges, nsteps, pos)
    r_last = _range_of(starts, num_ranges, nsteps, pos + tl.maximum(clen - 1, 0))
    spread = tl.max(tl.where(valid, r_last - r_first, 0), axis=0)  # most ranges a chunk here crosses, - 1
    last_block = tl.maximum(clen - 1, 0) // 64
    t_lo = chunk.to(tl.uint32)
    t_hi = (chunk >> 32).to(tl.uint32)
    zero = tl.zeros([C], tl.uint32)
    h0, h1, h2, h3, h4, h5, h6, h7 = _iv(zero)
    j = tl.arange(0, 16)
    only_chunk = num_chunks == 1
    for b in range(16):
        w = tl.zeros([C, 16], tl.uint32)
        for q in tl.static_range(4):
            # Chunk-relative byte positions, and each one's address in whichever range holds it.
            p = b * 64 + j[None, :] * 4 + q + tl.zeros([C, 16], tl.int32)
            addr = tl.zeros([C, 16], tl.int64)
            for k in range(0, spread + 1):
                r = tl.minimum(r_first + k, num_ranges - 1)
                s = tl.load(starts + r) - pos
                e = tl.load(starts + r + 1) - pos
                delta = tl.load(addrs + r) - s
                sel = (p >= s[:, None]) & (p < e[:, None])
                addr = tl.where(sel, delta[:, None] + p, addr)
            byte = tl.load(base + addr, mask=(p < clen[:, None]) & valid[:, None], other=0)
            w = w | (byte.to(tl.uint32) << (8 * q))
        is_last = b == last_block
        flags = (tl.where(b == 0, 1, 0) + tl.where(is_last, 2, 0) + tl.where(is_last & only_chunk, 8, 0)).to(
            tl.uint32
        )
        blen = tl.minimum(tl.maximum(clen - b * 64, 0), 64).to(tl.uint32)
        h = (h0, h1, h2, h3, h4, h5, h6, h7)
        n = _compress(h, _split16(w, C), t_lo, t_hi, blen, flags)
        live = (b * 64 < clen) | tl.where(b == 0, True, False)
        h0, h1, h2, h3, h4, h5, h6, h7 = _where8(live, n, h)
    _store_cvs(out, chunk, valid, (h0, h1, h2, h3, h4, h5, h6, h7))


@triton.jit(do_not_specialize=["in_at", "count", "out_at"])
def _parent_kernel(ws, in_at, count, out_at, N: tl.constexpr, LOG2N: tl.constexpr):
    """N nodes of a level (`count` CVs at word `in_at` of the workspace) -> their subtree's node, at
    word `out_at` + 8 x the program's index."""
    pid = tl.program_id(0)
    first = pid.to(tl.int64) * N
    rows = first + tl.arange(0, N)
    src = ws.to(tl.pointer_type(tl.uint32), bitcast=True) + in_at
    tile = tl.load(src + rows[:, None] * 8 + tl.arange(0, 8)[None, :], mask=(rows < count)[:, None], other=0)
    x = tl.reshape(tile, [N, 2, 2, 2])
    e, o = tl.split(x)
    ee, eo = tl.split(e)
    oe, oo = tl.split(o)
    h0, h4 = tl.split(ee)
    h2, h6 = tl.split(eo)
    h1, h5 = tl.split(oe)
    h3, h7 = tl.split(oo)
    cnt = tl.minimum(count - first, N)
    g = _tree(h0, h1, h2, h3, h4, h5, h6, h7, cnt, count <= N, N, LOG2N)
    _store_cvs(ws.to(tl.pointer_type(tl.uint32), bitcast=True) + out_at, pid, pid >= 0, g)


_fast = Launcher(_fast_kernel)
_general = Launcher(_general_kernel)
_parent = Launcher(_parent_kernel)


# -- the host side ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Plan:
    """Where the message's bytes are and which chunks the general kernel takes.

    `starts[r]`: the message offset of range r's first byte (`starts[-1]` = the message's length);
    `addrs[r]`: its address relative to the base pointer; `general`: chunk indices, a superset of
    those the fast kernel leaves (short, crossing a range boundary, at an address that is not a
    multiple of 16, or the message's only chunk)."""

    starts: list[int]
    addrs: list[int]
    num_chunks: int
    general: list[int]

    @property
    def total(self) -> int:
        return self.starts[-1]


def plan(ranges: Sequence[tuple[int, int]], base_mod: int = 0) -> Plan:
    """`ranges`: (address relative to the base pointer, nbytes) in message order, empty ones allowed;
    `base_mod`: the base pointer's address modulo 16."""
    starts, addrs = [0], []
    for addr, n in ranges:
        if n > 0:
            addrs.append(addr)
            starts.append(starts[-1] + n)
    if not addrs:  # the empty message: one range of nothing
        addrs, starts = [0], [0, 0]
    total = starts[-1]
    num_chunks = max(1, -(-total // CHUNK))
    general: set[int] = set()
    for r, addr in enumerate(addrs):
        s, e = starts[r], starts[r + 1]
        if e == s:
            continue
        if (base_mod + addr - s) % _ALIGN:
            general.update(range(s // CHUNK, (e - 1) // CHUNK + 1))
        if s % CHUNK:  # the chunk that straddles this range's start
            general.add(s // CHUNK)
    if total % CHUNK or num_chunks == 1:
        general.add(num_chunks - 1)
    return Plan(starts, addrs, num_chunks, sorted(general))


@dataclass(frozen=True)
class Job:
    """One digest's launches, ready to go: the range table on the device and the plan."""

    base: torch.Tensor
    base_mod: int
    table: torch.Tensor
    plan: Plan


def prepare(buffers: Sequence[torch.Tensor], ranges: Sequence[tuple[int, int, int]]) -> Job:
    """Check the ranges and copy their table to the device (the one host-to-device copy)."""
    used = sorted({shard for shard, _, n in ranges if n > 0}) or [0]
    device = buffers[used[0]].device
    for s in used:
        b = buffers[s]
        if b.device != device or b.dtype != torch.uint8 or b.dim() != 1:
            raise ValueError("blake3_gpu takes 1-D uint8 tensors on one device")
    base = min((buffers[s] for s in used), key=lambda t: t.data_ptr())
    where = {s: (buffers[s].data_ptr() - base.data_ptr(), buffers[s].numel()) for s in used}
    rel: list[tuple[int, int]] = []
    for shard, off, n in ranges:
        if n == 0:
            continue
        at, size = where[shard]
        if off < 0 or n < 0 or off + n > size:
            raise ValueError(f"range ({shard}, {off}, {n}) is outside its buffer of {size} bytes")
        rel.append((at + off, n))
    base_mod = base.data_ptr() % _ALIGN
    p = plan(rel, base_mod)
    pad = [0] * (len(p.starts) % 2)  # the addresses start 16-byte aligned
    table = torch.tensor(
        p.starts + pad + p.addrs + p.general, dtype=torch.int64, pin_memory=device.type == "cuda"
    )
    return Job(base, base_mod, table.to(device, non_blocking=True), p)


def launch(job: Job) -> torch.Tensor:
    """Queue the kernels on the current stream; returns the digest's 8 words (int32) on the device.
    Few host operations a call (a layer-wise node makes one per layer): one table, one workspace for
    every level's CVs, offsets into them passed as integers."""
    p, table = job.plan, job.table
    nranges = len(p.addrs)
    nsteps = nranges.bit_length()
    addrs_at = len(p.starts) + len(p.starts) % 2
    levels = [p.num_chunks]
    while levels[-1] > 1:
        levels.append(-(-levels[-1] // PARENT_FANIN))
    ws = torch.empty(8 * sum(levels), dtype=torch.int32, device=table.device)
    with torch.cuda.device(table.device) if table.device.type == "cuda" else contextlib.nullcontext():
        if len(p.general) < p.num_chunks:
            _fast(
                (-(-p.num_chunks // PER_PROGRAM),),
                (job.base, table, addrs_at, nranges, nsteps, p.num_chunks, job.base_mod, ws),
                (("C", PER_PROGRAM), ("ROW_LOADS", ROW_LOADS)),
                NUM_WARPS,
            )
        if p.general:
            _general(
                (-(-len(p.general) // GENERAL_LANES),),
                (
                    job.base,
                    table,
                    addrs_at,
                    addrs_at + nranges,
                    len(p.general),
                    nranges,
                    nsteps,
                    p.total,
                    p.num_chunks,
                    ws,
                ),
                (("C", GENERAL_LANES),),
                GENERAL_WARPS,
            )
        at = 0
        fanin = (("N", PARENT_FANIN), ("LOG2N", PARENT_FANIN.bit_length() - 1))
        for count, nxt in itertools.pairwise(levels):
            _parent((nxt,), (ws, at, count, at + 8 * count), fanin, PARENT_WARPS)
            at += 8 * count
    return ws[at : at + 8]


def digest(buffers: Sequence[torch.Tensor], ranges: Sequence[tuple[int, int, int]]) -> bytes:
    """BLAKE3 (32 bytes) of the concatenated bytes of `ranges` ((shard, offset, nbytes)) of the 1-D
    uint8 tensors `buffers`, all on one CUDA device. Runs on the current stream, after the work queued
    there, and returns once the digest is on the host."""
    words = launch(prepare(buffers, ranges)).cpu()
    return words.numpy().astype("<i4").tobytes()


def hexdigest(buffers: Sequence[torch.Tensor], ranges: Sequence[tuple[int, int, int]]) -> str:
    return digest(buffers, ranges).hex()


def reference(data: bytes, parent_fanin: int = PARENT_FANIN) -> bytes:
    """The same computation on the host in plain Python, launch by launch (every chunk's CV, then groups
    of `parent_fanin` nodes reduced to one until one is left, odd nodes carried up, ROOT on the last
    parent): the tree plan checked against `blake3` without a GPU. Slow: for tests of a few chunks."""
    chunks = [data[i : i + CHUNK] for i in range(0, len(data), CHUNK)] or [b""]
    nodes = [_chunk_cv(c, i, root=len(chunks) == 1) for i, c in enumerate(chunks)]
    while len(nodes) > 1:
        single = len(nodes) <= parent_fanin
        nodes = [_reduce(nodes[i : i + parent_fanin], single) for i in range(0, len(nodes), parent_fanin)]
    return b"".join(w.to_bytes(4, "little") for w in nodes[0])


def _reduce(nodes: list[list[int]], single: bool) -> list[int]:
    while len(nodes) > 1:
        root = single and len(nodes) == 2
        nodes = [
            _compress_py(list(_IV), nodes[i] + nodes[i + 1], 0, 64, _PARENT | (_ROOT if root else 0))
            if i + 1 < len(nodes)
            else nodes[i]
            for i in range(0, len(nodes), 2)
        ]
    return nodes[0]


def _chunk_cv(chunk: bytes, index: int, root: bool) -> list[int]:
    blocks = [chunk[i : i + 64] for i in range(0, len(chunk), 64)] or [b""]
    h = list(_IV)
    for k, blk in enumerate(blocks):
        flags = (_START if k == 0 else 0) | (_END | (_ROOT if root else 0) if k == len(blocks) - 1 else 0)
        words = [int.from_bytes(blk.ljust(64, b"\0")[4 * i : 4 * i + 4], "little") for i in range(16)]
        h = _compress_py(h, words, index, len(blk), flags)
    return h


_PERM = (2, 6, 3, 10, 7, 0, 4, 13, 1, 11, 12, 5, 9, 14, 15, 8)
_M32 = 0xFFFFFFFF


def _compress_py(h: list[int], m: list[int], counter: int, blen: int, flags: int) -> list[int]:
    s = [*h, *_IV[:4], counter & _M32, counter >> 32, blen, flags]

    def g(a: int, b: int, c: int, d: int, x: int, y: int) -> None:
        s[a] = (s[a] + s[b] + x) & _M32
        s[d] = _rot(s[d] ^ s[a], 16)
        s[c] = (s[c] + s[d]) & _M32
        s[b] = _rot(s[b] ^ s[c], 12)
        s[a] = (s[a] + s[b] + y) & _M32
        s[d] = _rot(s[d] ^ s[a], 8)
        s[c] = (s[c] + s[d]) & _M32
        s[b] = _rot(s[b] ^ s[c], 7)

    for _ in range(7):
        g(0, 4, 8, 12, m[0], m[1])
        g(1, 5, 9, 13, m[2], m[3])
        g(2, 6, 10, 14, m[4], m[5])
        g(3, 7, 11, 15, m[6], m[7])
        g(0, 5, 10, 15, m[8], m[9])
        g(1, 6, 11, 12, m[10], m[11])
        g(2, 7, 8, 13, m[12], m[13])
        g(3, 4, 9, 14, m[14], m[15])
        m = [m[i] for i in _PERM]
    return [s[i] ^ s[i + 8] for i in range(8)]


def _rot(x: int, n: int) -> int:
    return ((x >> n) | (x << (32 - n))) & _M32
