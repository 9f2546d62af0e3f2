"""`tilert-pd tiny-model`: write a tiny DeepSeek-V3-style checkpoint (MLA + MoE + MTP) for tests and demos."""

from __future__ import annotations

import argparse
from dataclasses import fields

from tilert_serve.tinymodel.generate import TinySpec, generate

# flag -> TinySpec field; defaults come from TinySpec so they are spelled once.
_FLAGS = {
    "seed": "seed",
    "layers": "layers",
    "hidden": "hidden",
    "heads": "heads",
    "q-lora-rank": "q_lora_rank",
    "intermediate": "intermediate",
    "moe-intermediate": "moe_intermediate",
    "experts": "experts",
    "top-k": "top_k",
    "vocab": "vocab",
    "max-positions": "max_positions",
    "mtp-fit-steps": "mtp_fit_steps",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--out", required=True, help="directory to write the checkpoint into (created if missing)"
    )
    defaults = {f.name: f.default for f in fields(TinySpec)}
    for flag, name in _FLAGS.items():
        parser.add_argument(
            f"--{flag}", dest=name, type=int, default=defaults[name], help=f"default {defaults[name]}"
        )


def run(args: argparse.Namespace) -> int:
    spec = TinySpec(**{name: getattr(args, name) for name in _FLAGS.values()})
    try:
        report = generate(spec, args.out)
    except ValueError as e:
        print(f"tiny-model: {e}")
        return 2
    print(
        f"wrote {report.out_dir} in {report.seconds:.1f} s: {report.num_parameters / 1e6:.1f} M parameters, "
        f"MTP draft accuracy on held-out greedy text {report.mtp.accuracy_after:.2f}"
    )
    return 0
