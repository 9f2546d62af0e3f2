"""The TileRT decode pool: a StatefulSet (stable identity per node for host:ctrl_port) and its
headless Service."""

from __future__ import annotations

import posixpath

from tilert_operator import constants
from tilert_operator.render import commands, pods
from tilert_operator.render.pods import Manifest
from tilert_operator.spec import PDClusterSpec
from tilert_serve import dataplane

COMPONENT = constants.TILERT


def network_status_volume() -> tuple[Manifest, Manifest]:
    """The pod's Multus network-status annotation as a file (the downward API keeps it current), from
    which the node learns its own address on the secondary network; and the namespace the spec's
    network names are relative to."""
    volume = {"name": "podinfo", "downwardAPI": {"items": [{
        "path": posixpath.basename(dataplane.NETWORK_STATUS_FILE),
        "fieldRef": {"fieldPath": f"metadata.annotations['{dataplane.MULTUS_STATUS_ANNOTATION}']"},
    }]}}  # fmt: skip
    return volume, {"name": "podinfo", "mountPath": posixpath.dirname(dataplane.NETWORK_STATUS_FILE), "readOnly": True}


NAMESPACE_ENV: Manifest = {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}}


def statefulset(spec: PDClusterSpec, cluster: str, namespace: str, secret_version: str | None = None) -> Manifest:
    t = spec.decode.tilert
    dp = pods.DataPlane(spec, cluster, secret=True, secret_version=secret_version)
    multus = bool(spec.transfer.rdma.networks)
    return dp.workload(
        kind="StatefulSet", namespace=namespace, component=COMPONENT, pool=t, container_name="decode",
        cmd=commands.tilert_decode(spec, dp.paths), ports=[("ctrl", t.ctrl_port), ("http", t.http_port)],
        ready=pods.http_probe("/ready", t.http_port, period=5), health_port=t.http_port,
        extra_env=[NAMESPACE_ENV] if multus else None,
        extra_volumes=[network_status_volume()] if multus else None,
        # Nodes are independent: start and replace them all at once, not one by one.
        spec_fields={"serviceName": constants.child_name(cluster, COMPONENT), "podManagementPolicy": "Parallel"},
    )


def headless_service(spec: PDClusterSpec, cluster: str, namespace: str) -> Manifest:
    t = spec.decode.tilert
    return pods.service(cluster, namespace, COMPONENT, [("ctrl", t.ctrl_port), ("http", t.http_port)], headless=True)


def render(spec: PDClusterSpec, cluster: str, namespace: str, secret_version: str | None = None) -> list[Manifest]:
    if not spec.decode.tilert.replicas:
        return []
    return [statefulset(spec, cluster, namespace, secret_version), headless_service(spec, cluster, namespace)]
