"""`tilert-pd operator`: run the PDCluster operator (what the chart's Deployment runs).

Equivalent to `kopf run -m tilert_operator.wiring --standalone ...`; settings beyond these flags come
from the environment (see operator/tilert_operator/wiring.py).
"""

from __future__ import annotations

import argparse
import logging
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "-n",
        "--namespace",
        action="append",
        default=[],
        help="watch only this namespace (repeatable); default: all namespaces",
    )
    parser.add_argument(
        "--liveness",
        default="http://0.0.0.0:8081/healthz",
        help="liveness endpoint URL (default http://0.0.0.0:8081/healthz; '' = off)",
    )
    parser.add_argument("--log-level", default="INFO", help="logging level (default INFO)")


def run(args: argparse.Namespace) -> int:
    import kopf

    # Importing the module registers the handlers with kopf's default registry.
    from tilert_operator import wiring  # noqa: F401

    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    kopf.run(
        standalone=True,  # one replica, strategy Recreate: no peering objects needed
        clusterwide=not args.namespace,
        namespaces=tuple(args.namespace),
        liveness_endpoint=args.liveness or None,
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tilert-pd operator", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
