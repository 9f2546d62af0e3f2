"""A decode node whose Multus network-status lacks its rdma network (the attachment failed, or the
NetworkAttachmentDefinition is misnamed) is reported, never silently served over the pod network."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.netns import bed
from tests.netns.conftest import (
    CTRL_PORT,
    K8S_NAMESPACE,
    PREFILL_PORT,
    RDMA_NET,
    Cluster,
    build_bed,
    network_status,
    spec_for,
    start_node,
    start_prefill,
)
from tilert_serve import dataplane

#: The node waits this long for Multus before giving up (the pod default is minutes).
STATUS_TIMEOUT_S = 8


@pytest.fixture
def orphan(netns_available: None, tiny_model: Path, secret_file: Path, tmp_path: Path) -> Iterator[Cluster]:
    b = build_bed("miss", 4)
    c = Cluster("mooncake", 4, b, spec_for("mooncake"), tmp_path, tiny_model)
    try:
        yield c
    finally:
        c.stop()
        left = b.close()
        assert not left, f"namespaces that would not go: {left}"


def test_node_without_its_rdma_network_exits_naming_it(orphan: Cluster, secret_file: Path) -> None:
    c = orphan
    status = network_status(c.node, secondary=False)
    # The operator's side of the same decision (observe.py): no address, a reason naming the network.
    where = dataplane.choose(c.spec.transfer.rdma.networks, status, K8S_NAMESPACE, c.pod_ip(c.node))
    assert where.address is None and RDMA_NET in where.problem, where

    before = c.node.counters()
    start_prefill(c, secret_file)
    # The wait for Multus shortened (the node's own flag); the rest is the rendered command.
    node = start_node(c, secret_file, status, ("--network-status-timeout", str(STATUS_TIMEOUT_S)))

    bed.wait_http(
        c.router, dataplane.http_url(c.pod_ip(c.prefill), PREFILL_PORT) + "/health", 120, c.procs["prefill"]
    )
    # A sender aimed at the pod IP (what a fallback would have advertised) finds nothing listening.
    deadline = time.monotonic() + STATUS_TIMEOUT_S + 90
    attempts: list[dict] = []
    while node.alive() and time.monotonic() < deadline:
        assert not [lst for lst in c.node.listeners() if lst[1] == CTRL_PORT], c.node.listeners()
        if not attempts:
            code, body = bed.http(
                c.router,
                "POST",
                dataplane.http_url(c.pod_ip(c.prefill), PREFILL_PORT) + "/v1/completions",
                {
                    "kv_transfer_params": {
                        "tilert_host": c.pod_ip(c.node),
                        "tilert_ctrl_port": CTRL_PORT,
                        "tilert_ticket": "none",
                    }
                },
                timeout=60,
            )
            assert code == 200, body
            attempts.append(json.loads(body)["kv_transfer_params"])
        time.sleep(0.5)
    rc = node.wait_exit(5)
    log = node.log.read_text(errors="replace")
    assert rc not in (None, 0), f"node still running or exited 0 (rc {rc}):\n{log[-3000:]}"
    assert RDMA_NET in log and "no data-plane address" in log, log[-3000:]
    assert attempts and attempts[0]["tilert_status"] == "failed", attempts
    assert "cannot reach" in attempts[0]["tilert_error"], attempts

    d = {i: {k: v - before[i][k] for k, v in kv.items()} for i, kv in c.node.counters().items()}
    print(
        f"\nnode without {RDMA_NET}: exited rc {rc}; node eth0 rx {d['eth0']['rx_bytes']} tx "
        f"{d['eth0']['tx_bytes']}, net1 rx {d['net1']['rx_bytes']}; sender: {attempts[0]['tilert_error'][:120]}"
    )
    assert d["eth0"]["rx_bytes"] < 64 * 1024 and d["net1"]["rx_bytes"] < 64 * 1024, d
