"""Reference engine TPOT for the tiny model, MTP on and off, on CPU or CUDA: time per output token of
one greedy decode after an injected 64-token prompt (median of runs). The MTP-off run is the baseline.

    python -m bench.engine.run --model DIR [--device cuda] [--tokens 128]

DIR is a tiny checkpoint (`tilert-pd tiny-model --out DIR`, deterministic per seed). Each device
writes its own section of bench/RESULTS.md (engine-cpu, engine-cuda).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from bench.common import record, table
from tilert_serve.decode.engines.base import Sampling
from tilert_serve.decode.engines.reference import ReferenceEngine, ReferenceSettings


def run(engine: ReferenceEngine, prompt: list[int], tokens: int, device: torch.device) -> tuple[float, float]:
    state, first = engine.prefill(prompt)
    seq = engine.start(state)
    drafted = accepted = produced = 0
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for step in seq.decode(first, Sampling(), tokens):
        produced += len(step.token_ids)
        drafted += step.drafted
        accepted += step.accepted
    if device.type == "cuda":
        torch.cuda.synchronize()
    seq.close()
    return (time.perf_counter() - t0) * 1e3 / produced, (accepted / drafted if drafted else 0.0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    dev = torch.device(args.device)
    prompt = [(i * 37) % 500 + 2 for i in range(64)]
    rows, base = [], None
    for k in (0, 1):
        engine = ReferenceEngine(
            ReferenceSettings(
                model_dir=args.model,
                device=args.device,
                dtype=args.dtype,
                max_seq_len=512,
                max_sequences=1,
                num_speculative_tokens=k,
            )
        )
        engine.load()
        run(engine, prompt, 16, dev)  # warm-up
        results = [run(engine, prompt, args.tokens, dev) for _ in range(args.runs)]
        tpot = statistics.median(r[0] for r in results)
        base = base or tpot
        rows.append(
            [
                "off" if k == 0 else f"on ({k} draft)",
                f"{tpot:.2f}",
                f"{1e3 / tpot:.0f}",
                f"{results[0][1]:.2f}" if k else "-",
                f"{base / tpot:.2f}x",
            ]
        )
    body = table(["MTP", "TPOT ms", "tokens/s", "acceptance", "vs MTP off"], rows)
    notes = (
        f"Tiny model ({args.dtype}), 64-token prompt, {args.tokens} greedy tokens, median of {args.runs} runs "
        "after one warm-up; baseline MTP off."
    )
    print(body)
    print(notes)
    record(
        f"engine-{dev.type}",
        f"Reference engine TPOT on {dev.type} (`bench/engine/run.py`)",
        body,
        device=dev,
        notes=notes,
    )


if __name__ == "__main__":
    main()
