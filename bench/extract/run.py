"""Extraction benchmark: one request's GLM-5 state (79 layers, fp8_ds_mla rows of 656 bytes in
64-token blocks, plus indexer pages) gathered from paged caches into staging at 8k, 32k and 128k
tokens, whole and layer by layer. Against, in the same run: a plain device copy of the same bytes
(whole: one copy of the request's bytes; per layer: one copy of a layer's bytes per layer), and one
index_select per layer over token slots (the upstream approach, also this project's CPU path). The
fused result is checked byte for byte against the index_select one.

Two timings of each: `call` = CUDA events around the Python call as a connector makes it (host
overhead counts where the GPU waits for it; whole-request calls alternate two block-id lists so
every call pays its block ids' host-to-device copy), and `kernel` = a CUDA graph of the same GPU
work replayed (bench/extract/timing.py). Medians of 50 after warm-ups.

    python -m bench.extract.run [--device cuda] [--sizes 8192,32768,131072] [--tune]
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Iterator

import torch

from bench.common import copy_bandwidth, median_ms, record, table
from bench.convert.kernels import call_ms, copy_kernel, empty_kernel
from bench.extract.timing import graph_ms
from tilert_serve import layouts
from tilert_serve.pd_vllm import extract_triton
from tilert_serve.pd_vllm.extract import Gatherer, PagedCache, gather

BLOCK = 64


def glm5_caches(dev: torch.device, max_tokens: int) -> tuple[list[PagedCache], layouts.Placement]:
    """Random GLM-5 paged caches (MLA rows and indexer pages of every layer, a quarter more blocks
    than `max_tokens` needs) and a staging placement for `max_tokens`."""
    layout = layouts.get("glm5", "fp8_ds_mla")
    num_blocks = max_tokens // BLOCK * 5 // 4
    gen = torch.Generator(device=dev).manual_seed(0)
    caches: list[PagedCache] = []
    for lid in range(layout.num_layers):
        mla = torch.randint(0, 256, (num_blocks, BLOCK, 656), dtype=torch.uint8, device=dev, generator=gen)
        idx = torch.randint(0, 256, (num_blocks, BLOCK, 132), dtype=torch.uint8, device=dev, generator=gen)
        caches += [
            PagedCache(f"l{lid}.mla", lid, "mla", mla, BLOCK, 0),
            PagedCache(f"l{lid}.indexer", lid, "indexer", idx, BLOCK, 0),
        ]
    return caches, layouts.Placement(layout, max_tokens=max_tokens)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--sizes", default="8192,32768,131072")
    ap.add_argument("--tune", action="store_true", help="also time loop chunk sizes and warp counts (kernel)")
    args = ap.parse_args()
    dev = torch.device(args.device)
    sizes = [int(s) for s in args.sizes.split(",")]
    caches, staging = glm5_caches(dev, max(sizes))
    layout = staging.layout
    L = layout.num_layers
    num_blocks = caches[0].tensor.shape[0]
    ref = torch.zeros(staging.total_nbytes(), dtype=torch.uint8, device=dev)
    out = torch.zeros_like(ref)
    fused = Gatherer(caches, staging, 0)
    assert fused._fused is not None
    kernel = fused._fused
    bw = copy_bandwidth(dev)
    rows: list[list[str]] = []
    tuning: list[str] = []
    floors: list[str] = []
    if dev.type == "cuda":
        x = torch.empty(16, dtype=torch.int32, device=dev)
        t_empty = graph_ms(lambda: [empty_kernel[(1024,)](x) for _ in range(L)]) / L
        floors.append(f"an empty Triton launch of 1,024 programs {t_empty * 1e3:.2f} us")
    for n in sizes:
        nblk = (n + BLOCK - 1) // BLOCK
        id_sets = [(random.Random(n + k).sample(range(num_blocks), nblk),) for k in range(2)]
        ids = id_sets[0]
        nbytes, lbytes = layout.request_bytes(n), layout.layer_bytes(n)
        gather(caches, ids, n, staging, [ref])
        for by_layer in (False, True):
            out.fill_(0xA5)  # poison: every byte the request owns must be written
            got = (
                sum(fused(ids, n, [out], layer=lid) for lid in range(L)) if by_layer else fused(ids, n, [out])
            )
            assert got == nbytes, (got, nbytes)
            for lid in range(L):
                for plane in layout.planes:
                    _, off = staging.offset(plane.name, lid)
                    k = plane.nbytes(n)
                    if not torch.equal(out[off : off + k], ref[off : off + k]):
                        raise SystemExit(
                            f"fused gather (by layer: {by_layer}) differs at layer {lid} plane "
                            f"{plane.name} ({n} tokens)"
                        )
        src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=dev)
        dst = torch.empty_like(src)
        dev_ids = torch.tensor([ids[0][:nblk]], dtype=torch.int32, device=dev)
        calls = iter(range(1 << 30))

        def whole_call(k: int = n, sets: list = id_sets, counter: Iterator[int] = calls) -> object:
            return fused(sets[next(counter) % 2], k, [out])

        def layers_call(k: int = n, i: tuple[list[int]] = ids) -> object:
            return [fused(i, k, [out], layer=lid) for lid in range(L)]

        def layer_copies(s: torch.Tensor = src, d: torch.Tensor = dst, b: int = lbytes) -> object:
            return [d[i * b : (i + 1) * b].copy_(s[i * b : (i + 1) * b]) for i in range(L)]

        t = {
            "copy call": median_ms(lambda s=src, d=dst: d.copy_(s), dev),
            "copy kernel": graph_ms(lambda s=src, d=dst: d.copy_(s)),
            "call": call_ms(whole_call, dev),
            "kernel": graph_ms(lambda i=dev_ids, k=n: kernel(i, k, out)),
            "layer copy call": median_ms(layer_copies, dev) / L,
            "layer copy kernel": graph_ms(layer_copies) / L,
            "layer call": call_ms(layers_call, dev) / L,
            "layer kernel": graph_ms(
                lambda i=dev_ids, k=n: [kernel(i, k, out, layer=lid) for lid in range(L)]
            )
            / L,
            "index_select": median_ms(lambda i=ids, k=n: gather(caches, i, k, staging, [ref]), dev),
        }
        if dev.type == "cuda":
            w = lbytes // 4 // 4 * 4
            s32, d32 = src.view(torch.int32), dst.view(torch.int32)
            t_tri = (
                graph_ms(
                    lambda s=s32, d=d32, k=w: [
                        copy_kernel[(-(-k // 2048),)](s[i * k :], d[i * k :], k, BLOCK_W=2048, num_warps=4)
                        for i in range(L)
                    ]
                )
                / L
            )
            floors.append(
                f"{n // 1024}k: a Triton copy of a layer's bytes {t_tri * 1e3:.2f} us, the gather "
                f"{t['layer kernel'] * 1e3:.2f} us"
            )
        src = dst = None
        # A large copy captured in a graph runs on the copy engines, slower than torch's copy kernel:
        # the baseline is the faster of the two ways, for both timings.
        copy_ms = min(t["copy call"], t["copy kernel"])
        layer_copy_ms = min(t["layer copy call"], t["layer copy kernel"])
        for what, c, keys in (
            ("whole", copy_ms, ("call", "kernel")),
            ("per layer", layer_copy_ms, ("layer call", "layer kernel")),
        ):
            for mode, key in zip(("call", "kernel"), keys, strict=True):
                rows.append(
                    [
                        f"{n // 1024}k",
                        what,
                        mode,
                        f"{(nbytes if what == 'whole' else lbytes) / 1e6:.1f}",
                        f"{c:.4f}",
                        f"{t[key]:.4f}",
                        f"{t[key] / c:.2f}x",
                    ]
                )
        rows.append(
            [
                f"{n // 1024}k",
                "whole",
                "index_select call",
                f"{nbytes / 1e6:.1f}",
                f"{copy_ms:.4f}",
                f"{t['index_select']:.4f}",
                f"{t['index_select'] / copy_ms:.2f}x",
            ]
        )
        if args.tune and dev.type == "cuda":
            for chunk, warps in ((512, 4), (1024, 4), (1024, 8), (2048, 8)):
                tk = graph_ms(
                    lambda i=dev_ids, k=n, c=chunk, w=warps: kernel(i, k, out, chunk=c, num_warps=w)
                )
                tuning.append(
                    f"{n // 1024}k whole chunk={chunk} warps={warps}: kernel {tk:.4f} ms "
                    f"({tk / copy_ms:.2f}x copy)"
                )
            for chunk, warps, split in ((1024, 8, 1), (1024, 8, 4), (512, 4, 8), (1024, 4, 11), (2048, 8, 4)):
                tk = (
                    graph_ms(
                        lambda i=dev_ids, k=n, c=chunk, w=warps, sp=split: [
                            kernel(i, k, out, layer=lid, chunk=c, num_warps=w, split=sp) for lid in range(L)
                        ]
                    )
                    / L
                )
                tuning.append(
                    f"{n // 1024}k per layer chunk={chunk} warps={warps} split={split}: kernel {tk:.4f} ms "
                    f"({tk / layer_copy_ms:.2f}x copy)"
                )
    body = table(["tokens", "what", "timing", "MB", "copy ms", "fused ms", "fused / copy"], rows)
    notes = "\n".join(
        [
            f"Copy bandwidth {bw:,.0f} GB/s (read + write, 4 GiB). Fused: one launch over every layer and plane "
            f"(chunk {extract_triton.CHUNK_WORDS} words, {extract_triton.NUM_WARPS} warps); per layer: ms per layer, "
            f"over {L} one-layer calls (chunk {extract_triton.LAYER_CHUNK_WORDS} words, {extract_triton.LAYER_WARPS} "
            f"warps, each block split over {extract_triton.LAYER_SPLIT} programs; the copy: {L} copies of one layer's "
            "bytes). call = events around the Python "
            "call (the best of three medians); kernel = CUDA graph replay; copy = the faster of its call and its graph replay (a large copy in a graph runs on the copy engines, slower). Every size checked byte for byte against index_select, whole and "
            "layer by layer.",
            "Floors of a one-layer launch (CUDA graph, per launch, each copy of its own bytes): "
            + "; ".join(floors)
            + ".",
            *tuning,
        ]
    )
    print(body)
    print(notes)
    record("extract", "Extraction into staging (`bench/extract/run.py`, H200)", body, device=dev, notes=notes)


if __name__ == "__main__":
    main()
