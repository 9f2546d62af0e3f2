"""Two rounds of scrapes -> what the screen shows (`build`), pure: rates and percentiles come from
the increases over the interval between the rounds, not from totals since each process started, so
the screen shows what the stack does now."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from tilert_serve.top import names
from tilert_serve.top.samples import Samples, bucket_increases, counter_increase, quantile, total

Kind = Literal["router", "node"]

#: A finished request's outcomes that are not the stack's failures (router metrics' OUTCOMES): served,
#: or the client left.
NOT_ERRORS = frozenset({"ok", "client_gone"})
#: The node's handoff outcomes that are failures (decode metrics' HANDOFF_OUTCOMES).
HANDOFF_FAILED = ("failed", "refused")


@dataclass(frozen=True)
class Source:
    """Where one component's metrics are read."""

    name: str
    kind: Kind
    url: str  # the component's base URL; /metrics is appended


@dataclass(frozen=True)
class Scrape:
    """One scrape of one source: its samples, or why there are none."""

    source: Source
    at: float  # time.monotonic() when the answer came
    samples: Samples | None
    error: str | None = None
    seconds: float = 0.0  # how long the scrape took


@dataclass(frozen=True)
class RouteRow:
    route: str
    up: float | None  # path_up: 1 up, 0 down, -1 not configured
    requests_per_s: float
    errors_per_s: float
    inflight: float | None
    ttft_p50: float | None
    ttft_p99: float | None
    tpot_p50: float | None  # between two chunks written to the client, as the router sees it
    tpot_p99: float | None


@dataclass(frozen=True)
class PoolRow:
    pool: str
    healthy: int
    endpoints: int
    breakers_open: int
    errors_per_s: float  # failed upstream calls


@dataclass(frozen=True)
class NodeRow:
    name: str
    url: str
    error: str | None  # why it is down; None when it answered
    slots_busy: float | None
    slots: float | None
    handoffs_per_s: float
    failed_per_s: float
    received_bytes_per_s: float  # handoff bytes received over the interval's wall time
    link_bytes_per_s: float | None  # handoff bytes over the seconds handoffs took (None: no handoff)
    tpot_p50: float | None
    tpot_p99: float | None


@dataclass(frozen=True)
class SourceRow:
    name: str
    kind: Kind
    url: str
    error: str | None
    seconds: float


@dataclass(frozen=True)
class View:
    interval_s: float  # the seconds the rates are over (0 before a second round)
    router: SourceRow | None
    routes: tuple[RouteRow, ...]
    pools: tuple[PoolRow, ...]
    router_slots: tuple[tuple[str, float, bool], ...]  # (node name, slots the router holds, breaker open)
    handoff_p50: float | None  # the router's view: prefill's answer to the node's first token
    handoff_p99: float | None
    nodes: tuple[NodeRow, ...]
    sources: tuple[SourceRow, ...]


def _rate(amount: float, seconds: float) -> float:
    return amount / seconds if seconds > 0 else 0.0


def _pair(
    current: Sequence[Scrape], previous: Sequence[Scrape] | None
) -> list[tuple[Scrape, Samples | None, float]]:
    """Each current scrape with the same source's previous samples and the seconds between them."""
    before = {s.source: s for s in previous or () if s.samples is not None}
    out = []
    for s in current:
        p = before.get(s.source)
        out.append((s, p.samples if p is not None else None, s.at - p.at if p is not None else 0.0))
    return out


def _routes(cur: Samples, prev: Samples | None, seconds: float) -> tuple[RouteRow, ...]:
    n = names.router()
    routes = cur.label_values(n.path_up, "path")
    for r in cur.label_values(n.requests, "path"):
        if r not in routes:
            routes.append(r)
    rows = []
    for route in routes:
        up = total(cur, n.path_up, path=route)
        finished = counter_increase(cur, prev, n.requests, path=route)
        failed = sum(
            counter_increase(cur, prev, n.requests, path=route, outcome=o)
            for o in cur.label_values(n.requests, "outcome")
            if o not in NOT_ERRORS
        )
        ttft = bucket_increases(cur, prev, n.ttft, path=route)
        itl = bucket_increases(cur, prev, n.inter_token, path=route)
        rows.append(
            RouteRow(
                route=route,
                up=up,
                requests_per_s=_rate(finished, seconds),
                errors_per_s=_rate(failed, seconds),
                inflight=total(cur, n.inflight, path=route),
                ttft_p50=quantile(0.5, ttft),
                ttft_p99=quantile(0.99, ttft),
                tpot_p50=quantile(0.5, itl),
                tpot_p99=quantile(0.99, itl),
            )
        )
    return tuple(rows)


def _pools(cur: Samples, prev: Samples | None, seconds: float) -> tuple[PoolRow, ...]:
    n = names.router()
    rows = []
    for pool in cur.label_values(n.healthy, "pool"):
        health = [v for labels, v in cur.get(n.healthy).items() if dict(labels).get("pool") == pool]
        breakers = [
            v for labels, v in cur.get(n.endpoint_breaker_open).items() if dict(labels).get("pool") == pool
        ]
        rows.append(
            PoolRow(
                pool=pool,
                healthy=sum(1 for v in health if v == 1),
                endpoints=len(health),
                breakers_open=sum(1 for v in breakers if v == 1),
                errors_per_s=_rate(counter_increase(cur, prev, n.upstream_errors, pool=pool), seconds),
            )
        )
    return tuple(rows)


def _node(scrape: Scrape, prev: Samples | None, seconds: float) -> NodeRow:
    n = names.node()
    cur = scrape.samples
    if cur is None:
        return NodeRow(
            name=scrape.source.name,
            url=scrape.source.url,
            error=scrape.error or "no metrics",
            slots_busy=None,
            slots=None,
            handoffs_per_s=0.0,
            failed_per_s=0.0,
            received_bytes_per_s=0.0,
            link_bytes_per_s=None,
            tpot_p50=None,
            tpot_p99=None,
        )
    received = counter_increase(cur, prev, n.handoff_bytes)
    transfer_s = counter_increase(cur, prev, n.handoff_seconds + "_sum")
    tpot = bucket_increases(cur, prev, n.tpot)
    return NodeRow(
        name=scrape.source.name,
        url=scrape.source.url,
        error=None,
        slots_busy=total(cur, n.slots_busy),
        slots=total(cur, n.slots),
        handoffs_per_s=_rate(counter_increase(cur, prev, n.handoffs), seconds),
        failed_per_s=_rate(
            sum(counter_increase(cur, prev, n.handoffs, outcome=o) for o in HANDOFF_FAILED), seconds
        ),
        received_bytes_per_s=_rate(received, seconds),
        link_bytes_per_s=received / transfer_s if received > 0 and transfer_s > 0 else None,
        tpot_p50=quantile(0.5, tpot),
        tpot_p99=quantile(0.99, tpot),
    )


def build(current: Sequence[Scrape], previous: Sequence[Scrape] | None) -> View:
    """The view of `current` (one scrape per source), with rates over the time since `previous`
    (the round before; None on the first, when only gauges can be shown)."""
    paired = _pair(current, previous)
    sources = tuple(
        SourceRow(s.source.name, s.source.kind, s.source.url, s.error, s.seconds) for s in current
    )
    router = next(((s, p, dt) for s, p, dt in paired if s.source.kind == "router"), None)
    nodes = tuple(_node(s, p, dt) for s, p, dt in paired if s.source.kind == "node")
    interval = max((dt for _, _, dt in paired), default=0.0)
    router_row = next((r for r in sources if r.kind == "router"), None)
    scrape, prev, dt = router if router is not None else (None, None, 0.0)
    cur = scrape.samples if scrape is not None else None
    if cur is None:
        return View(interval, router_row, (), (), (), None, None, nodes, sources)
    n = names.router()
    breakers = {dict(labels).get("node", ""): v == 1 for labels, v in cur.get(n.breaker_open).items()}
    slots = tuple(
        (node, value, breakers.get(node, False))
        for node, value in sorted((dict(labels).get("node", ""), v) for labels, v in cur.get(n.slots).items())
    )
    handoff = bucket_increases(cur, prev, n.handoff)
    return View(
        interval_s=dt,
        router=router_row,
        routes=_routes(cur, prev, dt),
        pools=_pools(cur, prev, dt),
        router_slots=slots,
        handoff_p50=quantile(0.5, handoff),
        handoff_p99=quantile(0.99, handoff),
        nodes=nodes,
        sources=sources,
    )
