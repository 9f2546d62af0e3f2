"""The metrics catalogue: docs/metrics.md is what the code exposes today (so a metric added without
its entry fails here), every metric follows Prometheus' naming conventions, and a label's values are
held to the set the catalogue lists."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from prometheus_client import Counter, Gauge
from prometheus_client.core import GaugeMetricFamily

from tilert_serve import metrics_catalogue
from tilert_serve.metric_defs import Bounded, Registry, Unbounded, Values, counter, values

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "metrics.md"

CATALOGUE = metrics_catalogue.catalogue()
ENTRIES = [(c, e) for c in CATALOGUE for e in c.entries]

# Units that are not Prometheus base units, and ratios dressed up as units.
_NOT_BASE_UNITS = (
    "_ms",
    "_milliseconds",
    "_us",
    "_microseconds",
    "_ns",
    "_nanoseconds",
    "_s",
    "_minutes",
    "_hours",
    "_days",
    "_kb",
    "_kilobytes",
    "_mb",
    "_megabytes",
    "_gb",
    "_gigabytes",
    "_bits",
    "_percent",
    "_percentage",
)
_UNIT_WORDS = {
    "seconds since the Unix epoch": "time",
    "bytes per second": "bytes per second",
    "seconds": "second",
    "bytes": "byte",
    "tokens": "token",
}
_SNAKE = re.compile(r"^[a-z][a-z0-9]*(_[a-z0-9]+)*$")


def test_doc_is_not_stale() -> None:
    assert DOC.read_text() == metrics_catalogue.render(CATALOGUE), (
        "docs/metrics.md is stale: run .venv/bin/python -m tilert_serve.metrics_catalogue > docs/metrics.md"
    )


def test_every_component_exposes_metrics() -> None:
    assert [c.prefix for c in CATALOGUE] == ["tilert_router_", "tilert_decode_", "vllm:tilert_", "tilert_pd_"]
    assert all(c.entries for c in CATALOGUE)
    names = [e.name for _, e in ENTRIES]
    assert len(names) == len(set(names))


def _problems(prefix: str, e: metrics_catalogue.Entry) -> list[str]:
    out = []
    bare = e.name.removeprefix("vllm:")
    if not e.name.startswith(prefix) or not _SNAKE.match(bare):
        out.append(f"name not snake_case under {prefix}")
    stem = e.name.removesuffix("_total")
    if e.type == "counter":
        if not e.name.endswith("_total") or stem.endswith("_total"):
            out.append("a counter's exposed name ends in one _total")
    elif e.name.endswith("_total"):
        out.append(f"a {e.type} named like a counter")
    if stem.endswith(_NOT_BASE_UNITS):
        out.append("a unit that is not a base unit (seconds, bytes), or a ratio named as a unit")
    if e.type == "histogram" and e.unit is None:
        out.append("a histogram without a unit")
    if re.search(r"\b(ratio|fraction|percent(age)?)\b", e.help, re.I) and not stem.endswith("_ratio"):
        out.append("a ratio not named _ratio")
    if re.match(r"(seconds|duration)\b", e.help, re.I) and e.unit != "seconds":
        out.append("a duration not named _seconds")
    if e.unit is not None and _UNIT_WORDS[e.unit] not in e.help.lower():
        out.append(f"the help does not say the unit ({e.unit})")
    if not re.match(r"^[-A-Z0-9].*\S.*\.$", e.help) or len(e.help.split()) < 3:
        out.append("the help is not a sentence")
    for label, _ in e.labels:
        if not _SNAKE.match(label) or label in ("le", "quantile"):
            out.append(f"label {label!r} not snake_case or reserved")
    return out


@pytest.mark.parametrize(("prefix", "entry"), [pytest.param(c.prefix, e, id=e.name) for c, e in ENTRIES])
def test_prometheus_conventions(prefix: str, entry: metrics_catalogue.Entry) -> None:
    assert _problems(prefix, entry) == []


def test_conventions_catch_what_they_should() -> None:
    def entry(name: str, kind: str, help: str, labels: tuple[str, ...] = ()) -> metrics_catalogue.Entry:
        return metrics_catalogue.Entry(name, kind, help, tuple((n, Unbounded("x")) for n in labels))

    assert _problems("p_", entry("p_wait_seconds", "histogram", "Seconds waited for a slot.")) == []
    assert _problems("p_", entry("p_wait_ms", "histogram", "Milliseconds waited.")) != []
    assert _problems("p_", entry("p_requests_total", "gauge", "Requests seen so far.")) != []
    assert _problems("p_", entry("p_wait", "histogram", "Seconds waited for a slot.")) != []
    assert _problems("p_", entry("p_hit_bytes", "gauge", "Fraction of bytes that hit the cache.")) != []
    assert _problems("p_", entry("p_sent_bytes_total", "counter", "Sent.")) != []
    assert _problems("p_", entry("p_sent_total", "counter", "Sent things, by peer.", ("peerName",))) != []


def test_a_labelled_metric_needs_its_values_declared() -> None:
    r = Registry()
    Counter("p_things_total", "Things.", ["kind"], registry=r)
    with pytest.raises(ValueError, match="not declared"):
        metrics_catalogue.entries(r)

    class Custom:
        def collect(self) -> list[GaugeMetricFamily]:
            g = GaugeMetricFamily("p_state", "States.", labels=["state"])
            g.add_metric(["a"], 1)
            return [g]

        def label_domains(self) -> dict[str, dict[str, Values]]:
            return {}

    r = Registry()
    r.register(Custom())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="not declared"):
        metrics_catalogue.entries(r)


def test_declared_labels_must_be_the_metrics_labels() -> None:
    from tilert_serve.metric_defs import declare

    with pytest.raises(ValueError):
        declare(Gauge("p_g", "G.", ["a", "b"], registry=Registry()), {"a": Unbounded("x")})


def test_bounded_labels_count_what_is_outside_their_set_as_other() -> None:
    r = Registry()
    m = Bounded(
        counter(r, "p_ends_total", "Ends.", {"why": values({"done", "failed"}), "node": Unbounded("n")})
    )
    m.labels("done", "n1").inc()
    m.labels("a peer's words", "n1").inc()
    assert r.get_sample_value("p_ends_total", {"why": "done", "node": "n1"}) == 1
    assert r.get_sample_value("p_ends_total", {"why": "other", "node": "n1"}) == 1
    m.keep_only(set())
    assert r.get_sample_value("p_ends_total", {"why": "done", "node": "n1"}) is None
    strict = values({"a"}, other=False)
    with pytest.raises(ValueError):
        strict.bound("b")


def test_patterned_values() -> None:
    from tilert_serve.router.metrics import KINDS, PROBE_OUTCOMES, bounded_kind

    assert bounded_kind("generate_http_503") == "generate_http_503"
    assert bounded_kind("http_600") == "other"
    assert KINDS.bound("connect") == "connect"
    assert PROBE_OUTCOMES.bound("prefill_timeout") == "prefill_timeout"
    assert PROBE_OUTCOMES.bound("tilert_admit_http_429") == "tilert_admit_http_429"
    assert PROBE_OUTCOMES.bound("unknown_ticket") == "unknown_ticket"
    assert PROBE_OUTCOMES.bound("whatever the node said") == "other"


def test_the_prefill_bounds_its_outcomes() -> None:
    from tilert_serve.pd_vllm.stats import TileRTStats

    stats = TileRTStats()
    stats.record("unreachable")
    stats.record("a sender's new reason")
    assert stats.data["handoffs"] == {"unreachable": 1, "other": 1}
