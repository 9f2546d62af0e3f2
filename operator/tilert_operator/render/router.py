"""The router: a Deployment, a Service, and the ConfigMap holding its config.yaml (routing policy and
endpoint list). The operator rewrites the ConfigMap when TileRT nodes come and go; the router reloads
it without a restart, so nothing on the pod template depends on the endpoint list.

The endpoint list names every live generation's prefill and native Services, TileRT nodes and TileRT
discovery with the generation's compatibility fingerprint (render/generations.py): the router pairs a
prefill only with a decode of its generation, so while a new generation comes up beside the old one
each request is served by a pair of one generation.

DNS discovery of TileRT nodes (the headless Service's name, tilert_serve/router/discovery.py) is
rendered only for a generation whose data plane is the pod network (no `spec.transfer.rdma.networks`).
With a secondary network the endpoint list alone says which nodes the router uses: it holds only the
wired nodes, each with its address on that network (observe.tilert_nodes), and a ready node without
one is left out (EndpointsWired=False, DataPlaneAddressMissing). Discovery cannot do that: DNS names
every ready pod by its pod IP, where such a node's control port does not listen, and the router sees
no network-status to tell a wired node from an unwired one, so it would route to every ready pod at
an address no handoff can reach. Rendering no discovery there (rather than teaching the router to
skip) keeps the decision in the one place that reads the network-status; the cost is that a new node
joins when the kubelet syncs the ConfigMap (up to a minute), not within seconds. `tilert-pd local`
with the docker runtime writes that list the same way (tilert_serve/local/docker_runtime.py
`wired_nodes`), so it needs no discovery either."""

from __future__ import annotations

import posixpath
from collections.abc import Sequence

from tilert_operator import constants
from tilert_operator.render import commands, hygiene, native_decode, pods, prefill, tilert_decode
from tilert_operator.render.generations import Live, single
from tilert_operator.render.pods import Manifest
from tilert_operator.spec import PDClusterSpec
from tilert_serve import defaults
from tilert_serve.router import config as router_config

COMPONENT = constants.ROUTER


def config(
    spec: PDClusterSpec,
    *,
    prefill_urls: Sequence[str | router_config.Endpoint],
    tilert_nodes: Sequence[router_config.TileRTNode],
    native_urls: Sequence[str | router_config.Endpoint],
    api_keys_file: str | None,
    api_token_file: str | None = None,
) -> router_config.RouterConfig:
    """The router's configuration from the spec and the live endpoints (pods and local runs alike).
    `api_token_file` holds the node API token the router presents to the decode nodes."""
    p = spec.router.policy
    return router_config.RouterConfig(
        tilert_api_token_file=api_token_file,
        model=spec.model.name,
        prefill=[_endpoint(u) for u in prefill_urls],
        tilert=list(tilert_nodes),
        native=[_endpoint(u) for u in native_urls],
        policy=router_config.RoutingPolicy(
            header=p.header,
            tilert_aliases=list(p.tilert_aliases),
            native_aliases=list(p.native_aliases),
            default=p.default,
            when_tilert_full=p.when_tilert_full,
            unsupported_on_tilert=p.unsupported_on_tilert,
            prefill=p.prefill,
        ),
        api_keys_file=api_keys_file,
        metrics_public=spec.router.metrics_public,
        # Probe idle TileRT nodes with a real handoff (HandoffReady; tilert_serve/router/canary.py).
        handoff_probe=router_config.HandoffProbe(interval_s=router_config.HANDOFF_PROBE_INTERVAL_S),
        # Warm each new (prefill, native) pair before users need it (tilert_serve/router/native_pairs.py).
        native_warmup=router_config.NativeWarmup(enabled=True),
        # Traces of each request (tilert_serve/tracing.py): off ("" endpoint) unless the spec sets one.
        tracing=router_config.Tracing(
            endpoint=spec.observability.tracing.endpoint,
            sample_ratio=spec.observability.tracing.sample_ratio,
        ),
    )


def discovers(spec: PDClusterSpec) -> bool:
    """Whether the router may find this generation's TileRT nodes through DNS: only when a pod's IP is
    its data-plane address, so every ready pod DNS names is a wired node (see the module docstring)."""
    return not spec.transfer.rdma.networks


def _endpoint(url: str | router_config.Endpoint) -> router_config.Endpoint:
    return url if isinstance(url, router_config.Endpoint) else router_config.Endpoint(url=url)


def api_keys_file(spec: PDClusterSpec) -> str | None:
    s = spec.router.api_keys_secret
    return posixpath.join(constants.ROUTER_KEYS_DIR, s.key) if s else None


def pod_config(
    spec: PDClusterSpec,
    cluster: str,
    namespace: str,
    tilert_nodes: Sequence[router_config.TileRTNode],
    lives: Sequence[Live] | None = None,
) -> router_config.RouterConfig:
    """The router's config in a pod. `lives`: the live generations, oldest first (render/generations.py);
    None = `spec` alone, in slot a, with `tilert_nodes`. Policy and the router's own settings come from
    `spec` (the current one); each generation's endpoints from its own spec."""
    lives = single(spec, tilert_nodes) if lives is None else lives
    prefills: list[router_config.Endpoint] = []
    natives: list[router_config.Endpoint] = []
    nodes: list[router_config.TileRTNode] = []
    discoveries: list[router_config.TileRTDiscovery] = []
    for live in lives:
        g, compat = live.spec, live.generation.compat
        prefills.append(router_config.Endpoint(url=prefill.url(cluster, namespace, live.slot), compat=compat))
        if g.decode.native.replicas:
            natives.append(
                router_config.Endpoint(url=native_decode.url(cluster, namespace, live.slot), compat=compat)
            )
        nodes += [n.model_copy(update={"compat": compat}) for n in live.tilert_nodes]
        t = g.decode.tilert
        if t.replicas and discovers(g):
            # The headless Service's name resolves to the ready TileRT pods within seconds; the endpoint
            # list in this ConfigMap reaches the router only when the kubelet syncs the volume (up to a
            # minute).
            discoveries.append(
                router_config.TileRTDiscovery(
                    service=tilert_decode.service_host(cluster, namespace, live.slot),
                    http_port=t.http_port,
                    ctrl_port=t.ctrl_port,
                    slots=t.slots,
                    max_seq_len=g.model.max_seq_len,
                    compat=compat,
                )
            )
    cfg = config(
        spec,
        prefill_urls=prefills,
        tilert_nodes=nodes,
        native_urls=natives,
        api_keys_file=api_keys_file(spec),
        api_token_file=defaults.NODE_API_TOKEN_PATH,
    )
    # The operator's autoscaler reads /metrics with its metrics-only token where a key guards it.
    guarded = cfg.api_keys_file is not None and not cfg.metrics_public
    return cfg.model_copy(
        update={
            "tilert_discovery": discoveries,
            "metrics_token_file": constants.ROUTER_METRICS_TOKEN_PATH if guarded else None,
        }
    )


def configmap(
    spec: PDClusterSpec,
    cluster: str,
    namespace: str,
    tilert_nodes: Sequence[router_config.TileRTNode],
    lives: Sequence[Live] | None = None,
) -> Manifest:
    cfg = pod_config(spec, cluster, namespace, tilert_nodes, lives)
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": pods.metadata(cluster, namespace, COMPONENT),
        "data": {posixpath.basename(constants.ROUTER_CONFIG_FILE): router_config.dump(cfg)},
    }


def deployment(spec: PDClusterSpec, cluster: str, namespace: str) -> Manifest:
    r = spec.router
    port = r.service.port
    cmd = commands.router(spec, commands.Paths.pod(spec))
    # The node API token is mounted whatever the TileRT pool's size: scaling it never restarts the router.
    mounts: list[Manifest] = [
        {"name": "config", "mountPath": constants.ROUTER_CONFIG_DIR, "readOnly": True},
        pods.NODE_API_MOUNT,
    ]
    volumes: list[Manifest] = [
        {"name": "config", "configMap": {"name": constants.child_name(cluster, COMPONENT)}},
        pods.node_api_volume(cluster, metrics_token=True),
    ]
    if r.api_keys_secret:
        mounts.append({"name": "api-keys", "mountPath": constants.ROUTER_KEYS_DIR, "readOnly": True})
        volumes.append(
            {"name": "api-keys", "secret": {"secretName": r.api_keys_secret.name, "defaultMode": 0o400}}
        )
    c = pods.container(
        "router", r.image, cmd, ports=[("http", port)], resources=pods.resources(r, gpus=0), mounts=mounts
    )
    # Ready = the router can route (a prefill and a decode route with a working handoff), not process up.
    c["readinessProbe"] = pods.http_probe("/ready", port, period=5)
    c["livenessProbe"] = pods.http_probe("/health", port, period=20, failures=6)
    c |= hygiene.container_fields(r)
    template = pods.pod_template(
        cluster=cluster, component=COMPONENT, containers=[c], pool=r, volumes=volumes
    )
    out: Manifest = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": pods.metadata(cluster, namespace, COMPONENT),
        "spec": {
            "replicas": r.replicas,
            **pods.rollout("Deployment", r, gpus=0),
            "selector": {"matchLabels": pods.selector(cluster, COMPONENT)},
            "template": template,
        },
    }
    return pods.apply_overrides(out, r)


def service(spec: PDClusterSpec, cluster: str, namespace: str) -> Manifest:
    r = spec.router
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": pods.metadata(cluster, namespace, COMPONENT),
        "spec": {
            "type": r.service.type,
            "selector": pods.selector(cluster, COMPONENT),
            "ports": [{"name": "http", "port": r.service.port, "targetPort": "http", "protocol": "TCP"}],
        },
    }


def render(
    spec: PDClusterSpec,
    cluster: str,
    namespace: str,
    tilert_nodes: Sequence[router_config.TileRTNode] = (),
    lives: Sequence[Live] | None = None,
) -> list[Manifest]:
    return [
        configmap(spec, cluster, namespace, tilert_nodes, lives),
        deployment(spec, cluster, namespace),
        service(spec, cluster, namespace),
    ]
