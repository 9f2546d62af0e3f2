"""Shared pieces of the pool renderers: labels, containers, the data-plane wiring (model volume,
/dev/shm, handoff secret, RDMA resources, Multus, IPC_LOCK, hostNetwork) and overrides.

Every function returns fresh dicts and never mutates the spec (the spec is frozen anyway).
"""

from __future__ import annotations

import copy
import posixpath
from typing import Any

from tilert_operator import constants
from tilert_operator.render import hygiene
from tilert_operator.render.commands import ContainerCommand, Paths, tiny_model
from tilert_operator.render.generations import Live
from tilert_operator.spec import NativeDecode, Pool, Prefill, ServingPool
from tilert_serve import dataplane, defaults

Manifest = dict[str, Any]


def selector(cluster: str, component: str) -> dict[str, str]:
    """The labels that select a pool's pods (Services, NetworkPolicies, the operator's index)."""
    return {constants.LABEL_CLUSTER: cluster, constants.LABEL_COMPONENT: component}


def labels(cluster: str, component: str) -> dict[str, str]:
    return selector(cluster, component) | {
        constants.LABEL_NAME: "tilert-pd",
        constants.LABEL_INSTANCE: cluster,
        constants.LABEL_PART_OF: "tilert-pd",
        constants.LABEL_MANAGED_BY: constants.MANAGED_BY,
    }


def metadata(cluster: str, namespace: str, component: str, name: str | None = None) -> Manifest:
    return {
        "name": name or constants.child_name(cluster, component),
        "namespace": namespace,
        "labels": labels(cluster, component),
    }


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch: dicts merge, null deletes, everything else (lists too) replaces."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = copy.deepcopy(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge_patch(out.get(key), value)
    return out


def apply_overrides(workload: Manifest, pool: Pool) -> Manifest:
    return merge_patch(workload, pool.overrides) if pool.overrides else workload


def env_list(cmd: ContainerCommand, extra: list[Manifest] | None = None) -> list[Manifest]:
    env: list[Manifest] = [{"name": k, "value": v} for k, v in sorted(cmd.env.items())]
    return env + (extra or [])


def http_probe(path: str, port: int, *, period: int = 10, failures: int = 3) -> Manifest:
    return {
        "httpGet": {"path": path, "port": port},
        "periodSeconds": period,
        "failureThreshold": failures,
        "timeoutSeconds": 5,
    }


def container(
    name: str,
    image: str,
    cmd: ContainerCommand,
    *,
    ports: list[tuple[str, int]],
    resources: Manifest,
    mounts: list[Manifest] | None = None,
    extra_env: list[Manifest] | None = None,
) -> Manifest:
    out: Manifest = {
        "name": name,
        "image": image,
        "command": list(cmd.argv),
        "ports": [{"name": n, "containerPort": p, "protocol": "TCP"} for n, p in ports],
        "resources": resources,
    }
    env = env_list(cmd, extra_env)
    if env:
        out["env"] = env
    if mounts:
        out["volumeMounts"] = mounts
    return out


def resources(pool: Pool, *, gpus: int, extra: dict[str, int] | None = None) -> Manifest:
    """The pool's requests/limits plus GPUs and RDMA devices (device plugins need them as limits)."""
    res: Manifest = copy.deepcopy(pool.resources)
    devices = dict(extra or {})
    if gpus:
        devices[constants.GPU_RESOURCE] = gpus
    if devices:
        res["limits"] = dict(res.get("limits") or {}) | devices
        res["requests"] = dict(res.get("requests") or {}) | devices
    return res


def scheduling(pool: Pool) -> Manifest:
    out: Manifest = {}
    if pool.node_selector:
        out["nodeSelector"] = dict(pool.node_selector)
    if pool.tolerations:
        out["tolerations"] = copy.deepcopy(pool.tolerations)
    return out


#: Host-network pods that listen on the same ports and so must not share a node: both vLLM pools use
#: VLLM_PORT; TileRT nodes clash only with each other (validation keeps their ports off vLLM's).
_SAME_PORTS: dict[str, frozenset[str]] = {
    constants.PREFILL: frozenset({constants.PREFILL, constants.NATIVE}),
    constants.NATIVE: frozenset({constants.PREFILL, constants.NATIVE}),
    constants.TILERT: frozenset({constants.TILERT}),
}


def handoff_secret_volume(cluster: str) -> Manifest:
    """The handoff Secret as files `secret` and `accept` beside each other (a directory mount, not
    subPath, so the kubelet's updates reach running pods: rotation needs no restart)."""
    return {
        "name": "handoff-secret",
        "secret": {
            "secretName": constants.handoff_secret_name(cluster),
            "defaultMode": 0o400,
            "items": [
                {"key": constants.HANDOFF_SECRET_KEY, "path": posixpath.basename(defaults.SECRET_PATH)},
                {"key": constants.HANDOFF_ACCEPT_KEY, "path": constants.HANDOFF_ACCEPT_KEY},
            ],
        },
    }


HANDOFF_SECRET_MOUNT: Manifest = {
    "name": "handoff-secret",
    "mountPath": posixpath.dirname(defaults.SECRET_PATH),
    "readOnly": True,
}


def node_api_volume(cluster: str, *, metrics_token: bool = False) -> Manifest:
    """The node API token, for the TileRT decode pods and the router; `metrics_token`: with the
    operator's metrics-only token too (the router's mount alone: it is what accepts it)."""
    items = [{"key": constants.NODE_API_TOKEN_KEY, "path": posixpath.basename(defaults.NODE_API_TOKEN_PATH)}]
    if metrics_token:
        items.append(
            {
                "key": constants.METRICS_TOKEN_KEY,
                "path": posixpath.basename(constants.ROUTER_METRICS_TOKEN_PATH),
            }
        )
    return {
        "name": "node-api-token",
        "secret": {
            "secretName": constants.node_api_secret_name(cluster),
            "defaultMode": 0o400,
            "items": items,
        },
    }


NODE_API_MOUNT: Manifest = {
    "name": "node-api-token",
    "mountPath": posixpath.dirname(defaults.NODE_API_TOKEN_PATH),
    "readOnly": True,
}


#: vLLM advertises its NIXL side channel at the pod's own address, for the native decode pods.
NIXL_SIDE_CHANNEL_ENV: Manifest = {
    "name": "VLLM_NIXL_SIDE_CHANNEL_HOST",
    "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}},
}


class DataPlane:
    """The wiring prefill and decode pods share: model, shm, secret and RDMA. `secret` marks the two
    ends of the TileRT handoff (prefill and TileRT decode pods), which also learn their own address on
    the handoff's secondary networks (tilert_serve.dataplane). `node_api` marks the TileRT decode
    pods, which mount the node API token. `live` is the generation rendered (its spec and slot)."""

    def __init__(self, live: Live, cluster: str, *, secret: bool, node_api: bool = False) -> None:
        self.live = live
        self.spec = live.spec
        self.cluster = cluster
        self.secret = secret
        self.node_api = node_api
        self.paths = Paths.pod(live.spec)

    def rdma_devices(self) -> dict[str, int]:
        return dict(self.spec.transfer.rdma.resources) if self.spec.transfer.protocol == "rdma" else {}

    @property
    def multus(self) -> bool:
        """An end of the handoff on secondary networks: it reads its own Multus network-status."""
        return self.secret and bool(self.spec.transfer.rdma.networks)

    def volumes(self) -> list[Manifest]:
        w = self.spec.model.weights
        model: Manifest = {"name": "model"} | (copy.deepcopy(w.volume) if w.volume else {"emptyDir": {}})
        vols = [
            model,
            {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": self.spec.transfer.shm_size}},
        ]
        if self.secret:
            vols.append(handoff_secret_volume(self.cluster))
        if self.node_api:
            vols.append(node_api_volume(self.cluster))
        if self.multus:
            # The pod's own Multus network-status annotation as a file (the kubelet keeps it current).
            vols.append({"name": "podinfo", "downwardAPI": {"items": [{
                "path": posixpath.basename(dataplane.NETWORK_STATUS_FILE),
                "fieldRef": {"fieldPath": f"metadata.annotations['{dataplane.MULTUS_STATUS_ANNOTATION}']"},
            }]}})  # fmt: skip
        return vols

    def mounts(self) -> list[Manifest]:
        out: list[Manifest] = [
            {"name": "model", "mountPath": constants.MODEL_MOUNT, "readOnly": True},
            {"name": "shm", "mountPath": "/dev/shm"},
        ]
        if self.secret:
            out.append(HANDOFF_SECRET_MOUNT)
        if self.node_api:
            out.append(NODE_API_MOUNT)
        if self.multus:
            out.append(
                {
                    "name": "podinfo",
                    "mountPath": posixpath.dirname(dataplane.NETWORK_STATUS_FILE),
                    "readOnly": True,
                }
            )
        return out

    def init_containers(self, pool: ServingPool) -> list[Manifest]:
        if not self.spec.model.weights.tiny:
            return []
        cmd = tiny_model(self.spec, self.paths)
        return [{
            "name": "tiny-model",
            "image": pool.image,
            "command": list(cmd.argv),
            "volumeMounts": [{"name": "model", "mountPath": constants.MODEL_MOUNT}],
            # The restricted Pod Security Standard checks init containers too; it needs no capability.
            "securityContext": hygiene.container_security_context(pool),
        }]  # fmt: skip

    def capabilities(self) -> list[str]:
        """Capabilities added back after dropping ALL: RDMA pins (registers) memory, and the container
        needs IPC_LOCK to lift its memlock limit."""
        return ["IPC_LOCK"] if self.spec.transfer.protocol == "rdma" else []

    def pod_annotations(self) -> dict[str, str]:
        out: dict[str, str] = {}
        nets = self.spec.transfer.rdma.networks
        if nets:
            out[constants.MULTUS_NETWORKS_ANNOTATION] = ",".join(nets)
        return out

    def pod_fields(self, component: str) -> Manifest:
        """hostNetwork, its DNS policy and one-pod-per-node anti-affinity (ports are the node's)."""
        if not self.spec.transfer.rdma.host_network:
            return {}
        return {
            "hostNetwork": True,
            # Without this, host-network pods resolve with the node's resolv.conf and miss Services.
            "dnsPolicy": "ClusterFirstWithHostNet",
            "affinity": {
                "podAntiAffinity": {
                    "requiredDuringSchedulingIgnoredDuringExecution": [{
                        "labelSelector": {
                            "matchLabels": {constants.LABEL_CLUSTER: self.cluster},
                            "matchExpressions": [{
                                "key": constants.LABEL_COMPONENT,
                                "operator": "In",
                                "values": sorted(_SAME_PORTS[component]),
                            }],
                        },
                        "topologyKey": "kubernetes.io/hostname",
                    }],
                },
            },
        }  # fmt: skip

    def workload(
        self,
        *,
        kind: str,
        namespace: str,
        component: str,
        pool: ServingPool,
        container_name: str,
        cmd: ContainerCommand,
        ports: list[tuple[str, int]],
        ready: Manifest,
        health_port: int,
        extra_env: list[Manifest] | None = None,
        spec_fields: Manifest | None = None,
        pre_stop: list[str] | None = None,
    ) -> Manifest:
        """A data-plane Deployment or StatefulSet: one container with the shared wiring and probes."""
        c = container(
            container_name,
            pool.image,
            cmd,
            ports=ports,
            resources=resources(pool, gpus=pool.gpus, extra=self.rdma_devices()),
            mounts=self.mounts(),
            extra_env=[*self.downward_env(), *(extra_env or [])],
        )
        c["readinessProbe"] = ready
        c["livenessProbe"] = http_probe("/health", health_port, period=20, failures=6)
        # Loading a large checkpoint takes minutes; the startup probe holds liveness off until then.
        c["startupProbe"] = http_probe("/health", health_port, failures=360)
        c |= hygiene.container_fields(pool, add_capabilities=self.capabilities(), pre_stop=pre_stop)
        template = pod_template(
            cluster=self.cluster,
            component=component,
            containers=[c],
            pool=pool,
            init_containers=self.init_containers(pool),
            volumes=self.volumes(),
            annotations=self.pod_annotations(),
            extra=self.pod_fields(component),
            as_root=bool(self.capabilities()),
            extra_labels=self.live.pod_labels(),
        )
        meta = metadata(self.cluster, namespace, component, name=self.live.name(self.cluster, component))
        meta["labels"] |= self.live.pod_labels()
        # The spec this generation was rendered from (on its prefill Deployment): while the next
        # generation comes up, this one is rendered from it as it was (render/generations.py).
        annotations = self.live.annotations(component)
        if annotations:
            meta["annotations"] = annotations
        out: Manifest = {
            "apiVersion": "apps/v1",
            "kind": kind,
            "metadata": meta,
            "spec": {
                "replicas": pool.replicas,
                **(spec_fields or {}),
                **rollout(kind, pool, pool.gpus),
                "selector": {
                    "matchLabels": selector(self.cluster, component) | self.live.workload_selector()
                },
                "template": template,
            },
        }
        return apply_overrides(out, pool)

    def downward_env(self) -> list[Manifest]:
        env = [
            {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
            {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        ]
        if self.multus:
            # The spec's network names are relative to the pod's namespace.
            env.append(
                {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}}
            )
        return env


def rollout(kind: str, pool: Pool, gpus: int) -> Manifest:
    """The workload's rollout strategy (render/hygiene.py)."""
    if kind == "StatefulSet":
        return {"updateStrategy": hygiene.statefulset_update_strategy(pool)}
    return {"strategy": hygiene.deployment_strategy(pool, gpus)}


def pod_template(
    *,
    cluster: str,
    component: str,
    containers: list[Manifest],
    pool: Pool,
    init_containers: list[Manifest] | None = None,
    volumes: list[Manifest] | None = None,
    annotations: dict[str, str] | None = None,
    extra: Manifest | None = None,
    as_root: bool = False,
    extra_labels: dict[str, str] | None = None,
) -> Manifest:
    meta: Manifest = {"labels": labels(cluster, component) | (extra_labels or {})}
    if annotations:
        meta["annotations"] = annotations
    spec: Manifest = {
        "containers": containers,
        **scheduling(pool),
        **hygiene.pod_fields(pool, selector(cluster, component), as_root=as_root),
        **(extra or {}),
    }
    if init_containers:
        spec["initContainers"] = init_containers
    if volumes:
        spec["volumes"] = volumes
    return {"metadata": meta, "spec": spec}


def service(
    cluster: str,
    namespace: str,
    component: str,
    ports: list[tuple[str, int]],
    *,
    headless: bool = False,
    live: Live | None = None,
) -> Manifest:
    """A pool's Service; with `live`, the Service of that generation's slot (its name and selector)."""
    spec: Manifest = {"clusterIP": "None"} if headless else {}
    spec["selector"] = selector(cluster, component) | (live.service_selector() if live else {})
    spec["ports"] = [{"name": n, "port": p, "targetPort": n, "protocol": "TCP"} for n, p in ports]
    meta = metadata(cluster, namespace, component, name=live.name(cluster, component) if live else None)
    if live is not None:
        meta["labels"] |= live.pod_labels()
    return {"apiVersion": "v1", "kind": "Service", "metadata": meta, "spec": spec}


def vllm_deployment(
    dp: DataPlane, namespace: str, component: str, pool: Prefill | NativeDecode, cmd: ContainerCommand
) -> Manifest:
    """A vLLM server pool (prefill, native decode): one `vllm serve` container on VLLM_PORT."""
    return dp.workload(
        kind="Deployment",
        namespace=namespace,
        component=component,
        pool=pool,
        container_name="vllm",
        cmd=cmd,
        ports=[("http", defaults.VLLM_PORT)],
        ready=http_probe("/health", defaults.VLLM_PORT),
        health_port=defaults.VLLM_PORT,
        extra_env=[NIXL_SIDE_CHANNEL_ENV],
        pre_stop=hygiene.vllm_pre_stop(pool),
    )


def vllm_service(cluster: str, namespace: str, component: str, live: Live) -> Manifest:
    return service(cluster, namespace, component, [("http", defaults.VLLM_PORT)], live=live)


def vllm_url(cluster: str, namespace: str, component: str, slot: str = constants.SLOT_A) -> str:
    """A vLLM pool's Service URL (of one slot's generation) as the router reaches it."""
    name = constants.slot_child_name(cluster, component, slot)
    return f"http://{name}.{namespace}.svc:{defaults.VLLM_PORT}"
