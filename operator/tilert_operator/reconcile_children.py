"""The reconcile's second step: the children. List what the cluster has, decide which compatibility
generations to render, render them, apply what differs and delete what the spec no longer wants.

In order, each a function:

- `observe` lists the cluster's pods and its children of every kind (by label) before anything is
  rendered, because which generations run is read from the workloads. An optional kind the API
  server does not serve (404) or does not let the operator list (403) is left out, not a failure.
- `plan` decides which generations to render (rollout.py): the spec's, and while it is not ready the
  one that served before it, each in its slot (render/generations.py). The TileRT nodes of both are
  polled once here (HandoffReady, and the new generation's readiness).
- `differences` (pure) compares the rendered intent with what the API server holds (by meaning:
  reconcile_compare.contains) and lists what to apply and what to delete, kind by kind.
- `apply` does that. Before a child's first apply the name is read: an object without this
  PDCluster's ownerReference is left untouched unless marked for adoption (credentials.adoptable);
  otherwise it is a ChildNotOwned failure. A child the API server refuses is a failure too; the other
  children are still applied.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace

from tilert_operator import constants, credentials, reconcile_status, render, rollout, status
from tilert_operator import handoff as handoff_check
from tilert_operator.autoscale import act
from tilert_operator.credentials import owner_reference
from tilert_operator.kubeapi import ApiError, Client, Obj
from tilert_operator.reconcile_compare import contains, stamp
from tilert_operator.reconcile_failures import CHILD_NOT_OWNED, Failure, failure
from tilert_operator.render.generations import Live
from tilert_operator.render.generations import generation as generation_of
from tilert_operator.spec import PDClusterSpec

log = logging.getLogger(__name__)

#: Kinds the operator applies as children (the Secrets are created apart, once).
CHILD_KINDS = (
    "Deployment",
    "StatefulSet",
    "Service",
    "ConfigMap",
    "NetworkPolicy",
    "MultiNetworkPolicy",
    "PodDisruptionBudget",
    "HorizontalPodAutoscaler",
)
#: Kinds served by an optional CRD: a 404 on listing them means "not installed", not a failure.
OPTIONAL_KINDS = frozenset({"MultiNetworkPolicy"})


@dataclass(frozen=True)
class Observed:
    """The cluster as listed before anything is applied."""

    pods: list[Obj]
    #: Per kind: 200, or the 403/404 an optional kind answered.
    served: dict[str, int]
    #: Per kind served: the children this PDCluster owns (Kind/name -> object).
    owned: dict[str, dict[str, Obj]]

    def workloads(self) -> dict[str, Obj]:
        """Every owned child by Kind/name."""
        return {k: o for objs in self.owned.values() for k, o in objs.items()}


@dataclass(frozen=True)
class Apply:
    key: str
    want: Obj
    #: Whether this PDCluster already owns an object of this name (else its name is checked first).
    owned: bool


@dataclass(frozen=True)
class Delete:
    key: str
    kind: str
    name: str


@dataclass
class Applied:
    """What `apply` did; `live` is the children as the API server holds them after it (Kind/name)."""

    live: dict[str, Obj]
    applied: list[str] = field(default_factory=list)
    deleted: list[str] = field(default_factory=list)
    #: Children taken over because they were marked for adoption (Kind/name).
    adopted: list[str] = field(default_factory=list)
    failed: list[Failure] = field(default_factory=list)


def key_of(obj: Obj) -> str:
    return f"{obj['kind']}/{obj['metadata']['name']}"


def owned_by(obj: Obj, uid: str) -> bool:
    return any(ref.get("uid") == uid for ref in obj.get("metadata", {}).get("ownerReferences") or [])


def _earlier_owner(obj: Obj, body: Obj) -> bool:
    """Whether a PDCluster of this name but another uid (deleted, then created again) controls `obj`."""
    meta = body["metadata"]
    return any(
        r.get("kind") == constants.KIND
        and r.get("apiVersion", "").startswith(f"{constants.GROUP}/")
        and r.get("name") == meta["name"]
        and r.get("uid") != meta["uid"]
        and r.get("controller")
        for r in obj.get("metadata", {}).get("ownerReferences") or []
    )


async def observe(api: Client, body: Obj) -> Observed:
    meta = body["metadata"]
    ns, selector = meta["namespace"], f"{constants.LABEL_CLUSTER}={meta['name']}"
    pods = await api.list("Pod", ns, selector)
    served: dict[str, int] = {}
    owned: dict[str, dict[str, Obj]] = {}
    for kind in CHILD_KINDS:
        listed = await _list_children(api, kind, ns, selector)
        served[kind] = listed if isinstance(listed, int) else 200
        if not isinstance(listed, int):  # else not served or not allowed: nothing to compare, apply or delete
            owned[kind] = {key_of(o | {"kind": kind}): o for o in listed if owned_by(o, meta["uid"])}
    return Observed(pods, served, owned)


async def _list_children(api: Client, kind: str, ns: str, selector: str) -> list[Obj] | int:
    """The children of one kind; for an optional kind the API server does not serve (404) or does not
    let the operator list (403, a ClusterRole older than the operator), that status instead."""
    try:
        return await api.list(kind, ns, selector)
    except ApiError as e:
        if e.status in (403, 404) and kind in OPTIONAL_KINDS:
            return e.status
        raise


async def plan(
    spec: PDClusterSpec, body: Obj, observed: Observed, node_api_secret: Obj | None, now: float
) -> rollout.Plan:
    """Which generations to render (rollout.py), from the workloads and pods as listed: the spec's, and
    the one that served before it until the spec's is ready. The TileRT nodes of both are polled once
    here (HandoffReady, and the new generation's readiness)."""
    cluster, pods, live = body["metadata"]["name"], observed.pods, observed.workloads()
    occupied = rollout.slots(cluster, live)
    choice = rollout.choose(spec, generation_of(spec).fingerprint, occupied)
    current = rollout.observe_view(Live(spec, choice.current), cluster, pods, live)
    old = (
        rollout.observe_view(Live(choice.old[1], choice.old[0]), cluster, pods, live) if choice.old else None
    )
    polled = [*current.nodes, *(old.nodes if old else [])]
    reports = (
        {r.pod: r for r in await handoff_check.poll(polled, node_api_secret)}
        if handoff_check.enabled()
        else None
    )
    handoff = (
        None
        if reports is None
        else [(n.name, status.node_handoff(reports[n.name])[0]) for n in current.nodes if n.name in reports]
    )
    readiness = rollout.readiness(current.pools, handoff)
    keep_old = old is not None and not readiness.ready
    kept = {choice.current} | ({old.live.slot} if keep_old and old else set())
    leftover = rollout.leftover_pods(pods, kept)
    shared = keep_old or bool(leftover)
    lives = [
        replace(g, tilert_nodes=tuple((current if g.slot == choice.current else old or current).nodes))
        for g in rollout.lives(choice, spec, readiness.ready, shared)
    ]
    return rollout.Plan(
        spec=spec,
        choice=choice,
        lives=lives,
        current=current,
        readiness=readiness,
        old=old,
        leftover=leftover,
        reports=reports,
        previous=reconcile_status.previous(body, "Progressing"),
        now=now,
    )


def desired(spec: PDClusterSpec, body: Obj, lives: list[Live]) -> dict[str, Obj]:
    """The rendered children (Kind/name -> object), owned by the PDCluster and stamped with their hash.
    The workloads of pools an HPA scales are applied without `spec.replicas`, so server-side apply
    leaves that field to the HPA (the operator never sets it back on a resync)."""
    meta = body["metadata"]
    hpa = {_COMPONENT_OF[p] for p in act.hpa_pools(spec)}
    return {
        key_of(o): stamp(o | {"metadata": o["metadata"] | {"ownerReferences": [owner_reference(body)]}})
        for o in (
            _without_replicas(r) if _component(r) in hpa else r
            for r in render.children(spec, meta["name"], meta["namespace"], lives=lives)
        )
    }


_COMPONENT_OF = {"prefill": constants.PREFILL, "tilert": constants.TILERT, "native": constants.NATIVE}


def hpa_replicas(spec: PDClusterSpec, cluster: str, observed: Observed) -> dict[str, int]:
    """The replicas each HPA-scaled pool's workload has now (what its HPA decided), for the status's
    desired counts; a pool whose workload is not there yet is left out (its minimum stands)."""
    kinds = {"prefill": "Deployment", "tilert": "StatefulSet", "native": "Deployment"}
    out: dict[str, int] = {}
    for p in act.hpa_pools(spec):
        found = [
            o["spec"].get("replicas")
            for slot in (constants.SLOT_A, constants.SLOT_B)
            if (
                o := observed.owned.get(kinds[p], {}).get(
                    f"{kinds[p]}/{constants.slot_child_name(cluster, _COMPONENT_OF[p], slot)}"
                )
            )
            is not None
        ]
        counts = [n for n in found if isinstance(n, int)]
        if counts:
            out[p] = max(counts)
    return out


def _component(obj: Obj) -> str | None:
    if obj["kind"] not in ("Deployment", "StatefulSet"):
        return None
    component: str | None = (obj["metadata"].get("labels") or {}).get(constants.LABEL_COMPONENT)
    return component


def _without_replicas(obj: Obj) -> Obj:
    return obj | {"spec": {k: v for k, v in obj["spec"].items() if k != "replicas"}}


def differences(owned: dict[str, dict[str, Obj]], want: dict[str, Obj]) -> list[Apply | Delete]:
    """What to apply (missing or different) and what to delete (not wanted), kind by kind; a kind not
    in `owned` (not served) is neither applied nor deleted."""
    todo: list[Apply | Delete] = []
    for kind, actual in owned.items():
        for key, obj in want.items():
            # List items carry no apiVersion/kind on a real API server: compare the rest.
            body_only = {k: v for k, v in obj.items() if k not in ("apiVersion", "kind")}
            if obj["kind"] == kind and not contains(actual.get(key), body_only):
                todo.append(Apply(key, obj, owned=key in actual))
        todo += [
            Delete(key, kind, have["metadata"]["name"]) for key, have in actual.items() if key not in want
        ]
    return todo


async def apply(api: Client, body: Obj, observed: Observed, todo: list[Apply | Delete]) -> Applied:
    """Apply and delete what `differences` listed; a failure is recorded and the rest carries on."""
    meta = body["metadata"]
    done = Applied(live=observed.workloads())
    for step in todo:
        if isinstance(step, Apply):
            written = await _apply_child(api, body, step, done)
            if written is not None:
                done.live[step.key] = written
            continue
        try:
            await api.delete(step.kind, meta["namespace"], step.name)
        except ApiError as e:
            log.warning("[%s/%s] deleting %s failed: %s", meta["namespace"], meta["name"], step.key, e)
            done.failed.append(
                failure(step.key, e, verb="delete", kind=step.kind, prefix="could not delete it: ")
            )
            continue
        done.deleted.append(step.key)
        done.live.pop(step.key, None)
    return done


async def _apply_child(api: Client, body: Obj, step: Apply, done: Applied) -> Obj | None:
    """Apply one child; before its first apply, make sure the name is free, ours or marked for adoption.
    Returns the child as the API server answered the apply; None when it was not applied."""
    meta = body["metadata"]
    key, want = step.key, step.want
    kind, ns, name = want["kind"], meta["namespace"], want["metadata"]["name"]
    creating = adopting = False
    if not step.owned:
        # The list holds only labelled objects: someone else's with this name may carry no labels.
        try:
            found = await api.get(kind, ns, name)
        except ApiError as e:
            done.failed.append(failure(key, e, verb="get", kind=kind, prefix="could not read it: "))
            return None
        creating = found is None
        if found is not None and not owned_by(found, meta["uid"]):
            if _earlier_owner(found, body):
                done.failed.append(
                    Failure(
                        key,
                        (
                            f"{kind} {ns}/{name} still belongs to an earlier PDCluster {ns}/{meta['name']}, which was deleted; the "
                            "garbage collector deletes it shortly and the operator then creates its own (if it stays, check "
                            "the garbage collector)"
                        ),
                        CHILD_NOT_OWNED,
                    )
                )
                return None
            if not credentials.adoptable(found, body):
                done.failed.append(
                    Failure(
                        key,
                        credentials.not_owned_message(
                            found,
                            body,
                            kind,
                            "applies nothing under its name; the PDCluster is not Ready until it is resolved",
                            " (the operator then rewrites it to the spec and the garbage collector deletes it with the PDCluster)",
                        ),
                        CHILD_NOT_OWNED,
                    )
                )
                return None
            adopting = True
    try:
        written = await api.apply(want)
    except ApiError as e:
        # Refused or not writable: report it and carry on with the other children.
        log.warning("[%s/%s] applying %s failed: %s", ns, meta["name"], key, e)
        done.failed.append(failure(key, e, verb="create" if creating else "patch", kind=kind))
        return None
    done.applied.append(key)
    if adopting:
        done.adopted.append(key)
    return written
