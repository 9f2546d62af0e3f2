"""Digest and scrub benchmark: what checking a handoff's digest (handoff/digest.py) and zeroing a
slot (decode/buffers.py scrub, pd_vllm/worker.py staging scrub) cost, against a plain copy of the same
bytes measured in the same run (memcpy on the CPU, device-to-device on a GPU).

Sizes: the tiny CPU stack's state (mla, float32, 3 layers) at 128 and 2048 tokens, and one GLM-5
request (79 layers, fp8_ds_mla + indexer) at 8k, 32k and 128k tokens. Candidates on the CPU: BLAKE3
(one thread, and its own threads), BLAKE2b and SHA-256 (hashlib), xxh3-128 where installed (not
cryptographic: for scale only). On a GPU: the host path (digest.of_ranges_on_host: pinned host copies
on a side stream overlapping BLAKE3 on host threads; of_ranges itself hashes CUDA buffers on the GPU,
measured by bench/digest/gpu.py), the host copy alone, and zero_ on the device.
Each cell is a median (reps shrink with size); sizes over --max-bytes are skipped and say so.

    python -m bench.digest.run [--device cpu|cuda] [--max-bytes 2.5e9]
"""

from __future__ import annotations

import argparse
import hashlib
from collections.abc import Callable

import torch

from bench.common import median_ms, record, table
from tilert_serve import layouts
from tilert_serve.handoff import digest


def _sizes() -> list[tuple[str, int]]:
    tiny = layouts.get("mla", "float32", num_layers=3)
    glm5 = layouts.get("glm5", "fp8_ds_mla")
    return [(f"tiny {n}", tiny.request_bytes(n)) for n in (128, 2048)] + [
        (f"GLM-5 {n // 1024}k", glm5.request_bytes(n)) for n in (8192, 32768, 131072)
    ]


def _reps(nbytes: int) -> tuple[int, int]:
    return (50, 5) if nbytes < 64 << 20 else (5, 1) if nbytes < 1 << 30 else (3, 1)


def _cpu_candidates(buf: torch.Tensor) -> dict[str, Callable[[], object]]:
    view = buf.numpy()
    out: dict[str, Callable[[], object]] = {}
    try:
        import blake3

        out["blake3 (1 thread)"] = lambda: blake3.blake3(view).digest()
        out["blake3 (its threads)"] = lambda: blake3.blake3(view, max_threads=blake3.blake3.AUTO).digest()
    except ImportError:
        pass
    out["blake2b"] = lambda: hashlib.blake2b(view, digest_size=32).digest()
    out["sha256"] = lambda: hashlib.sha256(view).digest()
    try:
        import xxhash

        out["xxh3-128 (not cryptographic)"] = lambda: xxhash.xxh3_128(view).digest()
    except ImportError:
        pass
    return out


def _measure(name: str, nbytes: int, dev: torch.device) -> tuple[list[str], list[str]]:
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    reps, warm = _reps(nbytes)
    base = median_ms(lambda: dst.copy_(src), dev, reps, warm)
    cells: dict[str, float] = {}
    if dev.type == "cpu":
        for cname, fn in _cpu_candidates(src).items():
            cells[cname] = median_ms(fn, dev, reps, warm)
    else:
        chunk = torch.empty(64 << 20, dtype=torch.uint8, pin_memory=True)

        def to_host() -> None:
            for start in range(0, nbytes, chunk.numel()):
                m = min(chunk.numel(), nbytes - start)
                chunk[:m].copy_(src[start : start + m], non_blocking=True)

        cells["host copy (64 MB pinned chunks)"] = median_ms(to_host, dev, reps, warm)
        alg = digest.preferred()
        cells[f"host path, of_ranges_on_host ({alg}, pipelined)"] = median_ms(
            lambda: digest.of_ranges_on_host([src], [(0, 0, nbytes)], alg), torch.device("cpu"), reps, warm
        )
    cells["scrub (zero_)"] = median_ms(lambda: dst.zero_(), dev, reps, warm)
    header = ["state", "MB", "copy ms", *[f"{c} ms (x copy)" for c in cells]]
    return header, [
        name,
        f"{nbytes / 1e6:.1f}",
        f"{base:.3f}",
        *[f"{ms:.3f} ({ms / base:.1f}x)" for ms in cells.values()],
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--max-bytes", type=float, default=2.5e9, help="skip sizes larger than this")
    args = ap.parse_args()
    dev = torch.device(args.device)
    rows: list[list[str]] = []
    header: list[str] = []
    for name, nbytes in _sizes():
        if nbytes > args.max_bytes:
            rows.append([name, f"{nbytes / 1e6:.0f}", f"not run (over --max-bytes {args.max_bytes:.2g})"])
            continue
        header, row = _measure(name, nbytes, dev)
        rows.append(row)
        print(row, flush=True)
    width = len(header)
    rows = [r + [""] * (width - len(r)) for r in rows]
    body = table(header, rows)
    print(body)
    record(f"digest-{dev.type}", f"Handoff digest and slot scrub ({dev.type})", body, device=dev)


if __name__ == "__main__":
    main()
