"""The prefill pool: a Deployment running `vllm serve` with TileRTConnector, and its Service."""

from __future__ import annotations

from tilert_operator import constants
from tilert_operator.render import commands, pods
from tilert_operator.render.pods import Manifest
from tilert_operator.spec import PDClusterSpec
from tilert_serve import defaults

COMPONENT = constants.PREFILL


def deployment(spec: PDClusterSpec, cluster: str, namespace: str, secret_version: str | None = None) -> Manifest:
    p = spec.prefill
    dp = pods.DataPlane(spec, cluster, secret=True, secret_version=secret_version)
    cmd = commands.prefill(spec, dp.paths)
    # The NIXL side channel must advertise the pod's own address to the native decode pods.
    env = [*dp.downward_env(), {"name": "VLLM_NIXL_SIDE_CHANNEL_HOST", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}]
    c = pods.container(
        "vllm",
        p.image,
        cmd,
        ports=[("http", defaults.VLLM_PORT)],
        resources=pods.resources(p, gpus=p.gpus, extra=dp.rdma_devices()),
        mounts=dp.mounts(),
        extra_env=env,
    )
    c["readinessProbe"] = pods.http_probe("/health", defaults.VLLM_PORT)
    c["livenessProbe"] = pods.http_probe("/health", defaults.VLLM_PORT, period=20, failures=6)
    # Loading a large checkpoint takes minutes; the startup probe holds liveness off until then.
    c["startupProbe"] = pods.http_probe("/health", defaults.VLLM_PORT, failures=360)
    sc = dp.security_context()
    if sc:
        c["securityContext"] = sc
    template = pods.pod_template(
        cluster=cluster,
        component=COMPONENT,
        containers=[c],
        pool=p,
        init_containers=dp.init_containers(p.image),
        volumes=dp.volumes(),
        annotations=dp.pod_annotations(),
        extra=dp.pod_fields(COMPONENT),
    )
    out: Manifest = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": pods.metadata(cluster, namespace, COMPONENT),
        "spec": {
            "replicas": p.replicas,
            "selector": {"matchLabels": pods.selector(cluster, COMPONENT)},
            "template": template,
        },
    }
    return pods.apply_overrides(out, p)


def service(spec: PDClusterSpec, cluster: str, namespace: str) -> Manifest:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": pods.metadata(cluster, namespace, COMPONENT),
        "spec": {
            "selector": pods.selector(cluster, COMPONENT),
            "ports": [{"name": "http", "port": defaults.VLLM_PORT, "targetPort": "http", "protocol": "TCP"}],
        },
    }


def url(cluster: str, namespace: str) -> str:
    """The prefill Service's URL as the router reaches it."""
    return f"http://{constants.child_name(cluster, COMPONENT)}.{namespace}.svc:{defaults.VLLM_PORT}"


def render(spec: PDClusterSpec, cluster: str, namespace: str, secret_version: str | None = None) -> list[Manifest]:
    return [deployment(spec, cluster, namespace, secret_version), service(spec, cluster, namespace)]
