"""A cluster at rest costs no writes: reconciles run one after another against the API test server
(the operator's own Client, its state kept between them as in the running operator) and every
write the operator sends is counted. Each source of churn the operator once had is here: a rotation
that ended (its `nextPhaseAt` stayed in the status), a foreign env var or container port added by
someone else (server-side apply keeps them: lists are merged by key), an empty `limits: {}` (the
API server does not store empty maps), and a repeated condition (one Event, with a count)."""

from __future__ import annotations

from typing import Any, TypeVar

import pdc_harness as h
import pdc_helpers as helpers

from tilert_operator import constants, reconcile
from tilert_operator.kubeapi import Client

T = TypeVar("T")
WRITES = ("create", "patch", "update", "delete")
#: Reconciles "at rest" after the one that settles: more than one, so a churn every other resync shows.
AT_REST = 4


def writes(srv: Any) -> list[Any]:
    return [c for c in srv.calls if c.user_agent.startswith(constants.FIELD_MANAGER) and c.verb in WRITES]


async def reconciles(
    api: Client, apiserver: Any, name: str, times: int, *, now: float | None = None
) -> list[reconcile.Outcome]:
    """`times` reconciles in a row, each on the PDCluster as the server holds it then."""
    return [await reconcile.reconcile(api, h.body(apiserver, name), now=now) for _ in range(times)]


def create(apiserver: Any, spec: dict[str, Any], name: str) -> None:
    h.run(apiserver, lambda api: api.create(h.pdc(helpers.cr(spec, name))))


def test_a_finished_rotation_leaves_no_next_phase_and_then_writes_nothing(apiserver: Any) -> None:
    srv = apiserver.server
    create(apiserver, helpers.minimal(), "rot")
    grace = 10.0

    async def go(api: Client) -> None:
        await reconciles(api, apiserver, "rot", 2, now=1000.0)
        await api.request(
            "patch",
            "PATCH",
            "/apis/pd.tilert.ai/v1alpha1/namespaces/default/pdclusters/rot",
            body={"metadata": {"annotations": {constants.ROTATE_HANDOFF_SECRET_ANNOTATION: "r1"}}},
            content_type="application/merge-patch+json",
        )
        for t in (1000.0, 1000.0 + grace, 1000.0 + 2 * grace):  # the three phases
            await reconcile.reconcile(api, h.body(apiserver, "rot"), now=t, rotation_grace_s=grace)
        state = h.body(apiserver, "rot")["status"]["handoffSecret"]
        assert state["phase"] == "Idle" and "lastRotated" in state
        assert "nextPhaseAt" not in state, "the rotation is over: no next phase"
        before = len(writes(srv))
        for i in range(AT_REST):
            await reconcile.reconcile(
                api, h.body(apiserver, "rot"), now=1000.0 + (3 + i) * grace, rotation_grace_s=grace
            )
        assert writes(srv)[before:] == []

    h.run(apiserver, go)
    # A finished rotation is good news: its Event is Normal, not a Warning.
    uid = h.body(apiserver, "rot")["metadata"]["uid"]
    [done] = [
        e
        for e in srv.objects("events", "default")
        if e["involvedObject"]["uid"] == uid and e["reason"] == "Rotated"
    ]
    assert done["type"] == "Normal", done


def _add_to_container(apiserver: Any, plural: str, name: str, field: str, item: dict[str, Any]) -> None:
    """Someone else adds an entry to a list of the first container (kubectl patch --type=json)."""
    h.run(
        apiserver,
        lambda api: api.request(
            "patch",
            "PATCH",
            f"/apis/apps/v1/namespaces/default/{plural}/{name}",
            body=[{"op": "add", "path": f"/spec/template/spec/containers/0/{field}/-", "value": item}],
            content_type="application/json-patch+json",
        ),
    )


def test_foreign_env_vars_and_ports_are_kept_and_cost_no_apply(apiserver: Any) -> None:
    """Server-side apply merges env by name and ports by containerPort and protocol: someone's extra
    entry stays beside the operator's, and comparing the lists by position would apply forever."""
    srv = apiserver.server
    create(apiserver, helpers.minimal(), "fo")
    h.run(apiserver, lambda api: reconciles(api, apiserver, "fo", 2))
    _add_to_container(apiserver, "deployments", "fo-prefill", "env", {"name": "FOREIGN", "value": "1"})
    _add_to_container(
        apiserver, "statefulsets", "fo-tilert-decode", "ports", {"name": "debug", "containerPort": 9999}
    )
    before = len(writes(srv))
    outs = h.run(apiserver, lambda api: reconciles(api, apiserver, "fo", AT_REST))
    assert [o.applied for o in outs] == [[]] * AT_REST
    assert writes(srv)[before:] == []
    env = srv.get("deployments", "default", "fo-prefill")["spec"]["template"]["spec"]["containers"][0]["env"]
    assert {"name": "FOREIGN", "value": "1"} in env


def test_an_operator_field_changed_by_someone_is_still_put_back(apiserver: Any) -> None:
    """Merge keys find the operator's own entries: one of them edited is a difference."""
    srv = apiserver.server
    create(apiserver, helpers.minimal(), "ed")
    h.run(apiserver, lambda api: reconciles(api, apiserver, "ed", 2))
    dep = srv.get("deployments", "default", "ed-prefill")
    env = dep["spec"]["template"]["spec"]["containers"][0]["env"]
    env[0] = env[0] | {"value": "edited"}
    apiserver.call(srv.put(("apps", "v1", "deployments"), dep))
    [first, *rest] = h.run(apiserver, lambda api: reconciles(api, apiserver, "ed", 3))
    assert first.applied == ["Deployment/ed-prefill"] and all(not o.applied for o in rest)
    assert (
        srv.get("deployments", "default", "ed-prefill")["spec"]["template"]["spec"]["containers"][0]["env"][
            0
        ]["value"]
        != "edited"
    )


def test_an_empty_limits_map_costs_no_apply(apiserver: Any) -> None:
    """The API server does not store an empty map (`limits: {}` reads back absent)."""
    srv = apiserver.server
    create(apiserver, helpers.minimal(prefill={"resources": {"limits": {}, "requests": {"cpu": "1"}}}), "em")
    h.run(apiserver, lambda api: reconciles(api, apiserver, "em", 2))
    live = srv.get("deployments", "default", "em-prefill")["spec"]["template"]["spec"]["containers"][0][
        "resources"
    ]
    assert "limits" not in live, live
    before = len(writes(srv))
    outs = h.run(apiserver, lambda api: reconciles(api, apiserver, "em", AT_REST))
    assert [o.applied for o in outs] == [[]] * AT_REST
    assert writes(srv)[before:] == []


def test_a_repeated_condition_is_one_event_with_a_count(apiserver: Any) -> None:
    """A failure that comes back (an API server refusing a list now and then) is one Event whose count
    grows, as Kubernetes' event recorder aggregates, not one Event each time."""
    srv = apiserver.server
    create(apiserver, helpers.minimal(), "rep")

    async def go(api: Client) -> None:
        await reconcile.reconcile(api, h.body(apiserver, "rep"))
        for _ in range(3):
            srv.fail(422, times=1, verb="list", resource="pods")
            try:
                await reconcile.reconcile(api, h.body(apiserver, "rep"))
            except Exception:
                pass
            await reconcile.reconcile(api, h.body(apiserver, "rep"))

    h.run(apiserver, go)
    uid = h.body(apiserver, "rep")["metadata"]["uid"]
    mine = [e for e in srv.objects("events", "default") if e["involvedObject"]["uid"] == uid]
    failed = [e for e in mine if e["reason"] == "ReconcileError"]
    assert len(failed) == 1 and failed[0]["count"] == 3, failed
    assert failed[0]["lastTimestamp"] >= failed[0]["firstTimestamp"]
    recovered = [e for e in mine if e["reason"] == "Reconciled"]
    assert len(recovered) == 1 and recovered[0]["count"] == 3, recovered


def test_many_messages_of_one_reason_become_one_combined_event(apiserver: Any) -> None:
    """As client-go's EventAggregator: beyond ten distinct messages of one object and reason within ten
    minutes, the rest are one Event whose message is the latest, prefixed, and whose count grows."""
    srv = apiserver.server
    create(apiserver, helpers.minimal(), "many")
    uid = h.body(apiserver, "many")["metadata"]["uid"]

    def event(i: int) -> dict[str, Any]:
        return {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"generateName": "many.", "namespace": "default"},
            "involvedObject": {
                "apiVersion": constants.API_VERSION,
                "kind": constants.KIND,
                "name": "many",
                "namespace": "default",
                "uid": uid,
            },
            "type": "Warning",
            "reason": "ApplyRejected",
            "message": f"Deployment/x: attempt {i}",
            "count": 1,
            "firstTimestamp": "2026-01-01T00:00:00Z",
            "lastTimestamp": "2026-01-01T00:00:00Z",
        }

    async def go(api: Client) -> None:
        for i in range(15):
            await api.event(event(i))

    h.run(apiserver, go)
    mine = [
        e
        for e in srv.objects("events", "default")
        if e["involvedObject"]["uid"] == uid and e["reason"] == "ApplyRejected"
    ]
    assert len(mine) == 11, [e["message"] for e in mine]
    [combined] = [e for e in mine if e["message"].startswith("(combined from similar events): ")]
    assert combined["count"] == 5 and combined["message"].endswith("attempt 14")
