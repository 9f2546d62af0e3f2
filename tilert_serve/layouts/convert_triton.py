"""CUDA conversion of received fp8_ds_mla state into the engine's bf16 tensors, in one pass.

One launch over every layer (or over one layer, for layer-wise handoff), of two kinds of program:
  - MLA rows (656 B: 512 fp8 latent values, 4 fp32 block scales, 64 bf16 RoPE values) -> kv [L, n, 512]
    and pe [L, n, 64] in bf16;
  - indexer pages (64 tokens x 128 fp8 values, then 64 fp32 scales) -> the fp8 values times the +-1
    Hadamard matrix on the tensor cores in fp8 (no conversion before the product), times each token's
    scale and 128^-1/2, stored as ki [L, n, 128] bf16.
Each byte of the wire is read once and each output written once, so the conversion runs near the
device's copy bandwidth (bench/convert). A layer converted alone runs the same tiles as in the whole
state (its indexer pages unrolled rather than in a pipelined loop: the same product), so it is bit for
bit the same. The torch path in convert.py is the reference it is tested against. Launches go
through Launcher (below): the node converts each layer as it lands.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import triton
import triton.language as tl
from triton import knobs
from triton.runtime import driver

from tilert_serve.layouts.convert import hadamard_matrix
from tilert_serve.layouts.placement import Placement
from tilert_serve.layouts.registry import FP8_DS_MLA_ROW_BYTES, INDEXER_PAGE_BYTES
from tilert_serve.layouts.state import InjectedState, LayerState

_ROW = FP8_DS_MLA_ROW_BYTES
_PAGE = INDEXER_PAGE_BYTES
#: MLA tokens per program and warps (indexer programs: IDX_WARPS when launched on their own): picked
#: on an H200 with `bench/convert/run.py --tune`.
BLOCK_T = 16
NUM_WARPS = 4
IDX_WARPS = 4
#: Indexer pages per program (None: by grid size, see _pages): the 16 KB Hadamard matrix is read
#: (from L2) once per program. Picked on an H200 with `bench/convert/explore.py --only indexer`.
PAGES: int | None = None
#: The whole state's indexer launch: its pages unrolled (0) or a loop pipelined over IDX_STAGES stages
#: (each page's bytes go straight to shared memory, the next pages' load while this one multiplies).
#: 3 stages over 2 pages a program on an H200: the indexer launch 70 / 259 / 1006 us at 8k / 32k / 128k
#: against 74 / 269 / 1054 with 2 stages over 4 pages, 80 / 293 / 1126 unrolled, the same bits
#: (`bench/convert/explore.py --only indexer,adopt`; 4 and 5 stages, 1 to 4 pages: no better).
IDX_STAGES = 3
#: Both planes in one launch (_convert_kernel) or one each (None: one for a single layer, two for
#: more: one layer's few microseconds pay for a second launch, the whole state runs faster as two).
ONE_LAUNCH: bool | None = None
#: A layer converted alone (one launch of _convert_kernel): MLA tokens per program and warps. Bit for
#: bit the same as the whole state's (MLA tokens convert independently; the indexer page is the same
#: product). 32 tokens, 8 warps on an H200: 7.8 / 23.0 / 83.0 us at 8k / 32k / 128k, within 1% of
#: the best of 16-64 tokens and 4-8 warps at each size (`bench/convert/explore.py --only convert`).
LAYER_BLOCK_T = 32
LAYER_WARPS = 8
#: The one launch's program order: 0 MLA programs first, 1 indexer programs first, 2 interleaved (an
#: indexer program after every mla_programs // idx_programs MLA programs); None: by size (_layer_order).
#: The same bits in any order. H200, 32 tokens, 8 warps (`bench/convert/explore.py --only convert`):
#: at 32k 22.9 / 24.1 / 23.1 us, at 128k 82.2 / 83.9 / 80.7 us (0 / 1 / 2).
LAYER_ORDER: int | None = None
#: Launch the compiled kernels through their launchers (Launcher below) instead of JITFunction.__call__,
#: which spends ~20 us a launch in Python binding and specialising the arguments. Off: Triton's own path.
DIRECT_LAUNCH = True


def _cdiv(a: int, b: int) -> int:
    # Not triton.cdiv: that is a ConstexprFunction, ~3.5 us a call from Python.
    return -(-a // b)


def _spec(arg: object) -> object:
    """What Triton specialises a kernel on for one argument (its default, do_not_specialize unused):
    a tensor's dtype and 16-byte alignment; an int's size class, whether it is 1 and whether a
    multiple of 16. Two calls with equal keys run the same compiled kernel."""
    if isinstance(arg, torch.Tensor):
        return arg.dtype, arg.data_ptr() % 16 == 0
    if isinstance(arg, int):
        return -(1 << 31) <= arg < (1 << 31), arg == 1, arg % 16 == 0
    return type(arg)


def _hooked() -> bool:
    """A launch hook is set (None, or an empty HookChain in newer Tritons, means none)."""
    hooks = (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook)
    return any(bool(getattr(h, "calls", h)) for h in hooks)


class Launcher:
    """A Triton kernel launched straight through its compiled kernel's launcher.

    `kernel[grid](...)` binds and specialises every argument in Python on every call (~20 us on the
    H200's host, measured in bench/extract and bench/convert as "call" against "kernel"): a layer-wise
    handoff makes a gather per layer in vLLM's forward thread and a conversion per layer on the node.
    The first call for a specialisation key (device, constexprs, `_spec` of each argument) goes
    through Triton's own path, which compiles and launches it and returns the compiled kernel; later
    calls with the same key call its launcher with the same arguments. Triton's own path is kept
    whenever launch hooks are set (a profiler) or DIRECT_LAUNCH is off, and for good if the launcher
    refuses the call (another Triton's calling convention).
    """

    def __init__(self, fn: Any) -> None:
        self.fn = fn
        self._compiled: dict[tuple[object, ...], Any] = {}
        self.direct = True

    def __call__(
        self,
        grid: tuple[int, ...],
        args: tuple[Any, ...],
        constexprs: tuple[tuple[str, int], ...],
        num_warps: int,
    ) -> None:
        """`args`: the kernel's runtime arguments in order; `constexprs`: (name, value) of the rest, in
        the kernel's order (they follow the runtime arguments in every kernel here)."""
        if not (DIRECT_LAUNCH and self.direct) or _hooked():
            self.fn[grid](*args, **dict(constexprs), num_warps=num_warps)
            return
        device = torch.cuda.current_device()
        key = (device, constexprs, num_warps, *map(_spec, args))
        compiled = self._compiled.get(key)
        if compiled is None:
            self._compiled[key] = self.fn[grid](*args, **dict(constexprs), num_warps=num_warps)
            return
        g0, g1, g2 = (*grid, 1, 1)[:3]
        try:
            compiled.run(
                g0,
                g1,
                g2,
                driver.active.get_current_stream(device),
                compiled.function,
                compiled.packed_metadata,
                None,
                None,
                None,
                *args,
                *(v for _, v in constexprs),
            )
        except TypeError:  # not this Triton's launcher convention: the launch did not happen
            self.direct = False
            self.fn[grid](*args, **dict(constexprs), num_warps=num_warps)


@triton.jit
def _mla_tile(
    src, layer_off, kv_out, pe_out, n, layer0, pid_t, layer, ROW: tl.constexpr, BLOCK_T: tl.constexpr
):
    """BLOCK_T MLA rows of output layer `layer` (its input is entry layer0 + layer of the offset table)."""
    t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    tmask = t < n
    # Offsets are multiples of 16 bytes (rows are 656 = 16 x 41 bytes): saying so lets loads vectorize.
    rows = (
        src + tl.multiple_of(tl.load(layer_off + layer0 + layer), 16) + t.to(tl.int64) * ROW
    )  # one pointer per token
    g = tl.arange(0, 4)
    c = tl.arange(0, 128)
    col = g[:, None] * 128 + c[None, :]  # [4, 128]
    vptr = (rows[:, None, None] + col[None, :, :]).to(tl.pointer_type(tl.float8e4nv), bitcast=True)
    vals = tl.load(vptr, mask=tmask[:, None, None], other=0.0, eviction_policy="evict_first").to(tl.float32)
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
def _indexer_page(lbase, h, ki_out, n, page, layer, PAGE: tl.constexpr):
    """One indexer page (64 tokens) of output layer `layer`, whose pages start at `lbase`: the fp8
    values times `h`, the +-1 Hadamard matrix, in fp8 on the tensor cores (the page's bytes go to shared
    memory as they are: no conversion before the product), then each token's sums times its scale and
    128^-1/2 (the orthonormal matrix's factor) in float32. The products are exact; the tensor cores'
    fp8 sums keep fewer bits than float32, yet the keys' error (1.7e-3 relative to the float32 torch
    path) is the bf16 rounding's alone: a bf16 product of the same exact values gives the same."""
    r = tl.arange(0, 64)
    c = tl.arange(0, 128)
    base = lbase + page.to(tl.int64) * PAGE
    vptr = (base + r[:, None] * 128 + c[None, :]).to(tl.pointer_type(tl.float8e4nv), bitcast=True)
    acc = tl.dot(tl.load(vptr, eviction_policy="evict_first"), h)
    scales = tl.load((base + 8192).to(tl.pointer_type(tl.float32), bitcast=True) + r) * 0.08838834764831845
    t = page * 64 + r
    out_row = layer.to(tl.int64) * n + t.to(tl.int64)
    tl.store(
        ki_out + out_row[:, None] * 128 + c[None, :],
        (acc * scales[:, None]).to(tl.bfloat16),
        mask=(t < n)[:, None],
    )


@triton.jit
def _hadamard_tile(hadamard):
    """The +-1 Hadamard matrix [128, 128] (fp8), read transposed (it is symmetric): the fp8 product
    wants its second operand K-major, which this order stores with 16-byte vectors."""
    c = tl.arange(0, 128)
    return tl.load(hadamard + c[None, :] * 128 + c[:, None])


@triton.jit
def _layer_base(src, layer_off, layer0, layer):
    """Where output layer `layer`'s pages start (entry layer0 + layer of the offset table): offsets are
    multiples of 16 bytes, and saying so lets the loads vectorize."""
    return src + tl.multiple_of(tl.load(layer_off + layer0 + layer), 16)


@triton.jit
def _indexer_tile(
    src,
    layer_off,
    hadamard,
    ki_out,
    n,
    layer0,
    pid,
    layer,
    PAGE: tl.constexpr,
    PAGES: tl.constexpr,
    STAGES: tl.constexpr,
):
    """PAGES indexer pages of one layer, the Hadamard matrix loaded once for all of them: unrolled
    (STAGES 0), or a loop the compiler pipelines over STAGES stages (the page's bytes go straight to
    shared memory, and the next pages' load while this one multiplies)."""
    h = _hadamard_tile(hadamard)
    lbase = _layer_base(src, layer_off, layer0, layer)
    n_pages = (n + 63) // 64
    if STAGES == 0:
        for k in tl.static_range(PAGES):
            page = pid * PAGES + k
            if page < n_pages:
                _indexer_page(lbase, h, ki_out, n, page, layer, PAGE)
    else:
        for page in tl.range(pid * PAGES, tl.minimum(pid * PAGES + PAGES, n_pages), num_stages=STAGES):
            _indexer_page(lbase, h, ki_out, n, page, layer, PAGE)


@triton.jit
def _mla_rows_kernel(src, layer_off, kv_out, pe_out, n, layer0, ROW: tl.constexpr, BLOCK_T: tl.constexpr):
    _mla_tile(src, layer_off, kv_out, pe_out, n, layer0, tl.program_id(0), tl.program_id(1), ROW, BLOCK_T)


@triton.jit
def _indexer_pages_kernel(
    src, layer_off, hadamard, ki_out, n, layer0, PAGE: tl.constexpr, PAGES: tl.constexpr, STAGES: tl.constexpr
):
    _indexer_tile(
        src, layer_off, hadamard, ki_out, n, layer0, tl.program_id(0), tl.program_id(1), PAGE, PAGES, STAGES
    )


@triton.jit
def _convert_kernel(
    src,
    mla_off,
    idx_off,
    hadamard,
    kv_out,
    pe_out,
    ki_out,
    n,
    layer0,
    mla_programs,
    ROW: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    PAGES: tl.constexpr,
    ORDER: tl.constexpr,
):
    """Both planes in one launch, side by side: the first `mla_programs` programs of a layer do MLA
    rows, the rest indexer pages. One launch and one tail instead of two, which at 8k tokens (~0.35 ms
    of bytes) and for one layer (a few microseconds) is a visible share."""
    pid = tl.program_id(0)
    idx_programs = tl.num_programs(0) - mla_programs
    if ORDER == 0:  # MLA programs first
        is_idx = pid >= mla_programs
        idx_pid = pid - mla_programs
        mla_pid = pid
    elif ORDER == 1:  # indexer programs first
        is_idx = pid < idx_programs
        idx_pid = pid
        mla_pid = pid - idx_programs
    else:  # interleaved: R MLA programs, then one indexer program, while indexer programs last
        r = mla_programs // idx_programs
        q = pid // (r + 1)
        inside = pid < idx_programs * (r + 1)
        is_idx = inside & (pid - q * (r + 1) == r)
        idx_pid = q
        mla_pid = tl.where(inside, pid - q, pid - idx_programs)
    if is_idx:
        # Unrolled: the pipelined loop's buffers (58 KB of shared memory a program) would hold back the
        # MLA programs of the same launch (a layer alone: 8.1 against 7.8 us at 8k, 91 against 83 us at 128k).
        _indexer_tile(src, idx_off, hadamard, ki_out, n, layer0, idx_pid, tl.program_id(1), PAGE, PAGES, 0)
    else:
        _mla_tile(src, mla_off, kv_out, pe_out, n, layer0, mla_pid, tl.program_id(1), ROW, BLOCK_T)


@functools.cache
def _layer_offsets(placement: Placement, plane: str, shard: int, device: torch.device) -> torch.Tensor:
    """Byte offset of each of `shard`'s layers' plane in its region (cached: one placement per node)."""
    offs = [placement.offset(plane, lid)[1] for lid in _shard_layers(placement, shard)]
    return torch.tensor(offs, dtype=torch.int64, device=device)


def _shard_layers(placement: Placement, shard: int) -> list[int]:
    return [lid for lid in range(placement.layout.num_layers) if placement.shard_of(lid) == shard]


@functools.cache
def _hadamard(dim: int, device: torch.device) -> torch.Tensor:
    """The Sylvester Hadamard matrix's +-1 entries in fp8 (exact); the kernels apply its dim^-1/2."""
    signs: torch.Tensor = (hadamard_matrix(dim) * dim**0.5).round()
    return signs.to(device=device, dtype=torch.float8_e4m3fn)


_MLA_ROWS = Launcher(_mla_rows_kernel)
_INDEXER_PAGES = Launcher(_indexer_pages_kernel)
_CONVERT = Launcher(_convert_kernel)


def _convert_shard(
    region: torch.Tensor,
    placement: Placement,
    shard: int,
    n: int,
    block_t: int,
    num_warps: int,
    pages: int | None,
    first: int = 0,
    count: int | None = None,
) -> list[LayerState]:
    """Layers `first` .. `first + count - 1` of one shard's own (all of them by default), converted on
    that shard's GPU in one launch or two (ONE_LAUNCH)."""
    layout, dev = placement.layout, region.device
    if count is None:
        count = len(_shard_layers(placement, shard)) - first
    r, d, i = layout.kv_lora_rank, layout.rope_dim, layout.index_head_dim
    # One allocation for the three outputs (each a contiguous part of it): one allocator call, not three.
    out = torch.empty(count * n * (r + d + i), dtype=torch.bfloat16, device=dev)
    kv = out[: count * n * r].view(count, n, r)
    pe = out[count * n * r : count * n * (r + d)].view(count, n, d)
    ki = out[count * n * (r + d) :].view(count, n, i) if i else None
    mla_off = _layer_offsets(placement, "mla", shard, dev)
    if ki is None:
        _MLA_ROWS(
            (_cdiv(n, block_t), count),
            (region, mla_off, kv, pe, n, first),
            (("ROW", _ROW), ("BLOCK_T", block_t)),
            num_warps,
        )
    else:
        if pages is None:
            pages = _pages(_cdiv(n, 64) * count)
        idx_off, had = _layer_offsets(placement, "indexer", shard, dev), _hadamard(i, dev)
        mla_programs, idx_programs = _cdiv(n, block_t), _cdiv(_cdiv(n, 64), pages)
        if (count == 1) if ONE_LAUNCH is None else ONE_LAUNCH:
            _CONVERT(
                (mla_programs + idx_programs, count),
                (region, mla_off, idx_off, had, kv, pe, ki, n, first, mla_programs),
                (
                    ("ROW", _ROW),
                    ("PAGE", _PAGE),
                    ("BLOCK_T", block_t),
                    ("PAGES", pages),
                    ("ORDER", _layer_order(n) if LAYER_ORDER is None else LAYER_ORDER),
                ),
                num_warps,
            )
        else:
            _MLA_ROWS(
                (mla_programs, count),
                (region, mla_off, kv, pe, n, first),
                (("ROW", _ROW), ("BLOCK_T", block_t)),
                num_warps,
            )
            _INDEXER_PAGES(
                (idx_programs, count),
                (region, idx_off, had, ki, n, first),
                (("PAGE", _PAGE), ("PAGES", pages), ("STAGES", IDX_STAGES)),
                IDX_WARPS,
            )
    if count == 1:  # a layer alone (layer-wise, once per layer on the node): its views, no unbind
        return [LayerState(kv=kv.view(n, r), pe=pe.view(n, d), ki=None if ki is None else ki.view(n, i))]
    if ki is None:
        return [LayerState(kv=k, pe=p) for k, p in zip(kv.unbind(0), pe.unbind(0), strict=True)]
    # unbind: one call for every layer's views instead of three indexing operations per layer.
    return [
        LayerState(kv=k, pe=p, ki=x) for k, p, x in zip(kv.unbind(0), pe.unbind(0), ki.unbind(0), strict=True)
    ]


def _layer_order(n: int) -> int:
    """A layer's program order (LAYER_ORDER): interleaved from 64k tokens, where the indexer programs,
    slower per byte than the MLA ones, otherwise all run in the launch's tail; MLA first below."""
    return 2 if n >= 65536 else 0


def _pages(total_pages: int) -> int:
    """Pages a program: two share one read of the Hadamard matrix, and load together in the pipelined
    loop, when there are programs to spare (more pages a program: fewer loads in flight)."""
    return 1 if total_pages < 4096 else 2


def _check(regions: list[torch.Tensor], placement: Placement) -> None:
    if placement.layout.kv_cache_dtype != "fp8_ds_mla":
        raise ValueError(f"the CUDA conversion handles fp8_ds_mla, not {placement.layout.kv_cache_dtype}")
    if len(regions) != placement.shards:
        raise ValueError(f"{len(regions)} regions for a placement of {placement.shards} shards")


def to_layer_state(
    regions: list[torch.Tensor],
    placement: Placement,
    layer: int,
    num_tokens: int,
    *,
    block_t: int | None = None,
    num_warps: int | None = None,
    pages: int | None = PAGES,
) -> LayerState:
    """One layer of a slot's received fp8_ds_mla bytes -> bf16, on the GPU of the layer's shard; bit for
    bit what `to_injected_state` gives for it (the same tiles, one layer's grid)."""
    _check(regions, placement)
    if not 0 <= layer < placement.layout.num_layers:
        raise ValueError(f"layer {layer} is outside 0..{placement.layout.num_layers - 1}")
    shard = placement.shard_of(layer)
    # A shard holds layers shard, shard + shards, ...: this one is its (layer // shards)-th.
    return _convert_shard(
        regions[shard],
        placement,
        shard,
        num_tokens,
        LAYER_BLOCK_T if block_t is None else block_t,
        LAYER_WARPS if num_warps is None else num_warps,
        pages,
        layer // placement.shards,
        1,
    )[0]


def to_injected_state(
    regions: list[torch.Tensor],
    placement: Placement,
    num_tokens: int,
    last_prompt_token: int,
    *,
    block_t: int = BLOCK_T,
    num_warps: int = NUM_WARPS,
    pages: int | None = PAGES,
) -> InjectedState:
    """One slot's received fp8_ds_mla bytes (a uint8 CUDA tensor per shard) -> bf16 engine state.

    Each shard converts on its own GPU, so a node that spreads layers over 8 GPUs converts them in
    parallel; layer `lid` comes back as views on the GPU of shard `lid % shards`, where TileRT's
    injection copies from.
    """
    _check(regions, placement)
    per_shard = [
        iter(_convert_shard(r, placement, s, num_tokens, block_t, num_warps, pages))
        for s, r in enumerate(regions)
    ]
    layers = [next(per_shard[placement.shard_of(lid)]) for lid in range(placement.layout.num_layers)]
    return InjectedState(layers=layers, seq_len=num_tokens, last_prompt_token=last_prompt_token)
