"""`tilert-pd local apply` for the docker runtime: the steps of rollout.py against containers.

A pod's endpoints here are the DNS names of its Services on the pod network (the router reaches the
prefill and native pools through their Service names, and finds TileRT nodes through the headless
Service's name). Docker cannot take a name away from a connected container, so a pod leaves the
endpoints by being disconnected from the pod network and connected again at once with the same
address and only its own hostname: its connections in flight keep their addresses (TCP retransmits
over the new link), while no lookup names it any more. A new pod starts without its Service names and
gets them once its readiness probes pass, as the endpoints controller publishes only ready pods.

"The router has the new endpoints" is read where the router reads them: the router's own metrics for
the TileRT nodes it discovered (one series per node), and the pod network's DNS, asked from inside the
router's container, for each Service name. The router's HTTP client caches a lookup for up to 10 s
and reuses open connections; the preStop sleep and the servers' drain on SIGTERM cover that window,
as they cover kube-proxy's in a cluster.
"""

from __future__ import annotations

import copy
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from tilert_operator import constants
from tilert_operator.cli_render import render_document
from tilert_serve.local import apply as applymod
from tilert_serve.local import docker, docker_runtime, pods, rollout, runner

#: The rendered Secrets a docker run was started with (owner-only, in its state directory).
SECRETS_FILE = "secrets.json"
#: Asked inside the router's container: the addresses a name resolves to there.
_RESOLVE = (
    "import socket, sys, json\n"
    "try:\n"
    "    print(json.dumps(sorted({a[4][0] for a in socket.getaddrinfo(sys.argv[1], None)})))\n"
    "except socket.gaierror:\n"
    "    print('[]')\n"
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
    saved = {s["metadata"]["name"]: s for s in json.loads(secrets_file.read_text())}
    manifests = [
        saved.get(m["metadata"]["name"], m) if m.get("kind") == "Secret" else m
        for m in render_document(doc, None, with_secret=True)
    ]
    missing = docker_runtime.missing_images(manifests)
    if missing:
        raise docker.DockerError(f"images not built: {', '.join(missing)}; build them with `make images`")
    say(f"tilert-pd local apply: {name} as containers (state in {state_dir})")
    rt = Containers(name, state_dir, state, manifests)
    steps = applymod.converge(rt, rollout.rendered(manifests, name, local_names=False), timeout, say)
    rt.save()
    say(f"applied: {steps} steps; the OpenAI API is at {state['router']}/v1; `tilert-pd local status`")
    return 0


@dataclass
class Containers:
    """The docker runtime: each pod its containers on the run's networks (docker_runtime.py)."""

    run: str
    state_dir: Path
    state: dict[str, Any]
    manifests: list[pods.Manifest]

    def __post_init__(self) -> None:
        self.records = docker_runtime.records_from(self.state)
        self.net = docker.network(f"tpd-{self.run}")

    def _rec(self, name: str) -> docker_runtime.PodRecord:
        return next(r for r in self.records if r.name == name)

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
        rec = replace(
            rec,
            workload=step.workload,
            revision=step.revision,
            ordinal=step.ordinal,
            grace_s=rendered.grace_s,
            pre_stop=list(rendered.pre_stop) if rendered.pre_stop else None,
            aliases=list(made.aliases),
            published=False,
        )
        self.records.append(rec)

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
        router = next(
            (r for r in self.records if r.component == constants.ROUTER and docker_runtime.ready(r)), None
        )
        if router is None:
            say("    (no router ready: it finds the endpoints when it starts)")
            return
        self.state["router"] = router.url
        self._await_dns(router, serving, say)
        nodes = {r.url for r in self.records if r.component == constants.TILERT and r.name in serving}
        t0 = time.monotonic()
        while time.monotonic() - t0 < applymod.ROUTER_RELOAD_TIMEOUT_S:
            if applymod.router_endpoints(router.url, pool="tilert") == nodes:
                say(
                    f"    router has the new endpoints ({len(nodes)} TileRT nodes; {time.monotonic() - t0:.1f} s)"
                )
                return
            time.sleep(0.5)
        raise applymod.Stalled(
            f"the router at {router.url} did not find the TileRT nodes {sorted(nodes)} in time"
        )

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
