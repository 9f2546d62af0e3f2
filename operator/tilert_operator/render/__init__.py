"""Pure renderers: parsed spec in, complete manifests (dicts) out. No API client, no I/O.

One module per pool (prefill, tilert_decode, native_decode, router) plus network (Secrets,
NetworkPolicies, MultiNetworkPolicies), disruption (PodDisruptionBudgets) and autoscaling
(HorizontalPodAutoscalers under the HPA actuator); hygiene holds what every
pool's pods get (spread, rollout, preStop and grace period, securityContext); `commands` holds every component's command line for pods and
local runs alike.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from tilert_operator.render import (
    autoscaling,
    disruption,
    native_decode,
    network,
    prefill,
    router,
    tilert_decode,
)
from tilert_operator.render.generations import Live, single
from tilert_operator.render.pods import Manifest
from tilert_operator.spec import PDClusterSpec
from tilert_serve.router.config import TileRTNode


def children(
    spec: PDClusterSpec,
    cluster: str,
    namespace: str,
    tilert_nodes: Sequence[TileRTNode] = (),
    lives: Sequence[Live] | None = None,
) -> list[Manifest]:
    """Every child the operator server-side-applies (the Secrets are created apart, once). Nothing
    here depends on a Secret's value: a new or rotated credential changes no child.

    `lives`: the generations whose data-plane pools run, oldest first, each in its slot
    (render/generations.py; rollout.py decides them); None = `spec` alone in slot a with
    `tilert_nodes`. The router, policies and budgets follow `spec` and span every slot."""
    lives = single(spec, tilert_nodes) if lives is None else lives
    return [
        *(o for live in lives for o in prefill.render(live, cluster, namespace)),
        *(o for live in lives for o in tilert_decode.render(live, cluster, namespace)),
        *(o for live in lives for o in native_decode.render(live, cluster, namespace)),
        *router.render(spec, cluster, namespace, tilert_nodes, lives),
        *network.network_policies(spec, cluster, namespace),
        *network.multi_network_policies(spec, cluster, namespace),
        *disruption.render(spec, cluster, namespace),
        *autoscaling.render(spec, cluster, namespace, lives),
    ]


def all_manifests(
    spec: PDClusterSpec,
    cluster: str,
    namespace: str,
    *,
    secret_token: str,
    node_api_token: str | None = None,
    tilert_nodes: Sequence[TileRTNode] = (),
) -> list[Manifest]:
    """What `tilert-pd render` prints: the Secrets first (pods mount them), then the children.
    Without `node_api_token`, one is derived from `secret_token` (deterministic output for tests;
    `tilert-pd render` passes an independent random one). The metrics-only token is a one-way hash
    of the node API token: holding it reveals nothing of the other."""
    api_token = (
        node_api_token
        if node_api_token is not None
        else hashlib.sha256(f"node-api:{secret_token}".encode()).hexdigest()
    )
    metrics_token = hashlib.sha256(f"metrics:{api_token}".encode()).hexdigest()
    return [
        network.handoff_secret(cluster, namespace, secret_token),
        network.node_api_secret(cluster, namespace, api_token, metrics_token),
        *children(spec, cluster, namespace, tilert_nodes),
    ]
