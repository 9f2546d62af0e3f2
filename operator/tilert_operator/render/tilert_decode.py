"""The TileRT decode pool: a StatefulSet (stable identity per node for host:ctrl_port) and its
headless Service (one of each per live generation, render/generations.py)."""

from __future__ import annotations

from tilert_operator import constants
from tilert_operator.render import commands, pods
from tilert_operator.render.generations import Live, as_live
from tilert_operator.render.pods import Manifest
from tilert_operator.spec import PDClusterSpec

COMPONENT = constants.TILERT


def statefulset(spec_or_live: PDClusterSpec | Live, cluster: str, namespace: str) -> Manifest:
    live = as_live(spec_or_live)
    spec = live.spec
    t = spec.decode.tilert
    dp = pods.DataPlane(live, cluster, secret=True, node_api=True)
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
            "serviceName": live.name(cluster, COMPONENT),
            "podManagementPolicy": "Parallel",
        },
    )


def headless_service(spec_or_live: PDClusterSpec | Live, cluster: str, namespace: str) -> Manifest:
    live = as_live(spec_or_live)
    t = live.spec.decode.tilert
    return pods.service(
        cluster,
        namespace,
        COMPONENT,
        [("ctrl", t.ctrl_port), ("http", t.http_port)],
        headless=True,
        live=live,
    )


def service_host(cluster: str, namespace: str, slot: str = constants.SLOT_A) -> str:
    """The headless Service's DNS name (the router's discovery resolves it to the ready nodes)."""
    return f"{constants.slot_child_name(cluster, COMPONENT, slot)}.{namespace}.svc"


def render(spec_or_live: PDClusterSpec | Live, cluster: str, namespace: str) -> list[Manifest]:
    live = as_live(spec_or_live)
    if not live.spec.decode.tilert.replicas:
        return []
    return [statefulset(live, cluster, namespace), headless_service(live, cluster, namespace)]
