"""The TileRT decode pool: a StatefulSet (stable identity per node for host:ctrl_port) and its
headless Service."""

from __future__ import annotations

from tilert_operator import constants
from tilert_operator.render import commands, pods
from tilert_operator.render.pods import Manifest
from tilert_operator.spec import PDClusterSpec

COMPONENT = constants.TILERT


def statefulset(spec: PDClusterSpec, cluster: str, namespace: str, secret_version: str | None = None) -> Manifest:
    t = spec.decode.tilert
    dp = pods.DataPlane(spec, cluster, secret=True, secret_version=secret_version)
    cmd = commands.tilert_decode(spec, dp.paths)
    c = pods.container(
        "decode",
        t.image,
        cmd,
        ports=[("ctrl", t.ctrl_port), ("http", t.http_port)],
        resources=pods.resources(t, gpus=t.gpus, extra=dp.rdma_devices()),
        mounts=dp.mounts(),
        extra_env=dp.downward_env(),
    )
    c["readinessProbe"] = pods.http_probe("/ready", t.http_port, period=5)
    c["livenessProbe"] = pods.http_probe("/health", t.http_port, period=20, failures=6)
    c["startupProbe"] = pods.http_probe("/health", t.http_port, failures=360)
    sc = dp.security_context()
    if sc:
        c["securityContext"] = sc
    template = pods.pod_template(
        cluster=cluster,
        component=COMPONENT,
        containers=[c],
        pool=t,
        init_containers=dp.init_containers(t.image),
        volumes=dp.volumes(),
        annotations=dp.pod_annotations(),
        extra=dp.pod_fields(COMPONENT),
    )
    out: Manifest = {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": pods.metadata(cluster, namespace, COMPONENT),
        "spec": {
            "replicas": t.replicas,
            "serviceName": constants.child_name(cluster, COMPONENT),
            # Nodes are independent: start and replace them all at once, not one by one.
            "podManagementPolicy": "Parallel",
            "selector": {"matchLabels": pods.selector(cluster, COMPONENT)},
            "template": template,
        },
    }
    return pods.apply_overrides(out, t)


def headless_service(spec: PDClusterSpec, cluster: str, namespace: str) -> Manifest:
    t = spec.decode.tilert
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": pods.metadata(cluster, namespace, COMPONENT),
        "spec": {
            "clusterIP": "None",
            "selector": pods.selector(cluster, COMPONENT),
            "ports": [
                {"name": "ctrl", "port": t.ctrl_port, "targetPort": "ctrl", "protocol": "TCP"},
                {"name": "http", "port": t.http_port, "targetPort": "http", "protocol": "TCP"},
            ],
        },
    }


def render(spec: PDClusterSpec, cluster: str, namespace: str, secret_version: str | None = None) -> list[Manifest]:
    if not spec.decode.tilert.replicas:
        return []
    return [statefulset(spec, cluster, namespace, secret_version), headless_service(spec, cluster, namespace)]
