"""HandoffReady's facts in the network test bed: the decode node and the router from the
rendered commands in their own namespaces, the router with handoff probes on (as the operator renders
them, at a test's interval), the prefill stand-in on the "rdma" network. A prefill with another handoff
secret: the router's probe fails, the node's authenticated /v1/status counts the failed authentications
(no failure of its own: anyone can send a wrong MAC), the router is not ready (no other decode route). The prefill back with the cluster's secret: the next probe decodes
over net1, the node reports the transport and bandwidth, the router is ready again. A prefill of another
KV-cache dtype: layout_mismatch. The node made unreachable on the rdma network: the stand-in's sender
cannot connect and says so to the router (vLLM's sender runs after the prefill answers, so there the
node's ticket times out instead and the node records a timeout); back up, both recover."""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.netns import bed
from tests.netns.conftest import (
    K8S_NAMESPACE,
    NUM_TOKENS,
    PREFILL_PORT,
    ROUTER_PORT,
    Cluster,
    build_bed,
    network_status,
    spec_for,
    start_node,
    start_prefill,
    start_router,
)
from tilert_serve import dataplane


@pytest.fixture(scope="module")
def probed(
    netns_available: None, tiny_model: Path, secret_file: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Cluster, Path, Path]]:
    b = build_bed("hr4", 4)
    c = Cluster(
        "mooncake", 4, b, spec_for("mooncake"), tmp_path_factory.mktemp("netns-hr4"), model_dir=tiny_model
    )
    wrong = c.log_dir / "other-secret"
    wrong.write_text(secrets.token_hex(32))
    try:
        start_node(c, secret_file, network_status(c.node))
        start_prefill(c, wrong)
        where = dataplane.choose(
            c.spec.transfer.rdma.networks, network_status(c.node), K8S_NAMESPACE, c.pod_ip(c.node)
        )
        start_router(c, str(where.address), probes={"interval_s": 2.0, "retry_s": 1.0})
        try:
            bed.wait_http(c.router, c.node_url("/ready"), 120, c.procs["node0"])
            bed.wait_http(
                c.router,
                dataplane.http_url(c.pod_ip(c.prefill), PREFILL_PORT) + "/health",
                120,
                c.procs["prefill"],
            )
            bed.wait_http(c.router, f"http://127.0.0.1:{ROUTER_PORT}/health", 60, c.procs["router"])
        except RuntimeError as exc:
            raise RuntimeError(f"{exc}\n{c.logs()}") from exc
        yield c, secret_file, wrong
    finally:
        c.stop()
        left = b.close()
        assert not left, f"namespaces that would not go: {left}"


def _restart_prefill(c: Cluster, secret: Path, kv_cache_dtype: str | None = None) -> None:
    """The stand-in again, with `secret`; told another KV-cache dtype, it is a prefill of another layout."""
    c.procs["prefill"].stop()
    start_prefill(c, secret, kv_cache_dtype, num_tokens=16 if kv_cache_dtype else NUM_TOKENS)
    bed.wait_http(
        c.router, dataplane.http_url(c.pod_ip(c.prefill), PREFILL_PORT) + "/health", 120, c.procs["prefill"]
    )


def _json(c: Cluster, url: str) -> tuple[int, Any]:
    status, body = bed.http(c.router, "GET", url, timeout=5)
    try:
        return status, json.loads(body)
    except ValueError:
        return status, None


def _until(what: str, fn: Any, c: Cluster, timeout: float = 90) -> Any:
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = fn()
        if last:
            return last
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}; last {last!r}\n{c.logs()}")


def test_a_secret_mismatch_fails_the_handoff_and_recovers(probed: tuple[Cluster, Path, Path]) -> None:
    c, good, _ = probed

    def handoff() -> dict[str, Any]:
        status, body = _json(c, c.node_url("/v1/status"))
        assert status == 200, body
        return dict(body["handoff"])

    def refused() -> dict[str, Any] | None:
        # A wrong MAC is anyone's to send: the node counts it apart and records no failure of its own
        # (the router cancels its probe's ticket); the count turns the operator's hint to the secret.
        h = handoff()
        return h if h["recent_failed_authentication"] else None

    h = _until("the node's count of failed authentications", refused, c)
    assert h["last_success"] is None and h["last_failure"] is None and h["transport"]["engine"] == "mooncake"
    status, ready = _json(c, f"http://127.0.0.1:{ROUTER_PORT}/ready")
    assert status == 503 and ready["degraded"][0].startswith("TileRT node node0: handoff_failed"), ready

    _restart_prefill(c, good)

    def recovered() -> dict[str, Any] | None:
        h = handoff()
        ok, bad = h["last_success"], h["last_failure"]
        return h if ok and (bad is None or ok["age_s"] < bad["age_s"]) else None

    h = _until("a decoded handoff", recovered, c)
    assert h["last_success"]["bytes"] >= c.state_bytes  # the whole state, over net1
    assert (
        h["transport"] == {"engine": "mooncake", "protocol": "tcp"}
        and h["last_success"]["bandwidth_bytes_per_s"] > 0
    )
    _until(
        "the router's readiness", lambda: _json(c, f"http://127.0.0.1:{ROUTER_PORT}/ready")[0] == 200, c, 30
    )

    def latest_failure(reason: str) -> Any:
        def check() -> dict[str, Any] | None:
            h = handoff()
            ok, bad = h["last_success"], h["last_failure"]
            return h if bad and bad["reason"] == reason and bad["age_s"] < ok["age_s"] else None

        return check

    _restart_prefill(c, good, kv_cache_dtype="bfloat16")
    h = _until("the node's layout_mismatch", latest_failure("layout_mismatch"), c)
    assert "layout" in h["last_failure"]["message"]
    _until(
        "the router's unreadiness", lambda: _json(c, f"http://127.0.0.1:{ROUTER_PORT}/ready")[0] == 503, c, 30
    )

    _restart_prefill(c, good)
    _until("a decoded handoff", recovered, c)
    # The node unreachable on the rdma network (its pod network, so the router and the operator, still
    # reach it): the prefill's sender cannot connect; the router says why.
    bed.exec_in(c.node.ns, "ip", "link", "set", "net1", "down")
    try:

        def unreachable() -> Any:
            status, body = _json(c, f"http://127.0.0.1:{ROUTER_PORT}/ready")
            why = " ".join((body or {}).get("degraded", []))
            return body if status == 503 and "cannot reach decode node" in why else None

        _until("the router's unreachable", unreachable, c)
    finally:
        bed.exec_in(c.node.ns, "ip", "link", "set", "net1", "up")
    _until(
        "the router's readiness", lambda: _json(c, f"http://127.0.0.1:{ROUTER_PORT}/ready")[0] == 200, c, 90
    )
