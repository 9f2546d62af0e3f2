"""Observed state of a PDCluster's pods, pure: readiness per pool and the TileRT endpoint list.

A TileRT node's address is its address on the RDMA network (from the Multus network-status
annotation) when the spec names a secondary network, else its pod IP; the router reaches the node's
HTTP port on the pod IP either way (the router is not on the RDMA network).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from tilert_operator import constants
from tilert_operator.spec import PDClusterSpec
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


def _network_matches(entry_name: str, wanted: str, namespace: str) -> bool:
    # Multus reports "namespace/name"; the spec may say "name" (same namespace) or "namespace/name".
    full = wanted if "/" in wanted else f"{namespace}/{wanted}"
    return entry_name in (wanted, full)


def rdma_address(pod: dict[str, Any], spec: PDClusterSpec) -> str | None:
    nets = spec.transfer.rdma.networks
    if not nets:
        return None
    meta = pod.get("metadata", {})
    raw = (meta.get("annotations") or {}).get(constants.MULTUS_STATUS_ANNOTATION)
    if not raw:
        return None
    try:
        entries = json.loads(raw)
    except ValueError:
        return None
    for entry in entries if isinstance(entries, list) else []:
        if isinstance(entry, dict) and _network_matches(str(entry.get("name", "")), nets[0], meta.get("namespace", "")):
            ips = entry.get("ips") or []
            if ips:
                return str(ips[0])
    return None


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


def tilert_nodes(spec: PDClusterSpec, pods: list[dict[str, Any]]) -> list[TileRTNode]:
    """Ready TileRT pods as router endpoints, sorted by name so the ConfigMap is stable."""
    t = spec.decode.tilert
    out = []
    for pod in sorted(pods_of(pods, constants.TILERT), key=lambda p: p["metadata"]["name"]):
        if not is_ready(pod):
            continue
        ip = pod["status"]["podIP"]
        out.append(TileRTNode(
            name=pod["metadata"]["name"],
            http_url=f"http://{ip}:{t.http_port}",
            ctrl_host=rdma_address(pod, spec) or ip,
            ctrl_port=t.ctrl_port,
            slots=t.slots,
            # Lets the router cap max_tokens for requests that give none.
            max_seq_len=spec.model.max_seq_len,
        ))  # fmt: skip
    return out
