"""The native decode pool: a Deployment running vLLM as the KV consumer, and its Service (one of each
per live generation, render/generations.py)."""

from __future__ import annotations

from tilert_operator import constants
from tilert_operator.render import commands, pods
from tilert_operator.render.generations import Live, as_live
from tilert_operator.render.pods import Manifest
from tilert_operator.spec import PDClusterSpec

COMPONENT = constants.NATIVE


def deployment(spec_or_live: PDClusterSpec | Live, cluster: str, namespace: str) -> Manifest:
    live = as_live(spec_or_live)
    dp = pods.DataPlane(live, cluster, secret=False)
    spec = live.spec
    return pods.vllm_deployment(
        dp, namespace, COMPONENT, spec.decode.native, commands.native_decode(spec, dp.paths)
    )


def service(spec_or_live: PDClusterSpec | Live, cluster: str, namespace: str) -> Manifest:
    live = as_live(spec_or_live)
    return pods.vllm_service(cluster, namespace, COMPONENT, live)


def url(cluster: str, namespace: str, slot: str = constants.SLOT_A) -> str:
    return pods.vllm_url(cluster, namespace, COMPONENT, slot)


def render(spec_or_live: PDClusterSpec | Live, cluster: str, namespace: str) -> list[Manifest]:
    """Nothing when the pool has no replicas: the operator then deletes what an earlier spec made."""
    live = as_live(spec_or_live)
    if not live.spec.decode.native.replicas:
        return []
    return [deployment(live, cluster, namespace), service(live, cluster, namespace)]
