"""The recording and alerting rules (charts/tilert-pd/files/prometheus-rules.yaml): promtool accepts
them, its unit tests (rules_unit.yaml: series in, alerts out) pass, every alert is among those tests,
every metric they read is in the catalogue (a renamed metric breaks this test, not production), and
every alert says how severe it is, what it means and where its runbook is."""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path

import yaml

from tests.observability.conftest import RULES, TROUBLESHOOTING, promtool, recorded, rules
from tests.observability.promql import metric_names

UNIT = Path(__file__).with_name("rules_unit.yaml")
SEVERITIES = {"warning", "critical"}


def unknown_names(exprs: Iterable[str], known: set[str]) -> dict[str, set[str]]:
    """expression -> the names it reads that are neither exposed metrics nor recorded series."""
    out = {}
    for expr in exprs:
        bad = metric_names(expr) - known
        if bad:
            out[expr] = bad
    return out


def github_anchors(markdown: str) -> set[str]:
    """The anchors GitHub gives a page's headings (lowercase, punctuation dropped, spaces to -)."""
    anchors = set()
    for line in markdown.splitlines():
        m = re.match(r"#+\s+(.*)", line)
        if m:
            text = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower())
            anchors.add(text.replace(" ", "-"))
    return anchors


def test_promtool_check_rules() -> None:
    done = promtool("check", "rules", str(RULES))
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"SUCCESS: {len(rules())} rules found" in done.stdout


def test_promtool_unit_tests(tmp_path: Path) -> None:
    bare = yaml.safe_load(RULES.read_text())
    for group in bare["groups"]:
        for rule in group["rules"]:
            rule.pop("annotations", None)
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(bare))
    unit = yaml.safe_load(UNIT.read_text())
    assert unit["rule_files"] == ["RULES"]
    unit["rule_files"] = [str(tmp_path / "rules.yaml")]
    (tmp_path / "unit.yaml").write_text(yaml.safe_dump(unit))
    done = promtool("test", "rules", str(tmp_path / "unit.yaml"))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout


def test_every_alert_has_a_unit_test_that_fires_it() -> None:
    unit = yaml.safe_load(UNIT.read_text())
    fired = {
        case["alertname"]
        for test in unit["tests"]
        for case in test.get("alert_rule_test", [])
        if case["exp_alerts"]
    }
    alerts = {r["alert"] for r in rules() if "alert" in r}
    assert alerts - fired == set(), "alerts no unit test in rules_unit.yaml fires"
    assert fired <= alerts


def test_every_metric_the_rules_read_is_in_the_catalogue(catalogue_names: set[str]) -> None:
    exprs = [r["expr"] for r in rules()]
    read = set().union(*(metric_names(e) for e in exprs))
    # The names found are the metrics, not words of PromQL: each is exposed or recorded.
    assert {"tilert_router_requests_total", "tilert_decode_slots_busy", "up"} <= read
    assert "rate" not in read and "le" not in read and "sum" not in read
    assert unknown_names(exprs, catalogue_names | recorded()) == {}, (
        "the rules read metrics docs/metrics.md does not list: rename them in "
        "charts/tilert-pd/files/prometheus-rules.yaml to the catalogue's names"
    )


def test_a_renamed_metric_fails_the_check(catalogue_names: set[str]) -> None:
    exprs = [r["expr"] for r in rules()]
    renamed = [e.replace("tilert_router_ttft_seconds_bucket", "tilert_router_ttft_ms_bucket") for e in exprs]
    bad = unknown_names(renamed, catalogue_names | recorded())
    assert bad and all(names == {"tilert_router_ttft_ms_bucket"} for names in bad.values())


def test_metric_names_reads_only_names() -> None:
    expr = (
        'histogram_quantile(0.99, sum by (namespace, le) (rate(a_bucket{path=~"x|y", le!="1e3"}[5m] offset 1h)))'
        " / ignoring (reason) group_left b:c:rate5m > 1.5e3 and on () vector(1) or d"
    )
    assert metric_names(expr) == {"a_bucket", "b:c:rate5m", "d"}


def test_alerts_say_severity_meaning_and_runbook() -> None:
    anchors = github_anchors(TROUBLESHOOTING.read_text())
    for rule in rules():
        if "alert" not in rule:
            assert rule["record"].startswith("tilert_pd:"), rule["record"]
            continue
        name = rule["alert"]
        assert name.startswith("TilertPD"), name
        assert rule["labels"]["severity"] in SEVERITIES, name
        assert "for" in rule, f"{name}: say how long the condition must hold (for:)"
        notes = rule["annotations"]
        assert notes["summary"] and notes["description"], name
        doc, _, anchor = notes["runbook_url"].partition("#")
        assert doc == "docs/troubleshooting.md", name
        assert anchor in anchors, f"{name}: docs/troubleshooting.md has no heading #{anchor}"
