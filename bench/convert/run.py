"""Conversion benchmark: GLM-5 state received in vLLM's fp8_ds_mla format (79 layers, rows and
indexer pages) converted into TileRT's bf16 layout (kv, pe, Hadamard-rotated ki) at 8k, 32k and
128k tokens. Achieved bytes/s (wire bytes read + bf16 bytes written) against the device copy
bandwidth measured in the same run. Baseline: the torch path of convert.py doing the same work
(every layer's kv, pe and Hadamard-rotated ki, bf16 out), timed the same way (median of 50 after 10
warm-ups), and a device copy with the same traffic. Whole state and layer by layer; each timed as a
call and as a CUDA graph replay (kernels only). Results checked against the torch path in float32.

    python -m bench.convert.run [--device cuda] [--sizes 8192,32768,131072]
"""

from __future__ import annotations

import argparse

import torch

from bench.common import copy_bandwidth, median_ms, record, table
from bench.convert.kernels import call_ms, copy_kernel, mix_kernel
from bench.extract.timing import graph_ms
from tilert_serve import layouts
from tilert_serve.layouts import convert


def fill(regions: list[torch.Tensor], place: layouts.Placement, n: int, gen: torch.Generator) -> None:
    dev = regions[0].device
    for lid in range(place.layout.num_layers):
        kv = torch.randn(n, 512, device=dev, generator=gen) * (1 + lid % 5)
        pe = torch.randn(n, 64, device=dev, generator=gen)
        keys = torch.randn(n, 128, device=dev, generator=gen)
        rows = convert.kv_pe_to_mla_rows(kv, pe, place.layout).flatten()
        pages = convert.keys_to_indexer_pages(keys).flatten()
        shard, off = place.offset("mla", lid)
        regions[shard][off : off + rows.numel()] = rows
        shard, off = place.offset("indexer", lid)
        regions[shard][off : off + pages.numel()] = pages


def received(n: int, gen: torch.Generator, dev: torch.device) -> tuple[layouts.Placement, torch.Tensor]:
    """A GLM-5 slot of `n` tokens as the node receives it: its placement and one region filled by fill()."""
    place = layouts.Placement(layouts.get("glm5", "fp8_ds_mla"), max_tokens=n)
    region = torch.zeros(place.total_nbytes(), dtype=torch.uint8, device=dev)
    fill([region], place, n, gen)
    return place, region


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def torch_state(
    region: torch.Tensor, place: layouts.Placement, n: int, out_dtype: torch.dtype
) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """The torch path of convert.py, layer by layer, for every plane: the same work as the kernels.

    convert.to_injected_state would take the Triton path for bf16 on CUDA; this is its other branch,
    called through the same public functions."""
    layout, mla, idx = place.layout, place.layout.plane("mla"), place.layout.plane("indexer")
    out = []
    for lid in range(layout.num_layers):
        rows = region[place.offset("mla", lid)[1] :][: mla.nbytes(n)].view(n, mla.unit_bytes)
        kv, pe = convert.mla_rows_to_kv_pe(rows, layout, out_dtype)
        pages = region[place.offset("indexer", lid)[1] :][: idx.nbytes(n)].view(idx.units(n), idx.unit_bytes)
        out.append((kv, pe, convert.indexer_pages_to_keys(pages, n, out_dtype)))
    return out


def check_sharded(dev: torch.device, layout: layouts.Layout, gen: torch.Generator) -> str:
    """Receive buffers sharded over GPUs (here 3 shards on one device): each shard converts on its own
    device; every layer must equal the CPU torch path."""
    n, place = 1000, layouts.Placement(layout, max_tokens=1024, shards=3)
    regions = [torch.zeros(place.shard_nbytes(s), dtype=torch.uint8, device=dev) for s in range(3)]
    fill(regions, place, n, gen)
    got = convert.to_injected_state(regions, place, n, 5, torch.bfloat16)
    want = convert.to_injected_state([r.cpu() for r in regions], place, n, 5, torch.float32)
    worst = max(
        rel_err(getattr(g, f).float().cpu(), getattr(w, f))
        for g, w in zip(got.layers, want.layers, strict=True)
        for f in ("kv", "pe", "ki")
    )
    if worst > 1e-2 or len(got.layers) != layout.num_layers:
        raise SystemExit(f"sharded conversion differs from the CPU path: relative error {worst:.2e}")
    return (
        f"Sharded (3 shards, {n} tokens): every layer matches the CPU path, worst relative error {worst:.1e}"
    )


def mix_note(
    src: torch.Tensor,
    dst: torch.Tensor,
    moved: int,
    lhalf: int,
    copy_ms: float,
    layer_copy_ms: float,
    t: dict[str, float],
    L: int,
) -> str:
    """The conversion's traffic as a plain Triton kernel, no arithmetic: read 4,096 words, write them and
    3,232 of them again (1.79 bytes written per byte read, as 788 wire bytes -> 1,408 bf16 bytes a
    token), contiguous 16-byte vectors; whole, and per layer over `L` layers' own bytes. And a Triton
    copy with a layer's traffic. `src` (at least 0.36 x `moved` bytes) and `dst` are scratch."""
    words = moved * 788 // 2196 // 16384 * 4096
    tiles, lw, lt = words // 4096, words // L // 4096 * 4096, words // L // 4096
    m_src = src.view(torch.int32)[:words]
    m_a = torch.empty(words, dtype=torch.int32, device=src.device)
    m_b = torch.empty(tiles * 3232, dtype=torch.int32, device=src.device)
    t_mix = graph_ms(
        lambda: mix_kernel[(tiles,)](m_src, m_a, m_b, tiles, BLOCK_W=4096, EXTRA_W=3232, num_warps=8)
    )
    t_lmix = (
        graph_ms(
            lambda: [
                mix_kernel[(lt,)](
                    m_src[i * lw :],
                    m_a[i * lw :],
                    m_b[i * lt * 3232 :],
                    lt,
                    BLOCK_W=4096,
                    EXTRA_W=3232,
                    num_warps=8,
                )
                for i in range(L)
            ]
        )
        / L
    )
    hw = lhalf // 4 // 4 * 4
    s32, d32 = src.view(torch.int32), dst.view(torch.int32)
    t_ltri = (
        graph_ms(
            lambda: [
                copy_kernel[(-(-hw // 2048),)](s32[i * hw :], d32[i * hw :], hw, BLOCK_W=2048, num_warps=4)
                for i in range(L)
            ]
        )
        / L
    )
    return (
        f"whole {t_mix:.4f} ms ({copy_ms / t_mix:.0%} of the copy's speed; the conversion "
        f"{copy_ms / t['kernel']:.0%}), per layer {t_lmix * 1e3:.2f} us ({layer_copy_ms / t_lmix:.0%}; the conversion "
        f"{t['layer kernel'] * 1e3:.2f} us, {layer_copy_ms / t['layer kernel']:.0%}); a same-traffic Triton copy "
        f"per layer {t_ltri * 1e3:.2f} us"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--sizes", default="8192,32768,131072")
    ap.add_argument(
        "--tune", action="store_true", help="also time kernel variants, tokens per step and warps"
    )
    ap.add_argument(
        "--idx-stages", type=int, help="convert_triton.IDX_STAGES for this run (default: the module's)"
    )
    args = ap.parse_args()
    from tilert_serve.layouts import convert_triton

    if args.idx_stages is not None:
        convert_triton.IDX_STAGES = args.idx_stages
    dev = torch.device(args.device)
    layout = layouts.get("glm5", "fp8_ds_mla")
    L = layout.num_layers
    bw = copy_bandwidth(dev)
    gen = torch.Generator(device=dev).manual_seed(0)
    rows: list[list[str]] = []
    errs: list[tuple] = []
    tuning: list[str] = []
    upcast: list[str] = []
    mixes: list[str] = []

    for n in [int(s) for s in args.sizes.split(",")]:
        place, region = received(n, gen, dev)
        fast = convert.to_injected_state([region], place, n, 0, torch.bfloat16)
        for lid in (0, 40, 78):  # the torch path, layer by layer (it needs the whole state otherwise)
            kv, pe = convert.mla_rows_to_kv_pe(
                region[place.offset("mla", lid)[1] :][: n * 656].view(n, 656), layout, torch.float32
            )
            ki = convert.indexer_pages_to_keys(
                region[place.offset("indexer", lid)[1] :][: layout.plane("indexer").nbytes(n)].view(-1, 8448),
                n,
                torch.float32,
            )
            got = fast.layers[lid]
            errs.append((n, lid, rel_err(got.kv, kv), rel_err(got.pe, pe), rel_err(got.ki, ki)))
            if max(errs[-1][2:]) > 1e-2:
                raise SystemExit(f"conversion error too large at layer {lid}, {n} tokens: {errs[-1]}")
            one = convert.to_layer_state([region], place, lid, n, torch.bfloat16)
            if not (
                torch.equal(one.kv, got.kv) and torch.equal(one.pe, got.pe) and torch.equal(one.ki, got.ki)
            ):
                raise SystemExit(f"layer {lid} converted alone differs from the whole state's ({n} tokens)")
        del fast
        wire = layout.request_bytes(n)
        out_bytes = L * n * (512 + 64 + 128) * 2
        moved = wire + out_bytes
        # A copy with the same traffic: reads and writes half the conversion's bytes each.
        half, lhalf = moved // 2, moved // 2 // L
        src = torch.empty(half, dtype=torch.uint8, device=dev).random_(0, 256, generator=gen)
        dst = torch.empty_like(src)

        def whole(r: torch.Tensor = region, p: layouts.Placement = place, k: int = n) -> object:
            return convert.to_injected_state([r], p, k, 0, torch.bfloat16)

        def layers(r: torch.Tensor = region, p: layouts.Placement = place, k: int = n) -> object:
            return [convert.to_layer_state([r], p, lid, k, torch.bfloat16) for lid in range(L)]

        def layer_copies(s: torch.Tensor = src, d: torch.Tensor = dst, b: int = lhalf) -> object:
            return [d[i * b : (i + 1) * b].copy_(s[i * b : (i + 1) * b]) for i in range(L)]

        t = {
            "copy call": median_ms(lambda s=src, d=dst: d.copy_(s), dev),
            "copy kernel": graph_ms(lambda s=src, d=dst: d.copy_(s)),
            "call": call_ms(whole, dev),
            "kernel": graph_ms(whole),
            "layer copy call": median_ms(layer_copies, dev) / L,
            "layer copy kernel": graph_ms(layer_copies) / L,
            "layer call": call_ms(layers, dev) / L,
            "layer kernel": graph_ms(layers) / L,
        }
        # A large copy captured in a graph runs on the copy engines, slower than torch's copy kernel:
        # the baseline is the faster of the two ways, for both timings.
        copy_ms = min(t["copy call"], t["copy kernel"])
        layer_copy_ms = min(t["layer copy call"], t["layer copy kernel"])
        # The conversion writes 1.8 bytes per byte it reads; a plain copy 1. A bf16 -> float32 upcast
        # (2 per 1) with the same traffic says what the device gives such write-heavy traffic.
        up_src = src.view(torch.bfloat16)[: moved // 6]
        up_dst = torch.empty(up_src.numel(), dtype=torch.float32, device=dev)
        t_up = median_ms(lambda a=up_src, b=up_dst: b.copy_(a), dev)
        upcast.append(
            f"{n // 1024}k: upcast {t_up:.4f} ms, {copy_ms / t_up:.0%} of the same-traffic copy's speed"
        )
        del up_src, up_dst
        if dev.type == "cuda":
            mixes.append(f"{n // 1024}k: " + mix_note(src, dst, moved, lhalf, copy_ms, layer_copy_ms, t, L))
        if args.tune and dev.type == "cuda":
            for one_launch, block_t, warps, pages in (
                (False, 8, 2, None),
                (False, 16, 2, None),
                (False, 16, 4, None),
                (False, 32, 4, None),
                (False, 32, 8, None),
                (False, 16, 4, 8),
                (True, 16, 4, 1),
                (True, 8, 2, 1),
            ):
                convert_triton.ONE_LAUNCH = one_launch

                def variant(r=region, p=place, k=n, b=block_t, w=warps, g=pages) -> object:
                    return convert_triton.to_injected_state([r], p, k, 0, block_t=b, num_warps=w, pages=g)

                tk = graph_ms(variant)
                tl_ = (
                    graph_ms(
                        lambda r=region, p=place, k=n, b=block_t, w=warps, g=pages: [
                            convert_triton.to_layer_state([r], p, lid, k, block_t=b, num_warps=w, pages=g)
                            for lid in range(L)
                        ]
                    )
                    / L
                )
                tuning.append(
                    f"{n // 1024}k one_launch={one_launch} block_t={block_t} warps={warps} pages={pages}: "
                    f"kernel {tk:.4f} ms ({copy_ms / tk:.0%} of the copy's speed), per layer {tl_:.4f} ms "
                    f"({layer_copy_ms / tl_:.0%})"
                )
            convert_triton.ONE_LAUNCH = None
        t_torch = median_ms(
            lambda r=region, p=place, k=n: torch_state(r, p, k, torch.bfloat16), dev, reps=10, warmup=2
        )
        for what, c, keys, mb in (
            ("whole", copy_ms, ("call", "kernel"), moved),
            ("per layer", layer_copy_ms, ("layer call", "layer kernel"), moved // L),
        ):
            for mode, key in zip(("call", "kernel"), keys, strict=True):
                rows.append(
                    [
                        f"{n // 1024}k",
                        what,
                        mode,
                        f"{mb / 1e6:.1f}",
                        f"{c:.4f}",
                        f"{t[key]:.4f}",
                        f"{c / t[key]:.0%}",
                        f"{mb / t[key] / 1e6 / bw:.0%}",
                    ]
                )
        rows.append(
            [
                f"{n // 1024}k",
                "whole",
                "torch path call",
                f"{moved / 1e6:.1f}",
                f"{copy_ms:.4f}",
                f"{t_torch:.4f}",
                f"{copy_ms / t_torch:.0%}",
                f"{moved / t_torch / 1e6 / bw:.0%}",
            ]
        )
        del region, src, dst
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    sharded = check_sharded(dev, layout, gen)
    worst = [max(e[i] for e in errs) for i in (2, 3, 4)]
    body = table(
        [
            "tokens",
            "what",
            "timing",
            "MB moved (read + write)",
            "same-traffic copy ms",
            "fused ms",
            "of the copy's speed",
            "of copy bandwidth",
        ],
        rows,
    )
    notes = "\n".join(
        [
            f"Copy bandwidth {bw:,.0f} GB/s (read + write, 4 GiB copy). Same-traffic copy: a device copy reading and "
            "writing half the conversion's bytes each (per layer: one such copy per layer), the faster of its call and its graph replay (a large copy in a graph runs on the copy engines, slower). call = events around the "
            "Python call (host overhead counts where the GPU waits for it; the best of three medians); kernel = CUDA graph replay. Per layer: ms "
            f"per layer over {L} one-layer calls. Medians of 50 (torch path: of 10). Worst relative error against the "
            f"torch path in float32 (layers 0, 40, 78 at each size): kv {worst[0]:.1e}, pe {worst[1]:.1e}, ki "
            f"{worst[2]:.1e}; each of those layers converted alone equals the whole state's bit for bit. {sharded}.",
            "Write-heavy ceiling (a bf16 -> float32 copy, reading 1 byte per 2 written, same total traffic): "
            + "; ".join(upcast)
            + ".",
            "The conversion's read:write mix with no arithmetic (a plain Triton kernel, CUDA graph; bench/convert/"
            "kernels.py's mix_kernel): " + "; ".join(mixes) + ".",
            *tuning,
        ]
    )
    print(body)
    print(notes)
    record(
        "convert",
        "Conversion to TileRT's layout (`bench/convert/run.py`, H200)",
        body,
        device=dev,
        notes=notes,
    )


if __name__ == "__main__":
    main()
