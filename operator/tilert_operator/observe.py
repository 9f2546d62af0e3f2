"""Observed state of a PDCluster's pods, pure: readiness per pool and the TileRT endpoint list.

A TileRT node's control address is its data-plane address (`tilert_serve.dataplane`, the decision
the node makes for itself from the same annotation): its address on the RDMA network when the spec
names secondary networks, else its pod IP. A ready node without its RDMA address is left out of the
router and reported, never wired over the pod network. The router reaches the node's HTTP port on
the pod IP either way (the router is not on the RDMA network).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tilert_operator import constants
from tilert_operator.spec import PDClusterSpec
from tilert_serve import dataplane
from tilert_serve.router.config import TileRTNode


@dataclass(frozen=True)
class PoolState:
    """A pool as its workload reports it: `ready` counts ready pods of the current template only
    (old pods do not make a new generation look ready)."""

    ready: int
    desired: int
    #: Ready pods of any template: what serves while a rollout is under way (None: as `ready`).
    serving: int | None = None
    #: What the current template's rollout still waits for; None when it is rolled out.
    rolling: str | None = None

    @property
    def text(self) -> str:
        return f"{self.ready}/{self.desired}"

    @property
    def serves(self) -> int:
        return self.ready if self.serving is None else self.serving


def is_ready(pod: dict[str, Any]) -> bool:
    if pod.get("metadata", {}).get("deletionTimestamp"):
        return False  # terminating pods leave the endpoint list at once
    if not pod.get("status", {}).get("podIP"):
        return False
    conds = pod.get("status", {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conds)


def data_plane(pod: dict[str, Any], spec: PDClusterSpec) -> dataplane.DataPlane:
    meta = pod.get("metadata", {})
    return dataplane.choose(
        spec.transfer.rdma.networks,
        (meta.get("annotations") or {}).get(dataplane.MULTUS_STATUS_ANNOTATION),
        meta.get("namespace", ""),
        pod.get("status", {}).get("podIP"),
    )


@dataclass(frozen=True)
class Unwired:
    """A ready TileRT pod left out of the router, and why."""

    pod: str
    problem: str


def pods_of(pods: list[dict[str, Any]], component: str) -> list[dict[str, Any]]:
    return [
        p
        for p in pods
        if (p.get("metadata", {}).get("labels") or {}).get(constants.LABEL_COMPONENT) == component
    ]


#: The workload kind of each pool.
WORKLOAD_KINDS = {
    constants.PREFILL: "Deployment",
    constants.TILERT: "StatefulSet",
    constants.NATIVE: "Deployment",
    constants.ROUTER: "Deployment",
}


def _count(status: dict[str, Any], key: str) -> int:
    value = status.get(key)  # the API omits zero counts
    return value if isinstance(value, int) else 0


def rollout(kind: str, workload: dict[str, Any] | None, desired: int) -> tuple[int, str | None]:
    """_rollout, with what to do about a rollout under way: where to watch it, and why it is stuck
    when its controller says so (a Deployment past its progressDeadlineSeconds)."""
    ready, waiting = _rollout(kind, workload, desired)
    if waiting is None or workload is None:
        return ready, waiting
    name = (workload.get("metadata") or {}).get("name")
    stuck = next(
        (
            c
            for c in (workload.get("status") or {}).get("conditions") or []
            if c.get("type") == "Progressing" and c.get("status") == "False"
        ),
        None,
    )
    if stuck is not None:
        waiting += f"; stuck ({stuck.get('reason')}: {stuck.get('message')}): see kubectl describe {kind.lower()} {name}"
    return ready, f"{waiting}; follow it with kubectl rollout status {kind.lower()}/{name}"


def _rollout(kind: str, workload: dict[str, Any] | None, desired: int) -> tuple[int, str | None]:
    """From a Deployment's or StatefulSet's own status: how many ready pods are of its current
    template, and what its rollout still waits for (None: rolled out).

    Rolled out means its controller has seen the current generation (observedGeneration), `desired`
    pods are of the current template (updatedReplicas) and no pod of an earlier one is left: for a
    StatefulSet, currentRevision has become updateRevision, which its controller does only once every
    pod is updated and ready; for a Deployment, no replicas beyond the updated ones, and every updated
    one available unless its Progressing condition already says NewReplicaSetAvailable (the rollout
    completed; a pod that failed since makes the pool degraded, not a rollout). Ready pods of the
    current template are not counted by the API, so the old pods are assumed ready first (a lower
    bound: never more than there are), and none is counted before the controller has seen the
    generation."""
    if desired == 0:
        return 0, None  # nothing to roll out: the workload is gone, or going
    if workload is None:
        return 0, f"{kind} not created yet"
    meta, st = workload.get("metadata") or {}, workload.get("status") or {}
    name, generation, seen = (
        meta.get("name"),
        int(meta.get("generation") or 0),
        _count(st, "observedGeneration"),
    )
    total, updated = _count(st, "replicas"), _count(st, "updatedReplicas")
    ready = _count(st, "readyReplicas" if kind == "StatefulSet" else "availableReplicas")
    old = max(0, total - updated)
    ready_new = max(0, min(updated, ready - old))
    where = f"{kind} {name}"
    if seen < generation:
        # Its counts are of an earlier generation: none is known to be of the current template.
        return 0, f"{where}: its controller has not yet seen generation {generation} (it reports {seen})"
    # A StatefulSet's partition keeps the pods with lower ordinals on the earlier template by design
    # (a canary): rolled out once the others are updated and every pod is ready (kubectl rollout status).
    partition = 0
    if kind == "StatefulSet":
        rolling_update = (
            ((workload.get("spec") or {}).get("updateStrategy") or {}).get("rollingUpdate")
        ) or {}
        raw = rolling_update.get("partition")
        partition = min(desired, raw) if isinstance(raw, int) and raw > 0 else 0
    if updated < desired - partition:
        return ready_new, f"{where}: {updated} of {desired - partition} pods are of the current template"
    if partition:
        if ready < desired:
            return (
                ready_new,
                f"{where}: {ready} of {desired} pods ready (partition {partition}: pods below it keep their template)",
            )
        return min(ready, desired), None
    if kind == "StatefulSet":
        if st.get("currentRevision") != st.get("updateRevision"):
            return ready_new, (
                f"{where}: {ready_new} of {desired} pods of revision {st.get('updateRevision')} ready, "
                f"pods of {st.get('currentRevision')} left to replace"
            )
        return min(ready, desired), None
    if old:
        return (
            ready_new,
            f"{where}: {ready_new} of {desired} updated pods available, {old} pod(s) of an earlier template left",
        )
    progressing = next(
        (c.get("reason") for c in st.get("conditions") or [] if c.get("type") == "Progressing"), None
    )
    if ready_new < desired and progressing != "NewReplicaSetAvailable":
        return ready_new, f"{where}: {ready_new} of {desired} updated pods available"
    return ready_new, None


def pool_states(
    spec: PDClusterSpec, pods: list[dict[str, Any]], workloads: dict[str, dict[str, Any] | None] | None = None
) -> dict[str, PoolState]:
    """Each pool's state. `workloads` (component -> its Deployment or StatefulSet as the API server
    holds it, None when absent) makes ready counts and rollouts follow the workloads' own status;
    without it, ready pods are counted by label."""
    desired = {
        constants.PREFILL: spec.prefill.replicas,
        constants.TILERT: spec.decode.tilert.replicas,
        constants.NATIVE: spec.decode.native.replicas,
        constants.ROUTER: spec.router.replicas,
    }
    out = {}
    for c, d in desired.items():
        serving = sum(1 for p in pods_of(pods, c) if is_ready(p))
        if workloads is None:
            out[c] = PoolState(serving, d)
            continue
        ready, rolling = rollout(WORKLOAD_KINDS[c], workloads.get(c), d)
        # Never more than the ready pods this reconcile saw: the workload's status and the pod list
        # are read apart, and a status already counting a pod the list does not show yet would report
        # the pool whole while its endpoints (from the pods) miss that pod.
        out[c] = PoolState(min(ready, serving), d, serving, rolling)
    return out


def tilert_nodes(spec: PDClusterSpec, pods: list[dict[str, Any]]) -> tuple[list[TileRTNode], list[Unwired]]:
    """Ready TileRT pods as router endpoints, sorted by name so the ConfigMap is stable, and the ready
    pods that cannot be wired (no data-plane address)."""
    t = spec.decode.tilert
    out, unwired = [], []
    for pod in sorted(pods_of(pods, constants.TILERT), key=lambda p: p["metadata"]["name"]):
        if not is_ready(pod):
            continue
        where = data_plane(pod, spec)
        if where.address is None:
            unwired.append(Unwired(pod["metadata"]["name"], where.problem))
            continue
        out.append(TileRTNode(
            name=pod["metadata"]["name"],
            http_url=dataplane.http_url(pod["status"]["podIP"], t.http_port),
            ctrl_host=where.address,
            ctrl_port=t.ctrl_port,
            slots=t.slots,
            # Lets the router cap max_tokens for requests that give none.
            max_seq_len=spec.model.max_seq_len,
        ))  # fmt: skip
    return out, unwired


@dataclass(frozen=True)
class NodeReport:
    """What a TileRT node's authenticated GET /v1/status said of its data plane (handoff.py fetches it).

    `handoff`: the node's record (tilert_serve/decode/record.py HandoffRecord.as_dict: its last failure
    is an authenticated peer's or the node's own fact, in the node's words; control connections that
    failed before authenticating are only counted there); None when the status could not be read, then `error` says why and `error_kind` is unreachable, timeout or
    not_authorized. `busy`: a slot is in use (a node decoding long streams has no new handoff to show)."""

    pod: str
    handoff: dict[str, Any] | None = None
    busy: bool = False
    error: str | None = None
    error_kind: str | None = None

    @classmethod
    def from_status(cls, pod: str, body: dict[str, Any]) -> NodeReport:
        slots = body.get("slots") or []
        busy = any(isinstance(s, dict) and s.get("state") not in (None, "free") for s in slots)
        handoff = body.get("handoff")
        if not isinstance(handoff, dict):
            return cls(
                pod,
                None,
                busy,
                "the node's /v1/status has no handoff record (an older node image)",
                "old_node",
            )
        return cls(pod, handoff, busy)
