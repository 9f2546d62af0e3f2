#!/usr/bin/env python3
"""Write docs/configuration.md, the PDCluster configuration reference, from crds/pdcluster.yaml.

The CRD is the one source of every field, type, default, constraint, description and CEL rule; this
script only lays it out, so the reference cannot disagree with what the API server enforces.
tests/chart/test_chart_docs.py fails when the checked-in file is stale.

    python scripts/gen_config_reference.py            # rewrite docs/configuration.md
    python scripts/gen_config_reference.py --check    # exit 1 if it is stale (CI)
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
CRD = ROOT / "crds" / "pdcluster.yaml"
OUT = ROOT / "docs" / "configuration.md"

Schema = dict[str, Any]


def _cell(text: str, code: bool = False) -> str:
    """Table-cell safe: one line, pipes escaped (CEL's `||` would split the row); outside code spans,
    `<name>` is escaped so Markdown does not take it for an HTML tag and drop it."""
    text = " ".join(text.split()).replace("|", "\\|")
    return text if code else text.replace("<", "&lt;").replace(">", "&gt;")


def _code(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, separators=(", ", ": "))
    return f"`{_cell(text, code=True)}`" if text != "" else '`""`'


def type_of(s: Schema) -> str:
    if s.get("x-kubernetes-int-or-string"):
        return "int or string"
    t = s.get("type", "any")
    if t == "array":
        return f"[]{type_of(s.get('items', {}))}"
    if t == "object":
        extra = s.get("additionalProperties")
        if isinstance(extra, dict):
            return f"map[string]{type_of(extra)}"
        if s.get("x-kubernetes-preserve-unknown-fields") and not s.get("properties"):
            return "object (free-form)"
    if s.get("format"):
        return f"{t} ({s['format']})"
    return str(t)


def constraints(s: Schema) -> list[str]:
    """The schema's limits on a value, as short phrases."""
    out: list[str] = []
    if "enum" in s:
        out.append("one of " + ", ".join(_code(v) for v in s["enum"]))
    lo, hi = s.get("minimum"), s.get("maximum")
    if lo is not None and hi is not None:
        out.append(f"range {lo} to {hi}")
    elif lo is not None:
        out.append(f"minimum {lo}")
    elif hi is not None:
        out.append(f"maximum {hi}")
    if s.get("minLength"):
        out.append(f"at least {s['minLength']} character{'s' if s['minLength'] > 1 else ''}")
    if "maxLength" in s:
        out.append(f"at most {s['maxLength']} characters")
    if "pattern" in s:
        out.append(f"matches {_code(s['pattern'])}")
    extra = s.get("additionalProperties")
    if isinstance(extra, dict) and constraints(extra):
        out.append("values: " + "; ".join(constraints(extra)))
    items = s.get("items")
    if isinstance(items, dict) and constraints(items):
        out.append("items: " + "; ".join(constraints(items)))
    return out


def walk(s: Schema, path: str, required: bool = False) -> Iterator[tuple[str, Schema, bool]]:
    """Every field under s, depth first in the CRD's own order: (path, schema, required)."""
    yield path, s, required
    req = set(s.get("required", []))
    for name, child in (s.get("properties") or {}).items():
        yield from walk(child, f"{path}.{name}", name in req)
    items = s.get("items")
    if isinstance(items, dict) and items.get("properties"):
        req = set(items.get("required", []))
        for name, child in items["properties"].items():
            yield from walk(child, f"{path}[].{name}", name in req)
    extra = s.get("additionalProperties")
    if isinstance(extra, dict) and extra.get("properties"):
        for name, child in extra["properties"].items():
            yield from walk(child, f"{path}.<key>.{name}")


def field_table(root: Schema, path: str) -> list[str]:
    lines = ["| Field | Type | Default | Description |", "|---|---|---|---|"]
    for field, s, required in walk(root, path):
        if field == path:
            continue
        desc = s.get("description", "")
        notes = constraints(s)
        if required:
            notes.insert(0, "**required**")
        rules = s.get("x-kubernetes-validations") or []
        if rules:
            notes.append(f"{len(rules)} CEL rule{'s' if len(rules) > 1 else ''} (below)")
        note = "; ".join(notes)
        note = (note[:1].upper() + note[1:] + ".") if note else ""
        text = _cell(desc) + (" " if desc and note else "") + note
        default = _code(s["default"]) if "default" in s else ""
        lines.append(f"| `{field}` | {_cell(type_of(s))} | {default} | {text} |")
    return lines


def rules_table(root: Schema) -> list[str]:
    lines = ["| Where | Rule (CEL) | Message |", "|---|---|---|"]
    for field, s, _ in walk(root, ""):
        for rule in s.get("x-kubernetes-validations") or []:
            where = field.lstrip(".") or "(the object)"
            transition = " (on update; `oldSelf` is the stored value)" if "oldSelf" in rule["rule"] else ""
            lines.append(
                f"| `{where}` | {_code(rule['rule'])}{transition} | {_cell(rule.get('message', ''))} |"
            )
    return lines


def render(crd: dict[str, Any]) -> str:
    spec = crd["spec"]
    names = spec["names"]
    short = names.get("shortNames", [])
    out = [
        "# PDCluster configuration reference",
        "",
        "<!-- Generated from crds/pdcluster.yaml by scripts/gen_config_reference.py: do not edit by hand.",
        "     tests/chart/test_chart_docs.py fails when this file is stale. -->",
        "",
        "Generated from [`crds/pdcluster.yaml`](../crds/pdcluster.yaml), the CRD the API server enforces; run",
        "`python scripts/gen_config_reference.py` after changing it.",
        "",
        f"Kind `{names['kind']}` (plural `{names['plural']}`"
        + (f", short name {', '.join(f'`{n}`' for n in short)}" if short else "")
        + f"), {spec['scope'].lower()}. The API server fills in the defaults when a PDCluster is created; the",
        "operator reads the same defaults (`operator/tilert_operator/spec.py`; a test keeps them equal).",
    ]
    for version in spec["versions"]:
        if not version.get("served", True):
            continue
        schema = version["schema"]["openAPIV3Schema"]
        props = schema["properties"]
        title = f"## `{spec['group']}/{version['name']}`" + (
            " (storage version)" if version.get("storage") else ""
        )
        out += ["", title, "", "### spec", ""]
        if props["spec"].get("description"):
            out += [_cell(props["spec"]["description"]), ""]
        out += field_table(props["spec"], "spec")
        out += [
            "",
            "### Validation rules",
            "",
            "Checked by the API server on create and update (CEL, `x-kubernetes-validations`); a failing rule",
            "refuses the request with its message. What CEL cannot express, the operator checks in two places",
            "that run the same checks: the validating webhook (when the chart enables it) refuses the request",
            "before it is stored; without it, the operator reports the resource `SpecValid=False` and changes",
            "nothing in the cluster. Those checks are the cross-field rules; what the pods could not do as asked",
            "(a preStop sleep that leaves no time to drain within the grace period, root under runAsNonRoot, an",
            "image, Secret or network name that cannot exist); and the children the operator would apply,",
            "rendered from the spec and checked against the Kubernetes schemas and the API server's own rules",
            "(names, labels, required fields, volumes, resources, securityContexts, rollout strategies, ...),",
            "each problem named by the PDCluster field it comes from (a pool's `overrides` when they cause it).",
            "",
            "Where the webhook can reach the API server it also applies each child as a dry run (`dryRun=All`,",
            "nothing stored), which sees what only the cluster knows: its own admission policies, the fields of",
            "its Kubernetes version, the live children. `TILERT_PD_WEBHOOK_DRY_RUN=0` (chart:",
            "`operator.extraEnv`) turns that off; an answer other than a refusal (403, a timeout) judges nothing.",
            "The webhook judges a spec only when it changes: an update of labels, annotations or finalizers",
            "passes whatever the stored spec is (so a PDCluster stored before the webhook can be relabelled and",
            "deleted), and deletion is never sent to it.",
            "",
        ]
        out += rules_table(schema)
        if "status" in props:
            out += ["", "### status", ""]
            if props["status"].get("description"):
                out += [_cell(props["status"]["description"]), ""]
            out += field_table(props["status"], "status")
        columns = version.get("additionalPrinterColumns") or []
        if columns:
            out += ["", f"### Columns of `kubectl get {(short or [names['plural']])[0]}`", ""]
            out += ["| Column | Type | JSONPath | Description |", "|---|---|---|---|"]
            out += [
                f"| {c['name']} | {c['type']} | {_code(c['jsonPath'])} | {_cell(c.get('description', ''))} |"
                for c in columns
            ]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/configuration.md is stale")
    args = parser.parse_args(argv)
    text = render(yaml.safe_load(CRD.read_text()))
    if args.check:
        if not OUT.is_file() or OUT.read_text() != text:
            print(
                f"{OUT.relative_to(ROOT)} is stale: run python scripts/gen_config_reference.py",
                file=sys.stderr,
            )
            return 1
        return 0
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(text)
    print(f"wrote {OUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
