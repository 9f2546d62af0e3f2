"""The docker runtime writes the router's TileRT nodes as the operator does (no Docker needed): the ready
nodes wired at their data-plane address, read from the network-status Multus would write, a node
without one left out; with a secondary network the router's config has no DNS discovery, so that list
is all it routes."""

from __future__ import annotations

import itertools
import posixpath
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tilert_operator import constants
from tilert_operator.cli_render import render_document
from tilert_operator.render import generations
from tilert_serve.local import docker_runtime, pods
from tilert_serve.router import config as router_config
from tilert_serve.router import discovery

ROOT = Path(__file__).resolve().parents[2]
#: Where the pods' secondary network hands out addresses here.
RDMA_NET = "10.98.0"


def _ips() -> Iterator[str]:
    return (f"10.99.0.{i}" for i in itertools.count(10))


def _manifests(networks: list[str]) -> list[dict[str, Any]]:
    doc = yaml.safe_load((ROOT / "examples/tiny-cpu.yaml").read_text())
    doc["spec"]["transfer"]["rdma"] = {"networks": networks}
    return render_document(doc, None, with_secret=True)


def _record(pod: pods.Pod, rdma: str | None) -> docker_runtime.PodRecord:
    """A started pod as `up` records it; `rdma`: its address on the secondary network, if Multus gave it one."""
    entries = [("", "eth0", pod.ip)] + ([("rdma-a", "eth1", rdma)] if rdma else [])
    return docker_runtime.PodRecord(
        pod.name,
        pod.labels[constants.LABEL_COMPONENT],
        pod.ip,
        pod.containers[0].image,
        [f"c-{pod.name}"],
        f"http://{pod.ip}:{next(iter(pod.containers[0].ports.values()))}",
        workload=pod.owner,
        namespace=pod.namespace,
        network_status=pods.network_status(pod, entries) if pod.networks else "",
    )


def _router_file(state_dir: Path, plan: dict[str, pods.Pod]) -> Path:
    """The router's config file as `up` wrote it into the router pod's volume (the path its container
    mounts), group-readable only."""
    router = plan["tiny-router-0"]
    (cfg,) = [f for f in router.files if posixpath.basename(f.path) == docker_runtime.ROUTER_CONFIG_KEY]
    assert any(
        m.target == constants.ROUTER_CONFIG_DIR and cfg.path.startswith(m.source)
        for m in router.containers[0].mounts
    )
    path = state_dir / "pods" / router.name / cfg.path
    path.parent.mkdir(parents=True)
    path.write_bytes(cfg.content)
    path.chmod(0o640)
    return path


def test_the_router_config_lists_the_wired_node_at_its_secondary_address(tmp_path: Path) -> None:
    manifests = _manifests(["rdma-a"])
    plan = {p.name: p for p in pods.pods(manifests, _ips())}
    path = _router_file(tmp_path, plan)
    wired = _record(plan["tiny-tilert-decode-0"], f"{RDMA_NET}.11")
    unwired = _record(plan["tiny-tilert-decode-1"], None)
    records = [_record(p, None) for p in plan.values() if p.name not in (wired.name, unwired.name)]
    records += [wired, unwired]
    nodes, left_out = docker_runtime.wired_nodes(manifests, records)
    listed = docker_runtime.write_router_config(tmp_path, manifests, records, nodes)

    cfg = router_config.load(path)
    spec = docker_runtime.generation_specs(manifests)[constants.SLOT_A]
    t = spec.decode.tilert
    assert cfg.tilert == [
        router_config.TileRTNode(
            name="tiny-tilert-decode-0",
            http_url=f"http://{wired.ip}:{t.http_port}",
            ctrl_host=f"{RDMA_NET}.11",
            ctrl_port=t.ctrl_port,
            slots=t.slots,
            max_seq_len=spec.model.max_seq_len,
            compat=generations.generation(spec).compat,
        )
    ]
    assert [u.pod for u in left_out] == ["tiny-tilert-decode-1"] and "rdma-a" in left_out[0].problem
    # No DNS discovery: what the router routes is that list, though DNS would name both ready pods.
    assert cfg.discoveries() == []
    found = [n for d in cfg.discoveries() for n in discovery.nodes_from([wired.ip, unwired.ip], d)]
    assert [n.name for n in router_config.with_discovered(cfg, found).tilert] == ["tiny-tilert-decode-0"]
    assert listed == {e.url for e in [*cfg.prefill, *cfg.native]} and listed
    # Rewritten in place with the mode `up` gave it (the router runs as another user).
    assert stat.S_IMODE(path.stat().st_mode) == 0o640
    line = docker_runtime.describe_nodes(nodes, left_out)
    assert (
        f"tiny-tilert-decode-0 (data plane {RDMA_NET}.11)" in line
        and "left out: tiny-tilert-decode-1" in line
    )

    # The node leaves (a step of apply): the list follows.
    docker_runtime.write_router_config(tmp_path, manifests, records, [])
    assert router_config.load(path).tilert == []


def test_without_a_secondary_network_nodes_are_listed_at_their_pod_ip_and_discovered(tmp_path: Path) -> None:
    manifests = _manifests([])
    plan = {p.name: p for p in pods.pods(manifests, _ips())}
    path = _router_file(tmp_path, plan)
    records = [_record(p, None) for p in plan.values()]
    nodes, left_out = docker_runtime.wired_nodes(manifests, records)
    docker_runtime.write_router_config(tmp_path, manifests, records, nodes)
    cfg = router_config.load(path)
    ips = [plan[f"tiny-tilert-decode-{i}"].ip for i in range(2)]
    assert left_out == [] and [(n.ctrl_host, n.http_url) for n in cfg.tilert] == [
        (ip, f"http://{ip}:5557") for ip in ips
    ]
    (d,) = cfg.discoveries()
    assert d.service == "tiny-tilert-decode.default.svc"


def test_only_ready_pods_of_a_rendered_generation_are_listed() -> None:
    manifests = _manifests([])
    plan = {p.name: p for p in pods.pods(manifests, _ips())}
    node = _record(plan["tiny-tilert-decode-0"], None)
    # Not among the ready pods: not listed.
    assert docker_runtime.wired_nodes(manifests, [])[0] == []
    # A pod of slot b, which these manifests no longer render (a drained generation): not listed.
    node.slot = constants.SLOT_B
    assert docker_runtime.wired_nodes(manifests, [node])[0] == []


def test_a_state_without_the_network_status_is_refused_with_what_to_do() -> None:
    manifests = _manifests(["rdma-a"])
    plan = {p.name: p for p in pods.pods(manifests, _ips())}
    node = _record(plan["tiny-tilert-decode-0"], f"{RDMA_NET}.11")
    node.network_status = ""  # a state.json written before the field existed
    with pytest.raises(ValueError, match=r"tiny-tilert-decode-0: .*`tilert-pd local down` and `up` again"):
        docker_runtime.wired_nodes(manifests, [node])
