"""The Grafana dashboards (charts/tilert-pd/files/dashboards/*.json: an overview, and a drill-down of
the handoff's stages): every query parses (promtool
checks them as recording rules), names only catalogue metrics or the rules' recorded series, and the
dashboards are well formed (unique uid and panel ids, a data source variable every query uses, panels
that do not overlap)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.observability.conftest import promtool, recorded
from tests.observability.promql import metric_names
from tilert_serve.observe import paths

DASHBOARDS = paths.dashboards()


def load(path: Path) -> dict[str, Any]:
    return dict(json.loads(path.read_text()))


def queries(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    """(panel title, PromQL) for every panel target and every query variable's series selector."""
    out = [(p["title"], t["expr"]) for p in dashboard["panels"] if p["type"] != "row" for t in p["targets"]]
    for var in dashboard["templating"]["list"]:
        if var["type"] == "query":
            m = re.fullmatch(r"label_values\((.*),\s*(\w+)\)", var["definition"])
            assert m, f"variable {var['name']}: only label_values(selector, label) is used here"
            out.append((f"variable {var['name']}", m.group(1)))
    return out


def test_there_are_an_overview_and_a_handoff_drill_down() -> None:
    assert [p.name for p in DASHBOARDS] == ["tilert-pd-handoffs.json", "tilert-pd-overview.json"]


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.stem)
def test_every_query_parses(path: Path, tmp_path: Path) -> None:
    found = queries(load(path))
    assert len(found) >= 10
    # Grafana's variables stand in regex strings ("$pdcluster"), which PromQL reads as they are.
    rules = {
        "groups": [
            {
                "name": "dashboard",
                "rules": [{"record": f"dashboard:q{i}", "expr": e} for i, (_, e) in enumerate(found)],
            }
        ]
    }
    (tmp_path / "q.yaml").write_text(yaml.safe_dump(rules))
    done = promtool("check", "rules", str(tmp_path / "q.yaml"))
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"SUCCESS: {len(found)} rules found" in done.stdout


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.stem)
def test_queries_name_only_catalogue_metrics_or_recorded_series(
    path: Path, catalogue_names: set[str]
) -> None:
    known = catalogue_names | recorded()
    used: set[str] = set()
    for title, expr in queries(load(path)):
        names = metric_names(expr)
        assert names, f"{title}: {expr} reads no metric"
        assert names <= known, f"{title}: {sorted(names - known)} are neither in docs/metrics.md nor recorded"
        used |= names
    # The overview reads the rules' numbers, so a panel and an alert agree on what a ratio is; the
    # drill-down reads the stages' own metrics mostly.
    assert len(used & recorded()) >= (15 if path.stem.endswith("overview") else 3)


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.stem)
def test_dashboard_is_well_formed(path: Path) -> None:
    d = load(path)
    assert d["uid"] == path.stem and d["title"]
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids)), "panel ids repeat"
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert (
        variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    )
    cells: set[tuple[int, int]] = set()
    for p in d["panels"]:
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24, p["title"]
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not mine & cells, f"panel {p['title']!r} overlaps another"
        cells |= mine
        if p["type"] == "row":
            continue
        assert p["datasource"]["uid"] == "${datasource}", p["title"]
        assert p["description"] and p["fieldConfig"]["defaults"]["unit"], p["title"]
        for t in p["targets"]:
            assert 'pdcluster=~"$pdcluster"' in t["expr"] or "operator" in t["expr"], (p["title"], t["expr"])
