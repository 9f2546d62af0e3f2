"""The native decode pool: a Deployment running vLLM as the KV consumer, and its Service."""

from __future__ import annotations

from tilert_operator import constants
from tilert_operator.render import commands, pods
from tilert_operator.render.pods import Manifest
from tilert_operator.spec import PDClusterSpec
from tilert_serve import defaults

COMPONENT = constants.NATIVE


def deployment(spec: PDClusterSpec, cluster: str, namespace: str) -> Manifest:
    n = spec.decode.native
    dp = pods.DataPlane(spec, cluster, secret=False)
    cmd = commands.native_decode(spec, dp.paths)
    env = [*dp.downward_env(), {"name": "VLLM_NIXL_SIDE_CHANNEL_HOST", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}]
    c = pods.container(
        "vllm",
        n.image,
        cmd,
        ports=[("http", defaults.VLLM_PORT)],
        resources=pods.resources(n, gpus=n.gpus, extra=dp.rdma_devices()),
        mounts=dp.mounts(),
        extra_env=env,
    )
    c["readinessProbe"] = pods.http_probe("/health", defaults.VLLM_PORT)
    c["livenessProbe"] = pods.http_probe("/health", defaults.VLLM_PORT, period=20, failures=6)
    c["startupProbe"] = pods.http_probe("/health", defaults.VLLM_PORT, failures=360)
    sc = dp.security_context()
    if sc:
        c["securityContext"] = sc
    template = pods.pod_template(
        cluster=cluster,
        component=COMPONENT,
        containers=[c],
        pool=n,
        init_containers=dp.init_containers(n.image),
        volumes=dp.volumes(),
        annotations=dp.pod_annotations(),
        extra=dp.pod_fields(COMPONENT),
    )
    out: Manifest = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": pods.metadata(cluster, namespace, COMPONENT),
        "spec": {
            "replicas": n.replicas,
            "selector": {"matchLabels": pods.selector(cluster, COMPONENT)},
            "template": template,
        },
    }
    return pods.apply_overrides(out, n)


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
    return f"http://{constants.child_name(cluster, COMPONENT)}.{namespace}.svc:{defaults.VLLM_PORT}"


def render(spec: PDClusterSpec, cluster: str, namespace: str) -> list[Manifest]:
    """Nothing when the pool has no replicas: the operator then deletes what an earlier spec made."""
    if not spec.decode.native.replicas:
        return []
    return [deployment(spec, cluster, namespace), service(spec, cluster, namespace)]
