"""The data-plane address: one decision for the node (from its mounted annotation) and the operator
(from the pod it watches), per-protocol transport settings, and the node's wait for Multus."""

from __future__ import annotations

import argparse
import json
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from tilert_operator import spec as specmod
from tilert_operator.render import commands, prefill, tilert_decode
from tilert_serve import dataplane, transfer
from tilert_serve.decode import cli as node_cli

POD_NET = {"name": "k8s-pod-network", "interface": "eth0", "ips": ["10.244.0.5"], "default": True}
RDMA_NET = {
    "name": "serving/rdma-net",
    "interface": "net1",
    "ips": ["192.168.7.5", "fd00:7::5"],
    "default": False,
}


def status(*entries: dict[str, object]) -> str:
    return json.dumps(list(entries))


def test_the_named_network_wins_and_its_interface_is_known() -> None:
    where = dataplane.choose(["rdma-net"], status(POD_NET, RDMA_NET), "serving", "10.244.0.5")
    assert (where.address, where.interface, where.source) == (
        "192.168.7.5",
        "net1",
        "multus:serving/rdma-net",
    )
    # "namespace/name" in the spec matches too; a name in another namespace does not.
    assert dataplane.choose(["serving/rdma-net"], status(RDMA_NET), "other", None).address == "192.168.7.5"
    assert dataplane.choose(["rdma-net"], status(RDMA_NET), "other", None).address is None


def test_a_missing_entry_is_a_reason_not_the_pod_ip() -> None:
    for raw in (status(POD_NET), None, "not json", json.dumps({"not": "a list"})):
        where = dataplane.choose(["rdma-net"], raw, "serving", "10.244.0.5")
        assert where.address is None and where.source == "missing"
        assert "rdma-net" in where.problem and "NetworkAttachmentDefinition" in where.problem


def test_without_networks_the_pod_ip_is_the_data_plane() -> None:
    assert dataplane.choose([], status(RDMA_NET), "serving", "10.244.0.5").address == "10.244.0.5"


@pytest.mark.parametrize(
    ("address", "url"),
    [
        ("10.0.0.1", "http://10.0.0.1:80"),
        ("fd00:10:244::5", "http://[fd00:10:244::5]:80"),
        ("node-0.svc", "http://node-0.svc:80"),
    ],
)
def test_urls_put_ipv6_in_brackets(address: str, url: str) -> None:
    assert dataplane.http_url(address, 80) == url


def test_each_protocol_gets_its_own_transport_settings_and_nothing_of_the_other() -> None:
    tcp = transfer.transport_env("nixl", "tcp", "net1")
    assert tcp == {"UCX_TLS": "tcp", "UCX_MODULES": "^ib", "UCX_NET_DEVICES": "net1"}
    # rdma: UCX's InfiniBand transports stay on; the NICs come from the spec's env.
    assert transfer.transport_env("nixl", "rdma", "net1") == {}
    assert transfer.transport_env("mooncake", "tcp") == {"MC_TCP_SLICE_SIZE": str(1 << 20)}
    assert transfer.transport_env("mooncake", "rdma") == {}
    # Mooncake's handshake speaks IPv6 only when told to.
    assert transfer.transport_env("mooncake", "rdma", host="fd00:7::5") == {"MC_USE_IPV6": "1"}
    assert "MC_USE_IPV6" not in transfer.transport_env("mooncake", "tcp", host="192.168.7.5")


def test_the_users_environment_wins_over_the_protocol_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MC_TCP_SLICE_SIZE", "65536")
    with pytest.raises(transfer.TransferError, match="unknown transfer engine"):
        transfer.create("rdma", host="127.0.0.1")
    engine = transfer.create("mooncake", host="127.0.0.1", protocol="tcp")
    try:
        assert os.environ["MC_TCP_SLICE_SIZE"] == "65536"
    finally:
        engine.close()


def example(name: str) -> dict[str, Any]:
    return yaml.safe_load((Path(__file__).resolve().parents[2] / "examples" / f"{name}.yaml").read_text())


def test_a_tilert_pod_on_a_secondary_network_gets_its_network_status_file() -> None:
    spec = specmod.parse(example("glm5-b200-rdma")["spec"])
    argv = commands.tilert_decode(spec, commands.Paths.pod(spec)).argv
    assert argv[argv.index("--data-plane-networks") + 1] == ",".join(spec.transfer.rdma.networks)
    assert argv[argv.index("--network-status-file") + 1] == dataplane.NETWORK_STATUS_FILE
    # Both ends of the handoff read their own Multus status: the node and the prefill's connector.
    kv = json.loads(_arg(commands.prefill(spec, commands.Paths.pod(spec)).argv, "--kv-transfer-config"))
    tilert = kv["kv_connector_extra_config"]["connectors"][0]["kv_connector_extra_config"]
    assert tilert["tilert_data_plane_networks"] == list(spec.transfer.rdma.networks)
    for workload in (
        tilert_decode.statefulset(spec, "glm5", "serving"),
        prefill.deployment(spec, "glm5", "serving"),
    ):
        pod = workload["spec"]["template"]["spec"]
        (vol,) = [v for v in pod["volumes"] if v["name"] == "podinfo"]
        assert (
            vol["downwardAPI"]["items"][0]["fieldRef"]["fieldPath"]
            == f"metadata.annotations['{dataplane.MULTUS_STATUS_ANNOTATION}']"
        )
        c = pod["containers"][0]
        assert "POD_NAMESPACE" in {e["name"] for e in c["env"]}
        assert dataplane.NETWORK_STATUS_FILE.startswith(
            next(m["mountPath"] for m in c["volumeMounts"] if m["name"] == "podinfo")
        )
    tiny = specmod.parse(example("tiny-cpu")["spec"])
    assert "--data-plane-networks" not in commands.tilert_decode(tiny, commands.Paths.pod(tiny)).argv


def _arg(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def _args(tmp_path: Path, networks: str, timeout: float) -> argparse.Namespace:
    return argparse.Namespace(
        data_plane_networks=networks,
        network_status_file=str(tmp_path / "network-status"),
        network_status_timeout=timeout,
        advertise_host="10.244.0.5",
    )


def test_the_node_waits_for_multus_then_takes_its_address(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("POD_NAMESPACE", "serving")
    (tmp_path / "network-status").write_text(status(POD_NET))  # Multus has not reported net1 yet

    def later() -> None:
        time.sleep(0.3)
        (tmp_path / "network-status").write_text(status(POD_NET, RDMA_NET))

    threading.Thread(target=later).start()
    where = node_cli.find_data_plane(_args(tmp_path, "rdma-net", 30), sleep=0.05)
    assert (where.address, where.interface) == ("192.168.7.5", "net1")


def test_the_node_gives_up_naming_the_network_and_never_uses_the_pod_ip(tmp_path: Path) -> None:
    (tmp_path / "network-status").write_text(status(POD_NET))
    with pytest.raises(SystemExit, match="rdma-net") as err:
        node_cli.find_data_plane(_args(tmp_path, "rdma-net", 0.2), sleep=0.05)
    assert "10.244.0.5" not in str(err.value)
    where = node_cli.find_data_plane(_args(tmp_path, "", 0.2))
    assert (where.address, where.source) == ("10.244.0.5", "pod-ip")


def test_the_prefill_connector_runs_its_engine_on_its_own_multus_address(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tilert_serve.pd_vllm.config import ConnectorConfig
    from tilert_serve.pd_vllm.worker import TileRTWorker

    (tmp_path / "network-status").write_text(status(POD_NET, RDMA_NET))
    monkeypatch.setenv("POD_NAMESPACE", "serving")
    cfg = ConnectorConfig.from_extra_config(
        {
            "tilert_model": "mla",
            "tilert_max_seq_len": 64,
            "tilert_data_plane_networks": ["rdma-net"],
            "tilert_network_status_file": str(tmp_path / "network-status"),
        }
    )
    worker = TileRTWorker.__new__(TileRTWorker)  # the method under test reads only the config
    worker.config = cfg
    where = worker._data_plane()
    assert (where.address, where.interface) == ("192.168.7.5", "net1")
