"""Driving the operator in tests: KopfRunner arguments, waits, and pods a test plays the controller for."""

from __future__ import annotations

import copy
import json
import time
from collections.abc import Callable
from typing import Any, TypeVar

from tilert_operator import constants
from tilert_serve import dataplane

T = TypeVar("T")
POD = ("", "v1", "pods")
PDC = (constants.GROUP, constants.VERSION, constants.PLURAL)
ARGS = ["run", "-m", "tilert_operator.wiring", "--all-namespaces", "--standalone", "--verbose"]


def wait_for(what: str, fn: Callable[[], T | None], timeout: float = 20.0, interval: float = 0.1) -> T:
    deadline = time.monotonic() + timeout
    last: T | None = None
    while time.monotonic() < deadline:
        last = fn()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}; last: {last!r}")


def pod(cluster: str, component: str, index: int, namespace: str = "default", *, ready: bool = True,
        ip: str | None = None, rdma_net: str | None = None, rdma_ip: str | None = None, owner: dict[str, Any] | None = None) -> dict[str, Any]:
    """A pod as a workload controller and the kubelet would make it."""
    name = f"{cluster}-{component}-{index}"
    meta: dict[str, Any] = {
        "name": name, "namespace": namespace,
        "labels": {constants.LABEL_CLUSTER: cluster, constants.LABEL_COMPONENT: component,
                   constants.LABEL_MANAGED_BY: constants.MANAGED_BY},
    }  # fmt: skip
    if owner:
        meta["ownerReferences"] = [{"apiVersion": owner["apiVersion"], "kind": owner["kind"], "name": owner["metadata"]["name"],
                                    "uid": owner["metadata"]["uid"], "controller": True}]
    if rdma_net:
        meta["annotations"] = {dataplane.MULTUS_STATUS_ANNOTATION: json.dumps(
            [{"name": "cbr0", "ips": [ip]}, {"name": rdma_net, "interface": "net1", "ips": [rdma_ip]}])}
    return {
        "apiVersion": "v1", "kind": "Pod", "metadata": meta,
        "spec": {"containers": [{"name": "c", "image": "i"}]},
        "status": {"phase": "Running", "podIP": ip or f"10.0.{len(component)}.{index + 1}",
                   "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]},
    }  # fmt: skip


def condition(obj: dict[str, Any] | None, type_: str) -> dict[str, Any]:
    for c in ((obj or {}).get("status") or {}).get("conditions") or []:
        if c["type"] == type_:
            return dict(c)
    return {}


def pdc(doc: dict[str, Any], namespace: str = "default") -> dict[str, Any]:
    out = copy.deepcopy(doc)
    out["metadata"]["namespace"] = out["metadata"].get("namespace") or namespace
    return out
