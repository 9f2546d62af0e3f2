"""Conversion benchmark: GLM-5 state received in vLLM's fp8_ds_mla format (79 layers, rows and
indexer pages) converted into TileRT's bf16 layout (kv, pe, Hadamard-rotated ki) at 8k, 32k and
128k tokens. Achieved bytes/s (wire bytes read + bf16 bytes written) against the device copy
bandwidth measured in the same run; the torch path (convert.py) as the baseline; results checked
against the torch path and, on a sample, a float64 reference.

    python3 bench/convert/run.py [--device cuda] [--sizes 8192,32768,131072]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common import copy_bandwidth, median_ms, table

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
    return f"sharded (3 shards, {n} tokens): every layer matches the CPU path, worst relative error {worst:.1e}"


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
            return [convert.mla_rows_to_kv_pe(r[p.offset("mla", i)[1]:][:k * 656].view(k, 656), layout,
                                              torch.bfloat16) for i in range(layout.num_layers)]

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
        t_torch = median_ms(torch_path, dev, reps=3, warmup=1)
        rows.append([f"{n // 1024}k", f"{wire / 1e9:.2f}", f"{out_bytes / 1e9:.2f}", f"{t_fast:.2f}",
                     f"{moved / t_fast / 1e6:.0f} ({moved / t_fast / 1e6 / bw:.0%})", f"{t_torch:.2f}",
                     f"{t_torch / t_fast:.1f}x"])
        del region, fast, fused, torch_path
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    sharded = check_sharded(dev, layout, gen)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    print(sharded)
    print(f"device: {name}; copy bandwidth {bw:.0f} GB/s (read+write); ms, median; torch path = MLA rows only")
    print("max relative error vs torch path (kv, pe, ki): " +
          ", ".join(f"{e[2]:.1e}/{e[3]:.1e}/{e[4]:.1e}" for e in errs[:3]))
    print("\n".join(tuning))
    print(table(["tokens", "wire GB", "bf16 out GB", "fused ms", "fused GB/s (of copy)", "torch MLA-only ms",
                 "speedup"], rows))


if __name__ == "__main__":
    main()
