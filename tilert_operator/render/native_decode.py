"""The native decode pool: a Deployment running vLLM as the KV consumer, and its Service."""

from __future__ import annotations

from tilert_operator import constants
from tilert_operator.render import commands, pods
from tilert_operator.render.pods import Manifest
from tilert_operator.spec import PDClusterSpec
from tilert_serve import defaults

COMPONENT = constants.NATIVE


def deployment(spec: PDClusterSpec, cluster: str, namespace: str) -> Manifest:
    dp = pods.DataPlane(spec, cluster, secret=False)
    return dp.workload(kind="Deployment", namespace=namespace, component=COMPONENT, pool=spec.decode.native,
                       container_name="vllm", cmd=commands.native_decode(spec, dp.paths),
                       ports=[("http", defaults.VLLM_PORT)], ready=pods.http_probe("/health", defaults.VLLM_PORT),
                       health_port=defaults.VLLM_PORT, extra_env=[pods.NIXL_SIDE_CHANNEL_ENV])


def service(spec: PDClusterSpec, cluster: str, namespace: str) -> Manifest:
    return pods.service(cluster, namespace, COMPONENT, [("http", defaults.VLLM_PORT)])


def url(cluster: str, namespace: str) -> str:
    return f"http://{constants.child_name(cluster, COMPONENT)}.{namespace}.svc:{defaults.VLLM_PORT}"


def render(spec: PDClusterSpec, cluster: str, namespace: str) -> list[Manifest]:
    """Nothing when the pool has no replicas: the operator then deletes what an earlier spec made."""
    if not spec.decode.native.replicas:
        return []
    return [deployment(spec, cluster, namespace), service(spec, cluster, namespace)]
