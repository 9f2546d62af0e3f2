"""Which compatibility generations run, and in which slot: the order of a rollout that changes the
generation, decided from what the API server holds (pure; reconcile.py does the I/O).

A generation is what a prefill and a decode must agree on to pair (render/generations.py). When the
spec's generation differs from the one running, Kubernetes' rolling updates cannot keep a compatible
pair for every route (three independent workloads, a Deployment without partitions, a StatefulSet that
cannot surge), so the operator orders it, blue/green:

1. NewGenerationStarting: the new generation's workloads are created in the free slot beside the old
   ones (same replicas, so as many GPUs again as the data-plane pools hold: `surge_gpus`); the router's
   ConfigMap lists both generations' endpoints, each with its fingerprint, and pairs within one.
2. WaitingForNewGeneration: until every data-plane pool of the new generation has rolled out and its
   pods are ready, and every one of its TileRT nodes reports a working handoff (HandoffReady) where the
   operator reads the nodes' status. The old generation serves meanwhile: Ready stays True.
3. DrainingOldGeneration: the old generation's workloads are deleted and its endpoints leave the router's
   list; its pods drain (preStop, then SIGTERM: the servers finish what they hold within the grace
   period) until none is left.
4. RolloutComplete: one generation runs. RolloutStalled instead of 2 when a workload of the new
   generation reports itself stuck or the wait exceeds spec.generationRollout.progressDeadlineSeconds;
   the old generation keeps serving, and nothing is removed until the new one is ready or the spec
   goes back (then the new slot is deleted: the spec's generation is the one running).

Everything here is read again on every reconcile from the workloads' labels (the generation and the
slot) and the spec each generation's workloads recorded (generations.GENERATION_SPEC_ANNOTATION), so a
restarted operator continues where the last one stopped. A spec change during a rollout replaces the
generation that was coming up (it never served alone); the older one keeps serving. Workloads made by
an operator without generations carry no label: they are taken as the spec's generation (an ordinary
rolling update, as before).

With spec.generationRollout.strategy Recreate the old generation is deleted when the new one is
created: no extra GPUs, and until the new one is ready only what a compatible pair remains for is
served (the router falls back, and counts it, for the rest).
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from tilert_operator import constants, observe, status
from tilert_operator.observe import WORKLOAD_KINDS, NodeReport, PoolState, Unwired
from tilert_operator.render.generations import DATA_PLANE, Live, recorded_spec
from tilert_operator.spec import PDClusterSpec
from tilert_serve.router.config import TileRTNode

Obj = dict[str, Any]

# Phases of a generation in status.generations.
STARTING = "Starting"
SERVING = "Serving"
DRAINING = "Draining"


@dataclass(frozen=True)
class Slot:
    """The data-plane workloads the API server holds under one slot's names."""

    slot: str
    #: Their generation label; None for workloads from before generations.
    fingerprint: str | None
    #: The spec they were rendered from; None when they recorded none.
    spec: PDClusterSpec | None
    #: component -> workload.
    workloads: Mapping[str, Obj]
    #: The earliest creationTimestamp among them (RFC 3339 text sorts by time).
    created: str


def other(slot: str) -> str:
    return constants.SLOT_B if slot == constants.SLOT_A else constants.SLOT_A


def slots(cluster: str, live: Mapping[str, Obj]) -> dict[str, Slot]:
    """The occupied slots, from the children listed (Kind/name -> object)."""
    out = {}
    for slot in constants.SLOTS:
        found = {}
        for comp in DATA_PLANE:
            key = f"{WORKLOAD_KINDS[comp]}/{constants.slot_child_name(cluster, comp, slot)}"
            if key in live:
                found[comp] = live[key]
        if not found:
            continue
        # The prefill is always there; the decode pools may be scaled to nothing.
        first = found.get(constants.PREFILL) or next(iter(found.values()))
        meta = first.get("metadata") or {}
        out[slot] = Slot(
            slot=slot,
            fingerprint=(meta.get("labels") or {}).get(constants.LABEL_GENERATION),
            spec=recorded_spec(found[constants.PREFILL]) if constants.PREFILL in found else None,
            workloads=found,
            created=min(
                str((w.get("metadata") or {}).get("creationTimestamp") or "") for w in found.values()
            ),
        )
    return out


@dataclass(frozen=True)
class Choice:
    """Where the spec's generation goes, and which older one may still be serving."""

    #: The slot of the spec's generation.
    current: str
    #: The slot and spec of the generation that served before it, while it may still be needed.
    old: tuple[str, PDClusterSpec] | None = None
    #: The spec's generation has no workload yet (this reconcile creates them).
    starting: bool = False


def choose(spec: PDClusterSpec, fingerprint: str, occupied: Mapping[str, Slot]) -> Choice:
    """Pure: the slot of the spec's generation and the older generation kept beside it (before readiness
    is considered: `decide` removes the old one once the new one is ready)."""
    blue_green = spec.generation_rollout.strategy == "BlueGreen"
    if not occupied:
        return Choice(constants.SLOT_A)
    mine = [s for s in occupied.values() if s.fingerprint in (fingerprint, None)]
    if len(occupied) == 1:
        (only,) = occupied.values()
        if only.fingerprint in (fingerprint, None) or only.spec is None:
            return Choice(only.slot)
        keep = (only.slot, only.spec) if blue_green else None
        return Choice(other(only.slot), keep, starting=True)
    if mine:
        current = mine[0]
        old = occupied[other(current.slot)]
        if old.fingerprint in (fingerprint, None) or old.spec is None or not blue_green:
            return Choice(current.slot)
        return Choice(current.slot, (old.slot, old.spec))
    # Neither slot holds the spec's generation: a change during a rollout. The generation that came up
    # last never served alone; it makes room, and the one that served before keeps serving.
    survivor = min(occupied.values(), key=lambda s: s.created)
    if survivor.spec is None or not blue_green:
        return Choice(other(survivor.slot), starting=True)
    return Choice(other(survivor.slot), (survivor.slot, survivor.spec), starting=True)


@dataclass(frozen=True)
class Readiness:
    """Whether a generation can take over: its data-plane pools and its TileRT nodes' handoffs."""

    ready: bool
    #: What it still waits for (counts), for Progressing's message.
    waiting: list[str] = field(default_factory=list)
    #: A workload of it reports itself stuck (a Deployment past its progress deadline).
    stuck: str | None = None


def readiness(pools: Mapping[str, PoolState], handoff: Sequence[tuple[str, str]] | None) -> Readiness:
    """`pools`: the generation's data-plane pools (component -> state); `handoff`: (node, reason) for its
    wired TileRT nodes as status.node_handoff gives them, None when the operator does not read them."""
    waiting = []
    stuck = None
    for comp in DATA_PLANE:
        s = pools.get(comp)
        if s is None or not s.desired:
            continue
        if s.rolling is not None or s.ready < s.desired:
            waiting.append(f"{comp} {s.ready}/{s.desired} ready")
            if s.rolling and "stuck" in s.rolling:
                stuck = s.rolling
    tilert = pools.get(constants.TILERT)
    if handoff is not None and tilert is not None and tilert.desired:
        ok = sum(1 for _, reason in handoff if reason == "HandoffOK")
        if ok < tilert.desired:
            waiting.append(f"TileRT handoff {ok}/{tilert.desired} nodes HandoffReady")
    return Readiness(not waiting, waiting, stuck)


def lives(choice: Choice, spec: PDClusterSpec, new_ready: bool, shared: bool) -> list[Live]:
    """The generations to render, oldest first: the old one only until the new one is ready."""
    out = []
    if choice.old is not None and not new_ready:
        out.append(Live(choice.old[1], choice.old[0], shared=True))
    out.append(Live(spec, choice.current, shared=shared or bool(out)))
    return out


def slot_of(pod: Obj) -> str:
    """A pod's slot; pods from before generations carry none and are slot a's."""
    return str(
        ((pod.get("metadata") or {}).get("labels") or {}).get(constants.LABEL_SLOT) or constants.SLOT_A
    )


def component_of(obj: Obj) -> str | None:
    return ((obj.get("metadata") or {}).get("labels") or {}).get(constants.LABEL_COMPONENT)


def slot_pods(pods: Sequence[Obj], slot: str) -> list[Obj]:
    """The pods of one slot's data-plane pools, and the router's (which every generation shares)."""
    return [
        p
        for p in pods
        if component_of(p) == constants.ROUTER or (component_of(p) in DATA_PLANE and slot_of(p) == slot)
    ]


def leftover_pods(pods: Sequence[Obj], keep: set[str]) -> list[Obj]:
    """Data-plane pods of slots no generation is rendered in: a removed generation's, draining."""
    return [p for p in pods if component_of(p) in DATA_PLANE and slot_of(p) not in keep]


@dataclass(frozen=True)
class View:
    """A generation as observed: its pods' pools, its wired TileRT nodes and those left out."""

    live: Live
    pools: dict[str, PoolState]
    nodes: list[TileRTNode]
    unwired: list[Unwired]


def observe_view(live_gen: Live, cluster: str, pods: Sequence[Obj], live: Mapping[str, Obj]) -> View:
    spec = live_gen.spec
    mine = slot_pods(pods, live_gen.slot)
    workloads: dict[str, Obj | None] = {
        c: live.get(f"{WORKLOAD_KINDS[c]}/{constants.slot_child_name(cluster, c, live_gen.slot)}")
        for c in DATA_PLANE
    }
    workloads[constants.ROUTER] = live.get(
        f"{WORKLOAD_KINDS[constants.ROUTER]}/{constants.child_name(cluster, constants.ROUTER)}"
    )
    nodes, unwired = observe.tilert_nodes(spec, mine)
    return View(live_gen, observe.pool_states(spec, mine, workloads), nodes, unwired)


#: The reasons under which a new generation is on its way (Progressing's lastTransitionTime is then
#: when the rollout began).
UNDER_WAY = (status.NEW_GENERATION_STARTING, status.WAITING_FOR_NEW_GENERATION, status.ROLLOUT_STALLED)


def _epoch(stamp: object) -> float | None:
    if not isinstance(stamp, str):
        return None
    try:
        return (
            datetime.datetime.strptime(stamp, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=datetime.UTC).timestamp()
        )
    except ValueError:
        return None


@dataclass(frozen=True)
class Plan:
    """One reconcile's decision: which generations to render, and what Progressing says about it."""

    spec: PDClusterSpec
    choice: Choice
    #: The generations rendered, oldest first, with their TileRT nodes.
    lives: list[Live]
    #: The spec's generation observed before this reconcile's applies, and what it still lacks.
    current: View
    readiness: Readiness
    #: The old generation as observed, when there is one (rendered or being removed now).
    old: View | None
    #: The data-plane pods of slots no generation is rendered in (a removed generation's, draining).
    leftover: list[Obj]
    #: The TileRT nodes' reports (pod -> report); None when the operator does not read them.
    reports: dict[str, NodeReport] | None
    #: Progressing as the status held it before this reconcile.
    previous: Mapping[str, Any]
    now: float

    def reports_of(self, nodes: Sequence[TileRTNode]) -> list[NodeReport] | None:
        if self.reports is None:
            return None
        return [self.reports[n.name] for n in nodes if n.name in self.reports]

    @property
    def old_rendered(self) -> bool:
        return len(self.lives) > 1

    def _stalled(self) -> bool:
        if self.readiness.stuck is not None or self.previous.get("reason") == status.ROLLOUT_STALLED:
            return True
        began = _epoch(self.previous.get("lastTransitionTime"))
        return (
            self.previous.get("reason") in UNDER_WAY
            and began is not None
            and self.now - began > self.spec.generation_rollout.progress_deadline_seconds
        )

    def reason(self) -> str:
        if self.old_rendered:
            if self.choice.starting:
                return status.NEW_GENERATION_STARTING
            return status.ROLLOUT_STALLED if self._stalled() else status.WAITING_FOR_NEW_GENERATION
        if self.choice.starting:
            return status.NEW_GENERATION_STARTING  # Recreate: the old one goes as the new one starts
        if self.leftover:
            return status.DRAINING_OLD_GENERATION
        if self.previous.get("reason") in UNDER_WAY and not self.readiness.ready:
            return status.ROLLOUT_STALLED if self._stalled() else status.WAITING_FOR_NEW_GENERATION
        return status.ROLLOUT_COMPLETE

    def _leftover_generations(self) -> dict[tuple[str, str], list[Obj]]:
        out: dict[tuple[str, str], list[Obj]] = {}
        for p in self.leftover:
            labels = (p.get("metadata") or {}).get("labels") or {}
            fp = str(labels.get(constants.LABEL_GENERATION) or "unknown")
            out.setdefault((slot_of(p), fp), []).append(p)
        return out

    def progressing(self) -> status.Condition:
        reason = self.reason()
        current = self.lives[-1].generation.fingerprint
        if reason == status.DRAINING_OLD_GENERATION or (not self.old_rendered and self.leftover):
            groups = self._leftover_generations()
            old = ", ".join(sorted({fp for _, fp in groups})) or None
            return status.progressing(
                reason, current=current, old=old, waiting=[f"{len(self.leftover)} pod(s)"]
            )
        old_fp = self.lives[0].generation.fingerprint if self.old_rendered else None
        return status.progressing(
            reason, current=current, old=old_fp, waiting=self.readiness.waiting, stuck=self.readiness.stuck
        )

    def generations(self, views: Mapping[str, View], progressing: status.Condition) -> list[dict[str, Any]]:
        """status.generations: every generation with pods or workloads, oldest first."""
        out = []
        for live in self.lives[:-1]:
            v = views.get(live.slot)
            out.append(_entry(live, SERVING, v.pools if v else {}))
        cur = self.lives[-1]
        v = views.get(cur.slot)
        phase = STARTING if progressing["reason"] in UNDER_WAY else SERVING
        out.append(_entry(cur, phase, v.pools if v else {}))
        for (slot, fp), pods in sorted(self._leftover_generations().items()):
            pools = {
                c: PoolState(sum(1 for p in pods if component_of(p) == c and observe.is_ready(p)), 0)
                for c in DATA_PLANE
                if any(component_of(p) == c for p in pods)
            }
            out.append(status.generation_entry(fp, slot, DRAINING, pools, None))
        return out


def _entry(live: Live, phase: str, pools: Mapping[str, PoolState]) -> dict[str, Any]:
    g = live.generation
    mine = {c: s for c, s in pools.items() if c in DATA_PLANE}
    return status.generation_entry(g.fingerprint, live.slot, phase, mine, g.compat)
