"""Shared by the observability tests: the rule file, the dashboards, the catalogue's metric names, and
the running of promtool (Debian's prometheus package, installed by make setup)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tilert_serve.observe import paths

ROOT = Path(__file__).resolve().parents[2]
RULES = paths.rules_file()
TROUBLESHOOTING = ROOT / "docs" / "troubleshooting.md"


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    # A plain lookup, no skip: make setup installs the package, and a missing promtool must fail here.
    exe = shutil.which("promtool")
    assert exe, "promtool not found: run make setup (it installs Debian's prometheus package)"
    return subprocess.run([exe, *args], capture_output=True, text=True, timeout=120)


def rule_groups() -> list[dict[str, Any]]:
    return list(yaml.safe_load(RULES.read_text())["groups"])


def rules() -> list[dict[str, Any]]:
    return [r for g in rule_groups() for r in g["rules"]]


def recorded() -> set[str]:
    return {r["record"] for r in rules() if "record" in r}


@pytest.fixture(scope="session")
def catalogue_names() -> set[str]:
    """Every series name a scrape of the stack can show: the catalogue's, a histogram's three series
    each, and Prometheus' own `up`."""
    from tilert_serve import metrics_catalogue

    names = {"up"}
    for component in metrics_catalogue.catalogue():
        for e in component.entries:
            if e.type == "histogram":
                names |= {f"{e.name}_bucket", f"{e.name}_sum", f"{e.name}_count"}
            else:
                names.add(e.name)
    return names
