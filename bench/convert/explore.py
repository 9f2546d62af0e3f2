"""Issue 14's kernel experiments in one run (a borrowed GPU is held by the minute): the floors a
per-layer call sits on (an empty launch; copies of one size, each of its own bytes so none is an L2
hit), a write-heavy ceiling for the conversion (its read:write mix as a plain Triton kernel), tile
variants of one layer's kernels, and the host cost of a launch through Triton's JITFunction against the compiled kernel's
launcher (convert_triton.Launcher). Prints one line per measurement; the numbers feed the Reading
paragraphs of bench/RESULTS.md's extraction and conversion sections.

    python -m bench.convert.explore [--sizes 8192,32768,131072] [--only floors,mix,convert,host,extract,adopt,indexer,planes]
"""

# Every lambda here is timed at once, inside the loop iteration that made it (and its tensors are
# deleted after): the late binding ruff warns of cannot bite.
# ruff: noqa: B023, F821
from __future__ import annotations

import argparse
import random
import time
from collections.abc import Callable

import torch
import triton
import triton.language as tl

from bench.common import copy_bandwidth, median_ms
from bench.convert.kernels import copy_kernel, empty_kernel, mix_kernel
from bench.convert.run import received
from bench.extract.run import glm5_caches
from bench.extract.timing import graph_ms
from tilert_serve import layouts
from tilert_serve.layouts import convert, convert_triton
from tilert_serve.layouts.convert import hadamard_matrix
from tilert_serve.pd_vllm import extract_triton
from tilert_serve.pd_vllm.extract import Gatherer, gather

L = layouts.get("glm5", "fp8_ds_mla").num_layers
BLOCK = 64


def say(*parts: object) -> None:
    print(*parts, flush=True)


def rotating(nbytes: int, dev: torch.device, total: int = 1 << 30) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Source and destination holding k >= 8 distinct `nbytes` slices, k * nbytes >= 1 GiB: a call per
    slice moves bytes from and to device memory, not the 60 MB L2."""
    k = max(8, -(-total // nbytes))
    src = torch.randint(0, 255, (k * nbytes,), dtype=torch.uint8, device=dev)
    return src, torch.empty_like(src), k


def per_slice_graph(fn: Callable[[int], object], k: int) -> float:
    """ms per call of fn(i), i = 0 .. k - 1 in one CUDA graph."""
    return graph_ms(lambda: [fn(i) for i in range(k)]) / k


def floors(dev: torch.device) -> None:
    x = torch.empty(16, dtype=torch.int32, device=dev)
    for grid in (1, 132, 1024):
        t = per_slice_graph(lambda i, g=grid: empty_kernel[(g,)](x), L)
        say(f"floor empty-triton grid={grid}: {t * 1e3:.2f} us a launch")
    for mb in (0.5, 1, 2, 4, 6.5, 9, 13, 18, 26, 52, 103, 144):
        n = int(mb * 1e6) // 64 * 64
        src, dst, k = rotating(n, dev)
        t_torch = per_slice_graph(lambda i: dst[i * n : (i + 1) * n].copy_(src[i * n : (i + 1) * n]), k)
        s32, d32, w = src.view(torch.int32), dst.view(torch.int32), n // 4
        t_tri = per_slice_graph(
            lambda i: copy_kernel[(triton.cdiv(w, 2048),)](
                s32[i * w :], d32[i * w :], w, BLOCK_W=2048, num_warps=4
            ),
            k,
        )
        say(
            f"floor copy {mb} MB (read + write {2 * n / 1e6:.1f} MB, {k} slices): torch {t_torch * 1e3:.2f} us "
            f"({2 * n / t_torch / 1e6:.0f} GB/s), triton {t_tri * 1e3:.2f} us ({2 * n / t_tri / 1e6:.0f} GB/s)"
        )
        del src, dst


def mix(dev: torch.device, sizes: list[int], bw: float) -> None:
    """Same-traffic 1:1 copy against the conversion's 1:1.79 read/write mix, both as Triton kernels."""
    for n in sizes:
        for what, layers in (("whole", L), ("layer", 1)):
            moved = layers * n * (788 + 1408)
            words = moved * 788 // (788 + 1408) // 16384 * 4096
            tiles, extra = words // 4096, 3232
            reps = 1 if what == "whole" else max(8, (1 << 30) // (words * 4))
            src = torch.randint(0, 1 << 30, (reps * words,), dtype=torch.int32, device=dev)
            a = torch.empty_like(src)
            b = torch.empty(reps * tiles * extra, dtype=torch.int32, device=dev)
            tot = (2 * words + tiles * extra) * 4
            hw = tot // 2 // 4
            half = torch.empty(reps * hw, dtype=torch.int32, device=dev)
            half2 = torch.empty_like(half)
            t_mix = per_slice_graph(
                lambda i: mix_kernel[(tiles,)](
                    src[i * words :],
                    a[i * words :],
                    b[i * tiles * extra :],
                    tiles,
                    BLOCK_W=4096,
                    EXTRA_W=extra,
                    num_warps=8,
                ),
                reps,
            )
            t_copy = per_slice_graph(
                lambda i: half2[i * hw : (i + 1) * hw].copy_(half[i * hw : (i + 1) * hw]), reps
            )
            if what == "whole":
                t_copy = min(t_copy, median_ms(lambda: half2.copy_(half), dev))
            t_tcopy = per_slice_graph(
                lambda i: copy_kernel[(triton.cdiv(hw, 2048),)](
                    half[i * hw :], half2[i * hw :], hw, BLOCK_W=2048, num_warps=4
                ),
                reps,
            )
            say(
                f"mix {n // 1024}k {what}: {tot / 1e6:.1f} MB moved; torch copy {t_copy * 1e3:.2f} us, triton copy "
                f"{t_tcopy * 1e3:.2f} us, read 1 : write 1.79 {t_mix * 1e3:.2f} us = {t_copy / t_mix:.0%} of the torch "
                f"copy's speed, {t_tcopy / t_mix:.0%} of the triton copy's, {tot / t_mix / 1e6 / bw:.0%} of copy bandwidth"
            )
            del src, a, b, half, half2


def conversion(dev: torch.device, sizes: list[int], host: bool) -> None:
    layout = layouts.get("glm5", "fp8_ds_mla")
    gen = torch.Generator(device=dev).manual_seed(0)
    for n in sizes:
        place, region = received(n, gen, dev)
        moved = layout.request_bytes(n) + L * n * 704 * 2
        lh = moved // 2 // L
        half = torch.empty(moved // 2, dtype=torch.uint8, device=dev)
        half2 = torch.empty_like(half)
        layer_copy = per_slice_graph(
            lambda i: half2[i * lh : (i + 1) * lh].copy_(half[i * lh : (i + 1) * lh]), L
        )
        del half, half2
        ref = convert_triton.to_injected_state([region], place, n, 0)
        tk = graph_ms(lambda: convert_triton.to_injected_state([region], place, n, 0))
        say(
            f"convert {n // 1024}k: layer same-traffic copy {layer_copy * 1e3:.2f} us; whole default {tk:.4f} ms"
        )
        # one_launch=False: a layer as two launches, its indexer pages in the pipelined loop (IDX_STAGES).
        for block_t, warps, pages, one_launch, order in (
            (32, 8, 1, True, 0),
            (32, 8, 1, True, 1),
            (32, 8, 1, True, 2),
            (16, 4, 1, True, 1),
            (16, 4, 1, True, 2),
            (32, 4, 1, True, 1),
            (32, 4, 1, True, 2),
            (64, 8, 1, True, 1),
            (64, 8, 1, True, 2),
            (32, 8, 2, True, 1),
            (32, 8, 2, True, 2),
            (16, 8, 1, True, 2),
        ):
            convert_triton.ONE_LAUNCH = one_launch
            convert_triton.LAYER_ORDER = order
            for lid in (0, 40, 78):
                one = convert_triton.to_layer_state(
                    [region], place, lid, n, block_t=block_t, num_warps=warps, pages=pages
                )
                w = ref.layers[lid]
                assert one.ki is not None and w.ki is not None
                if not (
                    torch.equal(one.kv, w.kv) and torch.equal(one.pe, w.pe) and torch.equal(one.ki, w.ki)
                ):
                    raise SystemExit(
                        f"convert layer block_t={block_t} warps={warps} differs from the whole state"
                    )
            t = per_slice_graph(
                lambda lid: convert_triton.to_layer_state(
                    [region], place, lid, n, block_t=block_t, num_warps=warps, pages=pages
                ),
                L,
            )
            say(
                f"convert {n // 1024}k layer block_t={block_t} warps={warps} pages={pages} one_launch={one_launch} "
                f"order={order}: "
                f"{t * 1e3:.2f} us ({layer_copy / t:.0%} of the same-traffic copy's speed)"
            )
        convert_triton.ONE_LAUNCH = None
        convert_triton.LAYER_ORDER = None
        if host:
            host_calls(
                "convert",
                n,
                dev,
                lambda: [convert_triton.to_layer_state([region], place, lid, n) for lid in range(L)],
                lambda: convert_triton.to_injected_state([region], place, n, 0),
            )
        del region, ref
        torch.cuda.empty_cache()


@triton.jit
def _bf16_indexer_kernel(
    src,
    layer_off,
    hadamard,
    ki_out,
    n,
    layer0,
    PAGE: tl.constexpr,
    PAGES: tl.constexpr,
    STAGES: tl.constexpr,
    EXACT: tl.constexpr,
):
    """The indexer kernel as it was before the fp8 product (commit f87d784): fp8 -> float32 x scale -> bf16
    in registers, stored to shared memory, times the orthonormal Hadamard matrix in bf16 (`hadamard`
    bf16 [128, 128]), a `tl.range` loop of STAGES stages over PAGES pages. EXACT: the fp8 values
    converted as they are (exact in bf16), times the +-1 matrix, the scale and 128^-1/2 after the product
    (the fp8 kernel's arithmetic with a bf16 product: what its fp8 accumulation costs in precision)."""
    c = tl.arange(0, 128)
    r = tl.arange(0, 64)
    h = tl.load(hadamard + c[:, None] * 128 + c[None, :])
    first = tl.program_id(0) * PAGES
    layer = tl.program_id(1)
    for page in tl.range(first, tl.minimum(first + PAGES, (n + 63) // 64), num_stages=STAGES):
        base = src + tl.multiple_of(tl.load(layer_off + layer0 + layer), 16) + page.to(tl.int64) * PAGE
        vptr = (base + r[:, None] * 128 + c[None, :]).to(tl.pointer_type(tl.float8e4nv), bitcast=True)
        vals = tl.load(vptr, eviction_policy="evict_first").to(tl.float32)
        scales = tl.load((base + 8192).to(tl.pointer_type(tl.float32), bitcast=True) + r)
        if EXACT:
            y = tl.dot(vals.to(tl.bfloat16), h) * (scales * 0.08838834764831845)[:, None]
        else:
            y = tl.dot((vals * scales[:, None]).to(tl.bfloat16), h)
        t = page * 64 + r
        out_row = layer.to(tl.int64) * n + t.to(tl.int64)
        tl.store(ki_out + out_row[:, None] * 128 + c[None, :], y.to(tl.bfloat16), mask=(t < n)[:, None])


def indexer_variants(dev: torch.device, sizes: list[int]) -> None:
    """The indexer pages kernel alone over every layer (as the whole state launches it): the bf16 kernel
    it replaced against convert_triton's fp8 product at several stages, pages a program and warps,
    each against a copy with the plane's traffic; errors against the torch path in float32, and every
    fp8 variant bit for bit against convert_triton's whole state."""
    gen = torch.Generator(device=dev).manual_seed(0)
    had_bf16 = hadamard_matrix(128).to(device=dev, dtype=torch.bfloat16)
    had_pm1 = (hadamard_matrix(128) * 128**0.5).to(device=dev, dtype=torch.bfloat16)
    had_f8 = convert_triton._hadamard(128, dev)
    layout = layouts.get("glm5", "fp8_ds_mla")
    for n in sizes:
        place, region = received(n, gen, dev)
        idx_off = convert_triton._layer_offsets(place, "indexer", 0, dev)
        ref = convert_triton.to_injected_state([region], place, n, 0)
        pages_of = [
            region[place.offset("indexer", lid)[1] :][: layout.plane("indexer").nbytes(n)].view(-1, 8448)
            for lid in (0, 40, 78)
        ]
        want = [convert.indexer_pages_to_keys(p, n, torch.float32) for p in pages_of]
        ki = torch.empty(L, n, 128, dtype=torch.bfloat16, device=dev)
        moved = L * n * (132 + 256)
        half = torch.empty(moved // 2, dtype=torch.uint8, device=dev)
        half2 = torch.empty_like(half)
        t_copy = min(graph_ms(lambda: half2.copy_(half)), median_ms(lambda: half2.copy_(half), dev))
        del half, half2
        pg = -(-n // 64)
        say(f"indexer {n // 1024}k: same-traffic copy {t_copy * 1e3:.1f} us ({moved / 1e6:.0f} MB)")
        variants: list[tuple[str, Callable[[], object]]] = []
        for exact, had in ((False, had_bf16), (True, had_pm1)):
            variants.append(
                (
                    f"bf16 exact={exact} stages=2 pages=4 warps=4",
                    lambda h=had, e=exact: _bf16_indexer_kernel[(-(-pg // 4), L)](
                        region, idx_off, h, ki, n, 0, PAGE=8448, PAGES=4, STAGES=2, EXACT=e, num_warps=4
                    ),
                )
            )
        for stages, pages, warps in (
            (0, 4, 4),
            (2, 4, 4),
            (3, 1, 4),
            (3, 2, 4),
            (3, 3, 4),
            (3, 4, 4),
            (4, 2, 4),
            (4, 3, 4),
            (4, 4, 4),
            (5, 4, 4),
            (3, 2, 8),
            (4, 4, 8),
        ):
            variants.append(
                (
                    f"fp8 stages={stages} pages={pages} warps={warps}",
                    lambda s=stages, p=pages, w=warps: convert_triton._indexer_pages_kernel[(-(-pg // p), L)](
                        region, idx_off, had_f8, ki, n, 0, PAGE=8448, PAGES=p, STAGES=s, num_warps=w
                    ),
                )
            )
        for what, fn in variants:
            try:
                ki.fill_(float("nan"))
                fn()
                err = max(
                    float((ki[lid].double() - w.double()).norm() / w.double().norm())
                    for lid, w in zip((0, 40, 78), want, strict=True)
                )
                same = all(torch.equal(ki[lid], ref.layers[lid].ki) for lid in range(L))
                t = graph_ms(fn)
                say(
                    f"indexer {n // 1024}k {what}: {t * 1e3:.1f} us ({t_copy / t:.0%} of its copy's speed), "
                    f"error {err:.2e}, bits as convert_triton: {same}"
                )
            except Exception as exc:  # a variant that does not compile is a result too
                say(f"indexer {n // 1024}k {what}: failed {type(exc).__name__}: {str(exc)[-160:]}")
        del region, ki, ref
        torch.cuda.empty_cache()


def adopt(dev: torch.device) -> None:
    """convert_triton.IDX_STAGES > 0 against 0: the same bits at token counts whose specialisations differ."""
    place, region = received(8192, torch.Generator(device=dev).manual_seed(1), dev)
    saved = convert_triton.IDX_STAGES
    for stages in (2, 3, 4):
        for n in (1, 17, 64, 65, 1000, 8192):
            try:
                got = {}
                for st in (0, stages):
                    convert_triton.IDX_STAGES = st
                    got[st] = [s_.ki for s_ in convert_triton.to_injected_state([region], place, n, 0).layers]
                same = all(torch.equal(a, b) for a, b in zip(got[0], got[stages], strict=True))
                say(f"adopt idx_stages={stages} n={n}: bits as unrolled: {same}")
            except Exception as exc:
                say(f"adopt idx_stages={stages} n={n}: failed {type(exc).__name__}: {str(exc)[-160:]}")
    convert_triton.IDX_STAGES = saved


def planes(dev: torch.device, sizes: list[int]) -> None:
    """Which plane holds the whole state's gap to the copy: each plane's kernel alone (as the whole state
    launches it) against a torch copy with that plane's traffic and the plain read:write-mix kernel."""
    gen = torch.Generator(device=dev).manual_seed(0)
    for n in sizes:
        place, region = received(n, gen, dev)
        mla_off = convert_triton._layer_offsets(place, "mla", 0, dev)
        idx_off = convert_triton._layer_offsets(place, "indexer", 0, dev)
        had = convert_triton._hadamard(128, dev)
        kv = torch.empty(L, n, 512, dtype=torch.bfloat16, device=dev)
        pe = torch.empty(L, n, 64, dtype=torch.bfloat16, device=dev)
        ki = torch.empty(L, n, 128, dtype=torch.bfloat16, device=dev)
        bt, pages = convert_triton.BLOCK_T, convert_triton._pages(-(-n // 64) * L)
        t_mla = graph_ms(
            lambda: convert_triton._mla_rows_kernel[(-(-n // bt), L)](
                region, mla_off, kv, pe, n, 0, ROW=656, BLOCK_T=bt, num_warps=convert_triton.NUM_WARPS
            )
        )
        pg = -(-n // 64)
        t_idx = graph_ms(
            lambda: convert_triton._indexer_pages_kernel[(-(-pg // pages), L)](
                region,
                idx_off,
                had,
                ki,
                n,
                0,
                PAGE=8448,
                PAGES=pages,
                STAGES=convert_triton.IDX_STAGES,
                num_warps=convert_triton.IDX_WARPS,
            )
        )
        for name, t, rd, wr in (("mla", t_mla, 656, 1152), ("indexer", t_idx, 132, 256)):
            moved = L * n * (rd + wr)
            half = torch.empty(moved // 2, dtype=torch.uint8, device=dev)
            half2 = torch.empty_like(half)
            t_copy = min(graph_ms(lambda: half2.copy_(half)), median_ms(lambda: half2.copy_(half), dev))
            del half, half2
            words = L * n * rd // 4 // 4096 * 4096
            extra = int(4096 * (wr / rd - 1)) // 4 * 4
            tiles = words // 4096
            src = torch.randint(0, 1 << 30, (words,), dtype=torch.int32, device=dev)
            a = torch.empty_like(src)
            b = torch.empty(tiles * extra, dtype=torch.int32, device=dev)
            t_mix = graph_ms(
                lambda: mix_kernel[(tiles,)](src, a, b, tiles, BLOCK_W=4096, EXTRA_W=extra, num_warps=8)
            )
            del src, a, b
            say(
                f"planes {n // 1024}k {name}: kernel {t * 1e3:.1f} us for {moved / 1e6:.0f} MB, same-traffic copy "
                f"{t_copy * 1e3:.1f} us ({t_copy / t:.0%} of its speed); its read:write mix as a plain kernel "
                f"{t_mix * 1e3:.1f} us ({t_copy / t_mix:.0%})"
            )
        say(
            f"planes {n // 1024}k both: {(t_mla + t_idx) * 1e3:.1f} us, whole state "
            f"{graph_ms(lambda: convert_triton.to_injected_state([region], place, n, 0)) * 1e3:.1f} us"
        )
        del region, kv, pe, ki
        torch.cuda.empty_cache()


def host_calls(
    what: str, n: int, dev: torch.device, layers: Callable[[], object], whole: Callable[[], object]
) -> None:
    """Call time (events around the calls) per layer and whole, JITFunction's launch against the
    launcher's, interleaved three times (the host's timings wander); the best of each."""
    got: dict[bool, list[tuple[float, float, float]]] = {False: [], True: []}
    for _ in range(3):
        for direct in (False, True):
            convert_triton.DIRECT_LAUNCH = direct
            call = median_ms(layers, dev) / L
            t_whole = median_ms(whole, dev)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(5):
                layers()
            host = (time.perf_counter() - t0) / 5 / L
            torch.cuda.synchronize()
            got[direct].append((call, host, t_whole))
    convert_triton.DIRECT_LAUNCH = True
    for direct, rows in got.items():
        say(
            f"{what} {n // 1024}k direct_launch={direct}: layer call {min(r[0] for r in rows) * 1e3:.2f} us "
            f"(host {min(r[1] for r in rows) * 1e6:.1f} us; all {', '.join(f'{r[0] * 1e3:.1f}' for r in rows)}), "
            f"whole call {min(r[2] for r in rows):.4f} ms"
        )


def extraction(dev: torch.device, sizes: list[int]) -> None:
    caches, staging = glm5_caches(dev, max(sizes))
    layout = staging.layout
    num_blocks = caches[0].tensor.shape[0]
    ref = torch.zeros(staging.total_nbytes(), dtype=torch.uint8, device=dev)
    out = torch.zeros_like(ref)
    g = Gatherer(caches, staging, 0)
    assert g._fused is not None and g._fused._planes is not None
    kernel = g._fused
    for n in sizes:
        nblk = (n + BLOCK - 1) // BLOCK
        ids = (random.Random(n).sample(range(num_blocks), nblk),)
        gather(caches, ids, n, staging, [ref])
        dev_ids = torch.tensor([ids[0]], dtype=torch.int32, device=dev)
        lbytes = layout.layer_bytes(n)
        src = torch.randint(0, 256, (lbytes * L,), dtype=torch.uint8, device=dev)
        dst = torch.empty_like(src)
        layer_copy = per_slice_graph(
            lambda i: dst[i * lbytes : (i + 1) * lbytes].copy_(src[i * lbytes : (i + 1) * lbytes]), L
        )
        whole_copy = min(graph_ms(lambda: dst.copy_(src)), median_ms(lambda: dst.copy_(src), dev))
        del src, dst
        say(
            f"extract {n // 1024}k: layer copy {layer_copy * 1e3:.2f} us ({lbytes / 1e6:.1f} MB), whole copy "
            f"{whole_copy:.4f} ms"
        )
        for planes in (True,):
            extract_triton.PLANES_KERNEL = planes
            for chunk, warps, split in (
                (1024, 4, 11),
                (1024, 2, 11),
                (1024, 8, 11),
                (2048, 4, 6),
                (2048, 8, 6),
                (512, 2, 21),
                (512, 4, 21),
                (4096, 8, 3),
                (1024, 4, 6),
                (256, 2, 41),
            ):
                out.fill_(0)  # ref is zero outside the request's bytes
                for lid in range(L):
                    kernel(dev_ids, n, out, layer=lid, chunk=chunk, num_warps=warps, split=split)
                if not torch.equal(
                    out[: staging.offset("indexer", L - 1)[1]], ref[: staging.offset("indexer", L - 1)[1]]
                ):
                    raise SystemExit(f"extract planes={planes} {chunk, warps, split} differs")
                t = per_slice_graph(
                    lambda lid: kernel(dev_ids, n, out, layer=lid, chunk=chunk, num_warps=warps, split=split),
                    L,
                )
                say(
                    f"extract {n // 1024}k planes={planes} chunk={chunk} warps={warps} split={split}: layer "
                    f"{t * 1e3:.2f} us ({t / layer_copy:.2f}x copy)"
                )
            tw = graph_ms(lambda: kernel(dev_ids, n, out))
            say(f"extract {n // 1024}k planes={planes} whole: {tw:.4f} ms ({tw / whole_copy:.3f}x copy)")
        extract_triton.PLANES_KERNEL = True
        host_calls(
            "extract",
            n,
            dev,
            lambda: [g(ids, n, [out], layer=lid) for lid in range(L)],
            lambda: g(ids, n, [out]),
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="8192,32768,131072")
    ap.add_argument("--only", default="floors,mix,convert,host,extract")
    args = ap.parse_args()
    dev = torch.device("cuda")
    sizes = [int(s) for s in args.sizes.split(",")]
    only = args.only.split(",")
    bw = copy_bandwidth(dev)
    say(f"copy bandwidth {bw:,.0f} GB/s; {torch.cuda.get_device_name(dev)}, triton {triton.__version__}")
    if "floors" in only:
        floors(dev)
    if "mix" in only:
        mix(dev, sizes, bw)
    if "convert" in only:
        conversion(dev, sizes, "host" in only)
    if "adopt" in only:
        adopt(dev)
    if "indexer" in only:
        indexer_variants(dev, sizes)
    if "planes" in only:
        planes(dev, sizes)
    if "extract" in only:
        extraction(dev, sizes)


if __name__ == "__main__":
    main()
