"""The stack's Secrets and the policies that fence the data plane.

Secrets: the handoff's shared secret (`secret`, what senders sign with, and `accept`, further secrets
nodes accept during a rotation) and the node API token (the router's credential on the decode nodes'
HTTP API). The operator creates each once and changes the handoff Secret only to rotate it
(credentials.py); neither is re-applied from a render.

NetworkPolicies (the pod network): only prefill pods reach TileRT decode pods on anything but HTTP
(the ctrl port plus the transfer engine's data ports, which Mooncake and NIXL pick at run time), and
on the pod network only when the spec names no secondary network for the handoff; only the router
reaches the HTTP ports of prefill and decode pods; the native pool and prefill reach each other (the
native connector moves KV between them). Host-network pods are outside NetworkPolicy's reach, so none
are rendered under hostNetwork (status.DataPlaneProtected says so).

MultiNetworkPolicies (k8snetworkplumbingwg's CRD, enforced by a MultiNetworkPolicy implementation such
as multi-networkpolicy-iptables) do the same on the Multus networks named in transfer.rdma.networks:
there the decode pools admit the prefill pods alone, and the prefill admits only the decode pools.
They filter IP traffic; RDMA verbs traffic that bypasses the kernel is beyond any such policy.
"""

from __future__ import annotations

import base64
import copy

from tilert_operator import constants
from tilert_operator.autoscale.act import operator_driven
from tilert_operator.render import pods
from tilert_operator.render.pods import Manifest
from tilert_operator.spec import PDClusterSpec
from tilert_serve import defaults


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def handoff_secret(cluster: str, namespace: str, token: str, accept: str = "") -> Manifest:
    """The handoff secret: `secret` signs, `accept` lists further secrets nodes accept (one a line)."""
    meta = pods.metadata(cluster, namespace, "handoff", name=constants.handoff_secret_name(cluster))
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": meta,
        "type": "Opaque",
        "data": {constants.HANDOFF_SECRET_KEY: _b64(token), constants.HANDOFF_ACCEPT_KEY: _b64(accept)},
    }


def node_api_secret(cluster: str, namespace: str, token: str, metrics_token: str) -> Manifest:
    """The decode nodes' HTTP API credential, shared by the nodes and the router, and the operator's
    metrics-only token for the router's /metrics (the autoscaler's; it opens nothing else)."""
    meta = pods.metadata(cluster, namespace, "node-api", name=constants.node_api_secret_name(cluster))
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": meta,
        "type": "Opaque",
        "data": {constants.NODE_API_TOKEN_KEY: _b64(token), constants.METRICS_TOKEN_KEY: _b64(metrics_token)},
    }


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


#: The operator's pods, in whatever namespace the chart installed them, by the two labels the chart
#: gives its pod whatever the release is named or overridden to (nameOverride changes the name label):
#: it reads each TileRT node's /v1/status (HandoffReady), with the node-API token the node requires,
#: and, where it runs the autoscaler, the pods' /metrics (vLLM's on its API port, which it then admits).
OPERATOR_PEER: Manifest = {
    "namespaceSelector": {},
    "podSelector": {
        "matchLabels": {constants.LABEL_PART_OF: "tilert-pd", "app.kubernetes.io/component": "operator"}
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
    # The operator's autoscaler reads vLLM's /metrics (queue, KV use) where it runs the planner.
    vllm_scrapers = [*scrapers, copy.deepcopy(OPERATOR_PEER)] if operator_driven(spec) else scrapers
    out = []
    prefill_in = [{"from": [router, *vllm_scrapers], "ports": _tcp(defaults.VLLM_PORT)}]
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
        # The operator on the HTTP port only (HandoffReady reads the nodes' authenticated /v1/status).
        tilert_in.append({"from": [copy.deepcopy(OPERATOR_PEER)], "ports": _tcp(t.http_port)})
        out.append(_policy(cluster, namespace, constants.TILERT, tilert_in))
    if spec.decode.native.replicas:
        out.append(_policy(cluster, namespace, constants.NATIVE, [
            {"from": [router, *vllm_scrapers], "ports": _tcp(defaults.VLLM_PORT)},
            {"from": [prefill]},
        ]))  # fmt: skip
    return out


def _multi_policy(
    spec: PDClusterSpec, cluster: str, namespace: str, component: str, peers: list[str]
) -> Manifest:
    meta = pods.metadata(cluster, namespace, component)
    meta["annotations"] = {
        constants.MULTI_NETWORK_POLICY_FOR_ANNOTATION: ",".join(spec.transfer.rdma.networks)
    }
    return {
        "apiVersion": constants.MULTI_NETWORK_POLICY_API_VERSION,
        "kind": "MultiNetworkPolicy",
        "metadata": meta,
        "spec": {
            "podSelector": {"matchLabels": pods.selector(cluster, component)},
            "policyTypes": ["Ingress"],
            # Every port from the peers: the ctrl port and the engines' data ports (picked at run time).
            "ingress": [{"from": [_peer(cluster, p) for p in peers]}],
        },
    }


def multi_network_policies(spec: PDClusterSpec, cluster: str, namespace: str) -> list[Manifest]:
    """MultiNetworkPolicies on the spec's Multus networks: the decode pools admit only prefill pods,
    the prefill only the decode pools (a transfer engine's peer may open connections either way).
    Every pod of the data plane joins these networks, so each gets a policy there."""
    if not spec.network_policies.enabled or not spec.transfer.rdma.networks:
        return []
    t, n = spec.decode.tilert.replicas, spec.decode.native.replicas
    decoders = [c for c, on in ((constants.TILERT, t), (constants.NATIVE, n)) if on]
    out = [_multi_policy(spec, cluster, namespace, constants.PREFILL, decoders)] if decoders else []
    out += [_multi_policy(spec, cluster, namespace, c, [constants.PREFILL]) for c in decoders]
    return out
