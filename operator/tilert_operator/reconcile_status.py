"""The reconcile's last step: the PDCluster's status. `decide` (pure) turns what the steps before
found into the status to hold; `write` patches it when it differs and says which Events its
transitions call for; `not_applied` and `error` are the status of a reconcile that applied nothing
(a spec or Secrets it cannot use) and of one that failed.

Ready and the pool conditions follow the generation that serves (the old one while the spec's comes
up); Progressing and status.generations say where a rollout stands. A child that is someone else's
makes Ready False (ChildNotOwned) whatever the pods say; so does a child the API server refused
(NotApplied), and the generation is then not observed: status.observedGeneration stays the last one
applied.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tilert_operator import constants, credentials, reconcile_events, rollout, status
from tilert_operator.kubeapi import ApiError, Client, Obj
from tilert_operator.reconcile_events import Note
from tilert_operator.reconcile_failures import (
    CHILD_NOT_OWNED,
    NOT_APPLIED,
    RECONCILE_ERROR,
    RECONCILED,
    Failure,
    children_owned,
    failure,
    reconciled,
)
from tilert_operator.reconcile_secrets import Rotations
from tilert_operator.spec import PDClusterSpec


@dataclass(frozen=True)
class Found:
    """What the steps before the status found, all the status is decided from."""

    spec: PDClusterSpec
    plan: rollout.Plan
    #: Each rendered generation (by slot) as observed after this reconcile's applies.
    views: dict[str, rollout.View]
    #: Per child kind: 200, or the 403/404 an optional kind answered when listed.
    served: Mapping[str, int]
    #: Whether the rendered children include a MultiNetworkPolicy.
    wants_mnp: bool
    secret_names: list[str]
    rotations: Rotations
    failed: list[Failure]


@dataclass(frozen=True)
class Decided:
    """The status to hold, the state it puts the PDCluster in, and Reconciled (for its Events)."""

    new: dict[str, Any]
    state: str  # ready | not_ready
    reconciled: status.Condition


def previous(body: Obj, type_: str) -> Obj:
    """A condition as the status held it before this reconcile; empty when it had none."""
    return next((c for c in (body.get("status") or {}).get("conditions") or [] if c.get("type") == type_), {})


def decide(body: Obj, found: Found) -> Decided:
    meta = body["metadata"]
    cluster, generation = meta["name"], meta.get("generation")
    spec, plan, views, rotations = found.spec, found.plan, found.views, found.rotations
    current = views[plan.lives[-1].slot]
    serving = views[plan.lives[0].slot]  # the old generation while the new one is not ready
    rdma = spec.transfer.rdma
    security = [
        status.rotation(cluster, credentials.HANDOFF, rotations.handoff.status(rotations.grace_s)),
        status.rotation(cluster, credentials.NODE_API, rotations.node_api.status(rotations.grace_s)),
        status.data_plane(
            rdma.networks,
            rdma.host_network,
            spec.network_policies.enabled,
            found.served["MultiNetworkPolicy"] if found.wants_mnp else None,
        ),
    ]
    applied = reconciled(found.failed)
    owned_cond = children_owned(found.failed)
    # HandoffReady: each wired TileRT node's own record of the handoffs that reached it (polled once
    # per reconcile, in reconcile_children.plan), for the generation that serves.
    reports = plan.reports_of(serving.nodes)
    progressing = plan.progressing()
    conds = status.conditions(
        cluster,
        serving.pools,
        serving.nodes,
        serving.unwired,
        [status.secrets_owned(found.secret_names), owned_cond, *security, applied],
        handoff=status.handoff_ready(serving.live.spec.decode.tilert.replicas, serving.nodes, reports),
        handoff_working=status.any_handoff_working(reports),
        progressing=progressing,
    )
    ready: status.Condition | None = None
    if owned_cond["status"] == "False":
        # What serves under a child's name is not what this PDCluster describes: not Ready, whatever the pods say.
        ready = {
            "type": "Ready",
            "status": "False",
            "reason": CHILD_NOT_OWNED,
            "message": "an object with a child's name is not this PDCluster's (see ChildrenOwned)",
        }
    elif found.failed:
        # This generation is not what runs: whatever the pods say, it is not Ready.
        before = (body.get("status") or {}).get("observedGeneration")
        running = (
            f"generation {before} is what runs"
            if before is not None
            else "no generation of it was applied yet"
        )
        ready = {
            "type": "Ready",
            "status": "False",
            "reason": NOT_APPLIED,
            "message": (
                f"generation {generation} of the spec is not applied ({running}): see Reconciled for what the API server "
                "refused and what to do"
            ),
        }
    elif serving is not current:
        # Ready says whether the stack serves: it does, from the old generation, while the new one comes up.
        ready = next(c for c in conds if c["type"] == "Ready")
        ready = ready | {
            "message": f"{ready['message']} (generation {serving.live.generation.fingerprint}; "
            f"generation {current.live.generation.fingerprint} is coming up: see Progressing)"
        }
    if ready is not None:
        conds = [ready if c["type"] == "Ready" else c for c in conds]
    is_ready = next(c for c in conds if c["type"] == "Ready")["status"] == "True"
    new = status.build(
        generation=generation,
        conditions_=conds,
        old=body.get("status") or {},
        pools=current.pools,
        endpoints=[n for v in views.values() for n in v.nodes],
        rotations=rotations.status(),
        applied=not found.failed,
        generations=plan.generations(views, progressing),
    )
    return Decided(new, "ready" if is_ready else "not_ready", applied)


def not_applied(body: Obj, conditions: list[status.Condition]) -> dict[str, Any]:
    """The status of a reconcile that applies nothing (a spec or Secrets it cannot use): the conditions
    say why, and it keeps the last applied generation."""
    return status.build(
        generation=body["metadata"].get("generation"),
        conditions_=conditions,
        old=body.get("status") or {},
        applied=False,
    )


@dataclass(frozen=True)
class Written:
    """What `write` did: whether it patched, the PDCluster as the patch returned it, the Events due."""

    patched: bool
    obj: Obj | None
    notes: list[Note]
    #: (type, status) of every condition the PDCluster holds after it (the operator's condition gauge).
    conditions: tuple[tuple[str, str], ...] = ()


def held(conditions: list[Obj]) -> tuple[tuple[str, str], ...]:
    return tuple((str(c.get("type")), str(c.get("status"))) for c in conditions)


async def write(api: Client, body: Obj, new: dict[str, Any]) -> Written:
    """Patch the status when it differs from what the PDCluster holds; its transitions' Events."""
    old = body.get("status") or {}
    if status.same(new, old):
        return Written(False, None, [], held(new["conditions"]))
    meta = body["metadata"]
    # A merge patch keeps what it does not name: a key the status no longer has (a finished
    # rotation's nextPhaseAt) is removed explicitly, or every resync would find it and write again.
    written = await api.patch_status(
        constants.KIND, meta["namespace"], meta["name"], status.merge_patch(old, new)
    )
    return Written(
        True,
        written,
        reconcile_events.transitions(new["conditions"], old.get("conditions") or []),
        held(new["conditions"]),
    )


async def error(api: Client, body: Obj, cause: Exception) -> Written:
    """Reconciled=False (ReconcileError, or Forbidden for a 403) for a reconcile that failed, unless
    the status already says so; the other conditions are left as they are."""
    if isinstance(cause, ApiError):
        failed = failure("reconcile", cause, otherwise=RECONCILE_ERROR)
    else:
        failed = Failure("reconcile", f"{type(cause).__name__}: {cause}", RECONCILE_ERROR)
    cond = reconciled([failed._replace(message=failed.message[:800])])
    old = body.get("status") or {}
    if reconcile_events.unchanged(previous(body, RECONCILED), cond):
        return Written(False, None, [], held(old.get("conditions") or []))
    conds = [c for c in old.get("conditions") or [] if c.get("type") != RECONCILED]
    conds = status.with_transition_times(
        [*conds, cond], old.get("conditions") or [], body["metadata"].get("generation")
    )
    meta = body["metadata"]
    written = await api.patch_status(constants.KIND, meta["namespace"], meta["name"], {"conditions": conds})
    note = Note(
        ok=False, reason=cond["reason"], message=f"reconcile failed: {failed.message}", tag=cond["reason"]
    )
    return Written(True, written, [note], held(conds))
