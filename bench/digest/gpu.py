"""GPU digest benchmark: BLAKE3 of a GLM-5 state hashed on the GPU where it lies (handoff/blake3_gpu.py
through digest.of_ranges), against a device copy of the same number of bytes and against the host path
(pinned host copies + BLAKE3 on host threads, digest.of_ranges_on_host), all in the same run.

The state: a sender's staging placement sized for 128k tokens (GLM-5, fp8_ds_mla + indexer, one
shard); at n tokens the digest covers what the sender writes (digest.sender_ranges: each layer's MLA
rows and indexer pages, 158 ranges for the whole state), scattered over the 8 GB buffer as in
production. "per layer": one layer's two ranges (a LayersDone digest). Every size is checked against
the host path's digest first.

Timings: `call` = CUDA events around digest.of_ranges as a caller makes it (range table to the device,
launches, the 32-byte result back); `kernel` = the launches alone, captured in a CUDA graph and
replayed. copy = `dst.copy_(src)` of the same number of bytes (contiguous), events around the call.
% of copy = copy ms / digest ms. Medians.

    python -m bench.digest.gpu [--sizes 8192,32768,131072] [--layer 39] [--tune]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from bench.common import median_ms, record, table
from bench.extract.timing import graph_ms
from tilert_serve import layouts
from tilert_serve.handoff import blake3_gpu, digest

GiB = 1 << 30


def _reps(nbytes: int) -> tuple[int, int]:
    return (50, 5) if nbytes < 256 << 20 else (10, 2) if nbytes < 4 << 30 else (5, 1)


def _host_us(fn: Callable[[], object], reps: int = 100) -> float:
    """Median host microseconds of a call (the GPU is synchronised after each, outside the timing)."""
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else "")
    ap.add_argument("--sizes", default="8192,32768,131072")
    ap.add_argument("--layer", type=int, default=39, help="the layer hashed alone")
    ap.add_argument("--tune", action="store_true", help="also time chunks per program x warps (kernel)")
    ap.add_argument("--no-host", action="store_true", help="skip the host path (slow at 128k)")
    args = ap.parse_args()
    dev = torch.device("cuda")
    sizes = [int(s) for s in args.sizes.split(",")]
    staging = layouts.Placement(layouts.get("glm5", "fp8_ds_mla"), max_tokens=max(sizes))
    buf = torch.randint(0, 256, (staging.total_nbytes(),), dtype=torch.uint8, device=dev)
    bufs = [buf]
    rows: list[list[str]] = []
    tuning: list[str] = []
    host_us: list[str] = []
    for n in sizes:
        for what, layers in (("whole", None), ("per layer", [args.layer])):
            ranges = digest.sender_ranges(staging, 0, 1, n, layers)
            nbytes = sum(r[2] for r in ranges)
            reps, warm = _reps(nbytes)
            host = digest.of_ranges_on_host(bufs, ranges, "blake3")
            got = digest.of_ranges(bufs, ranges, "blake3")
            if got != host:
                raise SystemExit(f"GPU digest {got} != host digest {host} ({what}, {n} tokens)")
            src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=dev)
            dst = torch.empty_like(src)
            t_copy = median_ms(lambda s=src, d=dst: d.copy_(s), dev, reps, warm)
            del src, dst
            job = blake3_gpu.prepare(bufs, ranges)
            t_call = median_ms(lambda r=ranges: digest.of_ranges(bufs, r, "blake3"), dev, reps, warm)
            t_kernel = graph_ms(lambda j=job: blake3_gpu.launch(j), reps=reps, warmup=warm)
            t_host = (
                float("nan")
                if args.no_host
                else median_ms(
                    lambda r=ranges: digest.of_ranges_on_host(bufs, r, "blake3"), dev, min(reps, 5), 1
                )
            )
            if n == sizes[0]:
                host_us.append(
                    f"{n // 1024}k {what}: prepare {_host_us(lambda r=ranges: blake3_gpu.prepare(bufs, r)):.0f}"
                    f" us, launch {_host_us(lambda j=job: blake3_gpu.launch(j)):.0f} us (queued), of_ranges "
                    f"{_host_us(lambda r=ranges: digest.of_ranges(bufs, r, 'blake3')):.0f} us (to the digest)"
                )
            for timing, t in (("call", t_call), ("kernel", t_kernel)):
                rows.append(
                    [
                        f"{n // 1024}k",
                        what,
                        timing,
                        f"{nbytes / 1e6:.1f}",
                        f"{t_copy:.4f}",
                        f"{t:.4f}",
                        f"{nbytes / GiB / (t / 1e3):,.0f}",
                        f"{t_copy / t:.0%}",
                        f"{t_host:.3f}" if timing == "call" else "",
                        f"{t_host / t:.1f}x" if timing == "call" else "",
                    ]
                )
                print(rows[-1], flush=True)
            # Tuning (each shape compiles both chunk kernels anew): the whole state at the middle size,
            # one layer at the smallest.
            if args.tune and (n, what) in ((sizes[len(sizes) // 2], "whole"), (sizes[0], "per layer")):
                names = ("PER_PROGRAM", "NUM_WARPS", "ROW_LOADS", "PARENT_FANIN", "PARENT_WARPS")
                base = tuple(getattr(blake3_gpu, k) for k in names)
                for shape in (
                    (128, 4, True, 256, 1),
                    (128, 4, False, 256, 1),
                    (256, 8, True, 256, 1),
                    (128, 4, True, 512, 2),
                ):
                    for k, v in zip(names, shape, strict=True):
                        setattr(blake3_gpu, k, v)
                    j = blake3_gpu.prepare(bufs, ranges)
                    ok = (
                        blake3_gpu.launch(j).cpu().numpy().astype("<i4").tobytes().hex() == host.split(":")[1]
                    )
                    tk = graph_ms(lambda j=j: blake3_gpu.launch(j), reps=reps, warmup=warm)
                    tuning.append(
                        f"{n // 1024}k {what}: {dict(zip(names, shape, strict=True))}: kernel {tk:.4f} ms "
                        f"({t_copy / tk:.0%} of copy){'' if ok else ' WRONG DIGEST'}"
                    )
                    print(tuning[-1], flush=True)
                for k, v in zip(names, base, strict=True):
                    setattr(blake3_gpu, k, v)
    regs = []
    for name, launcher in (
        ("fast", blake3_gpu._fast),
        ("general", blake3_gpu._general),
        ("parent", blake3_gpu._parent),
    ):
        for key, k in launcher._compiled.items():
            regs.append(
                f"{name} {dict(key[1])}, {key[2]} warps: {getattr(k, 'n_regs', '?')} registers, "
                f"{getattr(k, 'n_spills', '?')} spilled"
            )
    body = table(
        [
            "tokens",
            "what",
            "timing",
            "MB",
            "copy ms",
            "GPU digest ms",
            "GiB/s",
            "of copy",
            "host path ms",
            "GPU / host",
        ],
        rows,
    )
    notes = "\n".join(
        [
            f"GPU digest: {blake3_gpu.PER_PROGRAM} chunks of 1 KiB per program (one per lane), {blake3_gpu.NUM_WARPS} "
            f"warps, {'each lane loading its own chunk' if blake3_gpu.ROW_LOADS else 'coalesced loads regrouped in shared memory'}; "
            f"parents {blake3_gpu.PARENT_FANIN} per program of {blake3_gpu.PARENT_WARPS} warp(s). Host path: 64 MB pinned copies on a side stream "
            "overlapping BLAKE3 on the host's threads (the `blake3` package). Both give the same digest, checked "
            "at every size.",
            "Compiled: " + "; ".join(regs) + ".",
            "Host time of a call, medians (what `call` adds to `kernel` where the GPU waits): "
            + "; ".join(host_us)
            + f"; direct launches: {all(k.direct for k in (blake3_gpu._fast, blake3_gpu._general, blake3_gpu._parent))}.",
            *tuning,
        ]
    )
    print(body)
    print(notes)
    record(
        "digest-gpu", "Handoff digest on the GPU (`bench/digest/gpu.py`, H200)", body, device=dev, notes=notes
    )


if __name__ == "__main__":
    main()
