"""RBAC for the API test server: the authorizer a real kube-apiserver runs (Node,RBAC modes; only the
RBAC half matters to an operator), fed with the roles and bindings the chart renders.

What a real API server checks, and which this server therefore checks (pdc_apiserver.py):

- every resource request, as (user, verb, API group, resource, subresource, namespace, name); a
  subresource is its own resource: a rule on `pdclusters` grants nothing on `pdclusters/status` or
  `pdclusters/finalizers`;
- a server-side apply (PATCH, application/apply-patch+yaml) of an object that does not exist is
  checked again as `create` once the handler finds nothing to patch (the request itself passed as
  `patch`); the RBAC authorizer gives no reason for that refusal, so its 403 says only that the
  object "is forbidden";
- with the OwnerReferencesPermissionEnforcement admission plugin (on in OpenShift, off by default
  upstream): changing an existing object's ownerReferences needs `delete` on that object, and
  setting `blockOwnerDeletion: true` on a reference needs `update` on the owner's `finalizers`
  subresource (after a first probe of `update` on `*/finalizers` in any group).

Discovery (/api, /apis, /version) is not authorized here: every authenticated user may read it on a
real cluster (the system:discovery role).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

CHART_DIR = Path(__file__).resolve().parents[2] / "charts" / "tilert-pd"
Obj = dict[str, Any]


@dataclass(frozen=True)
class User:
    name: str
    groups: tuple[str, ...] = ()


def service_account(namespace: str, name: str) -> User:
    return User(
        f"system:serviceaccount:{namespace}:{name}",
        ("system:serviceaccounts", f"system:serviceaccounts:{namespace}", "system:authenticated"),
    )


@dataclass(frozen=True)
class Attributes:
    verb: str
    group: str
    resource: str
    subresource: str = ""
    namespace: str | None = None
    name: str = ""

    @property
    def combined(self) -> str:
        return f"{self.resource}/{self.subresource}" if self.subresource else self.resource


@dataclass(frozen=True)
class Check:
    """One authorization decision, for the RBAC test."""

    user: User
    attrs: Attributes
    allowed: bool
    #: A decision whose refusal fails nothing (the finalizers probe before the precise check).
    probe: bool = False


def _resource_matches(rule: Obj, a: Attributes) -> bool:
    for r in rule.get("resources") or []:
        if r == "*" or r == a.combined:
            return True
        if a.subresource and r == f"*/{a.subresource}":
            return True
    return False


def rule_allows(rule: Obj, a: Attributes) -> bool:
    groups, verbs, names = (
        rule.get("apiGroups") or [],
        rule.get("verbs") or [],
        rule.get("resourceNames") or [],
    )
    return (
        (a.group in groups or "*" in groups)
        and (a.verb in verbs or "*" in verbs)
        and _resource_matches(rule, a)
        and (not names or a.name in names)
    )


class Rbac:
    """Roles and bindings as a cluster holds them, and the RBAC authorizer's decision."""

    def __init__(self, objects: list[Obj]) -> None:
        self.cluster_roles = {o["metadata"]["name"]: o for o in objects if o["kind"] == "ClusterRole"}
        self.roles = {
            (o["metadata"]["namespace"], o["metadata"]["name"]): o for o in objects if o["kind"] == "Role"
        }
        self.cluster_bindings = [o for o in objects if o["kind"] == "ClusterRoleBinding"]
        self.bindings = [o for o in objects if o["kind"] == "RoleBinding"]

    @staticmethod
    def _binds(binding: Obj, user: User) -> bool:
        for s in binding.get("subjects") or []:
            if (
                s["kind"] == "ServiceAccount"
                and user.name == f"system:serviceaccount:{s.get('namespace')}:{s['name']}"
            ):
                return True
            if (s["kind"] == "User" and s["name"] == user.name) or (
                s["kind"] == "Group" and s["name"] in user.groups
            ):
                return True
        return False

    def rules(self, user: User, namespace: str | None) -> list[Obj]:
        """The rules that apply to `user` in `namespace` (None: cluster scope)."""
        out: list[Obj] = []
        for b in self.cluster_bindings:
            if self._binds(b, user):
                out += (self.cluster_roles.get(b["roleRef"]["name"]) or {}).get("rules") or []
        for b in self.bindings:
            ns = b["metadata"]["namespace"]
            if namespace is None or ns != namespace or not self._binds(b, user):
                continue
            ref = b["roleRef"]
            role = (
                self.cluster_roles.get(ref["name"])
                if ref["kind"] == "ClusterRole"
                else self.roles.get((ns, ref["name"]))
            )
            out += (role or {}).get("rules") or []
        return out

    def allows(self, user: User, a: Attributes) -> bool:
        return any(rule_allows(r, a) for r in self.rules(user, a.namespace))

    def granted(self, user: User, namespaces: list[str]) -> set[tuple[str, str, str]]:
        """(group, resource, verb) of every rule that applies to `user` somewhere, for coverage."""
        rules = self.rules(user, None) + [r for ns in namespaces for r in self.rules(user, ns)]
        return {
            (g, res, v) for r in rules for g in r["apiGroups"] for res in r["resources"] for v in r["verbs"]
        }


def forbidden_message(user: User, a: Attributes) -> str:
    """The message of the 403 a real API server's authorization filter answers (before any handler)."""
    where = f'in the namespace "{a.namespace}"' if a.namespace else "at the cluster scope"
    target = qualified(a.group, a.resource) + (f' "{a.name}"' if a.name else "")
    return f'{target} is forbidden: User "{user.name}" cannot {a.verb} resource "{a.combined}" in API group "{a.group}" {where}'


def qualified(group: str, resource: str) -> str:
    """schema.GroupResource.String(): `resource.group`, or `resource` for the core group."""
    return f"{resource}.{group}" if group else resource


def render_chart(values: Obj, namespace: str = "tilert-system", release: str = "tpd") -> list[Obj]:
    """The chart's objects as `helm install` would create them, rendered by the real Helm engine."""
    import helm_python as helm

    with helm.Chart.load(CHART_DIR) as chart:
        out = chart.render(values, name=release, namespace=namespace, is_install=True)
    return [
        o
        for path, text in out.items()
        if not path.endswith("NOTES.txt")
        for o in yaml.safe_load_all(text)
        if o
    ]


def operator_identity(objects: list[Obj]) -> User:
    """The ServiceAccount the chart's Deployment runs the operator as."""
    dep = next(o for o in objects if o["kind"] == "Deployment")
    return service_account(
        dep["metadata"]["namespace"], dep["spec"]["template"]["spec"]["serviceAccountName"]
    )


def operator_namespaces(objects: list[Obj]) -> list[str]:
    """The namespaces the chart's Deployment tells the operator to watch (empty: all)."""
    dep = next(o for o in objects if o["kind"] == "Deployment")
    args = dep["spec"]["template"]["spec"]["containers"][0].get("args") or []
    return [a.split("=", 1)[1] for a in args if a.startswith("--namespace=")]
