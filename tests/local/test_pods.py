"""The docker runtime's pure half: rendered manifests -> pods, as a kubelet and cluster DNS would run them."""

from __future__ import annotations

import base64
import http.server
import itertools
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tilert_operator import constants
from tilert_operator.cli_render import render_document
from tilert_serve import dataplane
from tilert_serve.local import docker, pods, probes

ROOT = Path(__file__).resolve().parents[2]


def _ips() -> Iterator[str]:
    return (f"10.99.0.{i}" for i in itertools.count(10))


def _tiny(**spec_changes: Any) -> list[dict[str, Any]]:
    doc = yaml.safe_load((ROOT / "examples/tiny-cpu.yaml").read_text())
    doc["spec"].update(spec_changes)
    return render_document(doc, None, with_secret=True)


@pytest.fixture(scope="module")
def tiny() -> tuple[list[dict[str, Any]], dict[str, pods.Pod]]:
    manifests = _tiny()
    return manifests, {p.name: p for p in pods.pods(manifests, _ips())}


def test_every_replica_is_a_pod_with_its_own_address(tiny: Any) -> None:
    manifests, by_name = tiny
    expected = {
        f"{m['metadata']['name']}-{i}"
        for m in manifests
        if m["kind"] in ("Deployment", "StatefulSet")
        for i in range(m["spec"]["replicas"])
    }
    assert set(by_name) == expected
    assert "tiny-tilert-decode-1" in by_name
    assert len({p.ip for p in by_name.values()}) == len(by_name)


def test_services_are_dns_names_of_the_pods_they_select(tiny: Any) -> None:
    _, by_name = tiny
    assert "tiny-prefill.default.svc" in by_name["tiny-prefill-0"].aliases
    assert "tiny-prefill.default.svc" not in by_name["tiny-router-0"].aliases
    decode = by_name["tiny-tilert-decode-1"]
    # The headless Service answers with every decode pod; each pod has its stable name as well.
    assert "tiny-tilert-decode.default.svc" in decode.aliases
    assert "tiny-tilert-decode-1.tiny-tilert-decode.default.svc.cluster.local" in decode.aliases
    assert not any(a.startswith("tiny-tilert-decode-0.") for a in decode.aliases)


def test_the_router_config_names_only_services_the_pods_answer(tiny: Any) -> None:
    manifests, by_name = tiny
    cm = next(m for m in manifests if m["kind"] == "ConfigMap" and m["metadata"]["name"] == "tiny-router")
    cfg = yaml.safe_load(cm["data"]["config.yaml"])
    # An endpoint is a URL, or a mapping with its URL (and the pool's compatibility generation).
    urls = [e if isinstance(e, str) else e["url"] for e in [*cfg["prefill"], *cfg["native"]]]
    names = [u.split("//")[1].split(":")[0] for u in urls]
    names.append(cfg["tilert_discovery"]["service"])
    every_alias = {a for p in by_name.values() for a in p.aliases}
    assert names and all(n in every_alias for n in names)


def test_command_env_and_downward_api(tiny: Any) -> None:
    manifests, by_name = tiny
    pod = by_name["tiny-tilert-decode-0"]
    (c,) = pod.containers
    deploy = next(
        m for m in manifests if m["metadata"]["name"] == "tiny-tilert-decode" and m["kind"] == "StatefulSet"
    )
    rendered = deploy["spec"]["template"]["spec"]["containers"][0]
    assert c.entrypoint == tuple(rendered["command"]) and c.args == ()
    assert c.env["POD_IP"] == pod.ip and c.env["POD_NAME"] == pod.name
    assert c.image == rendered["image"]
    assert c.ports == {p["name"]: p["containerPort"] for p in rendered["ports"]}
    assert [i.name for i in pod.init_containers] == ["tiny-model"]


def test_secret_and_configmap_volumes_become_files_with_their_modes(tiny: Any) -> None:
    manifests, by_name = tiny
    secret = next(m for m in manifests if m["kind"] == "Secret" and m["metadata"]["name"] == "tiny-handoff")
    pod = by_name["tiny-tilert-decode-0"]
    files = {f.path: f for f in pod.files}
    f = files["volumes/handoff-secret/secret"]
    assert f.content == base64.b64decode(secret["data"]["secret"]) and f.mode == 0o400
    mount = next(m for m in pod.containers[0].mounts if m.source == "volumes/handoff-secret")
    assert mount.target == "/etc/tilert-pd/handoff" and mount.read_only
    router = by_name["tiny-router-0"]
    assert any(p.endswith("config.yaml") for p in {f.path for f in router.files})
    # A memory emptyDir on /dev/shm is the container's shm, sized by the volume's limit.
    assert pod.containers[0].shm_size == "512Mi"
    assert "volumes/model" in pod.dirs and set(pod.empty_dirs) == {"volumes/model", "volumes/shm"}


def test_the_pods_run_as_the_non_root_user_with_their_fs_group(tiny: Any) -> None:
    uid = constants.RUN_AS_USER
    _, by_name = tiny
    for pod in by_name.values():
        assert pod.fs_group == uid, pod.name
        for c in (*pod.init_containers, *pod.containers):
            assert c.user == f"{uid}:{uid}" and c.groups == (uid,), (pod.name, c.name)
    # Over RDMA the data plane runs as root (IPC_LOCK); the router stays non-root.
    rdma = {
        p.name: p
        for p in pods.pods(
            _tiny(transfer={"protocol": "rdma", "rdma": {"resources": {"rdma/ib": 1}}}), _ips()
        )
    }
    assert rdma["tiny-tilert-decode-0"].containers[0].user == "0"
    assert rdma["tiny-router-0"].containers[0].user == f"{uid}:{uid}"


def test_probes_follow_the_pod_spec(tiny: Any) -> None:
    _, by_name = tiny
    c = by_name["tiny-tilert-decode-0"].containers[0]
    assert c.readiness is not None and c.readiness.kind == "http" and c.readiness.path == "/ready"
    assert c.readiness.port == c.ports["http"]
    assert c.startup is not None and c.startup.failure_threshold > 10


def test_expand_follows_kubernetes() -> None:
    env = {"A": "1", "POD_IP": "10.0.0.3"}
    assert pods.expand("--host=$(POD_IP)", env) == "--host=10.0.0.3"
    assert pods.expand("$$(POD_IP)", env) == "$(POD_IP)"
    assert pods.expand("$(MISSING)", env) == "$(MISSING)"


def test_what_cannot_be_played_is_refused_with_the_reason() -> None:
    manifests = _tiny()
    svc = next(m for m in manifests if m["kind"] == "Service")
    svc["spec"]["ports"][0]["targetPort"] = 9999
    with pytest.raises(pods.Unsupported, match="target port"):
        pods.pods(manifests, _ips())
    manifests = _tiny()
    sts = next(m for m in manifests if m["kind"] == "StatefulSet")
    sts["spec"]["template"]["spec"]["volumes"].append(
        {"name": "data", "persistentVolumeClaim": {"claimName": "x"}}
    )
    with pytest.raises(pods.Unsupported, match="persistentVolumeClaim"):
        pods.pods(manifests, _ips())
    manifests = [m for m in _tiny() if m["kind"] != "Secret"]
    with pytest.raises(pods.Unsupported, match="Secret tiny-handoff"):
        pods.pods(manifests, _ips())


def test_multus_networks_give_a_network_status_the_node_reads() -> None:
    transfer = yaml.safe_load((ROOT / "examples/tiny-cpu.yaml").read_text())["spec"]["transfer"]
    manifests = _tiny(transfer={**transfer, "rdma": {"networks": ["rdma-a"]}})
    pod = next(p for p in pods.pods(manifests, _ips()) if p.name == "tiny-tilert-decode-0")
    assert pod.networks == ("rdma-a",)
    assert pod.late_files and pod.late_files[0][0].endswith("network-status")
    status = pods.network_status(pod, [("", "eth0", pod.ip), ("rdma-a", "eth1", "10.98.0.5")])
    found = dataplane.choose(["rdma-a"], status, pod.namespace, pod.ip)
    assert (found.address, found.interface) == ("10.98.0.5", "eth1")


def test_create_args() -> None:
    spec = docker.RunSpec(
        name="c",
        image="img:1",
        entrypoint=["tilert-pd", "router"],
        args=["--port", "8000"],
        env={"A": "b c"},
        labels={"l": "v"},
        binds=[("/h", "/etc/x", True)],
        network="n",
        ip="10.1.0.9",
        hostname="pod",
        aliases=["svc"],
        shm_size="512Mi",
        user="7:8",
        group_add=[9, 10],
    )
    a = docker.create_args(spec)
    assert a[a.index("--entrypoint") + 1] == "tilert-pd"
    assert a[a.index("img:1") :] == ["img:1", "router", "--port", "8000"]
    assert "type=bind,source=/h,target=/etc/x,readonly" in a and "A=b c" in a
    assert a[a.index("--shm-size") + 1] == "512m" and a[a.index("--ip") + 1] == "10.1.0.9"
    assert a[a.index("--user") + 1] == "7:8" and [
        a[i + 1] for i, x in enumerate(a) if x == "--group-add"
    ] == ["9", "10"]
    joined = docker.create_args(
        docker.RunSpec(
            name="d",
            image="img:1",
            entrypoint=None,
            args=None,
            env={},
            labels={},
            network_of="c",
            network="n",
            ip="10.1.0.9",
        )
    )
    assert joined[joined.index("--network") + 1] == "container:c" and "--ip" not in joined


class _Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200 if self.path == "/ok" else 404)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def test_probes_run_like_the_kubelet() -> None:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = server.server_address[1]
    try:

        def no_exec(argv: Any, timeout: float) -> int:
            return 0 if argv[0] == "true" else 1

        assert probes.run(pods.Probe("http", port=port, path="/ok"), "127.0.0.1", no_exec)[0]
        ok, detail = probes.run(pods.Probe("http", port=port, path="/nope"), "127.0.0.1", no_exec)
        assert not ok and "HTTP 404" in detail
        assert probes.run(pods.Probe("tcp", port=port), "127.0.0.1", no_exec)[0]
        assert probes.run(pods.Probe("exec", command=("true",)), "127.0.0.1", no_exec)[0]
    finally:
        server.shutdown()
        server.server_close()
    ok, detail = probes.run(pods.Probe("http", port=port, path="/ok", timeout_s=1), "127.0.0.1", no_exec)
    assert not ok and "refused" in detail.lower()


def test_tracker_thresholds() -> None:
    t = probes.Tracker(
        pods.Probe("http", port=1, period_s=5, failure_threshold=2, success_threshold=2, initial_delay_s=3),
        started=100.0,
    )
    assert not t.due(102.0) and t.due(103.0)
    t.record(True, "ok", 103.0)
    assert not t.passed and t.next_at == 108.0
    t.record(True, "ok", 108.0)
    assert t.passed
    t.record(False, "HTTP 500", 113.0)
    t.record(False, "HTTP 500", 118.0)
    assert not t.passed and t.given_up and t.last == "HTTP 500"
