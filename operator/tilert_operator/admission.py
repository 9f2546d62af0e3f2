"""The validating admission check: the cross-field rules, answered as a kopf AdmissionError."""

from __future__ import annotations

from typing import Any

import kopf

from tilert_operator import validation


def check(spec: dict[str, Any], name: str, old_spec: dict[str, Any] | None = None) -> None:
    """Raise kopf.AdmissionError listing every problem (field and fix); return when the spec is valid."""
    _, problems = validation.validate(spec, name)
    if old_spec is not None:
        problems += immutability(spec, old_spec)
    if problems:
        raise kopf.AdmissionError("; ".join(str(p) for p in problems), code=422)


def immutability(spec: dict[str, Any], old_spec: dict[str, Any]) -> list[validation.Problem]:
    new, old = spec.get("model") or {}, old_spec.get("model") or {}
    return [
        validation.Problem(f"spec.model.{key}", f"is immutable ({old.get(key)!r} -> {new.get(key)!r}); create a new PDCluster to serve another model")
        for key in ("name", "tilertModel")
        if new.get(key) != old.get(key)
    ]
