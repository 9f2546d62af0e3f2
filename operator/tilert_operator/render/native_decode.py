"""The native decode pool: a Deployment running vLLM as the KV consumer, and its Service."""

from __future__ import annotations

from tilert_operator import constants
from tilert_operator.render import commands, pods
from tilert_operator.render.pods import Manifest
from tilert_operator.spec import PDClusterSpec

COMPONENT = constants.NATIVE


def deployment(spec: PDClusterSpec, cluster: str, namespace: str) -> Manifest:
    dp = pods.DataPlane(spec, cluster, secret=False)
    return pods.vllm_deployment(
        dp, namespace, COMPONENT, spec.decode.native, commands.native_decode(spec, dp.paths)
    )


def service(spec: PDClusterSpec, cluster: str, namespace: str) -> Manifest:
    return pods.vllm_service(cluster, namespace, COMPONENT)


def url(cluster: str, namespace: str) -> str:
    return pods.vllm_url(cluster, namespace, COMPONENT)


def render(spec: PDClusterSpec, cluster: str, namespace: str) -> list[Manifest]:
    """Nothing when the pool has no replicas: the operator then deletes what an earlier spec made."""
    if not spec.decode.native.replicas:
        return []
    return [deployment(spec, cluster, namespace), service(spec, cluster, namespace)]
