"""Names every part of the operator agrees on: API identity, label keys, child names, images.

Ports and the handoff secret's path are not here: they live in `tilert_serve.defaults`, the one source
the serving components share.
"""

from __future__ import annotations

import posixpath
from typing import Final

from tilert_serve import defaults

GROUP: Final = "pd.tilert.ai"
VERSION: Final = "v1alpha1"
KIND: Final = "PDCluster"
PLURAL: Final = "pdclusters"
API_VERSION: Final = f"{GROUP}/{VERSION}"

#: The one server-side-apply field manager: every write of a child uses it, so ownership is stable
#: across operator restarts and versions.
FIELD_MANAGER: Final = "tilert-pd-operator"

# Label keys. `cluster` and `component` select a pool's pods (Services, NetworkPolicies, the
# operator's pod index); the app.kubernetes.io ones are for people and tools.
LABEL_CLUSTER: Final = f"{GROUP}/cluster"
LABEL_COMPONENT: Final = f"{GROUP}/component"
LABEL_NAME: Final = "app.kubernetes.io/name"
LABEL_INSTANCE: Final = "app.kubernetes.io/instance"
LABEL_PART_OF: Final = "app.kubernetes.io/part-of"
LABEL_MANAGED_BY: Final = "app.kubernetes.io/managed-by"
#: On the data-plane pools' workloads and pods: the compatibility generation's fingerprint
#: (tilert_serve.compat.Compat; render/generations.py), 12 hex digits.
LABEL_GENERATION: Final = f"{GROUP}/generation"
#: On the data-plane pools' workloads and pods: which of the two sets of workload names (SLOTS) holds
#: them, so that the Services of one slot never select the pods of the other.
LABEL_SLOT: Final = f"{GROUP}/slot"
#: On the data-plane workloads: the spec (JSON) their generation was rendered from, so that while a
#: new generation comes up the old one is rendered as it was (and its endpoints stay in the router).
GENERATION_SPEC_ANNOTATION: Final = f"{GROUP}/generation-spec"
#: The two sets of workload names of the data-plane pools (render/generations.py): "a" keeps the
#: names of a PDCluster's first generation, "b" holds the next generation while both run.
SLOT_A: Final = "a"
SLOT_B: Final = "b"
SLOTS: Final = (SLOT_A, SLOT_B)
MANAGED_BY: Final = "tilert-pd-operator"

#: The non-root user (and group) every image of ours has (docker/*.Dockerfile) and the pods run as
#: (render/hygiene.py). The operator's own chart uses it too (charts/tilert-pd/values.yaml).
RUN_AS_USER: Final = 65532

# Component names: label values, child-name suffixes and keys of `commands()`.
PREFILL: Final = "prefill"
TILERT: Final = "tilert-decode"
NATIVE: Final = "native-decode"
ROUTER: Final = "router"
COMPONENTS: Final = (PREFILL, TILERT, NATIVE, ROUTER)

#: Hash of the intent last applied to a child. Server-side apply drops fields the operator stops
#: applying, but only if it applies again: a changed hash makes it apply even when every field it
#: still wants is already there (a subset check alone would miss a removed field).
APPLIED_HASH_ANNOTATION: Final = f"{GROUP}/applied-hash"

# No pod template carries a hash of a Secret: the handoff secret's readers (node, sender) and the
# node API token's (node, router) re-read the mounted files when the kubelet updates them, so a new
# or rotated credential never restarts a pod (credentials.py).

#: On a PDCluster: set it (to any new value) to rotate the handoff secret; see credentials.py.
ROTATE_HANDOFF_SECRET_ANNOTATION: Final = f"{GROUP}/rotate-handoff-secret"
#: On a PDCluster: set it (to any new value) to rotate the node API token; see credentials.py.
ROTATE_NODE_API_TOKEN_ANNOTATION: Final = f"{GROUP}/rotate-node-api-token"
#: On a Secret carrying the operator's labels for this cluster: "true" lets the operator adopt it
#: (take ownership and, for the handoff Secret, rotate it). Without it, or an ownerReference to the
#: PDCluster, a Secret with the expected name is left untouched and reported.
ADOPT_ANNOTATION: Final = f"{GROUP}/adopt"
#: On the handoff Secret: the rotation state (the request being served, its phase, when the phase
#: began, when the last rotation completed), so a restarted operator resumes where it left off.
ROTATION_REQUEST_ANNOTATION: Final = f"{GROUP}/rotation-request"
ROTATION_PHASE_ANNOTATION: Final = f"{GROUP}/rotation-phase"
ROTATION_SINCE_ANNOTATION: Final = f"{GROUP}/rotation-phase-since"
ROTATED_AT_ANNOTATION: Final = f"{GROUP}/rotated-at"

#: The pod annotation that asks Multus for secondary networks (what Multus reports back is
#: tilert_serve.dataplane.MULTUS_STATUS_ANNOTATION).
MULTUS_NETWORKS_ANNOTATION: Final = "k8s.v1.cni.cncf.io/networks"

#: Where the model weights are mounted in every pod that loads them.
MODEL_MOUNT: Final = "/models"
#: Where the router's ConfigMap and API-key Secret are mounted.
ROUTER_CONFIG_DIR: Final = "/etc/tilert-pd/router"
ROUTER_CONFIG_FILE: Final = f"{ROUTER_CONFIG_DIR}/config.yaml"
ROUTER_KEYS_DIR: Final = "/etc/tilert-pd/router-keys"
#: Key of the handoff secret inside its Secret object: senders sign with it, nodes accept it.
HANDOFF_SECRET_KEY: Final = "secret"
#: Key of the extra secrets nodes accept (one per line, may be empty): the rotation's other half.
HANDOFF_ACCEPT_KEY: Final = "accept"
#: Key of the node API token inside the `<cluster>-node-api` Secret.
NODE_API_TOKEN_KEY: Final = "token"
#: Key of the router's metrics-only token in the same Secret: the operator reads the router's
#: /metrics with it (autoscaling); the router accepts it for GET /metrics and nothing else.
METRICS_TOKEN_KEY: Final = "metrics-token"
#: Where the router reads it: beside the node API token, in the router's mount of that Secret only.
ROUTER_METRICS_TOKEN_PATH: Final = posixpath.join(
    posixpath.dirname(defaults.NODE_API_TOKEN_PATH), METRICS_TOKEN_KEY
)

#: MultiNetworkPolicy (k8snetworkplumbingwg's CRD): what fences the data plane on Multus networks.
MULTI_NETWORK_POLICY_API_VERSION: Final = "k8s.cni.cncf.io/v1beta1"
#: Which Multus networks a MultiNetworkPolicy applies to (comma-separated network names).
MULTI_NETWORK_POLICY_FOR_ANNOTATION: Final = "k8s.v1.cni.cncf.io/policy-for"

# Default images. One place, so the chart and the docs can point at them.
DEFAULT_VLLM_IMAGE: Final = "ghcr.io/tilert-pd/vllm-prefill:0.1.0-cuda"
DEFAULT_DECODE_IMAGE: Final = "ghcr.io/tilert-pd/serve:0.1.0-cuda"
DEFAULT_ROUTER_IMAGE: Final = "ghcr.io/tilert-pd/serve:0.1.0-cpu"

#: TileRT's kernels shard one model over exactly this many GPUs (upstream ShowHandsDSALayer.num_devices).
TILERT_GPUS: Final = 8
#: Device-plugin resource of NVIDIA GPUs.
GPU_RESOURCE: Final = "nvidia.com/gpu"


def child_name(cluster: str, component: str) -> str:
    """Name of a component's children (workload, Service, ConfigMap): `<cluster>-<component>`."""
    return f"{cluster}-{component}"


#: Slot b's workload names: `<cluster>-<this>` (short enough that the TileRT StatefulSet's name fits
#: 52 characters with a 38-character cluster name, as slot a's does).
SLOT_B_NAMES: Final = {PREFILL: "prefill-b", TILERT: "tilert-b", NATIVE: "native-b"}


def slot_child_name(cluster: str, component: str, slot: str) -> str:
    """Name of a data-plane pool's workload and Service in `slot`: slot a keeps `child_name`."""
    if slot == SLOT_A:
        return child_name(cluster, component)
    return f"{cluster}-{SLOT_B_NAMES[component]}"


def handoff_secret_name(cluster: str) -> str:
    return f"{cluster}-handoff"


def node_api_secret_name(cluster: str) -> str:
    return f"{cluster}-node-api"
