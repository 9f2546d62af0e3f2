"""The reconcile's pure decisions, without an API server: what to apply and delete, which Events a
change of Reconciled calls for, what the Secrets step says about Secrets and rotations."""

from __future__ import annotations

from typing import Any

from tilert_operator import credentials, reconcile_children, reconcile_events, reconcile_secrets
from tilert_operator.reconcile_failures import APPLY_REJECTED, CHILD_NOT_OWNED, Failure, reconciled


def _obj(kind: str, name: str, **spec: Any) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": kind, "metadata": {"name": name}, "spec": spec}


def test_differences_apply_what_differs_and_delete_what_is_not_wanted_kind_by_kind() -> None:
    want = {
        "ConfigMap/a": _obj("ConfigMap", "a", x=1),
        "ConfigMap/b": _obj("ConfigMap", "b", x=2),
        "Service/s": _obj("Service", "s", port=80),
        "MultiNetworkPolicy/m": _obj("MultiNetworkPolicy", "m"),
    }
    live = {
        # Listed items carry no kind: the rest is compared, and the server may hold more.
        "ConfigMap": {"ConfigMap/a": {"metadata": {"name": "a", "uid": "1"}, "spec": {"x": 1, "extra": 0}}},
        "Service": {
            "Service/s": {"metadata": {"name": "s"}, "spec": {"port": "81"}},
            "Service/old": {"metadata": {"name": "old"}, "spec": {}},
        },
        # MultiNetworkPolicy is not served: absent from the listing, so neither applied nor deleted.
    }
    todo = reconcile_children.differences(live, want)
    assert todo == [
        reconcile_children.Apply("ConfigMap/b", want["ConfigMap/b"], owned=False),
        reconcile_children.Apply("Service/s", want["Service/s"], owned=True),
        reconcile_children.Delete("Service/old", "Service", "old"),
    ]
    # At rest: nothing to do.
    at_rest = {"ConfigMap": {k: v for k, v in want.items() if v["kind"] == "ConfigMap"}}
    assert reconcile_children.differences(at_rest, {k: want[k] for k in at_rest["ConfigMap"]}) == []


def test_failure_events_are_posted_when_the_failures_change_and_once_when_they_are_gone() -> None:
    failed = [
        Failure("Deployment/d", "HTTP 422: bad", APPLY_REJECTED),
        Failure("Service/s", "someone else's", CHILD_NOT_OWNED),
    ]
    cond = reconciled(failed)
    notes = reconcile_events.failures(cond, {}, failed, "ns")
    assert [(n.ok, n.reason, n.tag) for n in notes] == [
        (False, APPLY_REJECTED, "ApplyRejected Deployment/d"),
        (False, CHILD_NOT_OWNED, "ChildNotOwned Service/s"),
    ]
    assert notes[0].related == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "d", "namespace": "ns"}
    # The same failures again: the status already says so, no Event.
    assert reconcile_events.failures(cond, cond, failed, "ns") == []
    # Gone: one Normal Event, and none on the next reconcile.
    ok = reconciled([])
    assert [(n.ok, n.tag) for n in reconcile_events.failures(ok, cond, [], "ns")] == [
        (True, "Reconciled=True")
    ]
    assert reconcile_events.failures(ok, ok, [], "ns") == []


def test_secrets_step_reports_actions_events_and_whose_secrets_they_are() -> None:
    handoff = credentials.SecretState("c-handoff", secret={}, actions=["created"])
    node_api = credentials.SecretState("c-node-api", problem="someone else's", actions=[])
    secrets = reconcile_secrets.Secrets(
        handoff=handoff,
        node_api=node_api,
        actions=["c-handoff: created"],
        notes=reconcile_events.secret_actions("c-handoff", ["created", "adopted", "added accept"]),
    )
    assert secrets.not_owned == ["someone else's"]
    assert secrets.names == ["c-handoff", "c-node-api"]
    # Creating is the normal path; adopting and completing are worth an Event.
    assert [(n.reason, n.tag) for n in secrets.notes] == [
        ("SecretAdopted", "c-handoff: adopted"),
        ("SecretCompleted", "c-handoff: added accept"),
    ]
