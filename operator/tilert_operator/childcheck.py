"""What the API server would refuse in a rendered child, found before anything is stored.

Two layers, as the API server has them: the Kubernetes OpenAPI schema (types, required fields, unknown
fields; the schemas kubernetes-validate ships, of the newest Kubernetes it knows, so that a field only
newer servers have is not refused), then the API server's validation beyond the schema, as far as the
operator's children can reach it: names, labels, images, volumes, resources, securityContexts,
tolerations, spread constraints, rollout strategies, NetworkPolicy peers. Objects that fail the schema
are not checked further (the API server would not decode them either).

A StatefulSet's pod template is checked as a pod's: the API server stores the StatefulSet without
validating it (a long-standing TODO in its validation) and then refuses each pod the StatefulSet
controller creates from it, which is worse than a refusal at apply.

Not everything the API server checks is here (admission policies of the cluster, quotas, immutable
fields of live objects): the webhook's server-side dry run covers those where it can reach the API.
Each Finding says the child's field and the fix in Kubernetes' terms; validation.py names the
PDCluster field that produced it.
"""

from __future__ import annotations

import functools
import ipaddress
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

# Neither ships type information (no py.typed, no stubs in our dependencies).
import jsonschema  # type: ignore[import-untyped]
import referencing
from kubernetes_validate import utils as kv_utils  # type: ignore[import-untyped]

Obj = dict[str, Any]
Path = tuple[str | int, ...]


@dataclass(frozen=True)
class Finding:
    kind: str
    name: str
    #: Where in the child, as a tuple (`("spec", "template", "spec", "volumes", 0)`).
    path: Path
    #: What is wrong and what to do instead.
    message: str

    @property
    def where(self) -> str:
        return dotted(self.path)

    def __str__(self) -> str:
        return f"{self.kind} {self.name}: {self.where}: {self.message}"


def dotted(path: Path) -> str:
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


# ---- the schema --------------------------------------------------------------------------------

#: Kubernetes' API groups as kubernetes-validate names its files (`apps/v1` -> `apps-v1`).
_GROUP = re.compile(r"^([^./]*)(?:\.[^/]*)?/")


@functools.lru_cache(maxsize=1)
def _schema_dir() -> tuple[str, str]:
    version = kv_utils.latest_version()
    return version, f"kubernetes-json-schema/v{version}-local-strict"


@functools.lru_cache(maxsize=1)
def _definitions() -> referencing.Registry[Any]:
    version, folder = _schema_dir()
    defs = kv_utils.schema_contents(f"{folder}/_definitions.json", version)
    return referencing.Resource.from_contents(defs) @ referencing.Registry()


@functools.lru_cache(maxsize=32)
def _validator(kind: str, api_version: str) -> jsonschema.protocols.Validator | None:
    version, folder = _schema_dir()
    group = _GROUP.sub(r"\1-", api_version)
    try:
        schema = kv_utils.schema_contents(f"{folder}/{kind.lower()}-{group}.json", version)
    except FileNotFoundError:
        return None  # a CRD's kind (MultiNetworkPolicy): its schema is the cluster's
    registry = referencing.Resource.from_contents(schema) @ _definitions()
    return jsonschema.Draft202012Validator(schema, registry=registry)


def _schema_fix(error: jsonschema.ValidationError) -> str:
    if error.validator == "required":
        return f"{error.message}: set it"
    if error.validator == "additionalProperties":
        return f"{error.message}: no Kubernetes version has such a field; remove it (or fix its spelling)"
    if error.validator == "type":
        return f"{error.message}: write it as that type"
    return str(error.message)


def schema_findings(obj: Obj) -> list[Finding]:
    validator = _validator(str(obj.get("kind")), str(obj.get("apiVersion")))
    if validator is None:
        return []
    name = str((obj.get("metadata") or {}).get("name"))
    errors = sorted(validator.iter_errors(obj), key=lambda e: [str(p) for p in e.absolute_path])
    return [Finding(str(obj["kind"]), name, tuple(e.absolute_path), _schema_fix(e)) for e in errors]


# ---- what the API server checks beyond the schema -------------------------------------------

DNS1123_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
DNS1123_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
QUALIFIED_NAME = re.compile(r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]")
IANA_SVC_NAME = re.compile(r"[a-z0-9]([a-z0-9-]*[a-z0-9])?")
SYSCTL = re.compile(r"([a-z0-9]([-_a-z0-9]*[a-z0-9])?[./])*[a-z0-9]([-_a-z0-9]*[a-z0-9])?")
CONFIG_KEY = re.compile(r"[-._a-zA-Z0-9]+")
STANDARD_RESOURCES = frozenset({"cpu", "memory", "ephemeral-storage"})
#: Extended resources that Kubernetes never overcommits: integers, and a request equal to the limit.
_NOT_EXTENDED = ("kubernetes.io/", "requests.")
VOLUME_SOURCES_MAX = 1
INT32_MAX = 2**31 - 1
RESTART_POLICIES = frozenset({"Always"})
HOST_PATH_TYPES = frozenset(
    {"", "DirectoryOrCreate", "Directory", "FileOrCreate", "File", "Socket", "CharDevice", "BlockDevice"}
)
SECCOMP_TYPES = frozenset({"RuntimeDefault", "Unconfined", "Localhost"})
FS_GROUP_POLICIES = frozenset({"OnRootMismatch", "Always"})
SELECTOR_OPERATORS = frozenset({"In", "NotIn", "Exists", "DoesNotExist"})


def qualified_name_problem(key: str) -> str | None:
    """Why `key` is not a label key (an optional DNS-subdomain prefix and '/', then a name), or None."""
    prefix, slash, name = key.rpartition("/")
    if slash and not (prefix and len(prefix) <= 253 and DNS1123_SUBDOMAIN.fullmatch(prefix)):
        return f"{key!r} is not a label key: its prefix before '/' must be a lowercase DNS subdomain"
    if not name or len(name) > 63 or not QUALIFIED_NAME.fullmatch(name):
        return (
            f"{key!r} is not a label key: at most 63 letters, digits, '-', '_' or '.' (after an optional "
            "DNS-subdomain prefix and '/'), starting and ending with a letter or digit"
        )
    return None


def label_value_problem(value: Any) -> str | None:
    if not isinstance(value, str) or len(value) > 63 or (value and not QUALIFIED_NAME.fullmatch(value)):
        return (
            f"{value!r} is not a label value: at most 63 letters, digits, '-', '_' or '.', starting and ending "
            "with a letter or digit (or empty)"
        )
    return None


class _Checker:
    """Collects the findings of one child (`at` is a path inside it)."""

    def __init__(self, obj: Obj) -> None:
        self.kind = str(obj.get("kind"))
        self.name = str((obj.get("metadata") or {}).get("name"))
        self.found: list[Finding] = []

    def add(self, at: Path, message: str) -> None:
        self.found.append(Finding(self.kind, self.name, at, message))

    # -- metadata and selectors -----------------------------------------------------------------

    def labels(self, at: Path, labels: Any) -> None:
        for key, value in (labels or {}).items():
            for problem in (qualified_name_problem(str(key)), label_value_problem(value)):
                if problem:
                    self.add((*at, str(key)), problem)

    def annotations(self, at: Path, annotations: Any) -> None:
        for key in annotations or {}:
            problem = qualified_name_problem(str(key))
            if problem:
                self.add((*at, str(key)), problem.replace("label key", "annotation key"))

    def metadata(self, at: Path, meta: Obj) -> None:
        self.labels((*at, "labels"), meta.get("labels"))
        self.annotations((*at, "annotations"), meta.get("annotations"))

    def selector(self, at: Path, sel: Any) -> None:
        if not isinstance(sel, dict):
            return
        self.labels((*at, "matchLabels"), sel.get("matchLabels"))
        for i, expr in enumerate(sel.get("matchExpressions") or []):
            here = (*at, "matchExpressions", i)
            problem = qualified_name_problem(str(expr.get("key", "")))
            if problem:
                self.add((*here, "key"), problem)
            op, values = expr.get("operator"), expr.get("values") or []
            if op not in SELECTOR_OPERATORS:
                self.add((*here, "operator"), f"{op!r}: use In, NotIn, Exists or DoesNotExist")
            elif op in ("In", "NotIn") and not values:
                self.add((*here, "values"), f"operator {op} needs values: list at least one")
            elif op in ("Exists", "DoesNotExist") and values:
                self.add((*here, "values"), f"operator {op} takes no values: remove them")
            for j, v in enumerate(values):
                problem = label_value_problem(v)
                if problem:
                    self.add((*here, "values", j), problem)

    # -- pods -----------------------------------------------------------------------------------

    def pod(self, at: Path, pod: Obj) -> None:
        volumes = [v for v in pod.get("volumes") or [] if isinstance(v, dict)]
        names = [v.get("name") for v in volumes]
        for i, v in enumerate(volumes):
            self.volume((*at, "volumes", i), v, twice=names.count(v.get("name")) > 1)
        containers = [("initContainers", i, c) for i, c in enumerate(pod.get("initContainers") or [])]
        containers += [("containers", i, c) for i, c in enumerate(pod.get("containers") or [])]
        cnames = [c.get("name") for _, _, c in containers]
        for group, i, c in containers:
            self.container(
                (*at, group, i),
                c,
                volumes=set(names),
                twice=cnames.count(c.get("name")) > 1,
                host_network=bool(pod.get("hostNetwork")),
            )
        policy = pod.get("restartPolicy")
        if policy is not None and policy not in RESTART_POLICIES:
            self.add(
                (*at, "restartPolicy"),
                f"{policy!r}: a Deployment's or StatefulSet's pods restart Always; remove it",
            )
        self.pod_security((*at, "securityContext"), pod.get("securityContext") or {})
        self.labels((*at, "nodeSelector"), pod.get("nodeSelector"))
        for i, tol in enumerate(pod.get("tolerations") or []):
            self.toleration((*at, "tolerations", i), tol)
        seen: set[tuple[Any, Any]] = set()
        for i, tsc in enumerate(pod.get("topologySpreadConstraints") or []):
            here = (*at, "topologySpreadConstraints", i)
            key = str(tsc.get("topologyKey", ""))
            problem = qualified_name_problem(key) if key else "is empty: name a node label key"
            if problem:
                self.add((*here, "topologyKey"), problem.replace("not a label key", "not a node label key"))
            pair = (key, tsc.get("whenUnsatisfiable"))
            if pair in seen:
                self.add(
                    (*here, "topologyKey"), f"{key!r} is constrained twice with {pair[1]}: list each key once"
                )
            seen.add(pair)
            self.selector((*here, "labelSelector"), tsc.get("labelSelector"))

    def volume(self, at: Path, v: Obj, *, twice: bool) -> None:
        name = str(v.get("name", ""))
        if not DNS1123_LABEL.fullmatch(name) or len(name) > 63:
            self.add((*at, "name"), f"{name!r} is not a volume name (a lowercase DNS label)")
        if twice:
            self.add((*at, "name"), f"volume {name!r} is defined twice: name each volume once")
        sources = sorted(k for k in v if k != "name")
        if len(sources) != VOLUME_SOURCES_MAX:
            what = (
                "no volume source" if not sources else f"{len(sources)} volume sources ({', '.join(sources)})"
            )
            self.add(
                at,
                f"has {what}: give exactly one volume source, e.g. persistentVolumeClaim: {{claimName: weights}}",
            )
            return
        source = v[sources[0]] if isinstance(v[sources[0]], dict) else {}
        required = {
            "persistentVolumeClaim": "claimName",
            "hostPath": "path",
            "nfs": "server",
            "csi": "driver",
            "image": "reference",
        }
        field = required.get(sources[0])
        if field and not str(source.get(field) or "").strip():
            self.add((*at, sources[0], field), f"{sources[0]}.{field} is empty: set it")
        if sources[0] == "nfs" and not source.get("path"):
            self.add((*at, "nfs", "path"), "nfs.path is empty: set it")
        if sources[0] == "hostPath" and source.get("type", "") not in HOST_PATH_TYPES:
            self.add(
                (*at, "hostPath", "type"),
                f"{source.get('type')!r}: use one of {', '.join(sorted(t for t in HOST_PATH_TYPES if t))}",
            )
        if sources[0] == "secret" and not source.get("secretName"):
            self.add((*at, "secret", "secretName"), "secret.secretName is empty: name the Secret")
        if sources[0] == "configMap" and not source.get("name"):
            self.add((*at, "configMap", "name"), "configMap.name is empty: name the ConfigMap")

    def container(self, at: Path, c: Obj, *, volumes: set[Any], twice: bool, host_network: bool) -> None:
        name = str(c.get("name", ""))
        if not DNS1123_LABEL.fullmatch(name) or len(name) > 63:
            self.add((*at, "name"), f"{name!r} is not a container name (a lowercase DNS label)")
        if twice:
            self.add((*at, "name"), f"container {name!r} appears twice: name each container once")
        image = c.get("image")
        if not image:
            self.add((*at, "image"), "is empty: set an image (a Deployment's containers each need one)")
        elif image != image.strip():
            self.add((*at, "image"), f"{image!r} has leading or trailing whitespace: remove it")
        port_names = [p.get("name") for p in c.get("ports") or [] if p.get("name")]
        for i, p in enumerate(c.get("ports") or []):
            pname = p.get("name")
            if pname and (
                len(pname) > 15 or not IANA_SVC_NAME.fullmatch(pname) or not re.search("[a-z]", pname)
            ):
                self.add(
                    (*at, "ports", i, "name"),
                    f"{pname!r} is not a port name (at most 15 lowercase letters, digits, '-')",
                )
            if pname and port_names.count(pname) > 1:
                self.add((*at, "ports", i, "name"), f"port name {pname!r} is used twice: name each port once")
            if host_network and p.get("hostPort") not in (None, p.get("containerPort")):
                self.add(
                    (*at, "ports", i, "hostPort"), "must equal containerPort under hostNetwork: remove it"
                )
        mounts = [m.get("mountPath") for m in c.get("volumeMounts") or []]
        for i, m in enumerate(c.get("volumeMounts") or []):
            if m.get("name") not in volumes:
                self.add(
                    (*at, "volumeMounts", i, "name"),
                    f"mounts {m.get('name')!r}, which is no volume of the pod",
                )
            if not m.get("mountPath"):
                self.add((*at, "volumeMounts", i, "mountPath"), "is empty: set a path")
            elif mounts.count(m.get("mountPath")) > 1:
                self.add(
                    (*at, "volumeMounts", i, "mountPath"),
                    f"{m.get('mountPath')!r} is mounted twice: mount one volume there",
                )
        self.resources((*at, "resources"), c.get("resources") or {})
        self.container_security((*at, "securityContext"), c.get("securityContext") or {})

    def resources(self, at: Path, res: Obj) -> None:
        requests, limits = res.get("requests") or {}, res.get("limits") or {}
        for kind, section in (("requests", requests), ("limits", limits)):
            for rname, value in section.items():
                here = (*at, kind, rname)
                if (
                    "/" not in rname
                    and rname not in STANDARD_RESOURCES
                    and not rname.startswith("hugepages-")
                ):
                    self.add(
                        here,
                        f"{rname!r} is not a resource name: use cpu, memory, ephemeral-storage, hugepages-<size> "
                        "or a device plugin's domain/name (e.g. nvidia.com/gpu)",
                    )
                    continue
                if "/" in rname:
                    prefix, _, short = rname.partition("/")
                    if not DNS1123_SUBDOMAIN.fullmatch(prefix) or not QUALIFIED_NAME.fullmatch(short):
                        self.add(
                            here, f"{rname!r} is not a resource name: a DNS-subdomain domain, '/', and a name"
                        )
                        continue
                if self._extended(rname) and not _whole(value):
                    self.add(here, f"{value!r}: {rname} is counted in whole devices; write a whole number")
        for rname, value in requests.items():
            if not (self._extended(rname) or rname.startswith("hugepages-")):
                continue
            if rname not in limits:
                self.add(
                    (*at, "requests", rname),
                    f"{rname} cannot be overcommitted: set limits.{rname} too (equal to the request)",
                )
            elif (
                _whole(value)
                and _whole(limits[rname])
                and str(value) != str(limits[rname])
                and self._extended(rname)
            ):
                self.add(
                    (*at, "requests", rname),
                    f"{rname} cannot be overcommitted: the request must equal the limit",
                )
        huge = [r for r in (*requests, *limits) if r.startswith("hugepages-")]
        if huge and not any(r in (*requests, *limits) for r in ("cpu", "memory")):
            self.add(at, f"{huge[0]} needs a cpu or memory request or limit beside it: set one")

    @staticmethod
    def _extended(rname: str) -> bool:
        return "/" in rname and not rname.startswith(_NOT_EXTENDED)

    def _ids(self, at: Path, sc: Obj, keys: Iterable[str]) -> None:
        for key in keys:
            value = sc.get(key)
            if isinstance(value, int) and not 0 <= value <= INT32_MAX:
                self.add((*at, key), f"{value} is out of range: a user or group id is 0 to {INT32_MAX}")

    def _seccomp(self, at: Path, sc: Obj) -> None:
        profile = sc.get("seccompProfile")
        if not isinstance(profile, dict):
            return
        kind = profile.get("type")
        if kind not in SECCOMP_TYPES:
            self.add(
                (*at, "seccompProfile", "type"), f"{kind!r}: use RuntimeDefault, Localhost or Unconfined"
            )
        elif kind == "Localhost" and not profile.get("localhostProfile"):
            self.add(
                (*at, "seccompProfile"),
                "type Localhost needs localhostProfile (the profile's path on the node): set it",
            )
        elif kind != "Localhost" and profile.get("localhostProfile"):
            self.add((*at, "seccompProfile", "localhostProfile"), "is only for type Localhost: remove it")

    def container_security(self, at: Path, sc: Obj) -> None:
        self._ids(at, sc, ("runAsUser", "runAsGroup"))
        self._seccomp(at, sc)
        if sc.get("allowPrivilegeEscalation") is False:
            if sc.get("privileged"):
                self.add(
                    (*at, "privileged"),
                    "privileged: true needs allowPrivilegeEscalation: true (the rendered value "
                    "is false): drop privileged, or set allowPrivilegeEscalation: true too",
                )
            # Only this spelling: the API server compares the string (SYS_ADMIN passes, and runs).
            if "CAP_SYS_ADMIN" in ((sc.get("capabilities") or {}).get("add") or []):
                self.add(
                    (*at, "capabilities", "add"),
                    "CAP_SYS_ADMIN needs allowPrivilegeEscalation: true (the rendered "
                    "value is false): drop it, or set allowPrivilegeEscalation: true",
                )
        if sc.get("procMount", "Default") not in ("Default", "Unmasked"):
            self.add((*at, "procMount"), f"{sc.get('procMount')!r}: use Default or Unmasked")

    def pod_security(self, at: Path, sc: Obj) -> None:
        self._ids(at, sc, ("runAsUser", "runAsGroup", "fsGroup"))
        for i, gid in enumerate(sc.get("supplementalGroups") or []):
            if isinstance(gid, int) and not 0 <= gid <= INT32_MAX:
                self.add(
                    (*at, "supplementalGroups", i), f"{gid} is out of range: a group id is 0 to {INT32_MAX}"
                )
        self._seccomp(at, sc)
        policy = sc.get("fsGroupChangePolicy")
        if policy is not None and policy not in FS_GROUP_POLICIES:
            self.add((*at, "fsGroupChangePolicy"), f"{policy!r}: use OnRootMismatch or Always")
        names = [s.get("name") for s in sc.get("sysctls") or []]
        for i, name in enumerate(names):
            if not isinstance(name, str) or len(name) > 253 or not SYSCTL.fullmatch(name):
                self.add(
                    (*at, "sysctls", i, "name"),
                    f"{name!r} is not a sysctl name (e.g. net.ipv4.tcp_keepalive_time)",
                )
            elif names.count(name) > 1:
                self.add((*at, "sysctls", i, "name"), f"sysctl {name} is set twice: set it once")

    def toleration(self, at: Path, tol: Obj) -> None:
        key, op = str(tol.get("key") or ""), tol.get("operator") or "Equal"
        if key:
            problem = qualified_name_problem(key)
            if problem:
                self.add((*at, "key"), problem.replace("label key", "taint key"))
        elif op != "Exists":
            self.add(
                (*at, "operator"),
                "a toleration with an empty key matches every taint only with operator: Exists; "
                "set a key, or operator: Exists",
            )
        if op == "Equal":
            problem = label_value_problem(tol.get("value", ""))
            if problem:
                self.add((*at, "value"), problem.replace("label value", "taint value (a label value)"))
        if tol.get("tolerationSeconds") is not None and tol.get("effect") != "NoExecute":
            self.add(
                (*at, "tolerationSeconds"),
                "applies to effect NoExecute only: set effect: NoExecute, or remove it",
            )

    # -- workloads and the rest -------------------------------------------------------------------

    def workload(self, obj: Obj) -> None:
        spec = obj.get("spec") or {}
        if isinstance(spec.get("replicas"), int) and spec["replicas"] < 0:
            self.add(("spec", "replicas"), "is negative: 0 or more")
        template = spec.get("template") or {}
        self.metadata(("spec", "template", "metadata"), template.get("metadata") or {})
        self.pod(("spec", "template", "spec"), template.get("spec") or {})
        if self.kind == "Deployment":
            self.deployment_strategy(("spec", "strategy"), spec.get("strategy") or {})
        else:
            self.statefulset_strategy(("spec", "updateStrategy"), spec.get("updateStrategy") or {})
            policy = spec.get("podManagementPolicy")
            if policy is not None and policy not in ("OrderedReady", "Parallel"):
                self.add(("spec", "podManagementPolicy"), f"{policy!r}: use OrderedReady or Parallel")

    def deployment_strategy(self, at: Path, strategy: Obj) -> None:
        kind, rolling = strategy.get("type", "RollingUpdate"), strategy.get("rollingUpdate")
        if kind not in ("RollingUpdate", "Recreate"):
            self.add((*at, "type"), f"{kind!r}: use RollingUpdate or Recreate")
        elif kind == "Recreate" and rolling is not None:
            self.add(
                (*at, "rollingUpdate"),
                "must be absent with type Recreate: set rollingUpdate: null beside type: Recreate",
            )
        elif kind == "RollingUpdate" and isinstance(rolling, dict):
            surge, unavailable = (
                _count(rolling.get("maxSurge", "25%")),
                _count(rolling.get("maxUnavailable", "25%")),
            )
            for key in ("maxSurge", "maxUnavailable"):
                value = rolling.get(key)
                if value is not None and _count(value) is None:
                    self.add(
                        (*at, "rollingUpdate", key),
                        f"{value!r}: write a count (0 or more) or a percentage such as 25%",
                    )
            if surge == 0 and unavailable == 0:
                self.add(
                    (*at, "rollingUpdate"),
                    "maxSurge and maxUnavailable are both 0, so no pod could ever be replaced: "
                    "set one of them above 0",
                )

    def statefulset_strategy(self, at: Path, strategy: Obj) -> None:
        kind, rolling = strategy.get("type", "RollingUpdate"), strategy.get("rollingUpdate")
        if kind not in ("RollingUpdate", "OnDelete"):
            self.add((*at, "type"), f"{kind!r}: use RollingUpdate or OnDelete")
        elif kind == "OnDelete" and rolling is not None:
            self.add(
                (*at, "rollingUpdate"),
                "must be absent with type OnDelete: set rollingUpdate: null beside type: OnDelete",
            )
        elif isinstance(rolling, dict):
            if isinstance(rolling.get("partition"), int) and rolling["partition"] < 0:
                self.add((*at, "rollingUpdate", "partition"), "is negative: 0 or more")
            if "maxUnavailable" in rolling and (_count(rolling["maxUnavailable"]) or 0) < 1:
                self.add(
                    (*at, "rollingUpdate", "maxUnavailable"),
                    f"{rolling['maxUnavailable']!r}: a StatefulSet takes at "
                    "least 1 pod down at a time; set at least 1, or leave it unset",
                )

    def service(self, obj: Obj) -> None:
        spec = obj.get("spec") or {}
        self.labels(("spec", "selector"), spec.get("selector"))
        names = [p.get("name") for p in spec.get("ports") or []]
        for i, p in enumerate(spec.get("ports") or []):
            if len(names) > 1 and (not p.get("name") or names.count(p.get("name")) > 1):
                self.add(
                    ("spec", "ports", i, "name"),
                    "a Service with several ports names each once: set a unique name",
                )

    def network_policy(self, obj: Obj) -> None:
        spec = obj.get("spec") or {}
        self.selector(("spec", "podSelector"), spec.get("podSelector"))
        for i, rule in enumerate(spec.get("ingress") or []):
            for j, peer in enumerate(rule.get("from") or []):
                self.peer(("spec", "ingress", i, "from", j), peer)

    def peer(self, at: Path, peer: Obj) -> None:
        block = peer.get("ipBlock")
        if block is not None and (
            peer.get("podSelector") is not None or peer.get("namespaceSelector") is not None
        ):
            self.add(
                at,
                "ipBlock admits addresses, podSelector and namespaceSelector admit pods: one peer takes ipBlock "
                "alone; list them as two peers",
            )
        if peer.get("podSelector") is None and peer.get("namespaceSelector") is None and block is None:
            self.add(at, "names no peer: set podSelector, namespaceSelector or ipBlock")
        for key in ("podSelector", "namespaceSelector"):
            self.selector((*at, key), peer.get(key))
        if isinstance(block, dict):
            try:
                net = ipaddress.ip_network(str(block.get("cidr")), strict=False)
                if "/" not in str(block.get("cidr")):
                    raise ValueError("no prefix length")
            except ValueError:
                self.add(
                    (*at, "ipBlock", "cidr"),
                    f"{block.get('cidr')!r} is not a CIDR: write an address and prefix, e.g. 10.0.0.0/8",
                )
                return
            for k, ex in enumerate(block.get("except") or []):
                try:
                    sub = ipaddress.ip_network(str(ex), strict=False)
                except ValueError:
                    self.add((*at, "ipBlock", "except", k), f"{ex!r} is not a CIDR")
                    continue
                if sub.version != net.version or not sub.subnet_of(net) or sub == net:  # type: ignore[arg-type]
                    self.add(
                        (*at, "ipBlock", "except", k),
                        f"{ex} must lie strictly within cidr {block.get('cidr')}: remove it, or widen cidr",
                    )

    def config_map(self, obj: Obj) -> None:
        size = 0
        for key, value in (obj.get("data") or {}).items():
            size += len(str(value).encode())
            if len(key) > 253 or not CONFIG_KEY.fullmatch(key):
                self.add(("data", key), f"{key!r} is not a ConfigMap key (letters, digits, '-', '_' and '.')")
        if size > 1024 * 1024:
            self.add(
                ("data",),
                f"holds {size} bytes; a ConfigMap holds at most 1 MiB: shorten the lists it is made of",
            )


def _whole(value: Any) -> bool:
    return (isinstance(value, int) and not isinstance(value, bool)) or (
        isinstance(value, str) and value.isdigit()
    )


def _count(value: Any) -> int | None:
    """A rollout count or percentage as a number (a percentage counts as its number: only 0 matters)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value if value >= 0 else None
    if isinstance(value, str) and re.fullmatch(r"[0-9]+%", value):
        return int(value[:-1])
    return None


def semantic_findings(obj: Obj) -> list[Finding]:
    c = _Checker(obj)
    c.metadata(("metadata",), obj.get("metadata") or {})
    kind = obj.get("kind")
    if kind in ("Deployment", "StatefulSet"):
        c.workload(obj)
    elif kind == "Service":
        c.service(obj)
    elif kind in ("NetworkPolicy", "MultiNetworkPolicy"):
        c.network_policy(obj)
    elif kind == "PodDisruptionBudget":
        c.selector(("spec", "selector"), (obj.get("spec") or {}).get("selector"))
    elif kind == "ConfigMap":
        c.config_map(obj)
    return c.found


def findings(obj: Obj) -> list[Finding]:
    """Everything the API server would refuse in `obj`, schema first (semantics only once it passes)."""
    return schema_findings(obj) or semantic_findings(obj)


def all_findings(objs: Iterable[Obj]) -> Iterator[Finding]:
    for obj in objs:
        yield from findings(obj)
