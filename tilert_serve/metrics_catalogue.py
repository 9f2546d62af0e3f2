"""The metrics catalogue: every Prometheus metric each component exposes, read from the component's
own registry (name, type, help) and from the label values declared beside each metric
(tilert_serve.metric_defs), so that docs/metrics.md cannot drift from the code.

    python -m tilert_serve.metrics_catalogue > docs/metrics.md

Building it needs the prefill's dependencies (vLLM): the prefill's metrics are made by its connector
class, through vLLM's metric classes.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, cast

from prometheus_client import Counter, Gauge, Histogram

from tilert_serve.metric_defs import (
    OTHER,
    DeclaresLabels,
    Domain,
    Registry,
    Unbounded,
    declared,
    label_names,
)

# The unit a name's suffix says, longest suffix first (Prometheus: the unit is the name's last word,
# before `_total` for a counter). A name with none counts things or states (its help says which).
_UNITS = (
    ("_timestamp_seconds", "seconds since the Unix epoch"),
    ("_bytes_per_second", "bytes per second"),
    ("_seconds", "seconds"),
    ("_bytes", "bytes"),
    ("_tokens", "tokens"),
)


@dataclass(frozen=True)
class Entry:
    """One metric as a scrape shows it."""

    #: As exposed: a counter's name ends in `_total`; a histogram's series add `_bucket`, `_sum`, `_count`.
    name: str
    type: str
    help: str
    labels: tuple[tuple[str, Domain], ...]

    @property
    def unit(self) -> str | None:
        stem = self.name.removesuffix("_total") if self.type == "counter" else self.name
        return next((unit for suffix, unit in _UNITS if stem.endswith(suffix)), None)


@dataclass(frozen=True)
class Component:
    title: str
    #: What every metric's name of this component starts with.
    prefix: str
    #: Where the component serves its metrics, and how they come to be there.
    where: str
    entries: tuple[Entry, ...]


def entries(registry: Registry) -> tuple[Entry, ...]:
    """The registry's metrics, sorted by name. A labelled metric whose labels were not declared with
    their values raises: the catalogue would have to guess them."""
    out: list[Entry] = []
    for collector in registry.collectors:
        custom = collector.label_domains() if isinstance(collector, DeclaresLabels) else None
        for family in collector.collect():
            if custom is not None:
                domains = dict(custom.get(family.name, {}))
                seen = {name for sample in family.samples for name in sample.labels}
                if not seen <= set(domains):
                    raise ValueError(f"{family.name}: labels {sorted(seen - set(domains))} are not declared")
            else:
                domains = declared(collector) or {}
                if tuple(domains) != label_names(collector):
                    raise ValueError(
                        f"{family.name}: labels {label_names(collector)} are not declared "
                        f"with their values (tilert_serve.metric_defs)"
                    )
            name = family.name + "_total" if family.type == "counter" else family.name
            out.append(Entry(name, family.type, family.documentation, tuple(domains.items())))
    return tuple(sorted(out, key=lambda e: e.name))


class _NoTransfer:
    """The decode node's record asks its byte mover for a name only."""

    name = "none"
    protocol = "none"


def decode() -> Component:
    from tilert_serve.decode.metrics import NodeMetrics
    from tilert_serve.decode.record import Recorder
    from tilert_serve.transfer import TransferEngine

    metrics = NodeMetrics(slots=1)
    Recorder(cast("TransferEngine", _NoTransfer()), metrics, lambda: 0.0)  # registers its metrics there
    return Component(
        "Decode node (TileRT)",
        "tilert_decode_",
        "each TileRT decode node's HTTP port, `GET /metrics`",
        entries(metrics.registry),
    )


def router() -> Component:
    from tilert_serve.router.metrics import Metrics

    return Component(
        "Router",
        "tilert_router_",
        "the router's HTTP port, `GET /metrics` (with API keys, only for a caller with a "
        "key unless the config says `metrics_public: true`)",
        entries(Metrics().registry),
    )


def prefill() -> Component:
    from tilert_serve.pd_vllm.stats import VLLM_LABELS, TileRTPromMetrics

    registry = Registry()
    # vLLM hands the connector its metric classes (its own, or Ray's wrappers); these register here.
    metric_types: dict[Any, Any] = {
        cls: functools.partial(cls, registry=registry) for cls in (Counter, Gauge, Histogram)
    }
    TileRTPromMetrics(
        SimpleNamespace(kv_transfer_config=None), metric_types, list(VLLM_LABELS), {0: ["model", "0"]}
    )
    return Component(
        "Prefill (vLLM with TileRTConnector)",
        "vllm:tilert_",
        "each prefill's vLLM server, `GET /metrics`, beside "
        "vLLM's own `vllm:*` metrics (vLLM's names, hence the colon)",
        entries(registry),
    )


def operator() -> Component:
    from tilert_operator.metrics import Metrics

    return Component(
        "Operator", "tilert_pd_", "the operator's metrics port, `GET /metrics`", entries(Metrics().registry)
    )


COMPONENTS: tuple[Callable[[], Component], ...] = (router, decode, prefill, operator)


def catalogue() -> tuple[Component, ...]:
    return tuple(build() for build in COMPONENTS)


def _code(text: str) -> str:
    return f"`{text}`"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _label(name: str, domain: Domain) -> str:
    if isinstance(domain, Unbounded):
        return f"{_code(name)}: unbounded by design, {domain.why}"
    said = [_code(v) for v in sorted(domain.values)]
    if domain.more:
        said.append(domain.more)
    if domain.other:
        said.append(f"{_code(OTHER)} for anything else")
    return f"{_code(name)}: {', '.join(said)}"


def render(components: Iterable[Component]) -> str:
    lines = [
        "# Metrics",
        "",
        "<!-- Generated by `python -m tilert_serve.metrics_catalogue > docs/metrics.md`: do not edit by hand;",
        "     tests/test_metrics_catalogue.py fails when this file differs from what the code exposes. -->",
        "",
        "Every Prometheus metric the components expose, read from their registries: name, type, labels with",
        "their values, unit, meaning (the metric's help text).",
        "",
        "Names follow Prometheus conventions: a counter ends in `_total`; the unit is the last word before it",
        "(`_seconds`, `_bytes`, `_tokens`), in base units; a metric with no unit counts things or holds a",
        "state its meaning describes. A histogram's series are `NAME_bucket{le}`, `NAME_sum` and `NAME_count`.",
        "",
        "Label values: a label with listed values takes only those (from the code's own set of them), and,",
        "where the list says so, `other` for anything else, so that no peer's or client's words make a",
        "series. Labels marked unbounded by design take one value per deployed thing (a node, an",
        "endpoint, a model): the deployment's size bounds them, not the code.",
    ]
    for component in components:
        lines += [
            "",
            f"## {component.title}",
            "",
            f"Served on {component.where}; every name starts with {_code(component.prefix)}.",
            "",
            "| Name | Type | Labels | Unit | Meaning |",
            "| --- | --- | --- | --- | --- |",
        ]
        for e in component.entries:
            labels = "<br>".join(_label(n, d) for n, d in e.labels) or "none"
            lines.append(
                f"| {_code(e.name)} | {e.type} | {_cell(labels)} | {e.unit or '—'} | {_cell(e.help)} |"
            )
    return "\n".join(lines) + "\n"


def main() -> None:
    sys.stdout.write(render(catalogue()))


if __name__ == "__main__":
    main()
