"""Shared test inputs: the examples and a small spec builder; a reader for the /metrics text."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))
#: Kubernetes version the rendered manifests are validated against (the oldest we support).
K8S_VERSION = "1.30.0"


def example(name: str) -> dict[str, Any]:
    return yaml.safe_load((ROOT / "examples" / f"{name}.yaml").read_text())


def minimal(**overrides: Any) -> dict[str, Any]:
    """A small valid CPU spec (tiny model, reference engine); overrides merge section by section."""
    spec: dict[str, Any] = {
        "model": {"name": "m", "weights": {"tiny": True}, "tilertModel": "mla"},
        "decode": {"tilert": {"engine": "reference", "gpus": 0}},
    }
    return deep_merge(spec, overrides)


def deep_merge(base: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for k, v in patch.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def cr(spec: dict[str, Any], name: str = "t") -> dict[str, Any]:
    return {
        "apiVersion": "pd.tilert.ai/v1alpha1",
        "kind": "PDCluster",
        "metadata": {"name": name},
        "spec": spec,
    }


def sample(text: str, metric: str, /, **labels: str) -> float | None:
    """The value of one series in Prometheus text, read with prometheus_client's own parser; None
    when the series is absent. (Positional-only: a series may have a `name` label.)"""
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == metric and s.labels == labels:
                return s.value
    return None
