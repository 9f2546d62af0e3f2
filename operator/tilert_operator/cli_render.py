"""`tilert-pd render -f FILE`: print the manifests a PDCluster becomes, like `helm template`.

The same pure renderers the operator uses; nothing talks to a cluster. The handoff and node API
Secrets get fresh random tokens (the operator generates its own, once, in the cluster).
"""

from __future__ import annotations

import argparse
import secrets
import sys
from pathlib import Path
from typing import Any

import yaml

from tilert_operator import constants, render, validation


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-f", "--filename", required=True, help="PDCluster YAML file ('-' for stdin)")
    parser.add_argument(
        "-n", "--namespace", default=None, help="namespace (default: the object's, else 'default')"
    )
    parser.add_argument(
        "--no-secret", action="store_true", help="leave out the generated Secrets (handoff, node API)"
    )


def _documents(path: str) -> list[dict[str, Any]]:
    text = sys.stdin.read() if path == "-" else Path(path).read_text()
    return [d for d in yaml.safe_load_all(text) if d]


def render_document(doc: dict[str, Any], namespace: str | None, *, with_secret: bool) -> list[dict[str, Any]]:
    """Render one PDCluster document; raises ValueError naming the field and the fix."""
    if doc.get("kind") != constants.KIND or doc.get("apiVersion") != constants.API_VERSION:
        raise ValueError(
            f"expected kind {constants.KIND}, apiVersion {constants.API_VERSION}; got "
            f"{doc.get('kind')}, {doc.get('apiVersion')}"
        )
    meta = doc.get("metadata") or {}
    name = meta.get("name")
    if not name:
        raise ValueError("metadata.name is required; name the PDCluster")
    ns = namespace or meta.get("namespace") or "default"
    parsed, problems = validation.validate(doc.get("spec") or {}, name)
    if problems or parsed is None:
        raise ValueError("\n".join(str(p) for p in problems))
    if with_secret:
        return render.all_manifests(
            parsed, name, ns, secret_token=secrets.token_urlsafe(32), node_api_token=secrets.token_urlsafe(32)
        )
    return render.children(parsed, name, ns)


def run(args: argparse.Namespace) -> int:
    try:
        out: list[dict[str, Any]] = []
        for doc in _documents(args.filename):
            out += render_document(doc, args.namespace, with_secret=not args.no_secret)
    except (OSError, yaml.YAMLError, ValueError) as e:
        print(f"tilert-pd render: {args.filename}: {e}", file=sys.stderr)
        return 1
    sys.stdout.write(yaml.safe_dump_all(out, sort_keys=False))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tilert-pd render", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
