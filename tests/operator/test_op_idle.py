"""Quiet at rest: an idle, reconciled PDCluster costs no API call per resync.

The operator's controller runs with its watch caches (controller.Settings.watch_cache, as wiring sets
it) against the strict API test server. Five minutes of idling are simulated by shortening the resync
period: at the chart's 30 s, five minutes are 10 resyncs, so the test waits for 10 resyncs at
RESYNC_S. The watches last WATCH_TIMEOUT_S (longer than the test), so a resumed watch is not counted
as a new start here; test_op_cache checks what happens when one ends. Then changes made behind the
operator's back (a child deleted, a pod going unready) must reach it through the watches alone: the
resync is pushed out to an hour first, so only a watch event can trigger the repair.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import pdc_harness as h
import pdc_helpers as helpers
import pytest

from tilert_operator import constants, reconcile
from tilert_operator.cache import CACHED_KINDS, OPTIONAL_KINDS, CacheSettings
from tilert_operator.controller import Controller, Settings
from tilert_operator.kubeapi import KINDS, Client, Connection

UA = constants.FIELD_MANAGER
#: The chart's resync is 30 s: 10 resyncs are five minutes of idling.
RESYNCS = 10
RESYNC_S = 0.2
WATCH_TIMEOUT_S = 600.0
DEBOUNCE_S = 0.1
WRITES = ("create", "patch", "update", "delete", "deletecollection")
WORKLOADS = {
    constants.PREFILL: "Deployment",
    constants.ROUTER: "Deployment",
    constants.NATIVE: "Deployment",
    constants.TILERT: "StatefulSet",
}
COMPONENTS = tuple(WORKLOADS)


async def until(
    what: str, fn: Callable[[], Any], timeout: float = 30.0, show: Callable[[], Any] | None = None
) -> Any:
    """Wait for an event (fn truthy), polling the test's own loop; the bound is generous for a loaded
    box. `show` says what stood instead when it times out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = fn()
        if value:
            return value
        await asyncio.sleep(0.02)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}; {show() if show else ''}")


def plural(kind: str) -> str:
    return KINDS[kind][1]


async def test_an_idle_pdcluster_costs_no_api_calls_and_drift_still_arrives_through_the_watches(
    apiserver: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    srv = apiserver.server
    outcomes: list[reconcile.Outcome] = []
    real = reconcile.reconcile

    async def counted(api: Client, body: Any, **kw: Any) -> reconcile.Outcome:
        out = await real(api, body, **kw)
        outcomes.append(out)
        return out

    monkeypatch.setattr(reconcile, "reconcile", counted)
    apiserver.call(srv.put(h.PDC, h.pdc(helpers.example("tiny-cpu"))))
    start = len(srv.calls)
    async with Client(Connection(server=apiserver.url)) as api:
        ctl = Controller(
            api,
            Settings(
                resync_s=RESYNC_S,
                watch_cache=True,
                drift_debounce_s=DEBOUNCE_S,
                drift_min_interval_s=0.2,
                cache=CacheSettings(watch_timeout_s=WATCH_TIMEOUT_S),
            ),
        )
        try:
            ctl.observe(h.body(apiserver, "tiny"))
            await until(
                "the workloads",
                lambda: all(
                    srv.get(plural(kind), "default", constants.child_name("tiny", component))
                    for component, kind in WORKLOADS.items()
                ),
            )
            # Play the workload controllers and kubelets: every pool's pods, ready.
            for component in COMPONENTS:
                h.roll(apiserver, "tiny", component)
            await until(
                "Ready=True",
                lambda: (
                    h.condition(srv.get("pdclusters", "default", "tiny"), "Ready").get("status") == "True"
                ),
                show=lambda: h.body(apiserver, "tiny").get("status"),
            )
            # Converged: a resync that writes nothing.
            await until(
                "a quiet resync",
                lambda: len(outcomes) >= 2 and outcomes[-1].writes == 0 and not outcomes[-1].status_written,
            )

            # ---- idle: RESYNCS resyncs, counted by request ------------------------------------
            mark, seen = len(srv.calls), len(outcomes)
            await until(f"{RESYNCS} resyncs", lambda: len(outcomes) >= seen + RESYNCS, timeout=60)
            idle = srv.counts(UA, since=mark)
            assert idle == Counter(), f"an idle PDCluster made API calls over {RESYNCS} resyncs: {idle}"
            assert all(o.writes == 0 and not o.status_written for o in outcomes[seen:])
            assert ctl.cache is not None and ctl.cache.hits > 0

            # Over the operator's whole life: one list and one watch start per kind and namespace.
            whole = srv.counts(UA, since=start)
            for kind in CACHED_KINDS:
                assert whole[("list", plural(kind))] <= 1, (kind, whole)
                # A kind the server does not serve (no MultiNetworkPolicy CRD here) is listed, not watched.
                watches = 0 if kind in OPTIONAL_KINDS else 1
                assert whole[("watch", plural(kind))] == watches, (kind, whole)

            # ---- behind the operator's back: only the watches can tell it now --------------------
            ctl.settings.resync_s = 3600.0
            await until("the long resync in force", lambda: len(outcomes) >= seen + RESYNCS + 1)
            before, kicks = len(outcomes), ctl.drift_kicks
            deleted_at = time.monotonic()
            apiserver.call(srv.remove(("", "v1", "configmaps"), "default", "tiny-router"))
            await until("the ConfigMap back", lambda: srv.get("configmaps", "default", "tiny-router"))
            repaired_s = time.monotonic() - deleted_at
            assert ctl.drift_kicks == kicks + 1 and len(outcomes) > before
            # The debounce plus one reconcile; the bound leaves room for a loaded box's scheduling.
            assert repaired_s < DEBOUNCE_S + 10, repaired_s

            def tilert_ready() -> str:
                return str((h.body(apiserver, "tiny")["status"].get("replicas") or {}).get("tilert"))

            serving = tilert_ready()
            sts = srv.get("statefulsets", "default", "tiny-tilert-decode")
            apiserver.call(srv.put(h.POD, h.pod("tiny", constants.TILERT, 0, ready=False, owner=sts)))
            await until("the unready node in the status", lambda: tilert_ready() != serving)
            assert tilert_ready().startswith(str(int(serving.split("/")[0]) - 1) + "/"), (
                serving,
                tilert_ready(),
            )
        finally:
            await ctl.stop()
