"""Generated and hand-written deployment docs stay true: docs/configuration.md is what
scripts/gen_config_reference.py makes of the CRD today, and the kind config is the one the docs name."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
CRD = ROOT / "crds" / "pdcluster.yaml"
REFERENCE = ROOT / "docs" / "configuration.md"


def _generator() -> Any:
    spec = importlib.util.spec_from_file_location("gen_config_reference", ROOT / "scripts" / "gen_config_reference.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_configuration_reference_is_not_stale() -> None:
    gen = _generator()
    expected = gen.render(yaml.safe_load(CRD.read_text()))
    assert REFERENCE.read_text() == expected, "docs/configuration.md is stale: run python scripts/gen_config_reference.py"
    assert gen.main(["--check"]) == 0


def _fields(schema: dict[str, Any], path: str) -> list[tuple[str, dict[str, Any]]]:
    # An independent walk of the CRD (properties, array items, map values), so a field the
    # generator skips is caught here rather than silently missing from the reference.
    out = []
    for name, child in (schema.get("properties") or {}).items():
        out.append((f"{path}.{name}", child))
        out += _fields(child, f"{path}.{name}")
    for key, suffix in (("items", "[]"), ("additionalProperties", ".<key>")):
        sub = schema.get(key)
        if isinstance(sub, dict):
            out += _fields(sub, path + suffix)
    return out


def test_reference_lists_every_field_default_and_rule() -> None:
    text = REFERENCE.read_text()
    root = yaml.safe_load(CRD.read_text())["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    # The field tables only: the rules table also starts rows with a field path.
    tables = {"spec": text.split("### Validation rules")[0], "status": text.split("### status")[1]}
    for section in ("spec", "status"):
        fields = _fields(root["properties"][section], section)
        assert fields
        for path, schema in fields:
            (row,) = [line for line in tables[section].splitlines() if line.startswith(f"| `{path}` |")]
            if "default" in schema:
                default = schema["default"]
                shown = default if isinstance(default, str) else json.dumps(default)
                assert f"`{shown}`" in row or (shown == "" and '`""`' in row), f"{path}: default {default!r} not shown"
            if "enum" in schema:
                assert all(f"`{v}`" in row for v in schema["enum"]), f"{path}: enum not shown"
    rules = [r for _, s in [("", root), *_fields(root, "")] for r in s.get("x-kubernetes-validations") or []]
    assert rules
    for rule in rules:
        assert rule["rule"].replace("|", "\\|") in text and rule["message"].split(" (")[0] in text


def test_kind_cluster_config_is_the_one_the_docs_name() -> None:
    config = yaml.safe_load((ROOT / "examples" / "kind" / "cluster.yaml").read_text())
    assert config["kind"] == "Cluster" and config["apiVersion"] == "kind.x-k8s.io/v1alpha4"
    roles = [n["role"] for n in config["nodes"]]
    assert roles.count("control-plane") == 1 and roles.count("worker") >= 1
    # `kind load docker-image --name <name>` in docker/README.md must target this cluster.
    assert f"kind load docker-image --name {config['name']}" in (ROOT / "docker" / "README.md").read_text()
    # One kind config, outside examples/*.yaml (tests/operator reads every file there as a PDCluster).
    assert [p.name for p in (ROOT / "examples" / "kind").iterdir()] == ["cluster.yaml"]
    assert not [p for p in (ROOT / "examples").glob("*.yaml") if yaml.safe_load(p.read_text()).get("kind") != "PDCluster"]
