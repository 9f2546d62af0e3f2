"""Where the chart's observability files are: the one source for the rules and the dashboards, which
the chart ships (charts/tilert-pd/files/) and the local Prometheus loads."""

from __future__ import annotations

from pathlib import Path

#: charts/tilert-pd/files/ of the checkout this package runs from.
CHART_FILES = Path(__file__).resolve().parents[2] / "charts" / "tilert-pd" / "files"


def rules_file() -> Path:
    """The recording and alerting rules (a Prometheus rule file)."""
    path = CHART_FILES / "prometheus-rules.yaml"
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} not found: the rules ship with the chart; run from a checkout of tilert-pd, or pass "
            "rules=[...] to tilert_serve.observe.start"
        )
    return path


def dashboards() -> list[Path]:
    """The Grafana dashboards (JSON), sorted by name."""
    return sorted((CHART_FILES / "dashboards").glob("*.json"))
