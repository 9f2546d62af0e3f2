"""A `View` -> the screen's lines, pure: plain text a terminal over SSH shows as is, and a test or the
README can read. Absent figures show as "-"; a source that does not answer shows as "down" with why."""

from __future__ import annotations

import math
from collections.abc import Sequence

from tilert_serve.top.view import View

DASH = "-"


def seconds(value: float | None) -> str:
    """A latency in the unit that keeps it short: 850 us, 12.0 ms, 1.20 s."""
    if value is None or math.isnan(value):
        return DASH
    if value < 1e-3:
        return f"{value * 1e6:.0f} us"
    if value < 1.0:
        return f"{value * 1e3:.1f} ms"
    return f"{value:.2f} s"


def byte_rate(value: float | None) -> str:
    """Bytes per second in decimal units: 0 B/s, 12.3 kB/s, 4.56 GB/s."""
    if value is None:
        return DASH
    for unit, scale in (("GB/s", 1e9), ("MB/s", 1e6), ("kB/s", 1e3)):
        if value >= scale:
            return f"{value / scale:.{2 if unit == 'GB/s' else 1}f} {unit}"
    return f"{value:.0f} B/s"


def rate(value: float) -> str:
    return f"{value:.1f}"


def number(value: float | None) -> str:
    return DASH if value is None else f"{value:g}"


def _path(up: float | None) -> str:
    return {1: "up", 0: "DOWN", -1: "off"}.get(int(up), DASH) if up is not None else DASH


def table(headers: Sequence[str], rows: Sequence[Sequence[str]], left: int = 1) -> list[str]:
    """Columns as wide as their widest cell, the first `left` left-aligned (names), the others
    right-aligned (figures). A row of two cells (a name and a note such as "DOWN: ...") spans the table."""
    widths = [len(h) for h in headers]
    for row in rows:
        if len(row) == len(headers):
            widths = [max(w, len(c)) for w, c in zip(widths, row, strict=True)]
        else:
            widths[0] = max(widths[0], len(row[0]))

    def line(cells: Sequence[str]) -> str:
        out = [
            c.ljust(w) if i < left else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        ]
        return "  ".join(out).rstrip()

    out = [line(headers)]
    for row in rows:
        out.append(line(row) if len(row) == len(headers) else f"{row[0].ljust(widths[0])}  {row[1]}")
    return out


def lines(view: View, clock: str) -> list[str]:
    """The screen for `view`; `clock` is the wall time of its scrapes, as shown in the title."""
    where = view.router.url if view.router is not None else "no router"
    over = (
        f"rates over the last {view.interval_s:.1f} s"
        if view.interval_s > 0
        else "no rates yet (they need two scrapes in a row)"
    )
    out = [f"tilert-pd top  {where}  {over}  {clock}", ""]
    if view.router is not None and view.router.error is not None:
        out += [f"router DOWN: {view.router.error}", ""]
    if view.routes:
        out += table(
            ("ROUTE", "PATH", "REQ/S", "ERR/S", "IN FLIGHT", "TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99"),
            [
                (
                    r.route,
                    _path(r.up),
                    rate(r.requests_per_s),
                    rate(r.errors_per_s),
                    number(r.inflight),
                    seconds(r.ttft_p50),
                    seconds(r.ttft_p99),
                    seconds(r.tpot_p50),
                    seconds(r.tpot_p99),
                )
                for r in view.routes
            ],
        )
        out.append("")
    if view.pools:
        out += table(
            ("POOL", "HEALTHY", "BREAKERS OPEN", "UPSTREAM ERR/S"),
            [
                (p.pool, f"{p.healthy}/{p.endpoints}", str(p.breakers_open), rate(p.errors_per_s))
                for p in view.pools
            ],
        )
        out.append("")
    if view.nodes:
        rows: list[Sequence[str]] = []
        for n in view.nodes:
            if n.error is not None:
                rows.append((n.name, f"DOWN: {n.error}"))
                continue
            busy = f"{number(n.slots_busy)}/{number(n.slots)}"
            rows.append(
                (
                    n.name,
                    busy,
                    rate(n.handoffs_per_s),
                    rate(n.failed_per_s),
                    byte_rate(n.received_bytes_per_s),
                    byte_rate(n.link_bytes_per_s),
                    seconds(n.tpot_p50),
                    seconds(n.tpot_p99),
                )
            )
        out += table(
            (
                "NODE",
                "SLOTS",
                "HANDOFF/S",
                "FAIL/S",
                "RECEIVED",
                "LINK",
                "TPOT p50",
                "TPOT p99",
            ),
            rows,
        )
        out.append("")
    if view.router_slots or view.handoff_p50 is not None:
        held = "  ".join(
            f"{node} {number(n)}" + (" (breaker open)" if open_ else "")
            for node, n, open_ in view.router_slots
        )
        out.append(f"router holds slots: {held or DASH}")
        out.append(
            f"handoff (router: prefill answer to first token)  p50 {seconds(view.handoff_p50)}  "
            f"p99 {seconds(view.handoff_p99)}"
        )
        out.append("")
    out += table(
        ("SOURCE", "URL", "STATE"),
        [
            (s.name, s.url, f"down: {s.error}" if s.error is not None else f"up ({seconds(s.seconds)})")
            for s in view.sources
        ],
        left=3,
    )
    return out
