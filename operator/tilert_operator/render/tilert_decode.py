"""The TileRT decode pool: a StatefulSet (stable identity per node for host:ctrl_port) and its
headless Service."""

from __future__ import annotations

from tilert_operator import constants
from tilert_operator.render import commands, pods
from tilert_operator.render.pods import Manifest
from tilert_operator.spec import PDClusterSpec

COMPONENT = constants.TILERT


def statefulset(spec: PDClusterSpec, cluster: str, namespace: str) -> Manifest:
    t = spec.decode.tilert
    dp = pods.DataPlane(spec, cluster, secret=True, node_api=True)
    return dp.workload(
        kind="StatefulSet",
        namespace=namespace,
        component=COMPONENT,
        pool=t,
        container_name="decode",
        cmd=commands.tilert_decode(spec, dp.paths),
        ports=[("ctrl", t.ctrl_port), ("http", t.http_port)],
        ready=pods.http_probe("/ready", t.http_port, period=5),
        health_port=t.http_port,
        # Nodes are independent: start and replace them all at once, not one by one.
        spec_fields={
            "serviceName": constants.child_name(cluster, COMPONENT),
            "podManagementPolicy": "Parallel",
        },
    )


def headless_service(spec: PDClusterSpec, cluster: str, namespace: str) -> Manifest:
    t = spec.decode.tilert
    return pods.service(
        cluster, namespace, COMPONENT, [("ctrl", t.ctrl_port), ("http", t.http_port)], headless=True
    )


def render(spec: PDClusterSpec, cluster: str, namespace: str) -> list[Manifest]:
    if not spec.decode.tilert.replicas:
        return []
    return [statefulset(spec, cluster, namespace), headless_service(spec, cluster, namespace)]
