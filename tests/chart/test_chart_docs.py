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
    spec = importlib.util.spec_from_file_location(
        "gen_config_reference", ROOT / "scripts" / "gen_config_reference.py"
    )
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_configuration_reference_is_not_stale() -> None:
    gen = _generator()
    expected = gen.render(yaml.safe_load(CRD.read_text()))
    assert REFERENCE.read_text() == expected, (
        "docs/configuration.md is stale: run python scripts/gen_config_reference.py"
    )
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
                assert f"`{shown}`" in row or (shown == "" and '`""`' in row), (
                    f"{path}: default {default!r} not shown"
                )
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
    assert not [
        p
        for p in (ROOT / "examples").glob("*.yaml")
        if yaml.safe_load(p.read_text()).get("kind") != "PDCluster"
    ]


def test_security_doc_names_what_the_code_has() -> None:
    """docs/security.md (the threat model) names files, tests, paths, annotations, conditions and
    settings: each must exist where the doc says, so the doc cannot silently drift from the code."""
    import re

    from tilert_operator import constants, credentials, status
    from tilert_serve import defaults

    text = (ROOT / "docs" / "security.md").read_text()
    files = set(re.findall(r"`((?:tests|tilert_serve|operator|bench)/[\w/.-]+\.(?:py|md))`", text))
    files |= {
        f"tilert_serve/{m}" for m in re.findall(r"`((?:decode|handoff|router|transfer)/\w+\.py)`", text)
    }
    assert files, "the doc names the code it describes"
    assert sorted(f for f in files if not (ROOT / f).exists()) == []
    tests_text = "\n".join(f.read_text() for f in (ROOT / "tests").rglob("test_*.py"))
    named = set(re.findall(r"`(test_\w+)`", text))
    assert named and sorted(t for t in named if f"def {t}(" not in tests_text) == []
    for path in (defaults.SECRET_PATH, defaults.NODE_API_TOKEN_PATH):
        assert path in text or path.rsplit("/", 1)[0] in text
    for name in (
        constants.ROTATE_HANDOFF_SECRET_ANNOTATION,
        constants.ROTATE_NODE_API_TOKEN_ANNOTATION,
        constants.ADOPT_ANNOTATION,
        constants.MULTI_NETWORK_POLICY_API_VERSION,
        constants.MULTI_NETWORK_POLICY_FOR_ANNOTATION,
        "TILERT_PD_SECRET_ROTATION_GRACE_S",
        *credentials.HANDOFF.phases,
        *credentials.NODE_API.phases,
    ):
        assert name in text, name
    # Reasons come from status.py (observed state) or reconcile_failures.py (what the API server answered).
    source = "".join(
        (ROOT / "operator" / "tilert_operator" / f).read_text()
        for f in ("status.py", "reconcile_failures.py")
    )
    for reason in re.findall(r"reason\s+`(\w+)`", text):
        assert f'"{reason}"' in source, f"{reason} is no reason the operator gives"
    for cond in ("SecretsOwned", "DataPlaneProtected", "HandoffSecretRotating", "NodeApiTokenRotating"):
        assert cond in status.CONDITION_TYPES and cond in text
    assert (
        "TILERT_PD_SECRET_ROTATION_GRACE_S"
        in (ROOT / "operator" / "tilert_operator" / "wiring.py").read_text()
    )
    assert str(int(credentials.DEFAULT_GRACE_S)) in text
