"""The prefill pool: a Deployment running `vllm serve` with TileRTConnector, and its Service."""

from __future__ import annotations

from tilert_operator import constants
from tilert_operator.render import commands, pods
from tilert_operator.render.pods import Manifest
from tilert_operator.spec import PDClusterSpec

COMPONENT = constants.PREFILL


def deployment(spec: PDClusterSpec, cluster: str, namespace: str) -> Manifest:
    dp = pods.DataPlane(spec, cluster, secret=True)
    return pods.vllm_deployment(dp, namespace, COMPONENT, spec.prefill, commands.prefill(spec, dp.paths))


def service(spec: PDClusterSpec, cluster: str, namespace: str) -> Manifest:
    return pods.vllm_service(cluster, namespace, COMPONENT)


def url(cluster: str, namespace: str) -> str:
    return pods.vllm_url(cluster, namespace, COMPONENT)


def render(spec: PDClusterSpec, cluster: str, namespace: str) -> list[Manifest]:
    return [deployment(spec, cluster, namespace), service(spec, cluster, namespace)]
