"""Drift repair from the children's watch: with the resync pushed out to 5 minutes, a deleted
NetworkPolicy, a hand-scaled Deployment, a deleted Secret and a deleted MultiNetworkPolicy come back
within seconds; the operator's own writes cause no reconcile, and a workload controller's status report
one reconcile that writes nothing (Ready follows rollouts). The children are watched by the
operator's informers (cache.py), one per kind in the PDCluster's namespace. Timings are the
benchmark's business (bench/operator/drift.py); here only the behaviour is checked.

"Nothing happened" is never a quiet period: each such check waits for a positive event that must come
after what must not happen. For the echoes of the operator's own writes, that is a marker: an edit
of the same child, or of one child of each kind, made after the write (so its watch event comes after
the echo's, on the same watch) that the controller must name in its drift log (`DriftLog`); the log
then holds every drift decision made about the echo, and must name nothing but the foreign edits."""

from __future__ import annotations

import collections
import logging
import re
import time
from collections.abc import Iterator
from typing import Any

import pdc_harness as h
import pdc_helpers as helpers
import pytest
from kopf.testing import KopfRunner
from test_op_e2e import CHILD_PLURALS, deleted_and_recreated, kubectl, wait_spec_valid

from tilert_operator import constants
from tilert_operator.cache import SELECTOR
from tilert_serve.local.runner import free_port

UA = constants.FIELD_MANAGER
#: Far beyond every wait below: a repair seen here came from the watch, not from the resync.
RESYNC_S = "300"


@pytest.fixture(autouse=True)
def slow_resync(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TILERT_PD_RESYNC_S", RESYNC_S)
    # A port of its own for the operator's /metrics, so tests running side by side do not collide.
    monkeypatch.setenv("TILERT_PD_METRICS_PORT", str(free_port()))
    monkeypatch.setenv("TILERT_PD_METRICS_HOST", "127.0.0.1")
    monkeypatch.setenv("TILERT_PD_WATCH_TIMEOUT_S", "10")


class DriftLog(logging.Handler):
    """The controller's drift kicks, each as the foreign changes its log line names ("Kind/name what")."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.kicks: list[list[str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        found = re.search(r"drift: (.*); reconciling$", record.getMessage())
        if found:
            self.kicks.append(found.group(1).split(", "))

    def named(self, since: int = 0) -> list[str]:
        return [c for kick in self.kicks[since:] for c in kick]


@pytest.fixture
def drift_log() -> Iterator[DriftLog]:
    logger = logging.getLogger("tilert_operator.controller")
    handler, level = DriftLog(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield handler
    logger.removeHandler(handler)
    logger.setLevel(level)


#: A marker per watched kind: a child of tiny-cpu that no step below edits by hand (a marker's entry
#: in the drift log must be told apart from the step's own edits).
MARKERS = {
    "deployments": ("Deployment", "tiny-native-decode"),
    "statefulsets": ("StatefulSet", "tiny-tilert-decode"),
    "services": ("Service", "tiny-native-decode"),
    "configmaps": ("ConfigMap", "tiny-router"),
    "secrets": ("Secret", "tiny-node-api"),
    "networkpolicies": ("NetworkPolicy", "tiny-native-decode"),
    "poddisruptionbudgets": ("PodDisruptionBudget", "tiny-router"),
}
MARKS = iter(range(1, 1000))


def only_foreign_drift(
    apiserver: Any, log: DriftLog, since: int, plurals: list[str], foreign: set[str], max_kicks: int = 1
) -> None:
    """That, from drift kick `since` on, the controller's drift log names the `foreign` edits ("Kind/name
    changed|deleted") in at most `max_kicks` kicks, and no echo of the operator's own writes.

    The positive event: a marker on each watch the operator's writes came back on (`plurals`), an
    annotation on a child no step edits (someone else's edit that changes nothing the operator applies:
    server-side apply keeps another manager's annotation), named by the drift log. A marker's watch
    event comes after every earlier event of its kind, and the controller decides one PDCluster's
    events in order, so by then every echo was decided. One marker at a time: the log line names five
    changes at most."""
    marks = set()
    for plural in plurals:
        kind, name = MARKERS[plural]
        mark = f"{kind}/{name} changed"
        kubectl(apiserver, "annotate", plural, name, f"test.example/marker={next(MARKS)}", "--overwrite")
        h.wait_for(f"the drift log naming {mark}", lambda m=mark: m in log.named(since), timeout=30)
        marks.add(mark)
    named = log.named(since)
    assert not [c for c in named if c not in foreign | marks], ("not someone else's edit", log.kicks[since:])
    assert len(named) == len(set(named)), ("named twice: an echo of the operator's write", log.kicks[since:])
    kicks = len([k for k in log.kicks[since:] if set(k) & foreign])
    assert (1 if foreign else 0) <= kicks <= max_kicks, log.kicks[since:]


def test_children_are_watched_and_drift_is_repaired_at_once(apiserver: Any, drift_log: DriftLog) -> None:
    srv = apiserver.server
    h.install_crd(apiserver, h.MULTI_NETWORK_POLICY_CRD)
    doc = h.pdc(helpers.example("tiny-cpu"))
    with KopfRunner(h.ARGS, timeout=60) as runner:
        apiserver.call(srv.put(h.PDC, doc))
        h.wait_for(
            "children",
            lambda: (
                srv.get("networkpolicies", "default", "tiny-tilert-decode")
                and srv.get("deployments", "default", "tiny-router")
            ),
        )
        wait_spec_valid(srv)
        # The children's informers: per kind, in the PDCluster's namespace, filtered by the API server
        # with the cluster label; kopf does not watch them a second time.
        for plural in CHILD_PLURALS:
            watches = h.wait_for(
                f"{plural} watch",
                lambda p=plural: [
                    c
                    for c in srv.calls
                    if c.resource == p and c.verb == "watch" and c.user_agent.startswith(UA)
                ],
            )
            assert {(c.label_selector, c.namespace) for c in watches} == {(SELECTOR, "default")}
            assert not [c for c in srv.calls if c.resource == plural and c.user_agent.startswith("kopf/")]
        # Creating the children echoed back through those watches: no drift kick (no reconcile storm).
        h.wait_for("every child", lambda: all(srv.get(p, "default", n) for p, (_, n) in MARKERS.items()))
        only_foreign_drift(apiserver, drift_log, 0, list(MARKERS), foreign=set(), max_kicks=0)

        # A deleted NetworkPolicy is back long before the resync, after one drift kick; the operator's
        # own create coming back kicks nothing.
        since = len(drift_log.kicks)
        kubectl(apiserver, "delete", "networkpolicies", "tiny-tilert-decode")
        h.wait_for(
            "NetworkPolicy back",
            lambda: srv.get("networkpolicies", "default", "tiny-tilert-decode"),
            timeout=10,
        )
        only_foreign_drift(
            apiserver, drift_log, since, ["networkpolicies"], {"NetworkPolicy/tiny-tilert-decode deleted"}
        )

        # A Deployment scaled by hand is scaled back, after one drift kick.
        since = len(drift_log.kicks)
        kubectl(
            apiserver, "patch", "deployments", "tiny-router", "--type=merge", "-p", '{"spec":{"replicas":5}}'
        )
        h.wait_for(
            "replicas restored",
            lambda: srv.get("deployments", "default", "tiny-router")["spec"]["replicas"] == 1,
            timeout=10,
        )
        only_foreign_drift(apiserver, drift_log, since, ["deployments"], {"Deployment/tiny-router changed"})

        # A controller reporting a rollout's progress is no drift: a reconcile reads it (the status
        # follows it) and writes no child. The status write comes after that reconcile's applies.
        def child_writes() -> int:
            return len(
                [
                    c
                    for c in srv.calls
                    if c.user_agent.startswith(UA)
                    and c.verb in ("create", "patch", "update", "delete")
                    and c.resource not in ("pdclusters/status", "events")
                ]
            )

        def report(status: dict[str, Any]) -> None:
            dep = srv.get("deployments", "default", "tiny-prefill")
            apiserver.call(srv.put(("apps", "v1", "deployments"), dep | {"status": status}))

        def prefill_ready() -> str:
            return str(h.condition(srv.get("pdclusters", "default", "tiny"), "PrefillReady").get("message"))

        since, writes = len(drift_log.kicks), child_writes()
        srv.workload_controllers = False
        dep = srv.get("deployments", "default", "tiny-prefill")
        reported = dict(dep["status"])
        before = prefill_ready()
        # Its controller reports the new template's pod up (this server runs no pods: none is ready).
        generation = dep["metadata"]["generation"]
        report({"observedGeneration": generation, "replicas": 1, "updatedReplicas": 1})
        h.wait_for("the report read", lambda: prefill_ready() != before, timeout=10)
        report(reported)
        h.wait_for("the next report read", lambda: prefill_ready() == before, timeout=10)
        srv.workload_controllers = True
        assert child_writes() == writes
        assert drift_log.kicks[since:] == []

        # A deleted handoff Secret is recreated at once.
        since = len(drift_log.kicks)
        deleted_and_recreated(apiserver, "secrets", "tiny-handoff", timeout=10)
        only_foreign_drift(apiserver, drift_log, since, ["secrets"], {"Secret/tiny-handoff deleted"})

        # MultiNetworkPolicies are watched once their CRD is served.
        apiserver.call(
            srv.put(
                h.PDC,
                h.pdc(
                    helpers.cr(helpers.minimal(transfer={"rdma": {"networks": ["rdma-net"]}}), name="nets")
                ),
            )
        )
        mnp = h.wait_for("MultiNetworkPolicies", lambda: srv.objects("multi-networkpolicies", "default"))
        name = mnp[0]["metadata"]["name"]
        apiserver.call(srv.remove(("k8s.cni.cncf.io", "v1beta1", "multi-networkpolicies"), "default", name))
        h.wait_for(
            "MultiNetworkPolicy back", lambda: srv.get("multi-networkpolicies", "default", name), timeout=10
        )
        # The deletion is someone else's edit, named by a drift kick; wait for it, or a kick decided
        # late (the cluster's first reconcile may have put the object back first) lands in the next step.
        gone = f"MultiNetworkPolicy/{name} deleted"
        h.wait_for(f"the drift log naming {gone}", lambda: gone in drift_log.named(), timeout=30)

        # A burst of edits to one cluster's children is one (or two) drift kicks, not one per edit.
        since, burst = len(drift_log.kicks), set()
        for plural, kind in (
            ("networkpolicies", "NetworkPolicy"),
            ("services", "Service"),
            ("configmaps", "ConfigMap"),
        ):
            for o in srv.objects(plural, "default"):
                if o["metadata"]["labels"].get(constants.LABEL_CLUSTER) == "tiny":
                    apiserver.call(
                        srv.remove(
                            ("networking.k8s.io", "v1", "networkpolicies")
                            if plural == "networkpolicies"
                            else ("", "v1", plural),
                            "default",
                            o["metadata"]["name"],
                        )
                    )
                    burst.add(f"{kind}/{o['metadata']['name']} deleted")
        h.wait_for(
            "all back",
            lambda: (
                srv.get("configmaps", "default", "tiny-router")
                and srv.get("services", "default", "tiny-router")
                and srv.get("networkpolicies", "default", "tiny-tilert-decode")
            ),
            timeout=10,
        )
        only_foreign_drift(
            apiserver, drift_log, since, ["networkpolicies", "services", "configmaps"], burst, max_kicks=2
        )
    assert runner.exception is None


async def test_drift_kicks_are_debounced_rate_limited_and_skip_our_own_echoes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The controller alone, its reconcile counted: what reaches a reconcile and what does not."""
    import asyncio
    import collections

    from tilert_operator import controller, reconcile

    runs: list[float] = []
    #: When the drift kick behind each reconcile fired (the rate limit's own clock: a reconcile starts
    #: after its kick by however long a loaded box takes to schedule it, which varies run to run).
    fired: list[float] = []

    async def fake_reconcile(api: Any, body: Any, **_: Any) -> reconcile.Outcome:
        runs.append(time.monotonic())
        fired.append(ctl._workers[("ns", "c")].drift_last)
        return reconcile.Outcome(state="ready")

    monkeypatch.setattr(reconcile, "reconcile", fake_reconcile)

    class Api:
        def __init__(self) -> None:
            self.calls: collections.Counter[str] = collections.Counter()
            self.written: dict[tuple[str, str, str], str] = {}

        def own(self, kind: str, ns: str, name: str) -> str | None:
            return self.written.get((kind, ns, name))

    api = Api()
    # Waits are for events (a reconcile arriving, with a generous bound). A "nothing happens" check
    # waits for the decision that would have made it happen: the debounce timer that held the events
    # has fired (`judged`), and the controller decides in the call that clears it, so a kick it would
    # have given is visible by then. No check waits a fixed time. The rate limit is long enough that a
    # loaded machine's scheduling delays cannot make an allowed kick look like a limited one.
    interval = 2.0
    ctl = controller.Controller(
        api,
        controller.Settings(
            resync_s=300,
            drift_debounce_s=0.05,  # type: ignore[arg-type]
            drift_min_interval_s=interval,
        ),
    )

    async def until(n: int, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while len(runs) < n and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert len(runs) == n, f"{len(runs)} reconciles, waited for {n}"

    async def judged(timeout: float = 30.0) -> None:
        """Until the events given so far are decided: no debounce timer pending, no kick unserved."""
        w = ctl._workers[("ns", "c")]
        deadline = time.monotonic() + timeout
        while (w.drift_timer, w.report_timer) != (None, None) or w.kick.is_set():
            assert time.monotonic() < deadline, "the controller never decided on the events"
            await asyncio.sleep(0.02)

    ctl.observe({"metadata": {"namespace": "ns", "name": "c", "uid": "u", "generation": 1}})
    await until(1)  # the first reconcile
    worker = ctl._workers[("ns", "c")]

    def dep(replicas: int, rv: str, ready: int = 0) -> dict[str, Any]:
        return {
            "metadata": {
                "namespace": "ns",
                "name": "c-router",
                "resourceVersion": rv,
                "labels": {constants.LABEL_CLUSTER: "c"},
            },
            "spec": {"replicas": replicas},
            "status": {"readyReplicas": ready},
        }

    ctl.child_event("Deployment", None, dep(1, "1"))  # the initial listing
    api.written[("Deployment", "ns", "c-router")] = "2"
    ctl.child_event("Deployment", "MODIFIED", dep(2, "2"))  # our own apply coming back
    # Status only: the controller reporting its rollout is read by one reconcile, and is no drift.
    ctl.child_event("Deployment", "MODIFIED", dep(2, "3", ready=1))
    ctl.child_event("Deployment", "MODIFIED", dep(2, "4", ready=1))  # nothing new in it
    assert worker.drift_timer is not None, "the echo is held for the debounce, then judged"
    await until(2)
    await judged()
    assert len(runs) == 2 and ctl.drift_kicks == 0

    # Someone scales it by hand, ten times in a row: one reconcile after the debounce, then at most
    # one per min interval however often it changes.
    for i in range(10):
        ctl.child_event("Deployment", "MODIFIED", dep(5 + i, str(10 + i), ready=1))
    await until(3)
    assert ctl.drift_kicks == 1
    ctl.child_event("Deployment", "MODIFIED", dep(99, "30", ready=1))
    # Rate limited: the kick waits for the interval since the last one (the timer's own clock says so).
    await until(4, timeout=interval + 30)
    assert ctl.drift_kicks == 2 and fired[3] - fired[2] >= interval

    # Our own delete's echo does not count; a foreign delete does; a child of an unknown cluster is ignored.
    api.written[("Deployment", "ns", "c-router")] = "<deleted>"
    ctl.child_event("Deployment", "DELETED", dep(1, "40"))
    other = dep(1, "41")
    other["metadata"]["labels"] = {constants.LABEL_CLUSTER: "nope"}
    ctl.child_event("Deployment", "DELETED", other)
    assert worker.drift_timer is not None, "the echo is held for the debounce, then judged"
    await judged(timeout=interval + 30)
    assert len(runs) == 4 and ctl.drift_kicks == 2
    ctl.child_event(
        "NetworkPolicy",
        "DELETED",
        {
            "metadata": {
                "namespace": "ns",
                "name": "c-np",
                "resourceVersion": "42",
                "labels": {constants.LABEL_CLUSTER: "c"},
            }
        },
    )
    await until(5)
    assert ctl.drift_kicks == 3
    await ctl.stop()
