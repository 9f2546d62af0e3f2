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

from tilert_operator import handoff as handoff_check
from tilert_operator import observe, validation
from tilert_operator.cli_render import render_document
from tilert_serve import defaults
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
        self.calls.append(f"connect {name} {'published' if aliases else 'unpublished'}")

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


def _url(pod: pods.Pod) -> str:
    """The pod's URL as docker_runtime.start_pods records it (its port named http, else its first)."""
    main = pod.containers[0]
    return f"http://{pod.ip}:{main.ports.get('http') or next(iter(main.ports.values()))}"


def _up_records(engine: Engine, manifests: list[dict[str, Any]]) -> list[docker_runtime.PodRecord]:
    """What `up` recorded for `manifests`: one pod per workload, its containers running in `engine`,
    each answering its Service's names."""
    records = []
    for pod in pods.pods(manifests, docker_runtime.addresses(NET, set())):
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
                _url(pod),
                workload=pod.owner,
                aliases=list(pod.aliases),
            )
        )
    return docker_apply.with_revisions(records, rollout.rendered(manifests, "tiny", local_names=False))


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

    # The router's endpoints: the TileRT nodes its discovery names answer with (a headless Service per
    # generation), and the prefill and native Services its config file (in its pod's volume) lists.
    def endpoints(url: str, timeout: float = 5.0, pool: str | None = None) -> set[str]:
        if pool == "tilert":
            return {
                f"http://{c['ip']}:{defaults.DECODE_HTTP_PORT}"
                for c in e.containers.values()
                if c["running"]
                and any(a.startswith("tiny-tilert-") and a.endswith(".default.svc") for a in c["aliases"])
            }
        out: set[str] = set()
        for path in tmp_path.glob("pods/tiny-router-*/volumes/config/config.yaml"):
            cfg = yaml.safe_load(path.read_text())
            out |= {ep["url"] if isinstance(ep, dict) else ep for ep in cfg.get(pool or "prefill") or []}
        return out

    monkeypatch.setattr(applymod, "router_endpoints", endpoints)
    monkeypatch.setattr(docker_runtime, "_write_files", lambda pod, pod_dir: None)
    return e


def test_a_prefill_rollout_publishes_the_new_pod_before_the_old_one_leaves(
    engine: Engine, tmp_path: Path
) -> None:
    before = _manifests([])
    records = _up_records(engine, before)
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


def _doc(mtp: bool) -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load(EXAMPLE.read_text())
    doc["spec"]["decode"]["tilert"]["replicas"] = 1
    doc["spec"]["decode"]["native"]["replicas"] = 0
    doc["spec"]["prefill"].setdefault("mtp", {})["enabled"] = mtp
    doc["spec"]["decode"]["tilert"]["mtp"] = mtp
    return doc


def test_a_generation_change_runs_blue_green_in_containers(
    engine: Engine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = tmp_path / "a.yaml"
    first.write_text(yaml.safe_dump(_doc(True)))
    before = render_document(_doc(True), None, with_secret=True)
    docker_apply.save_secrets(tmp_path, before)
    records = _up_records(engine, before)
    # What `up` records (no generation: apply adopts the file's as slot a's).
    state: dict[str, Any] = {
        "cluster": "tiny",
        "file": str(first),
        "router": "http://10.77.0.99:8000",
        "runtime": "docker",
        "pods": docker_runtime.dump(records),
    }
    monkeypatch.setattr(docker, "unavailable", lambda: None)
    monkeypatch.setattr(docker, "image_exists", lambda image: True)
    monkeypatch.setattr(applymod, "READINESS_POLL_S", 0.0)
    # The new nodes report no handoff on the first read, then one that succeeded (the router's probe).
    polled: list[list[str]] = []
    configs: list[dict[str, Any]] = []

    async def poll(nodes: Sequence[Any], secret: dict[str, Any] | None) -> list[observe.NodeReport]:
        assert handoff_check.node_token(secret), "the node-API token was not passed"
        polled.append([n.name for n in nodes])
        engine.calls.append("poll")
        (config,) = tmp_path.glob("pods/tiny-router-*/volumes/config/config.yaml")
        configs.append(yaml.safe_load(config.read_text()))
        ok = {"last_success": {"age_s": 1.0}} if len(polled) > 1 else None
        return [observe.NodeReport(n.name, ok, error=None if ok else "no handoff yet") for n in nodes]

    monkeypatch.setattr(handoff_check, "poll", poll)
    lines: list[str] = []
    assert docker_apply.apply(_doc(False), "tiny", tmp_path, state, 60, lines.append) == 0
    out = "\n".join(lines)
    assert "blue/green" in out and "generation phase 2/2" in out
    # Only the new generation's nodes are read; the first read (no handoff yet) held the old one serving.
    assert polled == [["tiny-tilert-b-0"], ["tiny-tilert-b-0"]], polled
    # While the new generation waited, the router listed both generations' Services, each with its compat.
    prefills = {ep["url"]: ep["compat"] for ep in configs[0]["prefill"]}
    assert set(prefills) == {"http://tiny-prefill.default.svc:8100", "http://tiny-prefill-b.default.svc:8100"}
    assert len(set(prefills.values())) == 2 and None not in prefills.values()
    assert {d["service"] for d in configs[0]["tilert_discovery"]} == {
        "tiny-tilert-decode.default.svc",
        "tiny-tilert-b.default.svc",
    }
    # The new pods answer slot b's Service names (once ready), the old ones left after.
    calls = engine.calls
    new_prefill, old_prefill = "tpd-tiny-tiny-prefill-b-0-vllm", "tpd-tiny-tiny-prefill-0-vllm"
    assert calls.index(f"create {new_prefill} aliases=0") < calls.index(f"connect {new_prefill} published")
    assert "tiny-prefill-b.default.svc" in engine.containers[new_prefill]["aliases"]
    assert calls.index(f"connect {new_prefill} published") < calls.index(f"connect {old_prefill} unpublished")
    assert calls.index(f"connect {old_prefill} unpublished") < calls.index(f"stop {old_prefill}")
    # The old generation left the endpoints only after the new nodes read HandoffReady.
    last_poll = len(calls) - 1 - calls[::-1].index("poll")
    assert last_poll < calls.index(f"connect {old_prefill} unpublished")
    saved = json.loads((tmp_path / "state.json").read_text())
    assert {p["name"] for p in saved["pods"]} == {"tiny-prefill-b-0", "tiny-tilert-b-0", "tiny-router-0"}
    slot_b = {p["name"]: (p["slot"], p["generation"]) for p in saved["pods"] if p["slot"]}
    assert set(slot_b) == {"tiny-prefill-b-0", "tiny-tilert-b-0"}
    assert {s for s, _ in slot_b.values()} == {"b"}
    assert set(saved[rollout.GENERATIONS_KEY]) == {"b"}
    assert {g for _, g in slot_b.values()} == {saved[rollout.GENERATIONS_KEY]["b"]["fingerprint"]}
    (config,) = tmp_path.glob("pods/tiny-router-*/volumes/config/config.yaml")
    final = yaml.safe_load(config.read_text())
    assert [ep["url"] for ep in final["prefill"]] == ["http://tiny-prefill-b.default.svc:8100"]
