"""Pure renderers: parsed spec in, complete manifests (dicts) out. No API client, no I/O.

One module per pool (prefill, tilert_decode, native_decode, router) plus network (Secret,
NetworkPolicies); `commands` holds every component's command line for pods and local runs alike.
"""

from __future__ import annotations

from collections.abc import Sequence

from tilert_operator.render import native_decode, network, prefill, router, tilert_decode
from tilert_operator.render.pods import Manifest
from tilert_operator.spec import PDClusterSpec
from tilert_serve.router.config import TileRTNode


def children(
    spec: PDClusterSpec,
    cluster: str,
    namespace: str,
    tilert_nodes: Sequence[TileRTNode] = (),
    secret_version: str | None = None,
) -> list[Manifest]:
    """Every child the operator server-side-applies (the handoff Secret is created apart, once).
    `secret_version` (network.secret_version of the token) goes on the pods that mount the Secret."""
    return [
        *prefill.render(spec, cluster, namespace, secret_version),
        *tilert_decode.render(spec, cluster, namespace, secret_version),
        *native_decode.render(spec, cluster, namespace),
        *router.render(spec, cluster, namespace, tilert_nodes),
        *network.network_policies(spec, cluster, namespace),
    ]


def all_manifests(
    spec: PDClusterSpec,
    cluster: str,
    namespace: str,
    *,
    secret_token: str,
    tilert_nodes: Sequence[TileRTNode] = (),
) -> list[Manifest]:
    """What `tilert-pd render` prints: the Secret first (pods mount it), then the children."""
    return [
        network.handoff_secret(cluster, namespace, secret_token),
        *children(spec, cluster, namespace, tilert_nodes, network.secret_version(secret_token)),
    ]
