"""`tilert-pd local apply` for the docker runtime: the steps of rollout.py against containers.

A pod's endpoints here are the DNS names of its Services on the pod network (the router reaches the
prefill and native pools through their Service names, and, without a secondary network, also finds
TileRT nodes through the headless Service's name), and for a TileRT node its entry in the router's
ConfigMap: every step that changes the endpoints rewrites that list with the wired nodes, as the
operator does (docker_runtime.wired_nodes: each node at its data-plane address; with a secondary
network the list is all the router routes). Docker cannot take a name away from a connected
container, so a pod leaves the endpoints by being disconnected from the pod network and connected
again at once with the same address and only its own hostname: its connections in flight keep their addresses (TCP retransmits
over the new link), while no lookup names it any more. A new pod starts without its Service names and
gets them once its readiness probes pass, as the endpoints controller publishes only ready pods.

"The router has the new endpoints" is read where the router reads them: the router's own metrics for
its TileRT nodes (one series per node), and the pod network's DNS, asked from inside the
router's container, for each Service name. The router's HTTP client caches a lookup for up to 10 s
and reuses open connections; the preStop sleep and the servers' drain on SIGTERM cover that window,
as they cover kube-proxy's in a cluster.

A change of compatibility generation plays the operator's blue/green rollout, decided by the same code
as the process runtime's (rollout.generation_phases, apply.apply_generations): each phase is rendered
with the operator's own renderer given the live generations, so the new generation's workloads and
Services are slot b's (`<cluster>-prefill-b`, `<cluster>-tilert-b`, ...) and its pods answer those
names; the router's ConfigMap, rewritten into the router pod's volume as the kubelet syncs it, lists
both generations' Services each with its compat; the new TileRT nodes' /v1/status is read from the
host at their pod addresses (HandoffReady) before the old generation leaves the router's list.
"""

from __future__ import annotations

import copy
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from tilert_operator import constants, render, validation
from tilert_operator import rollout as op_rollout
from tilert_operator.render import generations
from tilert_operator.render.generations import Live
from tilert_operator.spec import PDClusterSpec
from tilert_serve.local import apply as applymod
from tilert_serve.local import docker, docker_runtime, pods, rollout, runner
from tilert_serve.router import config as router_config

#: The rendered Secrets a docker run was started with (owner-only, in its state directory).
SECRETS_FILE = "secrets.json"
#: Asked inside the router's container: the addresses a name resolves to there. Docker's embedded DNS
#: answers a name a container holds at once and forwards any other to the host's resolvers, which on an
#: offline host never answer (a lookup then outlasts `docker exec`'s timeout): so a name that has not
#: answered within a few seconds reads as naming no pod, which is what it means there.
_RESOLVE = (
    "import json, os, socket, sys, threading\n"
    "found = []\n"
    "def look():\n"
    "    try:\n"
    "        found.append(sorted({a[4][0] for a in socket.getaddrinfo(sys.argv[1], None)}))\n"
    "    except socket.gaierror:\n"
    "        found.append([])\n"
    "t = threading.Thread(target=look, daemon=True)\n"
    "t.start()\n"
    "t.join(3)\n"
    "print(json.dumps(found[0] if found else []), flush=True)\n"
    "os._exit(0)\n"
)


def save_secrets(state_dir: Path, manifests: Sequence[pods.Manifest]) -> None:
    secrets = [m for m in manifests if m.get("kind") == "Secret"]
    runner.write_secret_file(state_dir / SECRETS_FILE, json.dumps(secrets))


def with_revisions(
    records: Sequence[docker_runtime.PodRecord], rendered: Sequence[rollout.Rendered]
) -> list[docker_runtime.PodRecord]:
    """Each record with its workload's template revision and how the kubelet stops it."""
    by = {r.workload.name: r for r in rendered}
    out = []
    for rec in records:
        r = by.get(rec.workload)
        if r is None:
            out.append(rec)
            continue
        pre_stop = list(r.pre_stop) if r.pre_stop else None
        out.append(replace(rec, revision=r.workload.revision, grace_s=r.grace_s, pre_stop=pre_stop))
    return out


def apply(
    doc: dict[str, Any],
    name: str,
    state_dir: Path,
    state: dict[str, Any],
    timeout: float,
    say: Callable[[str], None],
) -> int:
    reason = docker.unavailable()
    if reason:
        raise docker.DockerError(f"the stack runs as containers, and no Docker engine answers: {reason}")
    secrets_file = state_dir / SECRETS_FILE
    if not secrets_file.exists():
        raise ValueError(
            f"{state_dir} does not hold the credentials the running pods were started with (an `up` "
            "from before `apply`); `tilert-pd local down` and `up` again"
        )
    spec = _spec(doc, name)
    namespace = str((doc.get("metadata") or {}).get("namespace") or "default")
    rt = Containers(
        name,
        state_dir,
        state,
        [],
        spec=spec,
        namespace=namespace,
        secrets=list(json.loads(secrets_file.read_text())),
    )
    rt.adopt_generations(say)
    slots = rollout.occupied(rollout.recorded(state), rt.pod_generations())
    choice, phases = rollout.generation_phases(spec, slots)
    missing = docker_runtime.missing_images([m for lives in phases for m in rt.render(lives)])
    if missing:
        raise docker.DockerError(f"images not built: {', '.join(missing)}; build them with `make images`")
    say(f"tilert-pd local apply: {name} as containers (state in {state_dir})")
    applymod.say_phases(choice.current, phases, say)

    def render_lives(lives: Sequence[Live]) -> list[rollout.Rendered]:
        return rollout.rendered(rt.render(lives), name, local_names=False)

    steps = applymod.apply_generations(rt, phases, render_lives, timeout, say)
    state["applied"] = time.time()
    rt.save()
    say(f"applied: {steps} steps; the OpenAI API is at {state['router']}/v1; `tilert-pd local status`")
    return 0


def _spec(doc: dict[str, Any], name: str) -> PDClusterSpec:
    parsed, problems = validation.validate(doc.get("spec") or {}, name)
    if problems or parsed is None:
        raise ValueError("\n".join(str(p) for p in problems) or f"PDCluster {name}: no spec")
    return parsed


def _file_spec(path: str) -> PDClusterSpec:
    """The spec of the PDCluster file a run was started or last applied from."""
    doc = yaml.safe_load(Path(path).read_text()) or {}
    return _spec(doc, str((doc.get("metadata") or {}).get("name") or ""))


@dataclass
class Containers:
    """The docker runtime: each pod its containers on the run's networks (docker_runtime.py)."""

    run: str
    state_dir: Path
    state: dict[str, Any]
    #: What is rendered now: the Secrets the run started with and the children of the live generations.
    manifests: list[pods.Manifest]
    #: The spec being applied (the router's own settings follow it) and its namespace.
    spec: PDClusterSpec | None = None
    namespace: str = "default"
    #: The rendered Secrets the run was started with (a new render would lock the running pods out).
    secrets: list[pods.Manifest] = field(default_factory=list)
    #: The generations rendered now, by slot (`use`).
    lives: dict[str, Live] = field(default_factory=dict)
    #: The pods that are endpoints now (the last `publish`).
    serving: set[str] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.records = docker_runtime.records_from(self.state)
        self.net = docker.network(f"tpd-{self.run}")

    def _rec(self, name: str) -> docker_runtime.PodRecord:
        return next(r for r in self.records if r.name == name)

    def render(self, lives: Sequence[Live]) -> list[pods.Manifest]:
        """The Secrets and the operator's children with the generations `lives`, oldest first."""
        if self.spec is None:
            raise ValueError("Containers.render needs the spec being applied")
        children = render.children(self.spec, self.run, self.namespace, lives=lives)
        return [*self.secrets, *children]

    def adopt_generations(self, say: Callable[[str], None]) -> None:
        """A state from an `up` that recorded no generation: one generation in slot a, the spec of the
        file the run was started from, its data-plane pods that generation's (as the operator takes
        workloads without a generation label). A file that no longer loads: rolled in place."""
        if rollout.GENERATIONS_KEY in self.state:
            return
        try:
            live = Live(_file_spec(str(self.state.get("file") or "")))
        except (OSError, ValueError, yaml.YAMLError) as exc:
            say(
                f"  note: the state records no generation and its spec file does not load ({exc}); rolling in place"
            )
            return
        self.state[rollout.GENERATIONS_KEY] = {
            live.slot: asdict(rollout.RecordedGeneration.of(live, applymod.now_rfc3339()))
        }
        for rec in self.records:
            if rec.component in generations.DATA_PLANE and not rec.slot:
                rec.slot, rec.generation = live.slot, live.generation.fingerprint

    def pod_generations(self) -> dict[str, str | None]:
        """slot -> the fingerprint its data-plane pods recorded (None: from before generations)."""
        out: dict[str, str | None] = {}
        for rec in self.records:
            if rec.component in generations.DATA_PLANE:
                out.setdefault(rec.slot or constants.SLOT_A, rec.generation or None)
        return out

    def use(self, lives: Sequence[Live]) -> None:
        before = rollout.recorded(self.state)
        self.lives = {g.slot: g for g in lives}
        self.manifests = self.render(lives)

        def created(g: Live) -> str:
            # A generation keeps the time it was first rendered (tilert_operator.rollout.choose reads it).
            old = before.get(g.slot)
            if old is not None and old.created and old.fingerprint == g.generation.fingerprint:
                return old.created
            return applymod.now_rfc3339()

        self.state[rollout.GENERATIONS_KEY] = {
            g.slot: asdict(rollout.RecordedGeneration.of(g, created(g))) for g in lives
        }
        self.save()

    def readiness(self, live: Live, rendered: Sequence[rollout.Rendered]) -> tuple[op_rollout.Readiness, str]:
        pools = rollout.pool_states(rendered, self.pods(), live.slot)
        # Read from the host at each node's pod address, as the readiness probes are.
        nodes = [
            router_config.TileRTNode(
                name=r.name, http_url=r.url, ctrl_host=r.ip, compat=live.generation.compat
            )
            for r in self.records
            if r.component == constants.TILERT and (r.slot or constants.SLOT_A) == live.slot
        ]
        secret = next((s for s in self.secrets if constants.NODE_API_TOKEN_KEY in (s.get("data") or {})), {})
        return applymod.generation_readiness(pools, nodes, secret)

    def pods(self) -> list[rollout.Pod]:
        out = []
        for rec in self.records:
            if not rec.revision:
                raise ValueError(
                    f"{self.state_dir / runner.STATE_FILE} does not say which template each pod runs (an "
                    "`up` from before `apply`); `tilert-pd local down` and `up` again"
                )
            ready = docker_runtime.ready(rec)
            out.append(
                rollout.Pod(rec.name, rec.workload, rec.revision, rec.ordinal, ready is not None, bool(ready))
            )
        return out

    def create(self, step: rollout.Create, rendered: rollout.Rendered) -> None:
        workload = next(
            m
            for m in self.manifests
            if m.get("kind") in ("Deployment", "StatefulSet") and m["metadata"]["name"] == step.workload
        )
        # The pod of this ordinal, as the workload would make it (pods.pods names them <name>-<i>).
        one = copy.deepcopy(workload)
        one["spec"]["replicas"] = step.ordinal + 1
        others = [m for m in self.manifests if m.get("kind") not in ("Deployment", "StatefulSet")]
        ips = docker_runtime.addresses(self.net, docker.network_used(self.net.name))
        made = next(p for p in pods.pods([*others, one], ips) if p.name == step.pod)
        # No Service name until it is ready (publish gives them).
        pod = replace(made, aliases=())
        secondary = {}
        for network in pod.networks:
            net = docker.network(f"tpd-{self.run}-{network.replace('/', '-')}")
            secondary[network] = (net, docker_runtime.addresses(net, docker.network_used(net.name)))
        (rec,) = docker_runtime.start_pods(
            [pod], self.run, self.state_dir, self.net, secondary, lambda _m: None
        )
        live = self.lives.get(rendered.slot) if rendered.slot else None
        rec = replace(
            rec,
            slot=rendered.slot,
            generation=live.generation.fingerprint if live is not None else "",
            workload=step.workload,
            revision=step.revision,
            ordinal=step.ordinal,
            grace_s=rendered.grace_s,
            pre_stop=list(rendered.pre_stop) if rendered.pre_stop else None,
            aliases=list(made.aliases),
            published=False,
        )
        self.records.append(rec)
        if rec.component == constants.ROUTER:
            # It started with the ConfigMap as rendered, which lists no TileRT node: the wired ones now
            # (with a secondary network it finds none through DNS).
            self._write_router_config(self.serving, say=lambda _m: None)

    def wait(self, names: Sequence[str], timeout: float, say: Callable[[str], None]) -> None:
        t0 = time.monotonic()
        pending = set(names)
        last = 0.0
        while pending:
            for name in sorted(pending):
                rec = self._rec(name)
                ready = docker_runtime.ready(rec)
                if ready is None:
                    raise applymod.Stalled(
                        f"{name} exited before it was ready; its log ends with:\n"
                        f"{docker.logs(rec.containers[0], 40)}\nThe rollout stops here: the pods that "
                        "served before it keep serving. Fix the spec and apply again, or `tilert-pd local down`."
                    )
                if ready:
                    say(f"  ready  {name:<26} ({time.monotonic() - t0:.0f} s)")
                    pending.discard(name)
            elapsed = time.monotonic() - t0
            if pending and elapsed > timeout:
                raise applymod.Stalled(
                    f"{', '.join(sorted(pending))} not ready after {timeout:.0f} s; the pods that served "
                    "before keep serving. Fix the spec and apply again, or `tilert-pd local down`."
                )
            if pending and elapsed - last >= 15:
                say(f"  waiting for {', '.join(sorted(pending))} ({elapsed:.0f} s)")
                last = elapsed
            time.sleep(0.5)

    def publish(self, serving: set[str], say: Callable[[str], None]) -> None:
        for rec in self.records:
            want = rec.name in serving
            # The router's own Service name is no endpoint of anything here: left as it is.
            if rec.component != constants.ROUTER and want != rec.published and rec.aliases:
                container = rec.containers[0]
                docker.network_disconnect(self.net.name, container)
                docker.network_connect(self.net.name, container, rec.ip, rec.aliases if want else ())
                rec.published = want
        self.serving = set(serving)
        configured, nodes = self._write_router_config(serving, say)
        router = next(
            (r for r in self.records if r.component == constants.ROUTER and docker_runtime.ready(r)), None
        )
        if router is None:
            say("    (no router ready: it reads the endpoints when it starts)")
            return
        self.state["router"] = router.url
        self._await_dns(router, serving, say)
        t0 = time.monotonic()
        while time.monotonic() - t0 < applymod.ROUTER_RELOAD_TIMEOUT_S:
            tilert = applymod.router_endpoints(router.url, pool="tilert")
            prefill = applymod.router_endpoints(router.url, pool="prefill")
            native = applymod.router_endpoints(router.url, pool="native")
            if (
                tilert == nodes
                and prefill is not None
                and native is not None
                and prefill | native == configured
            ):
                say(
                    f"    router has the new endpoints ({len(nodes)} TileRT nodes, {len(configured)} "
                    f"Services; {time.monotonic() - t0:.1f} s)"
                )
                return
            time.sleep(0.5)
        raise applymod.Stalled(
            f"the router at {router.url} did not load its config ({sorted(configured)}) or find the TileRT "
            f"nodes {sorted(nodes)} within {applymod.ROUTER_RELOAD_TIMEOUT_S:.0f} s; its log: `docker logs "
            f"{router.containers[0]}`. Nothing was stopped."
        )

    def _write_router_config(
        self, serving: set[str], say: Callable[[str], None]
    ) -> tuple[set[str], set[str]]:
        """The router ConfigMap with the wired TileRT nodes among `serving` (docker_runtime.wired_nodes,
        as the operator lists them), written into the router pods' volumes; (the prefill and native
        endpoints it lists, the TileRT nodes' URLs)."""
        nodes, unwired = docker_runtime.wired_nodes(
            self.manifests, [r for r in self.records if r.name in serving]
        )
        listed = docker_runtime.write_router_config(self.state_dir, self.manifests, self.records, nodes)
        say(docker_runtime.describe_nodes(nodes, unwired))
        return listed, {n.http_url for n in nodes}

    def _await_dns(
        self, router: docker_runtime.PodRecord, serving: set[str], say: Callable[[str], None]
    ) -> None:
        services = [m for m in self.manifests if m.get("kind") == "Service"]
        for svc in services:
            name = pods.dns_names(svc["metadata"]["name"], svc["metadata"].get("namespace", "default"))[2]
            expected = sorted(r.ip for r in self.records if r.name in serving and name in r.aliases)
            t0 = time.monotonic()
            while True:
                done = docker.exec_(router.containers[0], ["python3", "-c", _RESOLVE, name], 10)
                seen = json.loads(done.stdout or "[]") if done.returncode == 0 else None
                if seen == expected:
                    break
                if time.monotonic() - t0 > applymod.ROUTER_RELOAD_TIMEOUT_S:
                    raise applymod.Stalled(f"{name} resolves to {seen} in the router's pod, not {expected}")
                time.sleep(0.5)

    def stop(self, name: str, say: Callable[[str], None]) -> None:
        rec = self._rec(name)
        t0 = time.monotonic()
        if rec.pre_stop and docker_runtime.ready(rec) is not None:
            docker.exec_(rec.containers[0], rec.pre_stop, rec.grace_s)
        left = max(2.0, rec.grace_s - (time.monotonic() - t0))
        docker.stop(rec.containers, left)
        for container in rec.containers:
            docker_runtime.save_log(self.state_dir, container)
        docker.rm(rec.containers)
        say(f"    {name} stopped ({time.monotonic() - t0:.1f} s)")
        self.records.remove(rec)

    def save(self) -> None:
        self.state["pods"] = docker_runtime.dump(self.records)
        runner.save_raw(self.state_dir, self.state)
