"""What a kubelet would run for rendered manifests: pods, their containers, files and probes.

`tilert-pd local up --runtime docker` runs a PDCluster from the operator's own manifests (Deployments,
StatefulSets, Services, Secrets, ConfigMaps), not from a second description of the stack, so the
commands, environment, mounted files, ports and probes that a cluster would run are the ones that run
here. This module is the pure half: manifests in, `Pod`s out, nothing started. It does what the
kubelet and the cluster's DNS do for such pods, within what one Docker host can play:

- a pod is one container per entry of `containers` (init containers first, in order), the first one
  owning the pod's network namespace and the others joining it;
- `command`/`args`, `$(VAR)` expansion and the downward API (`fieldRef`) follow the Pod API;
- Secret, ConfigMap and downward-API volumes become files with their modes, emptyDirs directories,
  a memory emptyDir at /dev/shm the container's shm size;
- a Service is a DNS name on the pod network (Docker's resolver answers with every matching pod, as
  a headless Service does); StatefulSet pods also get their stable `<pod>.<service>` names.

What cannot be played is refused with the reason (a Service whose port differs from its target port:
there is no virtual IP to translate it; PersistentVolumeClaims; resource-field env).
"""

from __future__ import annotations

import base64
import json
import posixpath
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

Manifest = dict[str, Any]

#: The cluster domain of the DNS names pods resolve (Kubernetes' default).
CLUSTER_DOMAIN = "cluster.local"


class Unsupported(ValueError):
    """A manifest asks for something this runtime cannot play; the message says what and why."""


@dataclass(frozen=True)
class Probe:
    """One of a container's probes, as the kubelet runs it (defaults are the Pod API's)."""

    #: http | tcp | exec
    kind: str
    port: int | None = None
    path: str = "/"
    scheme: str = "HTTP"
    command: tuple[str, ...] = ()
    initial_delay_s: float = 0.0
    period_s: float = 10.0
    timeout_s: float = 1.0
    failure_threshold: int = 3
    success_threshold: int = 1

    def describe(self) -> str:
        if self.kind == "http":
            return f"GET {self.scheme.lower()}://:{self.port}{self.path}"
        if self.kind == "tcp":
            return f"TCP :{self.port}"
        return "exec " + " ".join(self.command)


@dataclass(frozen=True)
class Mount:
    #: The volume's directory (or file, for a subPath) relative to the pod's own directory.
    source: str
    target: str
    read_only: bool = False


@dataclass(frozen=True)
class Container:
    name: str
    image: str
    #: The entrypoint override (Kubernetes' `command`), or None to keep the image's.
    entrypoint: tuple[str, ...] | None
    #: Kubernetes' `args` (or the command's tail), None to keep the image's CMD.
    args: tuple[str, ...] | None
    env: dict[str, str]
    mounts: tuple[Mount, ...] = ()
    ports: dict[str, int] = field(default_factory=dict)
    working_dir: str | None = None
    user: str | None = None
    #: Supplementary groups: the pod's fsGroup and supplementalGroups.
    groups: tuple[int, ...] = ()
    cap_add: tuple[str, ...] = ()
    shm_size: str | None = None
    readiness: Probe | None = None
    liveness: Probe | None = None
    startup: Probe | None = None


@dataclass(frozen=True)
class File:
    #: Relative to the pod's directory.
    path: str
    content: bytes
    mode: int


@dataclass(frozen=True)
class Pod:
    name: str
    namespace: str
    #: The workload that owns it (Deployment or StatefulSet name) and its kind.
    owner: str
    owner_kind: str
    labels: dict[str, str]
    annotations: dict[str, str]
    ip: str
    hostname: str
    #: DNS names on the pod network that answer with this pod's address.
    aliases: tuple[str, ...]
    init_containers: tuple[Container, ...]
    containers: tuple[Container, ...]
    #: Files to write under the pod's directory before any container starts.
    files: tuple[File, ...]
    #: Volume directories to create under the pod's directory.
    dirs: tuple[str, ...]
    #: The emptyDirs among them, writable by every user as the kubelet makes them.
    empty_dirs: tuple[str, ...] = ()
    #: The pod's fsGroup: volume files and directories get this group, and files group read.
    fs_group: int | None = None
    #: Downward-API files that depend on what exists only once the pod runs (its Multus
    #: network-status): (path under the pod directory, fieldPath).
    late_files: tuple[tuple[str, str], ...] = ()
    #: Secondary (Multus) networks the pod asks for, by name.
    networks: tuple[str, ...] = ()


def _selected(selector: Mapping[str, str], labels: Mapping[str, str]) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def _by_kind(manifests: Sequence[Manifest], kind: str) -> dict[str, Manifest]:
    return {m["metadata"]["name"]: m for m in manifests if m.get("kind") == kind}


def dns_names(name: str, namespace: str) -> list[str]:
    """Every name a pod in `namespace` may use for a Service (or a pod's subdomain) called `name`."""
    return [
        name,
        f"{name}.{namespace}",
        f"{name}.{namespace}.svc",
        f"{name}.{namespace}.svc.{CLUSTER_DOMAIN}",
    ]


def pods(manifests: Sequence[Manifest], ips: Iterator[str]) -> list[Pod]:
    """The pods the workloads in `manifests` run, each with an address taken from `ips`."""
    secrets = _by_kind(manifests, "Secret")
    configmaps = _by_kind(manifests, "ConfigMap")
    services = [m for m in manifests if m.get("kind") == "Service"]
    for svc in services:
        _check_service(svc)
    out: list[Pod] = []
    for m in manifests:
        kind = m.get("kind")
        if kind not in ("Deployment", "StatefulSet"):
            continue
        meta, spec = m["metadata"], m["spec"]
        template = spec["template"]
        labels = dict(template.get("metadata", {}).get("labels") or {})
        for i in range(int(spec.get("replicas", 1))):
            name = f"{meta['name']}-{i}"
            namespace = meta.get("namespace", "default")
            aliases = [
                a
                for svc in services
                if _selected(svc["spec"].get("selector") or {}, labels)
                for a in dns_names(svc["metadata"]["name"], namespace)
            ]
            if kind == "StatefulSet" and spec.get("serviceName"):
                aliases += [f"{name}.{a}" for a in dns_names(spec["serviceName"], namespace)]
            out.append(_pod(name, namespace, m, template, next(ips), tuple(aliases), secrets, configmaps))
    return out


def _check_service(svc: Manifest) -> None:
    for port in svc["spec"].get("ports") or []:
        target = port.get("targetPort", port["port"])
        if isinstance(target, int) and target != port["port"]:
            raise Unsupported(
                f"Service {svc['metadata']['name']} maps port {port['port']} to {target}: the docker runtime "
                "plays Services as DNS names without a virtual IP, so a Service port must equal its target port"
            )


def _pod(
    name: str,
    namespace: str,
    owner: Manifest,
    template: Manifest,
    ip: str,
    aliases: tuple[str, ...],
    secrets: dict[str, Manifest],
    configmaps: dict[str, Manifest],
) -> Pod:
    meta = template.get("metadata") or {}
    spec = template["spec"]
    if spec.get("hostNetwork"):
        raise Unsupported(
            f"pod {name} asks for hostNetwork; the docker runtime gives every pod its own address"
        )
    networks = _multus_networks((meta.get("annotations") or {}).get("k8s.v1.cni.cncf.io/networks", ""))
    pod = Pod(
        name=name,
        namespace=namespace,
        owner=owner["metadata"]["name"],
        owner_kind=owner["kind"],
        labels=dict(meta.get("labels") or {}),
        annotations=dict(meta.get("annotations") or {}),
        ip=ip,
        hostname=name,
        aliases=aliases,
        init_containers=(),
        containers=(),
        files=(),
        dirs=(),
        networks=networks,
    )
    files, dirs, late, shm = _volumes(pod, spec.get("volumes") or [], secrets, configmaps)
    security = spec.get("securityContext") or {}
    empty = tuple(f"volumes/{v['name']}" for v in spec.get("volumes") or [] if "emptyDir" in v)
    fs_group = security.get("fsGroup")
    init = tuple(
        _container(pod, c, security, secrets, configmaps, shm) for c in spec.get("initContainers") or []
    )
    main = tuple(_container(pod, c, security, secrets, configmaps, shm) for c in spec["containers"])
    return Pod(
        **{
            **pod.__dict__,
            "init_containers": init,
            "containers": main,
            "files": tuple(files),
            "dirs": tuple(dirs),
            "empty_dirs": empty,
            "late_files": tuple(late),
            "fs_group": None if fs_group is None else int(fs_group),
        }
    )


def _multus_networks(annotation: str) -> tuple[str, ...]:
    annotation = annotation.strip()
    if not annotation:
        return ()
    if annotation.startswith("["):
        return tuple(
            f"{n['namespace']}/{n['name']}" if n.get("namespace") else n["name"]
            for n in json.loads(annotation)
        )
    return tuple(n.strip().split("@")[0] for n in annotation.split(",") if n.strip())


def _volumes(
    pod: Pod, volumes: Sequence[Manifest], secrets: dict[str, Manifest], configmaps: dict[str, Manifest]
) -> tuple[list[File], list[str], list[tuple[str, str]], dict[str, str]]:
    """Files and directories for each volume, downward-API files known only later, and the memory
    emptyDirs (name -> size limit) that a /dev/shm mount turns into the container's shm size."""
    files: list[File] = []
    dirs: list[str] = []
    late: list[tuple[str, str]] = []
    memory: dict[str, str] = {}
    for v in volumes:
        root = f"volumes/{v['name']}"
        dirs.append(root)
        if "emptyDir" in v:
            if (v["emptyDir"] or {}).get("medium") == "Memory":
                memory[v["name"]] = str((v["emptyDir"] or {}).get("sizeLimit") or "64Mi")
        elif "secret" in v:
            src = v["secret"]
            secret = secrets.get(src["secretName"])
            if secret is None:
                if src.get("optional"):
                    continue
                raise Unsupported(
                    f"pod {pod.name} mounts Secret {src['secretName']}, which the manifests do not hold"
                )
            data = {k: base64.b64decode(x) for k, x in (secret.get("data") or {}).items()}
            data |= {k: str(x).encode() for k, x in (secret.get("stringData") or {}).items()}
            files += _key_files(pod, root, data, src, 0o644, f"Secret {src['secretName']}")
        elif "configMap" in v:
            src = v["configMap"]
            cm = configmaps.get(src["name"])
            if cm is None:
                if src.get("optional"):
                    continue
                raise Unsupported(
                    f"pod {pod.name} mounts ConfigMap {src['name']}, which the manifests do not hold"
                )
            data = {k: str(x).encode() for k, x in (cm.get("data") or {}).items()}
            files += _key_files(pod, root, data, src, 0o644, f"ConfigMap {src['name']}")
        elif "downwardAPI" in v:
            mode = int(v["downwardAPI"].get("defaultMode", 0o644))
            for item in v["downwardAPI"].get("items") or []:
                path = f"{root}/{item['path']}"
                if "resourceFieldRef" in item:
                    raise Unsupported(f"pod {pod.name}: downwardAPI resourceFieldRef is not played")
                fp = item["fieldRef"]["fieldPath"]
                if fp.startswith("metadata.annotations["):
                    late.append((path, fp))
                else:
                    files.append(File(path, field_value(pod, fp).encode(), int(item.get("mode", mode))))
        elif "hostPath" in v:
            dirs.remove(root)
        else:
            kind = next((k for k in v if k != "name"), "?")
            raise Unsupported(
                f"pod {pod.name}: volume {v['name']} is a {kind}, which the docker runtime does not "
                "play (it plays emptyDir, secret, configMap, downwardAPI and hostPath)"
            )
    return files, dirs, late, memory


def _key_files(
    pod: Pod, root: str, data: dict[str, bytes], src: Manifest, default: int, what: str
) -> list[File]:
    mode = int(src.get("defaultMode", default))
    items = src.get("items")
    if not items:
        return [File(f"{root}/{k}", v, mode) for k, v in sorted(data.items())]
    out = []
    for item in items:
        if item["key"] not in data:
            if src.get("optional"):
                continue
            raise Unsupported(f"pod {pod.name}: {what} has no key {item['key']!r}")
        out.append(File(f"{root}/{item['path']}", data[item["key"]], int(item.get("mode", mode))))
    return out


def field_value(pod: Pod, field_path: str) -> str:
    """A downward-API fieldRef, as the kubelet fills it in."""
    m = re.fullmatch(r"metadata\.(labels|annotations)\['(.+)'\]", field_path)
    if m:
        return (pod.labels if m.group(1) == "labels" else pod.annotations).get(m.group(2), "")
    simple = {
        "metadata.name": pod.name,
        "metadata.namespace": pod.namespace,
        "status.podIP": pod.ip,
        "status.podIPs": pod.ip,
        "spec.nodeName": "local",
        "status.hostIP": "",
        "metadata.uid": pod.name,
        "spec.serviceAccountName": "default",
    }
    if field_path not in simple:
        raise Unsupported(f"pod {pod.name}: fieldRef {field_path!r} is not one the docker runtime fills in")
    return simple[field_path]


def _container(
    pod: Pod,
    c: Manifest,
    pod_security: Manifest,
    secrets: dict[str, Manifest],
    configmaps: dict[str, Manifest],
    memory: dict[str, str],
) -> Container:
    env = _env(pod, c, secrets, configmaps)
    command = [expand(a, env) for a in c.get("command") or []]
    args = [expand(a, env) for a in c.get("args") or []]
    if command:
        entrypoint: tuple[str, ...] | None = tuple(command)
        argv: tuple[str, ...] | None = tuple(args)
    else:
        entrypoint, argv = None, (tuple(args) if "args" in c else None)
    ports = {p.get("name") or str(p["containerPort"]): int(p["containerPort"]) for p in c.get("ports") or []}
    mounts: list[Mount] = []
    shm_size = None
    for vm in c.get("volumeMounts") or []:
        if vm["mountPath"] == "/dev/shm" and vm["name"] in memory:
            shm_size = memory[vm["name"]]
            continue
        source = posixpath.join("volumes", vm["name"], vm.get("subPath", ""))
        mounts.append(Mount(source.rstrip("/"), vm["mountPath"], bool(vm.get("readOnly"))))
    security = {**pod_security, **(c.get("securityContext") or {})}
    user = None
    if "runAsUser" in security:
        user = str(security["runAsUser"]) + (f":{security['runAsGroup']}" if "runAsGroup" in security else "")
    groups = [
        int(g)
        for g in [pod_security.get("fsGroup"), *(pod_security.get("supplementalGroups") or [])]
        if g is not None
    ]
    return Container(
        name=c["name"],
        image=c["image"],
        entrypoint=entrypoint,
        args=argv,
        env=env,
        mounts=tuple(mounts),
        ports=ports,
        working_dir=c.get("workingDir"),
        user=user,
        groups=tuple(groups),
        cap_add=tuple((security.get("capabilities") or {}).get("add") or ()),
        shm_size=shm_size,
        readiness=_probe(c.get("readinessProbe"), ports),
        liveness=_probe(c.get("livenessProbe"), ports),
        startup=_probe(c.get("startupProbe"), ports),
    )


def _env(
    pod: Pod, c: Manifest, secrets: dict[str, Manifest], configmaps: dict[str, Manifest]
) -> dict[str, str]:
    env: dict[str, str] = {}
    for e in c.get("env") or []:
        if "value" in e:
            env[e["name"]] = expand(str(e["value"]), env)
            continue
        src = e.get("valueFrom") or {}
        if "fieldRef" in src:
            env[e["name"]] = field_value(pod, src["fieldRef"]["fieldPath"])
        elif "secretKeyRef" in src or "configMapKeyRef" in src:
            ref = src.get("secretKeyRef") or src["configMapKeyRef"]
            if "secretKeyRef" in src:
                obj = secrets.get(ref["name"])
                data = {k: base64.b64decode(v).decode() for k, v in ((obj or {}).get("data") or {}).items()}
            else:
                obj = configmaps.get(ref["name"])
                data = {k: str(v) for k, v in ((obj or {}).get("data") or {}).items()}
            if ref["key"] not in data:
                if ref.get("optional"):
                    continue
                raise Unsupported(
                    f"pod {pod.name}: env {e['name']} refers to {ref['name']}/{ref['key']}, which the "
                    "manifests do not hold"
                )
            env[e["name"]] = data[ref["key"]]
        else:
            raise Unsupported(f"pod {pod.name}: env {e['name']} uses {sorted(src)}, which is not played")
    return env


_VAR = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


def expand(text: str, env: Mapping[str, str]) -> str:
    """Kubernetes' `$(VAR)` expansion: defined variables are replaced, `$$` escapes, others stay."""

    def sub(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        return env.get(m.group(1), m.group(0))

    return _VAR.sub(sub, text)


def _probe(p: Manifest | None, ports: Mapping[str, int]) -> Probe | None:
    if not p:
        return None

    def make(kind: str, **where: Any) -> Probe:
        return Probe(
            kind,
            initial_delay_s=float(p.get("initialDelaySeconds", 0)),
            period_s=float(p.get("periodSeconds", 10)),
            timeout_s=float(p.get("timeoutSeconds", 1)),
            failure_threshold=int(p.get("failureThreshold", 3)),
            success_threshold=int(p.get("successThreshold", 1)),
            **where,
        )

    if "httpGet" in p:
        h = p["httpGet"]
        return make(
            "http", port=_port(h["port"], ports), path=h.get("path", "/"), scheme=h.get("scheme", "HTTP")
        )
    if "tcpSocket" in p:
        return make("tcp", port=_port(p["tcpSocket"]["port"], ports))
    if "exec" in p:
        return make("exec", command=tuple(p["exec"]["command"]))
    raise Unsupported(f"probe {sorted(p)} is not played (httpGet, tcpSocket and exec are)")


def _port(port: int | str, ports: Mapping[str, int]) -> int:
    if isinstance(port, int) or str(port).isdigit():
        return int(port)
    if port not in ports:
        raise Unsupported(f"a probe names port {port!r}, which the container does not declare")
    return ports[port]


def network_status(pod: Pod, interfaces: Sequence[tuple[str, str, str]]) -> str:
    """The Multus network-status annotation for a running pod: `interfaces` are (network name or
    "" for the pod network, interface, address)."""
    entries = []
    for net, iface, address in interfaces:
        name = net if "/" in net or not net else f"{pod.namespace}/{net}"
        entry: dict[str, Any] = {"name": name or "docker-pod-network", "interface": iface, "ips": [address]}
        if not net:
            entry["default"] = True
        entries.append(entry)
    return json.dumps(entries)
