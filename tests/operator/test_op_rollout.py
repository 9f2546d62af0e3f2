"""Status says what has happened, not what was asked: Ready, the pools' ready counts and
`observedGeneration` follow the children's own rollout state. The API test server plays the
Deployment and StatefulSet controllers' status (pdc_apiserver.ApiServer._play_controllers): a spec
change bumps a workload's generation, its pods keep the revision they were made from, and the counts
of the new revision catch up only when the test rolls the pods (deletes them and makes new ones)."""

from __future__ import annotations

from typing import Any, TypeVar

import pdc_harness as h
import pdc_helpers as helpers
import pytest
from kopf.testing import KopfRunner

from tilert_operator import constants, observe, reconcile
from tilert_operator import spec as specmod

T = TypeVar("T")
COMPONENTS = (constants.PREFILL, constants.TILERT, constants.NATIVE, constants.ROUTER)


def ready(obj: dict[str, Any]) -> tuple[str, str]:
    c = h.condition(obj, "Ready")
    return c.get("status", ""), c.get("reason", "")


def rolled_out(apiserver: Any, name: str) -> None:
    """A minimal PDCluster created, reconciled, every pool's pods rolled to its template, reconciled."""
    h.run(apiserver, lambda api: api.create(h.pdc(helpers.cr(helpers.minimal(), name))))
    h.reconcile_once(apiserver, name)
    for comp in COMPONENTS:
        h.roll(apiserver, name, comp)
    h.reconcile_once(apiserver, name)


def test_a_rollout_is_not_ready_until_every_pod_of_the_new_template_is(apiserver: Any) -> None:
    rolled_out(apiserver, "ro")
    assert ready(h.body(apiserver, "ro")) == ("True", "Serving")

    # A new template for the TileRT pool: its old pods still serve, but the generation is not done.
    h.patch_spec(apiserver, "ro", {"decode": {"tilert": {"slots": 8}}})
    out = h.reconcile_once(apiserver, "ro")
    assert "StatefulSet/ro-tilert-decode" in out.applied
    obj = h.body(apiserver, "ro")
    assert ready(obj) == ("False", "RollingOut"), h.condition(obj, "Ready")
    assert "ro-tilert-decode" in h.condition(obj, "Ready")["message"]
    assert (
        h.condition(obj, "TileRTDecodeReady")["status"],
        h.condition(obj, "TileRTDecodeReady")["reason"],
    ) == ("False", "RollingOut")
    # The generation was applied: observed, while Ready says it is not rolled out.
    assert obj["status"]["observedGeneration"] == obj["metadata"]["generation"]
    assert obj["status"]["pools"]["tilert"]["ready"] == 0, "old pods are not the new generation's"
    # A rollout is what a spec change asks for: its Events are Normal.
    rolling = [
        e
        for e in apiserver.server.objects("events", "default")
        if e["involvedObject"]["name"] == "ro" and e["reason"] == "RollingOut"
    ]
    assert rolling and {e["type"] for e in rolling} == {"Normal"}, rolling

    # New pods, not ready yet: still rolling out.
    h.roll(apiserver, "ro", constants.TILERT, ready=False)
    h.reconcile_once(apiserver, "ro")
    assert ready(h.body(apiserver, "ro"))[0] == "False"

    # Every pod of the new template ready: done.
    h.roll(apiserver, "ro", constants.TILERT)
    h.reconcile_once(apiserver, "ro")
    obj = h.body(apiserver, "ro")
    assert ready(obj) == ("True", "Serving"), h.condition(obj, "Ready")
    assert obj["status"]["pools"]["tilert"] == {"ready": 1, "desired": 1}


def test_a_workload_whose_controller_has_not_seen_the_new_generation_is_rolling_out(apiserver: Any) -> None:
    srv = apiserver.server
    rolled_out(apiserver, "lag")
    assert ready(h.body(apiserver, "lag")) == ("True", "Serving")
    srv.workload_controllers = False
    h.patch_spec(apiserver, "lag", {"router": {"replicas": 2}})
    h.reconcile_once(apiserver, "lag")
    cond = h.condition(h.body(apiserver, "lag"), "Ready")
    assert (cond["status"], cond["reason"]) == ("False", "RollingOut")
    assert "has not yet seen generation 2" in cond["message"], cond["message"]
    srv.workload_controllers = True
    apiserver.sync(srv.play_controllers)
    h.roll(apiserver, "lag", constants.ROUTER)
    h.reconcile_once(apiserver, "lag")
    assert ready(h.body(apiserver, "lag")) == ("True", "Serving")


def test_a_refused_generation_keeps_the_last_observed_generation_and_is_not_ready(apiserver: Any) -> None:
    rolled_out(apiserver, "rf")
    assert h.body(apiserver, "rf")["status"]["observedGeneration"] == 1

    # The API server refuses the router's apply (as it would an invalid field the spec's checks miss).
    apiserver.server.fail(422, times=1, verb="patch", resource="deployments")
    h.patch_spec(apiserver, "rf", {"router": {"replicas": 2}})
    out = h.reconcile_once(apiserver, "rf")
    assert [f.key for f in out.failed] == ["Deployment/rf-router"]
    obj = h.body(apiserver, "rf")
    assert obj["metadata"]["generation"] == 2
    assert obj["status"]["observedGeneration"] == 1, "generation 2 was refused: not observed"
    cond = h.condition(obj, "Ready")
    assert (cond["status"], cond["reason"]) == ("False", "NotApplied")
    assert "generation 2" in cond["message"] and "Reconciled" in cond["message"]

    # Accepted at the retry: applied and observed; Ready once the new replica is.
    h.reconcile_once(apiserver, "rf")
    obj = h.body(apiserver, "rf")
    assert obj["status"]["observedGeneration"] == 2
    assert ready(obj) == ("False", "RollingOut")
    h.roll(apiserver, "rf", constants.ROUTER)
    h.reconcile_once(apiserver, "rf")
    assert ready(h.body(apiserver, "rf")) == ("True", "Serving")


def test_an_invalid_generation_is_not_observed_either(apiserver: Any) -> None:
    """The operator refuses it itself (SpecValid=False, nothing changed): the last generation applied
    stays the observed one."""
    h.run(apiserver, lambda api: api.create(h.pdc(helpers.cr(helpers.minimal(), "inv"))))
    h.reconcile_once(apiserver, "inv")
    assert h.body(apiserver, "inv")["status"]["observedGeneration"] == 1
    # As the API server would hand it over were the CRD's rules silent about it (the operator's own
    # checks refuse 3 GPUs: vLLM's tensor parallelism needs a power of two).
    invalid = h.body(apiserver, "inv")
    invalid["spec"]["prefill"]["gpus"] = 3
    invalid["metadata"]["generation"] = 2
    out = h.run(apiserver, lambda api: reconcile.reconcile(api, invalid))
    assert out.state == "invalid"
    obj = h.body(apiserver, "inv")
    assert h.condition(obj, "SpecValid")["status"] == "False"
    assert obj["status"]["observedGeneration"] == 1


def test_rollout_state_is_read_from_the_workloads_status() -> None:
    """A Deployment's old pods (replicas above updatedReplicas) and a StatefulSet's revisions."""
    dep = {
        "kind": "Deployment",
        "metadata": {"name": "d", "generation": 3},
        "status": {"observedGeneration": 3, "replicas": 3, "updatedReplicas": 2, "availableReplicas": 3},
    }
    ready_new, rolling = observe.rollout("Deployment", dep, 2)
    assert ready_new == 2 and rolling is not None and "1 pod(s) of an earlier template" in rolling
    dep["status"] |= {"replicas": 2, "availableReplicas": 2}
    assert observe.rollout("Deployment", dep, 2) == (2, None)
    dep["metadata"]["generation"] = 4
    assert observe.rollout("Deployment", dep, 2)[1] is not None
    # Stuck, as its controller says: the message says so, with where to look.
    dep["status"] |= {
        "observedGeneration": 4,
        "replicas": 3,
        "conditions": [
            {
                "type": "Progressing",
                "status": "False",
                "reason": "ProgressDeadlineExceeded",
                "message": 'ReplicaSet "d-1" has timed out progressing.',
            }
        ],
    }
    rolling = observe.rollout("Deployment", dep, 2)[1] or ""
    assert "ProgressDeadlineExceeded" in rolling and "kubectl rollout status deployment/d" in rolling, rolling
    del dep["status"]["conditions"]
    dep["status"]["replicas"] = 2
    # Rolled out once (Progressing says so): an updated pod that is unavailable since is no rollout.
    dep["metadata"]["generation"] = 3
    dep["status"] |= {"availableReplicas": 1}
    assert observe.rollout("Deployment", dep, 2)[1] is not None
    dep["status"]["conditions"] = [
        {"type": "Progressing", "status": "True", "reason": "NewReplicaSetAvailable"}
    ]
    assert observe.rollout("Deployment", dep, 2) == (1, None)
    sts = {
        "kind": "StatefulSet",
        "metadata": {"name": "s", "generation": 1},
        "status": {
            "observedGeneration": 1,
            "replicas": 2,
            "updatedReplicas": 2,
            "readyReplicas": 1,
            "currentRevision": "s-a",
            "updateRevision": "s-b",
        },
    }
    assert observe.rollout("StatefulSet", sts, 2)[1] is not None
    sts["status"]["currentRevision"] = "s-b"
    # Rolled out; a pod that went unready since is a degraded pool, not a rollout.
    assert observe.rollout("StatefulSet", sts, 2) == (1, None)
    # A partition keeps the pods below it on the earlier template on purpose: rolled out once the
    # others are updated and all are ready.
    sts["spec"] = {"updateStrategy": {"type": "RollingUpdate", "rollingUpdate": {"partition": 1}}}
    sts["status"] |= {"updatedReplicas": 1, "readyReplicas": 2, "currentRevision": "s-a"}
    assert observe.rollout("StatefulSet", sts, 2) == (2, None)
    sts["status"] |= {"updatedReplicas": 0}
    assert observe.rollout("StatefulSet", sts, 2)[1] is not None
    # A pool scaled to nothing has nothing to roll out, whatever its workload still reports.
    dep["status"] |= {"replicas": 3}
    assert observe.rollout("Deployment", dep, 0) == (0, None)


def test_a_pool_counts_no_more_ready_pods_than_the_pod_list_shows() -> None:
    """The StatefulSet's status already counts both TileRT pods while the reconcile's pod list still
    shows one (they are read apart): the pool is not whole, so Ready cannot say Serving while the
    router's endpoints (from the pods) miss a node."""
    spec = specmod.parse(helpers.example("tiny-cpu")["spec"])
    sts = {
        "kind": "StatefulSet",
        "metadata": {"name": "tiny-tilert-decode", "generation": 1},
        "status": {
            "observedGeneration": 1,
            "replicas": 2,
            "updatedReplicas": 2,
            "readyReplicas": 2,
            "currentRevision": "r",
            "updateRevision": "r",
        },
    }
    one = [h.pod("tiny", constants.TILERT, 0, ip="10.1.0.1")]
    both = [*one, h.pod("tiny", constants.TILERT, 1, ip="10.1.0.2")]
    assert observe.pool_states(spec, one, {constants.TILERT: sts})[constants.TILERT].ready == 1
    assert observe.pool_states(spec, both, {constants.TILERT: sts})[constants.TILERT].ready == 2


#: The running operator's /metrics port (its reconcile count).
METRICS_PORT: list[int] = []


@pytest.fixture()
def fast_operator(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TILERT_PD_RESYNC_S", "300")
    METRICS_PORT[:] = [h.serve_metrics(monkeypatch)]
    monkeypatch.setenv("TILERT_PD_WATCH_TIMEOUT_S", "10")


@pytest.mark.usefixtures("fast_operator")
def test_the_running_operator_follows_a_rollout_from_the_workloads_status(apiserver: Any) -> None:
    """With the resync far away, the status follows the workload controllers' status writes."""
    srv = apiserver.server
    with KopfRunner(h.ARGS, timeout=60) as runner:
        h.run(apiserver, lambda api: api.create(h.pdc(helpers.cr(helpers.minimal(), "live"))))
        h.wait_for(
            "children",
            lambda: (
                srv.get("statefulsets", "default", "live-tilert-decode")
                and srv.get("deployments", "default", "live-router")
            ),
        )
        for comp in COMPONENTS:
            h.roll(apiserver, "live", comp)
        h.wait_for("Serving", lambda: ready(h.body(apiserver, "live")) == ("True", "Serving"))
        h.patch_spec(apiserver, "live", {"decode": {"tilert": {"slots": 8}}})
        h.wait_for("RollingOut", lambda: ready(h.body(apiserver, "live")) == ("False", "RollingOut"))
        # A real StatefulSet controller reports the new pods after the pods' own events: the operator
        # must follow the workload's status writes, not only its pods.
        srv.workload_controllers = False
        listed = h.reconciles(METRICS_PORT[0])
        h.roll(apiserver, "live", constants.TILERT)
        h.wait_for("a reconcile after the new pods", lambda: h.reconciles(METRICS_PORT[0]) > listed)
        assert ready(h.body(apiserver, "live")) == ("False", "RollingOut")
        srv.workload_controllers = True
        apiserver.sync(srv.play_controllers)
        h.wait_for("Serving again", lambda: ready(h.body(apiserver, "live")) == ("True", "Serving"))
    assert runner.exception is None
