"""docker_apply.Containers against a fake engine (the Docker CLI calls replaced, nothing started): a
prefill rollout creates the new pod without its Service name, publishes it once ready, and takes the
old pod off the Service's name (as the router's pod resolves it) before its preStop and stop. The
real engine runs the same in test_local_apply_docker.py (CI)."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from tilert_operator import validation
from tilert_operator.cli_render import render_document
from tilert_serve.local import apply as applymod
from tilert_serve.local import docker, docker_apply, docker_runtime, pods, rollout

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tiny-cpu.yaml"
NET = docker.Network("tpd-tiny", "10.77.0.0/24", "10.77.0.1")
PREFILL_SVC = "tiny-prefill.default.svc"


@dataclass
class Engine:
    """Containers by name: their address, the DNS names they answer, running or not."""

    containers: dict[str, dict[str, Any]] = field(default_factory=dict)
    calls: list[str] = field(default_factory=list)

    def create(self, spec: docker.RunSpec) -> None:
        self.containers[spec.name] = {"ip": spec.ip, "aliases": list(spec.aliases), "running": False}
        self.calls.append(f"create {spec.name} aliases={len(spec.aliases)}")

    def start(self, name: str) -> None:
        self.containers[name]["running"] = True

    def inspect(self, name: str) -> dict[str, Any] | None:
        c = self.containers.get(name)
        return None if c is None else {"State": {"Running": c["running"], "Pid": 1}, "Args": []}

    def disconnect(self, network: str, name: str) -> None:
        self.containers[name]["aliases"] = []
        self.calls.append(f"disconnect {name}")

    def connect(self, network: str, name: str, ip: str, aliases: Sequence[str] = ()) -> None:
        assert ip == self.containers[name]["ip"], "reconnected under another address"
        self.containers[name]["aliases"] = list(aliases)
        self.calls.append(f"connect {name} {'published' if PREFILL_SVC in aliases else 'unpublished'}")

    def exec_(self, name: str, argv: Sequence[str], timeout: float) -> subprocess.CompletedProcess[str]:
        if argv[:2] == ["python3", "-c"]:  # the router pod's lookup
            ips = sorted(
                c["ip"] for c in self.containers.values() if c["running"] and argv[3] in c["aliases"]
            )
            return subprocess.CompletedProcess(argv, 0, json.dumps(ips), "")
        self.calls.append(f"exec {name} {' '.join(argv)}")
        return subprocess.CompletedProcess(argv, 0, "", "")

    def stop(self, names: Sequence[str], grace_s: float) -> None:
        for n in names:
            self.containers[n]["running"] = False
            self.calls.append(f"stop {n}")

    def rm(self, names: Sequence[str]) -> None:
        for n in names:
            del self.containers[n]


def _manifests(prefill_args: list[str]) -> list[dict[str, Any]]:
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["spec"]["decode"]["tilert"]["replicas"] = 1
    doc["spec"]["decode"]["native"]["replicas"] = 0
    doc["spec"]["prefill"]["extraArgs"] += prefill_args
    assert validation.validate(doc["spec"], "tiny")[0] is not None
    return render_document(doc, None, with_secret=True)


@pytest.fixture
def engine(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Engine:
    e = Engine()
    monkeypatch.setattr(docker, "create", e.create)
    monkeypatch.setattr(docker, "start", e.start)
    monkeypatch.setattr(docker, "inspect", e.inspect)
    monkeypatch.setattr(docker, "network_disconnect", e.disconnect)
    monkeypatch.setattr(docker, "network_connect", e.connect)
    monkeypatch.setattr(docker, "exec_", e.exec_)
    monkeypatch.setattr(docker, "stop", e.stop)
    monkeypatch.setattr(docker, "rm", e.rm)
    monkeypatch.setattr(docker, "logs", lambda name, tail=None: "")
    monkeypatch.setattr(docker, "wait", lambda name, timeout: 0)  # an init container's exit code
    monkeypatch.setattr(docker, "network", lambda name: NET)
    monkeypatch.setattr(
        docker, "network_used", lambda name: {c["ip"] for c in e.containers.values() if c["ip"]}
    )
    # Readiness: a running container is ready (the probes themselves are probes.py's, tested apart).
    monkeypatch.setattr(
        docker_runtime,
        "ready",
        lambda rec: (e.containers.get(rec.containers[0]) or {}).get("running") or None,
    )
    # The router's discovered TileRT nodes: those the headless Service's name answers with.
    monkeypatch.setattr(
        applymod,
        "router_endpoints",
        lambda url, timeout=5.0, pool=None: {
            f"http://{c['ip']}:8000"
            for c in e.containers.values()
            if c["running"] and "tiny-tilert-decode.default.svc" in c["aliases"]
        },
    )
    monkeypatch.setattr(docker_runtime, "_write_files", lambda pod, pod_dir: None)
    return e


def test_a_prefill_rollout_publishes_the_new_pod_before_the_old_one_leaves(
    engine: Engine, tmp_path: Path
) -> None:
    before = _manifests([])
    # What `up` recorded: one pod per workload, each answering its Service's names.
    ips = docker_runtime.addresses(NET, set())
    records = []
    for pod in pods.pods(before, ips):
        names = [docker_runtime.container_name("tiny", pod.name, c.name) for c in pod.containers]
        for n in names:
            engine.containers[n] = {"ip": pod.ip, "aliases": list(pod.aliases), "running": True}
        records.append(
            docker_runtime.PodRecord(
                pod.name,
                pod.labels["pd.tilert.ai/component"],
                pod.ip,
                pod.containers[0].image,
                names,
                f"http://{pod.ip}:8000",
                workload=pod.owner,
                ordinal=0,
                aliases=list(pod.aliases),
            )
        )
    records = docker_apply.with_revisions(records, rollout.rendered(before, "tiny", local_names=False))
    state: dict[str, Any] = {
        "cluster": "tiny",
        "router": "",
        "runtime": "docker",
        "pods": docker_runtime.dump(records),
    }
    after = _manifests(["--max-num-seqs", "32"])
    rt = docker_apply.Containers("tiny", tmp_path, state, after)
    lines: list[str] = []
    steps = applymod.converge(rt, rollout.rendered(after, "tiny", local_names=False), 60, lines.append)
    assert steps == 3
    new, old = "tpd-tiny-tiny-prefill-1-vllm", "tpd-tiny-tiny-prefill-0-vllm"
    calls = engine.calls
    # Created without the Service's name, published once ready, before the old one is unpublished,
    # which comes before its preStop and its stop.
    assert calls.index(f"create {new} aliases=0") < calls.index(f"connect {new} published")
    assert calls.index(f"connect {new} published") < calls.index(f"connect {old} unpublished")
    # The rendered preStop (wait until vLLM is idle), run in the old pod's container as the kubelet would.
    hook = next(i for i, c in enumerate(calls) if c.startswith(f"exec {old} tilert-pd wait-idle "))
    assert "--url http://127.0.0.1:8100" in calls[hook]
    assert calls.index(f"connect {old} unpublished") < hook < calls.index(f"stop {old}")
    saved = json.loads((tmp_path / "state.json").read_text())
    assert {p["name"] for p in saved["pods"]} == {"tiny-prefill-1", "tiny-tilert-decode-0", "tiny-router-0"}
    (rec,) = [p for p in saved["pods"] if p["name"] == "tiny-prefill-1"]
    assert rec["published"] and PREFILL_SVC in rec["aliases"] and rec["ip"] not in {r.ip for r in records}
    assert "tiny-prefill: 1/1 updated, waiting for tiny-prefill-1 ready" in " ".join(lines)
