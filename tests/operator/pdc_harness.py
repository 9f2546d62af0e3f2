"""Driving the operator in tests: KopfRunner arguments, waits, and pods a test plays the controller for."""

from __future__ import annotations

import asyncio
import copy
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import pdc_apiserver
import pdc_rbac

from tilert_operator import constants
from tilert_operator.kubeapi import Client, Connection
from tilert_serve import dataplane

T = TypeVar("T")
POD = ("", "v1", "pods")
PDC = (constants.GROUP, constants.VERSION, constants.PLURAL)
ARGS = ["run", "-m", "tilert_operator.wiring", "--all-namespaces", "--standalone", "--verbose"]


def wait_for(what: str, fn: Callable[[], T | None], timeout: float = 20.0, interval: float = 0.1) -> T:
    deadline = time.monotonic() + timeout
    last: T | None = None
    while time.monotonic() < deadline:
        last = fn()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}; last: {last!r}")


def run(apiserver: Any, fn: Callable[[Client], Awaitable[T]]) -> T:
    """`fn` with the operator's own API client against the test server, from a synchronous test."""

    async def go() -> T:
        async with Client(Connection(server=apiserver.url)) as api:
            return await fn(api)

    return asyncio.run(go())


def body(apiserver: Any, name: str) -> dict[str, Any]:
    """The PDCluster `name` as the server holds it (it must exist)."""
    obj = apiserver.server.get("pdclusters", "default", name)
    assert obj is not None
    return obj


def reconcile_once(apiserver: Any, name: str) -> Any:
    """One reconcile of the PDCluster `name` in default, as the operator's worker runs it."""
    from tilert_operator import reconcile

    return run(apiserver, lambda api: reconcile.reconcile(api, body(apiserver, name)))


def patch_spec(apiserver: Any, name: str, patch: dict[str, Any], namespace: str = "default") -> None:
    """A merge patch of the PDCluster's spec, as `kubectl patch --type=merge` sends it."""
    path = f"/apis/{constants.GROUP}/{constants.VERSION}/namespaces/{namespace}/{constants.PLURAL}/{name}"
    run(
        apiserver,
        lambda api: api.request(
            "patch", "PATCH", path, body={"spec": patch}, content_type="application/merge-patch+json"
        ),
    )


def pod(
    cluster: str,
    component: str,
    index: int,
    namespace: str = "default",
    *,
    ready: bool = True,
    ip: str | None = None,
    rdma_net: str | None = None,
    rdma_ip: str | None = None,
    owner: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A pod as a workload controller and the kubelet would make it."""
    name = f"{cluster}-{component}-{index}"
    meta: dict[str, Any] = {
        "name": name, "namespace": namespace,
        "labels": {constants.LABEL_CLUSTER: cluster, constants.LABEL_COMPONENT: component,
                   constants.LABEL_MANAGED_BY: constants.MANAGED_BY},
    }  # fmt: skip
    if owner:
        meta["ownerReferences"] = [
            {
                "apiVersion": owner["apiVersion"],
                "kind": owner["kind"],
                "name": owner["metadata"]["name"],
                "uid": owner["metadata"]["uid"],
                "controller": True,
            }
        ]
    if rdma_net:
        meta["annotations"] = {
            dataplane.MULTUS_STATUS_ANNOTATION: json.dumps(
                [{"name": "cbr0", "ips": [ip]}, {"name": rdma_net, "interface": "net1", "ips": [rdma_ip]}]
            )
        }
    return {
        "apiVersion": "v1", "kind": "Pod", "metadata": meta,
        "spec": {"containers": [{"name": "c", "image": "i"}]},
        "status": {"phase": "Running", "podIP": ip or f"10.0.{len(component)}.{index + 1}",
                   "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]},
    }  # fmt: skip


def roll(
    apiserver: Any, cluster: str, component: str, *, ready: bool = True, ips: tuple[str, ...] = ()
) -> None:
    """Play a pool's workload controller and kubelet finishing a rollout: its pods are replaced by as
    many pods of the current template as the workload wants (the API test server stamps each new pod
    with that template's revision; pdc_apiserver.ApiServer._play_controllers). `ips`: their pod IPs."""
    srv = apiserver.server
    plural = "statefulsets" if component == constants.TILERT else "deployments"
    owner = srv.get(plural, "default", constants.child_name(cluster, component))
    if owner is None:
        return
    for p in srv.objects("pods", "default"):
        labels = p["metadata"].get("labels") or {}
        if (
            labels.get(constants.LABEL_CLUSTER) == cluster
            and labels.get(constants.LABEL_COMPONENT) == component
        ):
            apiserver.call(srv.remove(POD, "default", p["metadata"]["name"]))
    for i in range(int(owner["spec"].get("replicas", 1))):
        apiserver.call(
            srv.put(
                POD, pod(cluster, component, i, ready=ready, owner=owner, ip=ips[i] if i < len(ips) else None)
            )
        )


def roll_workload(
    apiserver: Any, kind: str, name: str, *, ready: bool | tuple[bool, ...] = True, net: int = 1
) -> list[dict[str, Any]]:
    """Play one workload's controller and kubelet finishing its rollout (any slot of a generation,
    render/generations.py): the pods it owns are replaced by as many pods of its current template,
    labelled as the template says (its generation and slot too). `ready`: one for all, or per pod;
    `net`: the third octet of their pod IPs (two slots' pods must not share addresses)."""
    srv = apiserver.server
    plural = {"StatefulSet": "statefulsets", "Deployment": "deployments"}[kind]
    owner = srv.get(plural, "default", name)
    assert owner is not None, f"{kind} {name} does not exist"
    for p in srv.objects("pods", "default"):
        if any(r.get("uid") == owner["metadata"]["uid"] for r in p["metadata"].get("ownerReferences") or []):
            apiserver.call(srv.remove(POD, "default", p["metadata"]["name"]))
    labels = owner["spec"]["template"]["metadata"]["labels"]
    made = []
    for i in range(int(owner["spec"].get("replicas", 1))):
        up = ready if isinstance(ready, bool) else ready[i]
        p = pod(labels[constants.LABEL_CLUSTER], labels[constants.LABEL_COMPONENT], i, ready=up, owner=owner,
                ip=f"10.{net}.{len(name)}.{i + 1}")  # fmt: skip
        p["metadata"]["name"] = f"{name}-{i}"
        p["metadata"]["labels"] |= labels
        apiserver.call(srv.put(POD, p))
        made.append(p)
    return made


def serve_metrics(monkeypatch: Any) -> int:
    """Make the operator serve /metrics on a free local port (its reconcile count: `reconciles`)."""
    from tilert_serve.local.runner import free_port

    port = free_port()
    monkeypatch.setenv("TILERT_PD_METRICS_PORT", str(port))
    monkeypatch.setenv("TILERT_PD_METRICS_HOST", "127.0.0.1")
    return port


def reconciles(port: int) -> int:
    """Reconciles the running operator has finished, from its /metrics (0 before it serves them). The
    API server's calls do not tell: with the watch caches a reconcile reads nothing from it."""
    import urllib.request

    import pdc_helpers

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
            text = resp.read().decode()
    except OSError:
        return 0
    return int(pdc_helpers.sample(text, "tilert_pd_reconcile_duration_seconds_count") or 0)


def condition(obj: dict[str, Any] | None, type_: str) -> dict[str, Any]:
    for c in ((obj or {}).get("status") or {}).get("conditions") or []:
        if c["type"] == type_:
            return dict(c)
    return {}


def pdc(doc: dict[str, Any], namespace: str = "default") -> dict[str, Any]:
    out = copy.deepcopy(doc)
    out["metadata"]["namespace"] = out["metadata"].get("namespace") or namespace
    return out


#: The k8snetworkplumbingwg MultiNetworkPolicy CRD, as far as the API test server needs it (a served
#: namespaced kind; the schema is left open).
MULTI_NETWORK_POLICY_CRD: dict[str, Any] = {
    "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
    "metadata": {"name": "multi-networkpolicies.k8s.cni.cncf.io"},
    "spec": {"group": "k8s.cni.cncf.io", "scope": "Namespaced",
             "names": {"kind": "MultiNetworkPolicy", "plural": "multi-networkpolicies", "singular": "multi-networkpolicy",
                       "shortNames": ["multi-policy"]},
             "versions": [{"name": "v1beta1", "served": True, "storage": True,
                           "schema": {"openAPIV3Schema": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}}}]},
}  # fmt: skip
CRD_RES = ("apiextensions.k8s.io", "v1", "customresourcedefinitions")


def install_crd(apiserver: Any, crd: dict[str, Any]) -> None:
    """Make the API test server serve a CRD's kind, as a real one does once the CRD is Established."""
    obj = copy.deepcopy(crd)

    async def install() -> None:
        srv = apiserver.server
        async with srv.wlock:
            srv._stamp_new(obj)
            srv._serve_crd(obj)
            srv._commit(CRD_RES, (CRD_RES, None, obj["metadata"]["name"]), obj, "ADDED")

    apiserver.call(install())


@dataclass
class ChartInstall:
    """The chart's RBAC installed in the API test server, and how its Deployment runs the operator."""

    objects: list[dict[str, Any]]
    user: pdc_rbac.User
    namespaces: list[str]
    #: KopfRunner arguments with the namespaces the chart's Deployment passes (none: all namespaces).
    kopf_args: list[str]
    #: (group, resource, verb) of every rule bound to the operator.
    granted: set[tuple[str, str, str]]


def install_chart_rbac(
    apiserver: Any, values: dict[str, Any], *, without: tuple[str, str, str] | None = None
) -> ChartInstall:
    """Render the chart (the real Helm engine), make the API test server enforce its roles and bindings
    for the operator's ServiceAccount (the kubeconfig's token) with OwnerReferencesPermissionEnforcement
    on; `without` (group, resource, verb) takes that verb out of every rendered rule, as an older or
    broken chart would lack it."""
    objects = pdc_rbac.render_chart(values)
    enforced = copy.deepcopy(objects)
    if without is not None:
        group, resource, verb = without
        for o in enforced:
            for rule in o.get("rules") or [] if o["kind"] in ("ClusterRole", "Role") else []:
                if group in rule["apiGroups"] and resource in rule["resources"]:
                    rule["verbs"] = [v for v in rule["verbs"] if v != verb]
    user = pdc_rbac.operator_identity(objects)
    namespaces = pdc_rbac.operator_namespaces(objects)
    srv = apiserver.server
    release = next(o for o in objects if o["kind"] == "Deployment")["metadata"]["namespace"]
    for ns in {"default", release, *namespaces}:  # a real cluster has them; kopf looks them up
        if srv.get("namespaces", None, ns) is None:
            apiserver.call(
                srv.put(
                    ("", "v1", "namespaces"),
                    {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}},
                )
            )
    srv.rbac = pdc_rbac.Rbac(enforced)
    srv.users[pdc_apiserver.TOKEN] = user
    srv.owner_references_permission_enforcement = True
    scope = [f"--namespace={n}" for n in namespaces] or ["--all-namespaces"]
    return ChartInstall(
        objects,
        user,
        namespaces,
        ["run", "-m", "tilert_operator.wiring", *scope, "--standalone", "--verbose"],
        pdc_rbac.Rbac(objects).granted(user, namespaces),
    )
