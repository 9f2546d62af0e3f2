"""The Events one reconcile posts about its PDCluster: which ones (pure functions of what the step
before decided, each returning `Note`s) and posting them (`post`, the only I/O here).

An Event marks a change, not a state: a condition's transition, a Secret adopted or completed (its
creation is the normal path and posts none), a child adopted, and the refused children when the
set of failures changes (a Warning per child, naming it in `related`), then a Normal one when they
are gone. A repeat of the same Event is one Event with a count (kubeapi.Client.event).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tilert_operator import constants, status
from tilert_operator.kubeapi import Client, Obj
from tilert_operator.reconcile_failures import RECONCILED, Failure

#: A child kind's apiVersion, for the `related` object of the Event about it.
API_VERSIONS = {
    "Deployment": "apps/v1",
    "StatefulSet": "apps/v1",
    "Service": "v1",
    "ConfigMap": "v1",
    "PodDisruptionBudget": "policy/v1",
    "HorizontalPodAutoscaler": "autoscaling/v2",
    "NetworkPolicy": "networking.k8s.io/v1",
    "MultiNetworkPolicy": constants.MULTI_NETWORK_POLICY_API_VERSION,
}


@dataclass(frozen=True)
class Note:
    """One Event to post about the PDCluster; `tag` is what Outcome.events records of it."""

    ok: bool
    reason: str
    message: str
    tag: str
    related: Obj | None = None


def secret_actions(name: str, actions: Sequence[str]) -> list[Note]:
    """Adopting or completing someone's Secret is worth an Event; creating one is the normal path."""
    return [
        Note(
            ok=True,
            reason="SecretAdopted" if a == "adopted" else "SecretCompleted",
            message=f"Secret {name}: {a}",
            tag=f"{name}: {a}",
        )
        for a in actions
        if a != "created"
    ]


def transitions(new: list[status.Condition], old: list[status.Condition]) -> list[Note]:
    """An Event per condition that changed; Reconciled's name each child instead (`failures`)."""
    return [
        Note(
            ok=not status.is_fault(cond),
            reason=cond["reason"],
            message=f"{cond['type']}={cond['status']}: {cond['message']}",
            tag=f"{cond['type']}={cond['status']}",
        )
        for cond in status.transitions(new, old)
        if cond["type"] != RECONCILED
    ]


def failures(
    cond: status.Condition, before: Mapping[str, Any], failed: Sequence[Failure], ns: str
) -> list[Note]:
    """A Warning per refused child when Reconciled changed (`before` is Reconciled as the status held
    it); a Normal one when the failures are gone."""
    if cond["status"] == "True":
        if before.get("status") != "False":
            return []
        return [
            Note(
                ok=True,
                reason="Reconciled",
                message=f"{RECONCILED}=True: {cond['message']}",
                tag=f"{RECONCILED}=True",
            )
        ]
    if unchanged(before, cond):
        return []
    notes = []
    for f in failed:
        kind, _, name = f.key.partition("/")
        related = (
            {"apiVersion": API_VERSIONS.get(kind, "v1"), "kind": kind, "name": name, "namespace": ns}
            if name
            else None
        )
        notes.append(
            Note(
                ok=False,
                reason=f.reason,
                message=f"{f.key}: {f.message}",
                tag=f"{f.reason} {f.key}",
                related=related,
            )
        )
    return notes


def unchanged(before: Mapping[str, Any], cond: status.Condition) -> bool:
    """Whether a condition says what the status held (`before`): then it is no news, and no Event."""
    return (before.get("status"), before.get("reason"), before.get("message")) == (
        cond["status"],
        cond["reason"],
        cond["message"],
    )


def adopted(keys: Sequence[str]) -> list[Note]:
    return [
        Note(
            ok=True,
            reason="ChildAdopted",
            tag=f"adopted {key}",
            message=f"{key}: adopted (marked {constants.ADOPT_ANNOTATION}=true); it now follows the spec "
            "and is deleted with the PDCluster",
        )
        for key in keys
    ]


async def post(api: Client, body: Obj, notes: Sequence[Note]) -> list[str]:
    """Post each Event, in order; returns their tags."""
    meta = body["metadata"]
    tags = []
    for note in notes:
        event = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"generateName": f"{meta['name']}.", "namespace": meta["namespace"]},
            "involvedObject": {
                "apiVersion": constants.API_VERSION, "kind": constants.KIND, "name": meta["name"],
                "namespace": meta["namespace"], "uid": meta["uid"],
            },
            "type": "Normal" if note.ok else "Warning",
            "reason": note.reason,
            "message": note.message[:1000],
            "source": {"component": constants.FIELD_MANAGER},
            "firstTimestamp": status.now(),
            "lastTimestamp": status.now(),
            "count": 1,
        }  # fmt: skip
        if note.related is not None:
            event["related"] = note.related
        await api.event(event)
        tags.append(note.tag)
    return tags
