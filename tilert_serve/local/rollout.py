"""What `tilert-pd local apply` does to converge running pods to a new render: the pure half.

Workloads (what the render asks for) and pods (what runs) go in; the steps Kubernetes' controllers
would take come out, in order, as if every pod created became ready when waited for. The executor
(`apply.py`) runs them one at a time and stops at the first pod that never becomes ready, leaving the
rest as a stalled rollout leaves them; a second `apply` plans again from what then runs.

A pod's *revision* is a hash of its workload's pod template (`revision`), as the Deployment's
pod-template-hash and the StatefulSet's controller-revision-hash are: a change of command, args,
env, image or mounts rolls the pods; a change of replicas or of the rollout strategy does not.

The rules emulated:

- **Deployment** (`_deployment`): the rolling update of Kubernetes' deployment controller
  (`rolling.go`): scale the new revision up while all pods stay within `replicas + maxSurge`, scale
  the old ones down while the ready pods stay at least `replicas - maxUnavailable`, counting a new pod
  only once it is ready. `maxSurge`/`maxUnavailable` are an integer or a percentage of the replicas
  (default 25 %), the surge rounded up and the unavailable rounded down, and 0/0 becomes 0/1 as the
  controller's `ResolveFenceposts` does. With the template unchanged, a replica change scales at once.
- **Which pod a scale-down takes** (`deletion_order`): the ReplicaSet controller's ranking without
  the parts one host has no use for (unscheduled, node co-location, restart counts, logarithmic age
  buckets): pods that are not running first, then those not ready, then the newest.
- **StatefulSet** (`_statefulset`): ordinals above the new count go first, highest first; missing
  ordinals are created (the operator renders `podManagementPolicy: Parallel`, so together) and waited
  for; then the rolling update goes from the highest ordinal down to `partition`, deleting a pod and
  creating it again under the same name, `maxUnavailable` (default 1) at a time, each batch waiting for
  ready before the next.
- A workload that disappears from the render (an old generation's) has its pods removed, highest
  ordinal first, after every workload still rendered has converged; a new one is created like a scale
  up from nothing, its pods started before any other step (every new workload's together, as their
  controllers act at once) and waited for in render order.

Not emulated: a pod created below a StatefulSet's partition gets the new revision here (Kubernetes
gives it the current one; the local runtimes render only the new spec); several removals in one
batch happen one after another (never more unavailable at once than Kubernetes allows, only fewer);
`minReadySeconds`, `progressDeadlineSeconds` (the executor's timeout plays it) and rollbacks.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

from tilert_operator import constants, observe
from tilert_operator import rollout as op_rollout
from tilert_operator.render import generations
from tilert_operator.render.generations import Live
from tilert_operator.spec import PDClusterSpec

#: Kubernetes' default for a Deployment's maxSurge and maxUnavailable.
DEFAULT_SURGE_UNAVAILABLE = "25%"

Kind = Literal["Deployment", "StatefulSet"]


def revision(template: dict[str, Any]) -> str:
    """The hash of a pod template (a workload's `spec.template`): equal templates, equal revisions."""
    canonical = json.dumps(template, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:10]


def scaled(value: int | str | None, replicas: int, *, round_up: bool) -> int:
    """An int-or-percent field of a rollout strategy as a pod count (None: Kubernetes' 25 %)."""
    if value is None:
        value = DEFAULT_SURGE_UNAVAILABLE
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"a rollout count must not be negative; got {value}")
        return value
    text = value.strip()
    if text.isdigit():
        return int(text)
    if not text.endswith("%") or not text[:-1].isdigit():
        raise ValueError(f"{value!r} is neither a count nor a percentage such as '25%'")
    share = int(text[:-1]) * replicas / 100
    return math.ceil(share) if round_up else math.floor(share)


def fenceposts(
    max_surge: int | str | None, max_unavailable: int | str | None, replicas: int
) -> tuple[int, int]:
    """(maxSurge, maxUnavailable) as pod counts, as the deployment controller resolves them."""
    surge = scaled(max_surge, replicas, round_up=True)
    unavailable = scaled(max_unavailable, replicas, round_up=False)
    if surge == 0 and unavailable == 0:
        # Otherwise nothing could move; Kubernetes' ResolveFenceposts does the same.
        unavailable = 1
    return surge, unavailable


@dataclass(frozen=True)
class Workload:
    """A Deployment or StatefulSet of the new render."""

    name: str
    kind: Kind
    replicas: int
    revision: str
    #: Pods are named `<prefix>-<ordinal>`.
    prefix: str
    max_surge: int | str | None = None
    max_unavailable: int | str | None = None
    #: StatefulSets: ordinals below it keep their revision.
    partition: int = 0


@dataclass(frozen=True)
class Pod:
    """A running pod: its workload, the revision it was created at, its ordinal (a StatefulSet's, or
    a Deployment's creation sequence: higher is newer) and whether it runs and is ready now."""

    name: str
    workload: str
    revision: str
    ordinal: int
    running: bool = True
    ready: bool = True


@dataclass(frozen=True)
class Create:
    workload: str
    pod: str
    ordinal: int
    revision: str


@dataclass(frozen=True)
class Wait:
    """Wait until these pods are ready (then they join the endpoints); `progress` is what to print."""

    workload: str
    pods: tuple[str, ...]
    progress: str


@dataclass(frozen=True)
class Remove:
    """Take a pod out of the endpoints, then stop it (preStop, SIGTERM, grace period, SIGKILL)."""

    workload: str
    pod: str
    why: str


Step = Create | Wait | Remove

#: Pod name prefixes of each component's pods in a local run (`up` names them prefill-0, tilert-0, ...).
SHORT_NAMES = {
    constants.PREFILL: "prefill",
    constants.TILERT: "tilert",
    constants.NATIVE: "native",
    constants.ROUTER: "router",
}


@dataclass(frozen=True)
class Rendered:
    """A workload of the render with what the kubelet needs to stop its pods."""

    workload: Workload
    #: prefill | tilert-decode | native-decode | router (the pod template's component label).
    component: str
    #: terminationGracePeriodSeconds (Kubernetes' default 30).
    grace_s: float
    #: The main container's preStop exec command, if rendered.
    pre_stop: tuple[str, ...] | None
    #: The generation slot of a data-plane workload (its pod template's slot label; slot a for one
    #: without); "" for the router, which every generation shares.
    slot: str = ""


def rendered(
    manifests: Sequence[dict[str, Any]], cluster: str, *, local_names: bool = True
) -> list[Rendered]:
    """The Deployments and StatefulSets of `manifests` (the operator's render of PDCluster `cluster`),
    in render order. Pods are named after their workload (`<workload>-<ordinal>`, as the docker runtime
    and a StatefulSet name them) or, with `local_names`, after the process runtime's name of their
    component (`tilert` for `<cluster>-tilert-decode`; a workload rendered under another name, such as
    a new generation's, keeps its own suffix: `tilert-g2` for `<cluster>-tilert-decode-g2`). A
    data-plane workload of slot b (a new compatibility generation beside the old one) names its pods
    `<component>-b-<ordinal>`: `prefill-b-0`, `tilert-b-0`."""
    out: list[Rendered] = []
    for m in manifests:
        kind = m.get("kind")
        if kind not in ("Deployment", "StatefulSet"):
            continue
        name = str(m["metadata"]["name"])
        spec = m["spec"]
        template = spec["template"]
        component = str((template.get("metadata") or {}).get("labels", {}).get(constants.LABEL_COMPONENT, ""))
        if component not in SHORT_NAMES:
            raise ValueError(
                f"{kind} {name} has no {constants.LABEL_COMPONENT} label naming one of {', '.join(SHORT_NAMES)}; "
                "`tilert-pd local apply` runs only what the operator renders"
            )
        base = f"{cluster}-{component}"
        labels = (template.get("metadata") or {}).get("labels", {})
        slot = (
            "" if component == constants.ROUTER else str(labels.get(constants.LABEL_SLOT) or constants.SLOT_A)
        )
        if slot and slot != constants.SLOT_A and name == constants.slot_child_name(cluster, component, slot):
            prefix = f"{SHORT_NAMES[component]}-{slot}"
        else:
            prefix = SHORT_NAMES[component] + (name[len(base) :] if name.startswith(base) else f"-{name}")
        if not local_names:
            prefix = name
        if kind == "Deployment":
            rolling = (spec.get("strategy") or {}).get("rollingUpdate") or {}
            if (spec.get("strategy") or {}).get("type") == "Recreate":
                raise ValueError(
                    f"Deployment {name} asks for the Recreate strategy, which apply does not play"
                )
            partition = 0
        else:
            rolling = (spec.get("updateStrategy") or {}).get("rollingUpdate") or {}
            if (spec.get("updateStrategy") or {}).get("type") == "OnDelete":
                raise ValueError(f"StatefulSet {name} asks for OnDelete updates, which apply does not play")
            partition = int(rolling.get("partition") or 0)
        pod = template["spec"]
        hook = (((pod.get("containers") or [{}])[0].get("lifecycle") or {}).get("preStop") or {}).get("exec")
        workload = Workload(
            name,
            kind,
            int(spec.get("replicas", 1)),
            revision(template),
            prefix,
            rolling.get("maxSurge"),
            rolling.get("maxUnavailable"),
            partition,
        )
        grace = float(pod.get("terminationGracePeriodSeconds", 30))
        out.append(Rendered(workload, component, grace, tuple(hook["command"]) if hook else None, slot))
    return out


def deletion_order(pods: Iterable[Pod]) -> list[Pod]:
    """The pods in the order a ReplicaSet deletes them: not running, not ready, then newest first."""
    return sorted(pods, key=lambda p: (p.running, p.ready, -p.ordinal))


def plan(workloads: Sequence[Workload], pods: Sequence[Pod]) -> list[Step]:
    """Every step from `pods` to `workloads`; [] when they already match."""
    names = [w.name for w in workloads]
    if len(set(names)) != len(names):
        raise ValueError(f"workload names repeat: {names}")
    steps: list[Step] = []
    # Brand-new workloads (a new generation's) are created by their controllers at once, not one after
    # another's rollout: their pods start first, together, and are waited for in render order.
    fresh: list[Step] = []
    for w in workloads:
        mine = [p for p in pods if p.workload == w.name]
        if not mine:
            first = _statefulset(w, []) if w.kind == "StatefulSet" else _deployment(w, [], 0)
            fresh += [s for s in first if isinstance(s, Create)]
            steps += [s for s in first if not isinstance(s, Create)]
            continue
        # A pod whose process is gone is replaced (the kubelet would restart it in place).
        for p in mine:
            if not p.running:
                steps.append(Remove(w.name, p.name, "not running"))
        live = [p for p in mine if p.running]
        if w.kind == "StatefulSet":
            steps += _statefulset(w, live)
        else:
            # New names continue after every pod's, a dead one's too (its record goes with it).
            steps += _deployment(w, live, max((p.ordinal for p in mine), default=-1) + 1)
    for p in sorted((p for p in pods if p.workload not in names), key=lambda p: (p.workload, -p.ordinal)):
        steps.append(Remove(p.workload, p.name, "its workload is no longer rendered"))
    return fresh + steps


def _name(w: Workload, ordinal: int) -> str:
    return f"{w.prefix}-{ordinal}"


def _progress(w: Workload, pods: Sequence[Pod], waiting: Sequence[Pod]) -> str:
    updated = sum(p.revision == w.revision for p in pods)
    names = ", ".join(p.name for p in waiting)
    return f"{w.prefix}: {updated}/{w.replicas} updated, waiting for {names} ready"


def _deployment(w: Workload, pods: list[Pod], next_ordinal: int) -> list[Step]:
    surge, unavailable = fenceposts(w.max_surge, w.max_unavailable, w.replicas)
    steps: list[Step] = []
    current = list(pods)
    while True:
        moved = False
        new = [p for p in current if p.revision == w.revision]
        old = [p for p in current if p.revision != w.revision]
        # reconcileNewReplicaSet: up within replicas + maxSurge, or down to replicas.
        if len(new) < w.replicas:
            up = min(w.replicas + surge - len(current), w.replicas - len(new))
            for _ in range(max(0, up)):
                pod = Pod(_name(w, next_ordinal), w.name, w.revision, next_ordinal, ready=False)
                next_ordinal += 1
                steps.append(Create(w.name, pod.name, pod.ordinal, pod.revision))
                current.append(pod)
                moved = True
        elif len(new) > w.replicas:
            for p in deletion_order(new)[: len(new) - w.replicas]:
                steps.append(Remove(w.name, p.name, "scale down"))
                current.remove(p)
                moved = True
        # reconcileOldReplicaSets: down while the ready pods stay at or above replicas - maxUnavailable.
        new = [p for p in current if p.revision == w.revision]
        old = [p for p in current if p.revision != w.revision]
        min_available = w.replicas - unavailable
        new_unavailable = sum(not p.ready for p in new)
        budget = len(current) - min_available - new_unavailable
        # Old pods that are not ready go first: removing them costs no availability.
        for p in [p for p in deletion_order(old) if not p.ready]:
            if budget <= 0:
                break
            steps.append(Remove(w.name, p.name, "rolling update"))
            current.remove(p)
            old.remove(p)
            budget -= 1
            moved = True
        available = sum(p.ready for p in current)
        budget = min(budget, available - min_available)
        for p in deletion_order(old)[: max(0, budget)]:
            steps.append(Remove(w.name, p.name, "rolling update"))
            current.remove(p)
            moved = True
        if moved:
            continue
        waiting = [p for p in current if not p.ready]
        if not waiting:
            if old or len(new) != w.replicas:
                # Cannot happen with fenceposts' guarantee (surge + unavailable > 0); never loop on it.
                raise AssertionError(f"{w.name}: rollout stuck with {len(new)} new and {len(old)} old pods")
            return steps
        steps.append(Wait(w.name, tuple(p.name for p in waiting), _progress(w, current, waiting)))
        current = [replace(p, ready=True) for p in current]


def _statefulset(w: Workload, pods: list[Pod]) -> list[Step]:
    steps: list[Step] = []
    by_ordinal = {p.ordinal: p for p in pods}
    for o in sorted(by_ordinal, reverse=True):
        if o >= w.replicas:
            steps.append(Remove(w.name, by_ordinal.pop(o).name, "scale down"))
    missing = [o for o in range(w.replicas) if o not in by_ordinal]
    for o in missing:
        by_ordinal[o] = Pod(_name(w, o), w.name, w.revision, o, ready=False)
        steps.append(Create(w.name, by_ordinal[o].name, o, w.revision))
    waiting = [p for p in by_ordinal.values() if not p.ready]
    if waiting:
        steps.append(
            Wait(w.name, tuple(p.name for p in waiting), _progress(w, list(by_ordinal.values()), waiting))
        )
        by_ordinal = {o: replace(p, ready=True) for o, p in by_ordinal.items()}
    batch = max(
        1, scaled(w.max_unavailable if w.max_unavailable is not None else 1, w.replicas, round_up=False)
    )
    targets = [
        o
        for o in sorted(by_ordinal, reverse=True)
        if o >= w.partition and by_ordinal[o].revision != w.revision
    ]
    for i in range(0, len(targets), batch):
        group = targets[i : i + batch]
        for o in group:
            steps.append(Remove(w.name, by_ordinal[o].name, "rolling update"))
        for o in group:
            by_ordinal[o] = Pod(_name(w, o), w.name, w.revision, o, ready=False)
            steps.append(Create(w.name, by_ordinal[o].name, o, w.revision))
        fresh = [by_ordinal[o] for o in group]
        steps.append(
            Wait(w.name, tuple(p.name for p in fresh), _progress(w, list(by_ordinal.values()), fresh))
        )
        by_ordinal = {o: replace(p, ready=True) for o, p in by_ordinal.items()}
    return steps


# Compatibility generations. A spec change that changes the generation (tilert_operator.render.
# generations: the model, the handoff layout, the protocol) is not a rolling update: the operator brings
# the new generation up in the other slot beside the old one, and removes the old one once the new one
# is ready and its TileRT nodes are HandoffReady (tilert_operator.rollout decides; what follows feeds
# its decisions from a local run's state).

#: The state meta's record of the live generations: slot -> RecordedGeneration's fields.
GENERATIONS_KEY = "generations"


@dataclass(frozen=True)
class RecordedGeneration:
    """A live generation as a local run's state records it (the operator reads the same facts from
    its workloads' labels and the prefill Deployment's recorded spec)."""

    slot: str
    fingerprint: str | None
    #: What its endpoints advertise in the router's list (Generation.compat).
    compat: str | None
    #: generations.spec_json of the spec it was rendered from; None when unknown.
    spec: str | None
    #: When it was first rendered (RFC 3339; the operator's creationTimestamp).
    created: str

    @classmethod
    def of(cls, live: Live, created: str) -> RecordedGeneration:
        g = live.generation
        return cls(live.slot, g.fingerprint, g.compat, generations.spec_json(live.spec), created)


def recorded(meta: Mapping[str, Any]) -> dict[str, RecordedGeneration]:
    """The generations a state's meta records (none in a state written before generations)."""
    raw = meta.get(GENERATIONS_KEY)
    if not isinstance(raw, dict):
        return {}
    out = {}
    for slot, g in raw.items():
        if not isinstance(g, dict):
            raise ValueError(
                f"the state's {GENERATIONS_KEY}.{slot} is not a mapping; `tilert-pd local down` and `up` again"
            )
        out[slot] = RecordedGeneration(
            slot, g.get("fingerprint"), g.get("compat"), g.get("spec"), str(g.get("created") or "")
        )
    return out


def occupied(
    records: Mapping[str, RecordedGeneration], pod_generations: Mapping[str, str | None]
) -> dict[str, op_rollout.Slot]:
    """The occupied slots as tilert_operator.rollout.choose reads them: every slot a data-plane pod
    runs in (`pod_generations`: slot -> a fingerprint its pods recorded, None for pods from before
    generations) or the meta records. A slot whose spec is unknown is taken as the operator takes
    workloads without a recorded spec: never kept as an old generation."""
    out = {}
    for slot in constants.SLOTS:
        rec = records.get(slot)
        if rec is None and slot not in pod_generations:
            continue
        fingerprint = rec.fingerprint if rec is not None else pod_generations.get(slot)
        spec = generations.spec_from_json(rec.spec) if rec is not None and rec.spec else None
        out[slot] = op_rollout.Slot(
            slot=slot,
            fingerprint=fingerprint,
            spec=spec,
            workloads={},
            created=rec.created if rec is not None else "",
        )
    return out


def generation_phases(
    spec: PDClusterSpec, slots: Mapping[str, op_rollout.Slot]
) -> tuple[op_rollout.Choice, list[list[Live]]]:
    """The operator's choice for `spec` given the occupied slots, and the generations each phase of
    `apply` renders: one phase (the spec's generation alone: a rolling update within its slot, and any
    other slot's pods removed after it converged), or, when an older generation must keep serving until
    the new one is ready, two: old and new side by side, then the new one alone."""
    choice = op_rollout.choose(spec, generations.generation(spec).fingerprint, slots)
    alone = op_rollout.lives(choice, spec, new_ready=True, shared=False)
    if choice.old is None:
        return choice, [alone]
    return choice, [op_rollout.lives(choice, spec, new_ready=False, shared=False), alone]


def pool_states(rendered: Sequence[Rendered], pods: Sequence[Pod], slot: str) -> dict[str, observe.PoolState]:
    """The data-plane pools of `slot` as a workload status reports them (tilert_operator.rollout.
    readiness reads these): ready pods of the current template against the replicas asked for."""
    out = {}
    for r in rendered:
        if r.component not in generations.DATA_PLANE or r.slot != slot:
            continue
        w = r.workload
        mine = [p for p in pods if p.workload == w.name]
        ready = sum(p.running and p.ready and p.revision == w.revision for p in mine)
        rolling = None if ready == w.replicas and len(mine) == w.replicas else f"{ready}/{w.replicas} updated"
        out[r.component] = observe.PoolState(ready, w.replicas, rolling=rolling)
    return out
