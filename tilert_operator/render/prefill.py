"""The prefill pool: a Deployment running `vllm serve` with TileRTConnector, and its Service."""

from __future__ import annotations

from tilert_operator import constants
from tilert_operator.render import commands, pods
from tilert_operator.render.pods import Manifest
from tilert_operator.spec import PDClusterSpec
from tilert_serve import defaults

COMPONENT = constants.PREFILL


def deployment(spec: PDClusterSpec, cluster: str, namespace: str, secret_version: str | None = None) -> Manifest:
    dp = pods.DataPlane(spec, cluster, secret=True, secret_version=secret_version)
    return dp.workload(kind="Deployment", namespace=namespace, component=COMPONENT, pool=spec.prefill,
                       container_name="vllm", cmd=commands.prefill(spec, dp.paths),
                       ports=[("http", defaults.VLLM_PORT)], ready=pods.http_probe("/health", defaults.VLLM_PORT),
                       health_port=defaults.VLLM_PORT, extra_env=[pods.NIXL_SIDE_CHANNEL_ENV])


def service(spec: PDClusterSpec, cluster: str, namespace: str) -> Manifest:
    return pods.service(cluster, namespace, COMPONENT, [("http", defaults.VLLM_PORT)])


def url(cluster: str, namespace: str) -> str:
    """The prefill Service's URL as the router reaches it."""
    return f"http://{constants.child_name(cluster, COMPONENT)}.{namespace}.svc:{defaults.VLLM_PORT}"


def render(spec: PDClusterSpec, cluster: str, namespace: str, secret_version: str | None = None) -> list[Manifest]:
    return [deployment(spec, cluster, namespace, secret_version), service(spec, cluster, namespace)]
