"""One idempotent reconcile of one PDCluster: validate, observe, render, apply what differs, report.

Reads: the handoff and node API Secrets, the cluster's pods, and its children of each kind (by
label). Writes only what differs from the rendered intent (a resync with nothing to change writes
nothing): the Secrets when created, adopted or rotated (credentials.py), server-side apply of changed
or missing children, deletion of children the spec no longer wants, the status when it changed, and
an Event per condition transition. A Secret with the expected name that is not this PDCluster's
stops the reconcile before anything is applied (SecretsOwned=False). A child is never taken over
either: before its first apply, an object of its name without this PDCluster's ownerReference is
read, and left untouched unless marked for adoption like a Secret (credentials.adoptable); otherwise
ChildrenOwned=False, Reconciled=False and Ready=False (ChildNotOwned) name it and say what to do, and
the garbage collector never deletes it with the PDCluster. MultiNetworkPolicies are
applied only when the API server serves them; otherwise DataPlaneProtected says so and the rest of
the stack is reconciled as usual.

Failures are visible, not only logged: a child the API server refuses (or that cannot be written
after the client's retries) is reported in the same reconcile as `Reconciled=False` (reason
ApplyRejected, the child and the API server's message) with a Warning Event naming the child; the
other children are still applied, and the reconcile is retried after FAILED_RETRY_S. Any other
failure of a reconcile (a list, a Secret) writes `Reconciled=False` (ReconcileError) before the
controller backs off. A refusal by the operator's own role (403) is neither: reason Forbidden, and
the message names the verb and the resource the role lacks and sends the reader to the chart's RBAC,
not to the spec. The next reconcile that applies everything sets `Reconciled=True` again.
Until then the generation is not observed: status.observedGeneration stays the last one applied, and
Ready is False (NotApplied). An applied generation is Ready only once its workloads report it rolled
out (observe.rollout reads their own status; the old pods do not count as the new generation's).
Which compatibility generations are rendered is decided before anything is applied
(reconcile_children.plan, rollout.py), from the workloads and pods as listed: the spec's generation, and while it is not ready
the one that served before it, each in its slot (render/generations.py); the old one's children go in
the reconcile that finds the new one ready. Ready and the pool conditions follow the generation that
serves; Progressing and status.generations say where a rollout stands (docs/operator.md).
Children are compared with what the server holds by meaning: quantities (`0.5` and `500m`) by value,
keyed lists by the keys server-side apply merges them by (someone else's env var or port is no
difference), an empty map as absent. An Event that repeats is one Event with a count (kubeapi.Client.event).

The steps, each a module with a narrow typed interface, run in this order and hand their result on:
reconcile_secrets (`Secrets`, then `Rotations`) -> reconcile_children (`Observed`, the `rollout.Plan`,
what to apply and delete, `Applied`) -> reconcile_status (`Found` in, `Decided` out, then `Written`)
-> reconcile_events (`Note`s, posted in the order the steps decided them). This module is the only
one that sequences them, and the only one that fills the `Outcome`. The vocabulary of failures is
reconcile_failures; comparing a child with what the API server holds is reconcile_compare.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from tilert_operator import (
    credentials,
    reconcile_children,
    reconcile_events,
    reconcile_secrets,
    reconcile_status,
    rollout,
    status,
    validation,
)
from tilert_operator.autoscale import act
from tilert_operator.kubeapi import Client, Obj
from tilert_operator.reconcile_events import Note
from tilert_operator.reconcile_failures import FAILED_RETRY_S, RECONCILED, Failure
from tilert_operator.reconcile_status import Found

log = logging.getLogger(__name__)


@dataclass
class Outcome:
    """What one reconcile did, for logs, metrics and tests."""

    state: str = "unknown"  # ready | not_ready | invalid
    applied: list[str] = field(default_factory=list)
    deleted: list[str] = field(default_factory=list)
    status_written: bool = False
    #: The PDCluster as the status write returned it (so the next resync compares against it).
    written: Obj | None = None
    events: list[str] = field(default_factory=list)
    #: When the next reconcile is due sooner than the resync (a rotation phase ends), epoch seconds.
    requeue_at: float | None = None
    #: What was done to the Secrets (created, adopted, completed, rotation phases).
    secrets: list[str] = field(default_factory=list)
    #: Children the API server refused, that could not be written, or that are someone else's.
    failed: list[Failure] = field(default_factory=list)
    #: Children taken over because they were marked for adoption (Kind/name).
    adopted: list[str] = field(default_factory=list)
    #: (type, status) of the conditions the PDCluster holds after this reconcile; empty when no
    #: status was decided (it is being deleted).
    conditions: tuple[tuple[str, str], ...] = ()

    @property
    def writes(self) -> int:
        return (
            len(self.applied)
            + len(self.deleted)
            + int(self.status_written)
            + len(self.events)
            + len(self.secrets)
        )


async def reconcile(
    api: Client, body: Obj, *, rotation_grace_s: float = credentials.DEFAULT_GRACE_S, now: float | None = None
) -> Outcome:
    out = Outcome()
    try:
        return await _reconcile(api, body, out, rotation_grace_s=rotation_grace_s, now=now)
    except Exception as e:
        # Visible before the controller backs off: the condition and an Event say what failed.
        try:
            if body["metadata"].get("uid") and not body["metadata"].get("deletionTimestamp"):
                await _write_status(api, body, out, await reconcile_status.error(api, body, e))
        except Exception as report:  # the API server may be what failed: the log has both
            log.warning(
                "[%s/%s] could not report the failure (%s)",
                body["metadata"].get("namespace"),
                body["metadata"].get("name"),
                report,
            )
        raise


async def _reconcile(
    api: Client, body: Obj, out: Outcome, *, rotation_grace_s: float, now: float | None
) -> Outcome:
    meta = body["metadata"]
    if meta.get("deletionTimestamp"):
        return out  # ownerReferences let the garbage collector remove the children
    spec, problems = validation.validate(body.get("spec") or {}, meta["name"])
    if spec is None or problems:
        return await _not_applied(api, body, out, "invalid", status.invalid(problems))
    now = time.time() if now is None else now
    # Autoscaled pools render the planner's decision held in status (autoscale/act.py), so a resync
    # renders the number already decided.
    spec = act.effective(spec, act.parse_status((body.get("status") or {}).get("autoscaling")))

    secrets = await reconcile_secrets.ensure(api, body)
    out.secrets += secrets.actions
    await _post(api, body, out, secrets.notes)
    if secrets.not_owned:
        return await _not_applied(api, body, out, "not_ready", status.secrets_not_owned(secrets.not_owned))
    rotations = await reconcile_secrets.rotate(api, body, secrets, now=now, grace_s=rotation_grace_s)
    out.secrets += rotations.actions
    out.requeue_at = rotations.due

    observed = await reconcile_children.observe(api, body)
    # Pools an HPA scales: the status's desired is what the HPA set on the workload.
    spec = act.with_replicas(spec, reconcile_children.hpa_replicas(spec, meta["name"], observed))
    plan = await reconcile_children.plan(spec, body, observed, secrets.node_api.secret, now)
    desired = reconcile_children.desired(spec, body, plan.lives)
    done = await reconcile_children.apply(
        api, body, observed, reconcile_children.differences(observed.owned, desired)
    )
    out.applied, out.deleted, out.adopted, out.failed = done.applied, done.deleted, done.adopted, done.failed
    if out.failed:
        retry = now + FAILED_RETRY_S
        out.requeue_at = retry if out.requeue_at is None else min(out.requeue_at, retry)

    # Ready counts and rollouts from the workloads' own status (what the apply answered, when applied).
    views = {g.slot: rollout.observe_view(g, meta["name"], observed.pods, done.live) for g in plan.lives}
    found = Found(
        spec=spec,
        plan=plan,
        views=views,
        served=observed.served,
        wants_mnp=any(o["kind"] == "MultiNetworkPolicy" for o in desired.values()),
        secret_names=secrets.names,
        rotations=rotations,
        failed=out.failed,
    )
    decided = reconcile_status.decide(body, found)
    out.state = decided.state
    await _write_status(api, body, out, await reconcile_status.write(api, body, decided.new))
    before = reconcile_status.previous(body, RECONCILED)
    await _post(
        api, body, out, reconcile_events.failures(decided.reconciled, before, out.failed, meta["namespace"])
    )
    await _post(api, body, out, reconcile_events.adopted(out.adopted))
    if out.applied or out.deleted:
        log.info("[%s/%s] applied %s, deleted %s", meta["namespace"], meta["name"], out.applied, out.deleted)
    return out


async def _not_applied(
    api: Client, body: Obj, out: Outcome, state: str, conditions: list[status.Condition]
) -> Outcome:
    """End a reconcile that applies nothing (a spec or Secrets it cannot use)."""
    out.state = state
    await _write_status(
        api,
        body,
        out,
        await reconcile_status.write(api, body, reconcile_status.not_applied(body, conditions)),
    )
    return out


async def _write_status(api: Client, body: Obj, out: Outcome, written: reconcile_status.Written) -> None:
    out.conditions = written.conditions
    if written.patched:
        out.written = written.obj
        out.status_written = True
    await _post(api, body, out, written.notes)


async def _post(api: Client, body: Obj, out: Outcome, notes: list[Note]) -> None:
    out.events += await reconcile_events.post(api, body, notes)
