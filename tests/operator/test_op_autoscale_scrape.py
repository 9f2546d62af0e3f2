"""autoscale/scrape.py and the pure parts of autoscale/loop.py: which pods are read and how (the
router's token only to the router), a pod that stalls, errs or answers garbage is named and left out
within the timeout; the Events a decision calls for, the bound one only when a pool comes to it."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pdc_harness as h
import pdc_helpers as helpers
from aiohttp import web

from tilert_operator import constants
from tilert_operator.autoscale import loop, scrape
from tilert_operator.autoscale.act import AutoscalingStatus, PoolStatus
from tilert_operator.autoscale.decision import Decision, PoolDecision
from tilert_operator.spec import parse
from tilert_serve import metric_defs as m


def test_targets_are_the_ready_pods_and_only_the_router_gets_the_token() -> None:
    spec = parse(helpers.minimal(decode={"tilert": {"replicas": 2}, "native": {"replicas": 1}}))
    pods = [
        h.pod("t", constants.ROUTER, 0),
        h.pod("t", constants.PREFILL, 0),
        h.pod("t", constants.PREFILL, 1, ready=False),
        h.pod("t", constants.TILERT, 0),
        h.pod("t", constants.TILERT, 1),
        h.pod("t", constants.NATIVE, 0),
    ]
    got = {t.pod: t for t in scrape.targets(spec, pods, "tok")}
    assert set(got) == {
        "t-router-0",
        "t-prefill-0",
        "t-tilert-decode-0",
        "t-tilert-decode-1",
        "t-native-decode-0",
    }
    assert got["t-router-0"].token == "tok" and all(
        t.token is None for n, t in got.items() if n != "t-router-0"
    )
    assert got["t-tilert-decode-1"].ordinal == 1 and got["t-tilert-decode-1"].url.endswith(":5557/metrics")
    assert got["t-prefill-0"].url.endswith(":8100/metrics")
    assert "tok" not in repr(got["t-router-0"])  # never in a log
    # The router is read on the port it listens on: its Service's, whatever the spec sets it to.
    assert got["t-router-0"].url.endswith(f":{spec.router.service.port}/metrics")
    moved = parse(helpers.minimal(router={"service": {"port": 9000}}))
    routers = [t for t in scrape.targets(moved, pods, "tok") if t.role == "router"]
    assert [t.url.rsplit(":", 1)[1] for t in routers] == ["9000/metrics"]


async def test_a_stalled_erring_or_garbled_pod_is_left_out_within_the_timeout() -> None:
    release = asyncio.Event()
    headers: dict[str, str | None] = {}

    async def handle(request: web.Request) -> web.Response:
        pod = request.match_info["pod"]
        headers[pod] = request.headers.get("Authorization")
        if pod == "stalled":
            await release.wait()
        if pod == "erring":
            return web.Response(status=500)
        if pod == "garbled":
            return web.Response(text="tilert_router_routes_total{path= 3 4\n")
        return web.Response(text=f"{m.DECODE_SLOTS_BUSY} 2\n")

    app = web.Application()
    app.router.add_get("/{pod}", handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        targets = [
            scrape.Target(p, "tilert", f"http://127.0.0.1:{port}/{p}", 0, token="k" if p == "ok" else None)
            for p in ("ok", "stalled", "erring", "garbled")
        ]
        started = time.monotonic()
        snap = await scrape.scrape(targets, timeout_s=0.5, concurrency=2)
        assert time.monotonic() - started < 10  # bounded: the stalled pod costs its timeout, no more
        assert set(snap.pods) == {"ok"} and snap.pods["ok"].samples[m.DECODE_SLOTS_BUSY]
        assert snap.missing["stalled"].startswith("GET /metrics timed out")
        assert snap.missing["erring"] == "GET /metrics answered 500"
        assert "Prometheus text format" in snap.missing["garbled"]
        assert headers["ok"] == "Bearer k" and headers["erring"] is None
    finally:
        release.set()
        await runner.cleanup()


def _decision(tilert: tuple[int, int, int, str]) -> Decision:
    same = {p: PoolDecision(p, 1, 1, 1, "steady") for p in ("prefill", "native")}  # type: ignore[misc]
    cur, rec, des, why = tilert
    return Decision(0.0, same["prefill"], PoolDecision("tilert", cur, rec, des, why), same["native"])


def test_events_for_a_change_and_for_coming_to_a_bound() -> None:
    at_max = _decision((2, 6, 4, "12 slots wanted: 6; maxReplicas 4"))
    notes = loop.notes(None, at_max)
    assert [n.reason for n in notes] == [loop.SCALED, loop.AT_BOUND]
    assert notes[0].message.startswith("tilert: 2 -> 4 replicas: 12 slots wanted")
    assert "held at maxReplicas 4" in notes[1].message and not notes[1].ok
    # Held there on the next run: no new Event, neither a change nor the bound again.
    before = AutoscalingStatus({"tilert": PoolStatus(4, 6, at_max.tilert.reason, "")}, loop.History())
    assert loop.notes(before, _decision((4, 6, 4, "12 slots wanted: 6; maxReplicas 4"))) == []


def test_ready_counts_and_ordinals_from_the_pods() -> None:
    pods: list[dict[str, Any]] = [
        h.pod("t", constants.TILERT, 0),
        h.pod("t", constants.TILERT, 2),
        h.pod("t", constants.TILERT, 1, ready=False),
        h.pod("t", constants.NATIVE, 0),
    ]
    r = loop.ready(pods)
    assert (r.prefill, r.tilert, r.native, r.tilert_ordinals) == (0, 2, 1, (0, 2))


def test_the_router_token_is_sent_only_where_its_metrics_ask_for_a_key() -> None:
    import base64

    secret = {"data": {constants.METRICS_TOKEN_KEY: base64.b64encode(b"mt").decode()}}
    keyed = parse(helpers.minimal(router={"apiKeysSecret": {"name": "keys"}}))
    public = parse(helpers.minimal(router={"apiKeysSecret": {"name": "keys"}, "metricsPublic": True}))
    assert loop.router_token(keyed, secret) == "mt"
    assert loop.router_token(public, secret) is None and not loop.needs_token(public)
    assert loop.router_token(parse(helpers.minimal()), secret) is None  # no keys: /metrics is open
