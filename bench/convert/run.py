"""Conversion benchmark: GLM-5 state received in vLLM's fp8_ds_mla format (79 layers, rows and
indexer pages) converted into TileRT's bf16 layout (kv, pe, Hadamard-rotated ki) at 8k, 32k and
128k tokens. Achieved bytes/s (wire bytes read + bf16 bytes written) against the device copy
bandwidth measured in the same run. Baseline: the torch path of convert.py doing the same work
(every layer's kv, pe and Hadamard-rotated ki, bf16 out), timed the same way (median of 50 after 10
warm-ups). Results checked against the torch path in float32.

    python -m bench.convert.run [--device cuda] [--sizes 8192,32768,131072]
"""

from __future__ import annotations

import argparse

import torch

from bench.common import copy_bandwidth, median_ms, record, table
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
        regions[shard][off:off + rows.numel()] = rows
        shard, off = place.offset("indexer", lid)
        regions[shard][off:off + pages.numel()] = pages


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def torch_state(region: torch.Tensor, place: layouts.Placement, n: int,
                out_dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """The torch path of convert.py, layer by layer, for every plane: the same work as the kernels.

    convert.to_injected_state would take the Triton path for bf16 on CUDA; this is its other branch,
    called through the same public functions."""
    layout, mla, idx = place.layout, place.layout.plane("mla"), place.layout.plane("indexer")
    out = []
    for lid in range(layout.num_layers):
        rows = region[place.offset("mla", lid)[1]:][:mla.nbytes(n)].view(n, mla.unit_bytes)
        kv, pe = convert.mla_rows_to_kv_pe(rows, layout, out_dtype)
        pages = region[place.offset("indexer", lid)[1]:][:idx.nbytes(n)].view(idx.units(n), idx.unit_bytes)
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
    worst = max(rel_err(getattr(g, f).float().cpu(), getattr(w, f)) for g, w in zip(got.layers, want.layers, strict=True)
                for f in ("kv", "pe", "ki"))
    if worst > 1e-2 or len(got.layers) != layout.num_layers:
        raise SystemExit(f"sharded conversion differs from the CPU path: relative error {worst:.2e}")
    return f"Sharded (3 shards, {n} tokens): every layer matches the CPU path, worst relative error {worst:.1e}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--sizes", default="8192,32768,131072")
    ap.add_argument("--tune", action="store_true", help="also time tokens per program and warp counts")
    args = ap.parse_args()
    dev = torch.device(args.device)
    layout = layouts.get("glm5", "fp8_ds_mla")
    bw = copy_bandwidth(dev)
    gen = torch.Generator(device=dev).manual_seed(0)
    rows: list[list[str]] = []
    errs: list[tuple] = []
    tuning: list[str] = []
    for n in [int(s) for s in args.sizes.split(",")]:
        place = layouts.Placement(layout, max_tokens=n)
        region = torch.zeros(place.total_nbytes(), dtype=torch.uint8, device=dev)
        fill([region], place, n, gen)
        fast = convert.to_injected_state([region], place, n, 0, torch.bfloat16)
        slow_layers = {}
        for lid in (0, 40, 78):  # the torch path, layer by layer (it needs the whole state otherwise)
            sub = layouts.Placement(layout, max_tokens=n)
            slow = convert.mla_rows_to_kv_pe(
                region[sub.offset("mla", lid)[1]:][:n * 656].view(n, 656), layout, torch.float32)
            ki = convert.indexer_pages_to_keys(
                region[sub.offset("indexer", lid)[1]:][:layout.plane("indexer").nbytes(n)].view(-1, 8448), n,
                torch.float32)
            slow_layers[lid] = (slow[0], slow[1], ki)
        for lid, (kv, pe, ki) in slow_layers.items():
            got = fast.layers[lid]
            errs.append((n, lid, rel_err(got.kv, kv), rel_err(got.pe, pe), rel_err(got.ki, ki)))
            if max(errs[-1][2:]) > 1e-2:
                raise SystemExit(f"conversion error too large at layer {lid}, {n} tokens: {errs[-1]}")
        wire = layout.request_bytes(n)
        out_bytes = layout.num_layers * n * (512 + 64 + 128) * 2
        moved = wire + out_bytes
        def fused(r: torch.Tensor = region, p: layouts.Placement = place, k: int = n) -> object:
            return convert.to_injected_state([r], p, k, 0, torch.bfloat16)

        def torch_path(r: torch.Tensor = region, p: layouts.Placement = place, k: int = n) -> object:
            return torch_state(r, p, k, torch.bfloat16)

        t_fast = median_ms(fused, dev)
        if args.tune and dev.type == "cuda":
            from tilert_serve.layouts import convert_triton

            for block_t in (16, 32, 64):
                for warps in (4, 8):
                    def variant(r=region, p=place, k=n, b=block_t, w=warps) -> object:
                        return convert_triton.to_injected_state([r], p, k, 0, block_t=b, num_warps=w)
                    t = median_ms(variant, dev, reps=20, warmup=10)
                    tuning.append(f"{n // 1024}k block_t={block_t} warps={warps}: {t:.2f} ms "
                                  f"({moved / t / 1e6 / bw:.0%})")
        t_torch = median_ms(torch_path, dev)
        rows.append([f"{n // 1024}k", f"{wire / 1e9:.2f}", f"{out_bytes / 1e9:.2f}", f"{t_fast:.2f}",
                     f"{moved / t_fast / 1e6:.0f} ({moved / t_fast / 1e6 / bw:.0%})", f"{t_torch:.2f}",
                     f"{t_torch / t_fast:.1f}x"])
        del region, fast, fused, torch_path
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    sharded = check_sharded(dev, layout, gen)
    worst = [max(e[i] for e in errs) for i in (2, 3, 4)]
    body = table(["tokens", "wire GB", "bf16 out GB", "fused ms", "fused GB/s (of copy)", "torch path ms",
                  "speedup"], rows)
    notes = "\n".join([
        f"Copy bandwidth {bw:,.0f} GB/s (read + write). ms = median of 50 after 10 warm-ups, both paths. Worst "
        f"relative error against the torch path in float32 (layers 0, 40, 78 at each size): kv {worst[0]:.1e}, "
        f"pe {worst[1]:.1e}, ki {worst[2]:.1e}. {sharded}.", *tuning])
    print(body)
    print(notes)
    record("convert", "Conversion to TileRT's layout (`bench/convert/run.py`, H200)", body, device=dev, notes=notes)

if __name__ == "__main__":
    main()
