"""The handoff's shared Secret and the NetworkPolicies that fence the data plane.

Policies: only prefill pods reach TileRT decode pods on anything but HTTP (the ctrl port plus the
transfer engine's data ports, which Mooncake and NIXL pick at run time), and on the pod network only
when the spec names no secondary network for the handoff; only the router reaches the
HTTP ports of prefill and decode pods; the native pool and prefill reach each other (the native
connector moves KV between them). Host-network pods are outside NetworkPolicy's reach, so none are
rendered under hostNetwork.
"""

from __future__ import annotations

import base64
import copy
import hashlib

from tilert_operator import constants
from tilert_operator.render import pods
from tilert_operator.render.pods import Manifest
from tilert_operator.spec import PDClusterSpec
from tilert_serve import defaults


def handoff_secret(cluster: str, namespace: str, token: str) -> Manifest:
    """The handoff secret; the operator creates it once (never re-applies it), so it stays stable."""
    meta = pods.metadata(cluster, namespace, "handoff", name=constants.handoff_secret_name(cluster))
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": meta,
        "type": "Opaque",
        "data": {constants.HANDOFF_SECRET_KEY: base64.b64encode(token.encode()).decode()},
    }


def secret_version(token: str) -> str:
    """A short, one-way version of the token for pod annotations (rolls pods when it changes)."""
    return hashlib.sha256(token.encode()).hexdigest()[:16]


def secret_version_of(secret: Manifest) -> str | None:
    raw = (secret.get("data") or {}).get(constants.HANDOFF_SECRET_KEY)
    return secret_version(base64.b64decode(raw).decode()) if raw else None


def _peer(cluster: str, component: str) -> Manifest:
    return {"podSelector": {"matchLabels": pods.selector(cluster, component)}}


def _policy(cluster: str, namespace: str, component: str, ingress: list[Manifest]) -> Manifest:
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": pods.metadata(cluster, namespace, component),
        "spec": {
            "podSelector": {"matchLabels": pods.selector(cluster, component)},
            "policyTypes": ["Ingress"],
            "ingress": ingress,
        },
    }


def _tcp(port: int) -> list[Manifest]:
    return [{"protocol": "TCP", "port": port}]


def network_policies(spec: PDClusterSpec, cluster: str, namespace: str) -> list[Manifest]:
    if not spec.network_policies.enabled or spec.transfer.rdma.host_network:
        return []
    router = _peer(cluster, constants.ROUTER)
    prefill = _peer(cluster, constants.PREFILL)
    native = _peer(cluster, constants.NATIVE)
    # Extra peers (a metrics scraper) on the HTTP ports only, never on the ctrl or transfer ports.
    scrapers = [copy.deepcopy(p) for p in spec.network_policies.metrics_from]
    out = []
    prefill_in = [{"from": [router, *scrapers], "ports": _tcp(defaults.VLLM_PORT)}]
    if spec.decode.native.replicas:
        prefill_in.append({"from": [native]})
    out.append(_policy(cluster, namespace, constants.PREFILL, prefill_in))
    t = spec.decode.tilert
    if t.replicas:
        tilert_in = [{"from": [router, *scrapers], "ports": _tcp(t.http_port)}]
        if not spec.transfer.rdma.networks:
            # The handoff crosses the pod network. With secondary networks it never does (the node
            # binds its control port there, and its transfer engine is reached there), so the pod
            # network admits the router alone: Mooncake's wildcard listeners stay closed on it.
            tilert_in.insert(0, {"from": [prefill]})
        out.append(_policy(cluster, namespace, constants.TILERT, tilert_in))
    if spec.decode.native.replicas:
        out.append(_policy(cluster, namespace, constants.NATIVE, [
            {"from": [router, *scrapers], "ports": _tcp(defaults.VLLM_PORT)},
            {"from": [prefill]},
        ]))  # fmt: skip
    return out
