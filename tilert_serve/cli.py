"""The `tilert-pd` command: one entry point, each subcommand a module that owns its arguments.

Subcommands import lazily so that `tilert-pd render` does not load torch and `tilert-pd router`
does not load vLLM.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module, help). Each module defines add_arguments(parser) and run(args) -> int.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "tiny-model": ("tilert_serve.tinymodel.cli", "write a tiny DeepSeek-V3-style checkpoint"),
    "decode-node": ("tilert_serve.decode.cli", "run a TileRT decode node"),
    "router": ("tilert_serve.router.cli", "run the OpenAI-compatible router"),
    "render": (
        "tilert_operator.cli_render",
        "print the manifests a PDCluster renders to (like helm template)",
    ),
    "operator": ("tilert_operator.cli_operator", "run the PDCluster operator"),
    "local": ("tilert_serve.local.cli", "run a PDCluster's components as local processes"),
    "top": (
        "tilert_serve.top.cli",
        "watch a running stack live in a terminal (router and TileRT node metrics)",
    ),
    "wait-idle": (
        "tilert_serve.pd_vllm.wait_idle",
        "wait until the local vLLM (prefill or native decode) is idle: the pods' preStop hook",
    ),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tilert-pd", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text)
        p.set_defaults(_module=module)
        importlib.import_module(module).add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # Import only the chosen subcommand's module when one is named, so each stays light.
    if argv and argv[0] in SUBCOMMANDS:
        module = importlib.import_module(SUBCOMMANDS[argv[0]][0])
        parser = argparse.ArgumentParser(prog=f"tilert-pd {argv[0]}", description=SUBCOMMANDS[argv[0]][1])
        module.add_arguments(parser)
        return int(module.run(parser.parse_args(argv[1:])) or 0)
    args = build_parser().parse_args(argv)
    return int(importlib.import_module(args._module).run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
