"""Validates a custom resource the way the API server would, as far as that can be done offline:
structural defaulting, unknown-field rejection, the openAPIV3Schema (jsonschema), then the CEL
x-kubernetes-validations (only when the schema passes, like the API server; transition rules only
with an old object), on properties, array items and map values. Not emulated: list-type uniqueness, K8s formats, CEL cost limits, K8s CEL
extension libraries (our CRD uses standard CEL only).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import cel
import jsonschema
import yaml

CRD_PATH = Path(__file__).resolve().parents[2] / "crds" / "pdcluster.yaml"

Schema = dict[str, Any]


def load_schema(path: Path = CRD_PATH) -> Schema:
    crd = yaml.safe_load(path.read_text())
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def apply_defaults(schema: Schema, value: Any) -> Any:
    if isinstance(value, dict):
        for key, sub in (schema.get("properties") or {}).items():
            if key not in value and "default" in sub:
                value[key] = copy.deepcopy(sub["default"])
            if key in value:
                value[key] = apply_defaults(sub, value[key])
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            for key in list(value):
                if key not in (schema.get("properties") or {}):
                    value[key] = apply_defaults(extra, value[key])
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        return [apply_defaults(schema["items"], v) for v in value]
    return value


def _closed(schema: Schema) -> Schema:
    """The schema with additionalProperties: false wherever the API server would reject unknown fields."""
    out = {k: v for k, v in schema.items() if not k.startswith("x-kubernetes")}
    if "properties" in schema:
        out["properties"] = {k: _closed(v) for k, v in schema["properties"].items()}
        if not schema.get("x-kubernetes-preserve-unknown-fields") and "additionalProperties" not in schema:
            out["additionalProperties"] = False
    if isinstance(schema.get("additionalProperties"), dict):
        out["additionalProperties"] = _closed(schema["additionalProperties"])
    if isinstance(schema.get("items"), dict):
        out["items"] = _closed(schema["items"])
    return out


def _cel_errors(schema: Schema, value: Any, old: Any, path: str) -> list[str]:
    errors: list[str] = []
    for rule in schema.get("x-kubernetes-validations") or []:
        expr = rule["rule"]
        if "oldSelf" in expr and old is None:
            continue  # transition rules apply to updates only
        ctx: dict[str, Any] = {"self": value}
        if old is not None:
            ctx["oldSelf"] = old
        if not cel.evaluate(expr, ctx):
            errors.append(f"{path or '.'}: {rule.get('message', expr)}")
    if isinstance(value, dict):
        for key, sub in (schema.get("properties") or {}).items():
            if key in value:
                sub_old = old.get(key) if isinstance(old, dict) else None
                errors += _cel_errors(sub, value[key], sub_old, f"{path}.{key}")
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            for key in value:
                if key not in (schema.get("properties") or {}):
                    errors += _cel_errors(extra, value[key], None, f"{path}[{key}]")
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        # Items have no oldSelf here (list-type map correlation is not emulated).
        for i, item in enumerate(value):
            errors += _cel_errors(schema["items"], item, None, f"{path}[{i}]")
    return errors


def validate(
    obj: dict[str, Any], old: dict[str, Any] | None = None, schema: Schema | None = None
) -> tuple[dict[str, Any], list[str]]:
    """(the defaulted object, error messages); no errors = the API server would accept it."""
    schema = schema or load_schema()
    obj = apply_defaults(schema, copy.deepcopy(obj))
    old = apply_defaults(schema, copy.deepcopy(old)) if old is not None else None
    validator = jsonschema.Draft202012Validator(_closed(schema))
    errors = [f"{'.'.join(str(p) for p in e.absolute_path)}: {e.message}" for e in validator.iter_errors(obj)]
    if errors:
        return obj, errors
    return obj, _cel_errors(schema, obj, old, "")
