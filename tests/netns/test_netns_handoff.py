"""The handoff on an emulated cluster with a secondary network, for Mooncake and NIXL over IPv4 and IPv6:
the state and the control connection cross the rdma network only, and nothing of the data plane
listens on the pod network.

The router takes a completion on the tilert route: it admits at the node (HTTP, pod network), sends
the prefill leg with the node's ctrl address, the prefill pod's Sender connects to that address and
writes the state with a real byte mover, and the router streams the node's decode back. Interface
counters in each namespace say which network carried which bytes.
"""

from __future__ import annotations

import json

from tests.netns import bed
from tests.netns.conftest import (
    CTRL_PORT,
    HTTP_PORT,
    PREFILL_PORT,
    ROUTER_PORT,
    Cluster,
    counters,
    deltas,
    settle,
)
from tilert_serve import dataplane

#: Texts decoded from the same seeded state, per variant: every transport and address family must
#: hand the node the same bytes, so the node's greedy decode must agree.
_TEXTS: dict[str, str] = {}


def _handoffs(c: Cluster) -> list[dict]:
    status, body = bed.http(
        c.router, "GET", dataplane.http_url(c.pod_ip(c.prefill), PREFILL_PORT) + "/handoffs"
    )
    assert status == 200, body
    return json.loads(body)


def _metric(c: Cluster, name: str) -> float:
    status, body = bed.http(c.router, "GET", c.node_url("/metrics"))
    assert status == 200, body
    return sum(
        float(line.split()[-1])
        for line in body.splitlines()
        if line.startswith(name) and not line.startswith("#")
    )


def test_handoff_crosses_the_rdma_network_only(cluster: Cluster) -> None:
    c = cluster
    rdma_node = c.rdma_ip(c.node)
    # The node advertises its Multus address, not its pod IP, in both places the router and the
    # operator read it.
    status, body = bed.http(c.router, "GET", c.node_url("/v1/status"))
    assert status == 200 and json.loads(body)["ctrl"] == {"host": rdma_node, "port": CTRL_PORT}, body

    before = counters(c)
    status, body = bed.http(
        c.router,
        "POST",
        f"http://127.0.0.1:{ROUTER_PORT}/v1/completions",
        {"model": c.spec.model.name, "prompt": "hello", "max_tokens": 8, "temperature": 0},
        headers={"x-pd-route": "tilert"},
        timeout=90,
    )
    settle()
    after = counters(c)
    d = deltas(before, after)
    assert status == 200, f"{body}\n{c.logs()}"
    answer = json.loads(body)
    text = answer["choices"][0]["text"]

    handoffs = _handoffs(c)
    assert len(handoffs) == 1 and handoffs[0]["ok"], handoffs
    # The control connection went to the rdma address: the one the node admitted with.
    assert (handoffs[0]["host"], handoffs[0]["port"]) == (rdma_node, CTRL_PORT), handoffs
    size = c.state_bytes
    assert _metric(c, "tilert_decode_handoff_bytes_total") == size

    node, prefill = d["node0"], d["prefill"]
    print(
        f"\n{c.engine} IPv{c.family}: state {size} B; node net1 rx {node['net1']['rx_bytes']} "
        f"tx {node['net1']['tx_bytes']}, node eth0 rx {node['eth0']['rx_bytes']} tx {node['eth0']['tx_bytes']}; "
        f"prefill net1 tx {prefill['net1']['tx_bytes']}, prefill eth0 tx {prefill['eth0']['tx_bytes']}; "
        f"router eth0 rx {d['router']['eth0']['rx_bytes']} tx {d['router']['eth0']['tx_bytes']}"
    )
    assert node["net1"]["rx_bytes"] >= size
    assert prefill["net1"]["tx_bytes"] >= size
    # The pod network carries the HTTP control only (admit, prefill leg, generate stream, probes).
    for side in (node["eth0"], prefill["eth0"]):
        assert side["rx_bytes"] < size // 50 and side["tx_bytes"] < size // 50, d

    key = "text"
    if key in _TEXTS:
        assert text == _TEXTS[key], (
            f"{c.engine} IPv{c.family} decoded {text!r}, an earlier variant {_TEXTS[key]!r}"
        )
    _TEXTS[key] = text


def test_ctrl_port_listens_on_the_rdma_address_only(cluster: Cluster) -> None:
    c = cluster
    found = [(a, p) for a, p, _ in c.node.listeners() if p == CTRL_PORT]
    assert found == [(c.rdma_ip(c.node), CTRL_PORT)], c.node.listeners()


def test_only_the_http_api_listens_on_the_pod_network(cluster: Cluster) -> None:
    """Every listener of the node other than its HTTP API (which the router and the kubelet reach on
    the pod IP) is on the rdma address or loopback: the control port and, for NIXL, UCX's listener.

    Mooncake 0.3.13 is the recorded exception: it binds its handshake (RPC) and data listeners to
    every interface whatever address it is initialised with, MC_TCP_BIND_ADDRESS or not (hard-coded in
    its TCP transport and P2P handshake). The bytes still take the rdma network (the test above proves
    it from the counters) because peers are told the rdma address, and the rendered NetworkPolicy
    closes the pod network's side. When the Mooncake branch fails, Mooncake binds one address: hold it
    to the same rule as NIXL."""
    c = cluster
    allowed = {c.rdma_ip(c.node), "127.0.0.1", "::1"}
    listeners = c.node.listeners()
    assert [(a, p) for a, p, _ in listeners if p == CTRL_PORT] == [(c.rdma_ip(c.node), CTRL_PORT)]
    engine_side = [(a, p) for a, p, _ in listeners if p not in (HTTP_PORT, CTRL_PORT)]
    print(f"\n{c.engine} IPv{c.family} listeners besides HTTP and ctrl: {engine_side}")
    if c.engine == "mooncake":
        assert engine_side and all(a in ("0.0.0.0", "*", "::") for a, _ in engine_side), engine_side
    else:
        stray = [(a, p) for a, p in engine_side if a not in allowed]
        assert engine_side and not stray, f"data-plane listeners reachable from the pod network: {stray}"
