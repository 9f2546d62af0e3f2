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
    ready: int
    desired: int

    @property
    def text(self) -> str:
        return f"{self.ready}/{self.desired}"


def is_ready(pod: dict[str, Any]) -> bool:
    if pod.get("metadata", {}).get("deletionTimestamp"):
        return False  # terminating pods leave the endpoint list at once
    if not pod.get("status", {}).get("podIP"):
        return False
    conds = pod.get("status", {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conds)


def data_plane(pod: dict[str, Any], spec: PDClusterSpec) -> dataplane.DataPlane:
    meta = pod.get("metadata", {})
    return dataplane.choose(spec.transfer.rdma.networks,
                            (meta.get("annotations") or {}).get(dataplane.MULTUS_STATUS_ANNOTATION),
                            meta.get("namespace", ""), pod.get("status", {}).get("podIP"))


@dataclass(frozen=True)
class Unwired:
    """A ready TileRT pod left out of the router, and why."""

    pod: str
    problem: str


def pods_of(pods: list[dict[str, Any]], component: str) -> list[dict[str, Any]]:
    return [p for p in pods if (p.get("metadata", {}).get("labels") or {}).get(constants.LABEL_COMPONENT) == component]


def pool_states(spec: PDClusterSpec, pods: list[dict[str, Any]]) -> dict[str, PoolState]:
    desired = {
        constants.PREFILL: spec.prefill.replicas,
        constants.TILERT: spec.decode.tilert.replicas,
        constants.NATIVE: spec.decode.native.replicas,
        constants.ROUTER: spec.router.replicas,
    }
    return {c: PoolState(sum(1 for p in pods_of(pods, c) if is_ready(p)), d) for c, d in desired.items()}


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
            return cls(pod, None, busy, "the node's /v1/status has no handoff record (an older node image)", "old_node")
        return cls(pod, handoff, busy)
