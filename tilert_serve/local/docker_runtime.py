"""`tilert-pd local up --runtime docker`: the operator's manifests run as containers of their images.

One Docker bridge network plays the pod network (every pod its own address, Services as DNS names);
a second bridge network per Multus network the pods ask for plays the secondary (RDMA) network, with
the network-status file written once the pod's interfaces exist, as Multus and the downward API do.
Readiness is each container's own readiness probe (after its startup probe), run from the host
against the pod's address, as the kubelet runs it. Everything created carries the run's label, so
`down` removes it all, logs saved first.

The router's TileRT nodes are written as the operator writes them: when a TileRT pod turns ready, the
router's ConfigMap file in the router pod's volume is rewritten with the ready nodes that
`tilert_operator.observe.tilert_nodes` wires (each at its data-plane address, read from the pod's
network-status; a node without one is left out), and the router reloads it. With a secondary network
the rendered config has no DNS discovery (render/router.py `discovers`), so that list is all the
router routes.
"""

from __future__ import annotations

import ipaddress
import os
import posixpath
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

from tilert_operator import constants, observe
from tilert_operator.render import generations
from tilert_operator.spec import PDClusterSpec
from tilert_serve import dataplane
from tilert_serve.local import docker, pods, probes
from tilert_serve.router import config as router_config


class StartFailed(RuntimeError):
    pass


@dataclass
class PodRecord:
    """What state.json keeps of a running pod."""

    name: str
    component: str
    ip: str
    image: str
    containers: list[str]
    #: http://ip:port of the pod's port named http (else its first declared port).
    url: str
    readiness: list[dict[str, Any]] = field(default_factory=list)
    #: What `apply` needs (rollout.py): the pod's workload, its template revision and ordinal, how
    #: the kubelet stops it, and the DNS names (its Services') it answers while it is an endpoint.
    workload: str = ""
    revision: str = ""
    ordinal: int = 0
    grace_s: float = 30.0
    pre_stop: list[str] | None = None
    aliases: list[str] = field(default_factory=list)
    #: Whether the Service names resolve to it now (an endpoint); apply takes them away first.
    published: bool = True
    #: A data-plane pod's generation slot (a or b: its workload's names, `<cluster>-prefill-b`, and its
    #: Services') and the fingerprint of the generation it was rendered for; "" for the router, and
    #: for a pod `up` started before these were recorded (apply adopts it as slot a's).
    slot: str = ""
    generation: str = ""
    namespace: str = "default"
    #: The pod's Multus network-status as written once its interfaces existed ("" for a pod on no
    #: secondary network, or one started before it was recorded): where the operator reads a TileRT
    #: node's data-plane address.
    network_status: str = ""


#: The router ConfigMap's key that holds the router's config.
ROUTER_CONFIG_KEY = posixpath.basename(constants.ROUTER_CONFIG_FILE)


def container_name(run: str, pod: str, container: str) -> str:
    return f"tpd-{run}-{pod}-{container}"


def _addresses(net: docker.Network, skip: int = 10) -> Iterator[str]:
    for i, host in enumerate(ipaddress.ip_network(net.subnet).hosts()):
        if i >= skip and str(host) != net.gateway:
            yield str(host)


def missing_images(manifests: Sequence[pods.Manifest]) -> list[str]:
    wanted = sorted(
        {
            c["image"]
            for m in manifests
            if m.get("kind") in ("Deployment", "StatefulSet")
            for c in [
                *m["spec"]["template"]["spec"]["containers"],
                *(m["spec"]["template"]["spec"].get("initContainers") or []),
            ]
        }
    )
    return [i for i in wanted if not docker.image_exists(i)]


def up(
    manifests: Sequence[pods.Manifest], run: str, state_dir: Path, timeout: float, say: Callable[[str], None]
) -> tuple[list[PodRecord], list[str]]:
    """Start every pod of `manifests` and wait until each is ready; (pods, networks). On failure,
    everything started is removed (logs kept in the state directory) and StartFailed says why."""
    reason = docker.unavailable()
    if reason:
        raise StartFailed(f"--runtime docker needs a Docker engine: {reason}")
    missing = missing_images(manifests)
    if missing:
        raise StartFailed(f"images not built: {', '.join(missing)}; build them with `make images`")
    running = docker.containers(run, running_only=True)
    if running:
        # Another state directory's run of a cluster with this name: never stop what we did not start.
        raise StartFailed(
            f"containers of a local run named {run!r} are running ({', '.join(running)}); stop "
            "that run (`tilert-pd local down --home ITS_HOME`) or give this PDCluster another name"
        )
    cleanup(run, state_dir)  # what an interrupted run or a stopped engine left behind
    net = docker.network_create(f"tpd-{run}", run)
    nets = [net.name]
    try:
        plan = pods.pods(manifests, _addresses(net))
        secondary: dict[str, tuple[docker.Network, Iterator[str]]] = {}
        for name in sorted({n for p in plan for n in p.networks}):
            extra = docker.network_create(f"tpd-{run}-{name.replace('/', '-')}", run)
            nets.append(extra.name)
            secondary[name] = (extra, _addresses(extra))
        say(
            f"  pod network {net.name} ({net.subnet}); "
            + (
                f"secondary networks {', '.join(n for n in nets[1:])}"
                if secondary
                else "no secondary network"
            )
        )
        records = start_pods(plan, run, state_dir, net, secondary, say)

        def route(ready: set[str]) -> None:
            # As the operator: a TileRT pod turned ready, so the router's ConfigMap lists the wired ones.
            nodes, unwired = wired_nodes(manifests, [r for r in records if r.name in ready])
            write_router_config(state_dir, manifests, records, nodes)
            say(describe_nodes(nodes, unwired))

        _wait_ready(plan, records, run, timeout, say, route)
    except BaseException:
        say("  removing what was started ...")
        cleanup(run, state_dir)
        raise
    return records, nets


def addresses(net: docker.Network, used: set[str]) -> Iterator[str]:
    """Addresses of `net` that no container holds."""
    return (a for a in _addresses(net) if a not in used)


def start_pods(
    plan: Sequence[pods.Pod],
    run: str,
    state_dir: Path,
    net: docker.Network,
    secondary: dict[str, tuple[docker.Network, Iterator[str]]],
    say: Callable[[str], None],
) -> list[PodRecord]:
    """Start `plan`'s pods on the run's networks, not waiting for ready (`up`, and `apply`'s create)."""
    lock = threading.Lock()
    addresses = {p.name: {n: next(secondary[n][1]) for n in p.networks} for p in plan}

    def one(pod: pods.Pod) -> PodRecord:
        pod_dir = state_dir / "pods" / pod.name
        _write_files(pod, pod_dir)
        labels = {docker.RUN_LABEL: run, "pd.tilert.ai/pod": pod.name, **pod.labels}
        for c in pod.init_containers:
            name = container_name(run, pod.name, c.name)
            with lock:
                say(f"  init   {pod.name}/{c.name} ({c.image})")
            docker.create(_run_spec(c, name, pod, pod_dir, labels, net.name, first=True))
            docker.start(name)
            code = docker.wait(name, timeout=1800)
            if code != 0:
                raise StartFailed(
                    f"init container {pod.name}/{c.name} exited with {code}; its log ends with:\n"
                    f"{docker.logs(name, 30)}"
                )
            _save_log(state_dir, name)
            docker.rm([name])
        names: list[str] = []
        for i, c in enumerate(pod.containers):
            name = container_name(run, pod.name, c.name)
            docker.create(
                _run_spec(
                    c,
                    name,
                    pod,
                    pod_dir,
                    labels,
                    net.name,
                    first=i == 0,
                    first_name=names[0] if names else None,
                )
            )
            names.append(name)
        for network, address in addresses[pod.name].items():
            docker.network_connect(secondary[network][0].name, names[0], address)
        for name in names:
            docker.start(name)
        status = _network_status(pod, names[0], addresses[pod.name]) if pod.networks or pod.late_files else ""
        if pod.late_files:
            _write_late_files(pod, pod_dir, status)
        main = pod.containers[0]
        # The pod's HTTP port (a decode node declares its control port first).
        port = main.ports.get("http") or next(iter(main.ports.values()), None)
        with lock:
            say(f"  start  {pod.name:<26} {pod.ip:<15} {main.image}")
        return PodRecord(
            pod.name,
            pod.labels.get(constants.LABEL_COMPONENT, pod.owner),
            pod.ip,
            main.image,
            names,
            f"http://{pod.ip}:{port}" if port else "",
            readiness=[asdict(c.readiness) for c in pod.containers if c.readiness is not None],
            workload=pod.owner,
            ordinal=int(pod.name.rsplit("-", 1)[1]),
            aliases=list(pod.aliases),
            published=bool(pod.aliases),
            namespace=pod.namespace,
            network_status=status,
        )

    with ThreadPoolExecutor(max_workers=max(1, len(plan))) as pool:
        return list(pool.map(one, plan))


def _run_spec(
    c: pods.Container,
    name: str,
    pod: pods.Pod,
    pod_dir: Path,
    labels: dict[str, str],
    network: str,
    *,
    first: bool,
    first_name: str | None = None,
) -> docker.RunSpec:
    binds = [(str((pod_dir / m.source).resolve()), m.target, m.read_only) for m in c.mounts]
    return docker.RunSpec(
        name=name,
        image=c.image,
        entrypoint=c.entrypoint,
        args=c.args,
        env=c.env,
        labels={**labels, "pd.tilert.ai/container": c.name},
        binds=binds,
        network=network if first else None,
        network_of=None if first else first_name,
        ip=pod.ip if first else None,
        hostname=pod.hostname,
        aliases=pod.aliases if first else (),
        working_dir=c.working_dir,
        user=c.user,
        group_add=c.groups,
        cap_add=c.cap_add,
        shm_size=c.shm_size,
    )


def _write_files(pod: pods.Pod, pod_dir: Path) -> None:
    """The pod's volumes as the kubelet makes them: emptyDirs writable by all, and with an fsGroup
    every volume directory and file in that group, files group-readable (the containers run as a
    non-root user that is not the files' owner)."""
    group = -1 if pod.fs_group is None else pod.fs_group
    for d in pod.dirs:
        path = pod_dir / d
        path.mkdir(parents=True, exist_ok=True)
        os.chown(path, -1, group)
        os.chmod(path, 0o777 if d in pod.empty_dirs else 0o755)
    for f in pod.files:
        path = pod_dir / f.path
        path.parent.mkdir(parents=True, exist_ok=True)
        mode = f.mode if pod.fs_group is None else f.mode | 0o440
        # Created with its mode (a secret is never readable by others, not even for a moment).
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as fh:
            os.fchown(fh.fileno(), -1, group)
            os.fchmod(fh.fileno(), mode)
            fh.write(f.content)


def _network_status(pod: pods.Pod, container: str, addresses: dict[str, str]) -> str:
    """Multus's part: the pod's network-status annotation, once its interfaces exist."""
    by_address = {address: iface for iface, address in docker.interfaces(container)}
    entries = [("", by_address.get(pod.ip, "eth0"), pod.ip)]
    entries += [(net, by_address.get(address, ""), address) for net, address in addresses.items()]
    return pods.network_status(pod, entries)


def _write_late_files(pod: pods.Pod, pod_dir: Path, status: str) -> None:
    """The network-status into the downward-API file that mounts the annotation (the node waits for
    it: --network-status-timeout)."""
    annotations = {**pod.annotations, dataplane.MULTUS_STATUS_ANNOTATION: status}
    live = pods.Pod(**{**pod.__dict__, "annotations": annotations})
    for path, field_path in pod.late_files:
        target = pod_dir / path
        tmp = target.with_suffix(".tmp")
        tmp.write_text(pods.field_value(live, field_path))
        tmp.replace(target)


def save_log(state_dir: Path, container: str) -> None:
    """Keep a container's log in the state directory (before it is removed)."""
    _save_log(state_dir, container)


def _save_log(state_dir: Path, container: str) -> None:
    logs = state_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    (logs / f"{container}.log").write_text(docker.logs(container))


def _wait_ready(
    plan: Sequence[pods.Pod],
    records: list[PodRecord],
    run: str,
    timeout: float,
    say: Callable[[str], None],
    on_tilert_ready: Callable[[set[str]], None],
) -> None:
    """Wait until every pod of `plan` passes its probes; each time TileRT pods turn ready,
    `on_tilert_ready` gets the names of every pod ready so far."""
    t0 = probes.now()
    trackers = {
        (p.name, c.name): (_trackers(c, t0), container_name(run, p.name, c.name))
        for p in plan
        for c in p.containers
    }
    ip = {p.name: p.ip for p in plan}
    pending = {p.name for p in plan}
    last_report = 0.0
    while pending:
        now = probes.now()
        for (pod, cname), ((startup, readiness), container) in trackers.items():
            if pod not in pending:
                continue
            state = (docker.inspect(container) or {}).get("State", {})
            if not state.get("Running"):
                raise StartFailed(
                    f"{pod}/{cname} exited (code {state.get('ExitCode')}) before it was ready; its "
                    f"log ends with:\n{docker.logs(container, 40)}"
                )
            for t in (startup, readiness):
                if t is None or t.passed or (t is readiness and startup is not None and not startup.passed):
                    continue
                if t.due(now):
                    ok, detail = probes.run(t.probe, ip[pod], _exec(container))
                    t.record(ok, detail, probes.now())
                    if t is startup and t.given_up:
                        raise StartFailed(
                            f"{pod}/{cname}: startup probe {t.probe.describe()} failed "
                            f"{t.failures} times (last: {t.last}); the kubelet would restart it. "
                            f"Its log ends with:\n{docker.logs(container, 40)}"
                        )
        turned = set()
        for pod in sorted(pending):
            if all(r is None or r.passed for (p, _), ((_, r), _) in trackers.items() if p == pod):
                pending.discard(pod)
                turned.add(pod)
                say(f"  ready  {pod:<26} ({probes.now() - t0:.0f} s)")
        if any(r.component == constants.TILERT for r in records if r.name in turned):
            on_tilert_ready({p.name for p in plan} - pending)
        elapsed = probes.now() - t0
        if pending and elapsed > timeout:
            detail = "; ".join(
                f"{p}/{c}: {_pending(s, r)}" for (p, c), ((s, r), _) in trackers.items() if p in pending
            )
            raise StartFailed(f"not ready after {timeout:.0f} s: {detail}")
        if pending and elapsed - last_report >= 15:
            say(f"  waiting for {', '.join(sorted(pending))} ({elapsed:.0f} s)")
            last_report = elapsed
        time.sleep(0.5)
    for rec in records:
        rec.readiness = [
            asdict(c.readiness)
            for p in plan
            if p.name == rec.name
            for c in p.containers
            if c.readiness is not None
        ]


def as_api_pod(rec: PodRecord) -> dict[str, Any]:
    """A ready pod as the API server shows it to the operator (what tilert_operator.observe reads): its
    IP, component label, Multus network-status annotation and Ready condition."""
    annotations = {dataplane.MULTUS_STATUS_ANNOTATION: rec.network_status} if rec.network_status else {}
    return {
        "metadata": {
            "name": rec.name,
            "namespace": rec.namespace,
            "labels": {constants.LABEL_COMPONENT: rec.component},
            "annotations": annotations,
        },
        "status": {"podIP": rec.ip, "conditions": [{"type": "Ready", "status": "True"}]},
    }


def generation_specs(manifests: Sequence[pods.Manifest]) -> dict[str, PDClusterSpec]:
    """slot -> the data-plane spec of each generation rendered in `manifests` (oldest first), as its
    prefill Deployment records it (every generation has one)."""
    out: dict[str, PDClusterSpec] = {}
    for m in manifests:
        labels = m["metadata"].get("labels") or {}
        if m.get("kind") != "Deployment" or labels.get(constants.LABEL_COMPONENT) != constants.PREFILL:
            continue
        spec = generations.recorded_spec(m)
        if spec is None:
            raise ValueError(
                f"Deployment {m['metadata']['name']} records no generation spec "
                f"({constants.GENERATION_SPEC_ANNOTATION}): it was not rendered by this tilert-pd; "
                "`tilert-pd local down` and `up` again"
            )
        out[labels.get(constants.LABEL_SLOT, constants.SLOT_A)] = spec
    return out


def wired_nodes(
    manifests: Sequence[pods.Manifest], ready: Sequence[PodRecord]
) -> tuple[list[router_config.TileRTNode], list[observe.Unwired]]:
    """The router's TileRT entries for the `ready` pods, decided by the operator's own code
    (observe.tilert_nodes: each node at its data-plane address, a node without one left out), each
    with its generation's compat as render/router.py gives it; and the nodes left out, with why. A pod
    of a generation `manifests` no longer render is no endpoint."""
    nodes: list[router_config.TileRTNode] = []
    unwired: list[observe.Unwired] = []
    tilert = [r for r in ready if r.component == constants.TILERT]
    for slot, spec in generation_specs(manifests).items():
        if spec.transfer.rdma.networks:
            old = [r.name for r in tilert if not r.network_status]
            if old:
                raise ValueError(
                    f"{', '.join(old)}: the run's state records no network-status for these TileRT pods "
                    "(started by a tilert-pd from before it was recorded), so their data-plane addresses "
                    "are unknown; `tilert-pd local down` and `up` again"
                )
        found, left_out = observe.tilert_nodes(
            spec, [as_api_pod(r) for r in tilert if (r.slot or constants.SLOT_A) == slot]
        )
        compat = generations.generation(spec).compat
        nodes += [n.model_copy(update={"compat": compat}) for n in found]
        unwired += left_out
    return nodes, unwired


def describe_nodes(nodes: Sequence[router_config.TileRTNode], unwired: Sequence[observe.Unwired]) -> str:
    """One progress line: which TileRT nodes the router's config lists, and which are left out."""
    listed = ", ".join(f"{n.name} (data plane {n.ctrl_host})" for n in nodes) or "none"
    out = f"    router config: TileRT nodes {listed}"
    if unwired:
        out += "; left out: " + "; ".join(f"{u.pod}: {u.problem}" for u in unwired)
    return out


def write_router_config(
    state_dir: Path,
    manifests: Sequence[pods.Manifest],
    records: Sequence[PodRecord],
    nodes: Sequence[router_config.TileRTNode],
) -> set[str]:
    """Write the rendered router ConfigMap, listing `nodes` as its TileRT nodes (as the operator renders
    it with the wired nodes), into every router pod's volume, as the kubelet syncs a mounted ConfigMap
    (one rename: the router never reads half a file); the prefill and native endpoints it lists."""
    configmaps = {m["metadata"]["name"]: m for m in manifests if m.get("kind") == "ConfigMap"}
    listed: set[str] = set()
    for rec in records:
        if rec.component != constants.ROUTER:
            continue
        workload = next(
            (m for m in manifests if m.get("kind") == "Deployment" and m["metadata"]["name"] == rec.workload),
            None,
        )
        if workload is None:
            continue
        for volume in workload["spec"]["template"]["spec"].get("volumes") or []:
            cm = configmaps.get((volume.get("configMap") or {}).get("name", ""))
            if cm is None:
                continue
            for key, text in (cm.get("data") or {}).items():
                if key == ROUTER_CONFIG_KEY:
                    cfg = router_config.RouterConfig.model_validate(yaml.safe_load(text))
                    cfg = cfg.model_copy(update={"tilert": list(nodes)})
                    text = router_config.dump(cfg)
                    listed |= {e.url for e in [*cfg.prefill, *cfg.native]}
                path = state_dir / "pods" / rec.name / "volumes" / volume["name"] / key
                if not path.exists() or path.read_text() != text:
                    path.parent.mkdir(parents=True, exist_ok=True)
                    st = path.stat() if path.exists() else None
                    tmp = path.with_suffix(".tmp")
                    tmp.write_text(text)
                    # The file's group and mode as `up` made them (the router runs as another user).
                    if st is not None:
                        os.chown(tmp, -1, st.st_gid)
                    os.chmod(tmp, st.st_mode & 0o777 if st is not None else 0o644)
                    tmp.replace(path)
    return listed


def _pending(startup: probes.Tracker | None, readiness: probes.Tracker | None) -> str:
    if startup is not None and not startup.passed:
        return f"startup probe {startup.probe.describe()}, last: {startup.last}"
    if readiness is not None:
        return f"readiness probe {readiness.probe.describe()}, last: {readiness.last}"
    return "no readiness probe"


def _trackers(c: pods.Container, t0: float) -> tuple[probes.Tracker | None, probes.Tracker | None]:
    return (
        probes.Tracker(c.startup, t0) if c.startup else None,
        probes.Tracker(c.readiness, t0) if c.readiness else None,
    )


def _exec(container: str) -> probes.Exec:
    def run(argv: Sequence[str], timeout: float) -> int:
        return docker.exec_(container, argv, timeout).returncode

    return run


def ready(rec: PodRecord) -> bool | None:
    """The pod's readiness now (its probes once each); None when its container is not running."""
    state = (docker.inspect(rec.containers[0]) or {}).get("State", {})
    if not state.get("Running"):
        return None
    for raw in rec.readiness:
        probe = pods.Probe(**{**raw, "command": tuple(raw.get("command") or ())})
        ok, _ = probes.run(probe, rec.ip, _exec(rec.containers[0]))
        if not ok:
            return False
    return True


def cleanup(run: str, state_dir: Path, grace_s: float = 15.0) -> int:
    """Stop every container of the run as the kubelet stops a pod (SIGTERM, then SIGKILL after the
    grace period), save its log, and remove it and the run's networks; how many containers."""
    names = docker.containers(run)
    docker.stop(names, grace_s)
    for name in names:
        _save_log(state_dir, name)
    docker.rm(names)
    docker.network_rm(docker.networks(run))
    return len(names)


def records_from(state: dict[str, Any]) -> list[PodRecord]:
    return [PodRecord(**p) for p in state.get("pods", [])]


def dump(records: Sequence[PodRecord]) -> list[dict[str, Any]]:
    return [asdict(r) for r in records]
