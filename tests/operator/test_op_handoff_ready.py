"""HandoffReady: True only when a handoff reached every wired TileRT node recently and the
node decoded from it, False with the data plane's reason, the node(s), the transport and bandwidth;
Ready needs it. Pure condition tests, then the operator end to end against the API test server with a
fake node serving its authenticated /v1/status."""

from __future__ import annotations

import base64
from typing import Any

import pdc_harness as h
import pdc_helpers as helpers
import pytest
from aiohttp import web
from kopf.testing import KopfRunner

from tilert_operator import constants, observe, status
from tilert_operator import spec as specmod
from tilert_operator.render import network
from tilert_serve import defaults
from tilert_serve.router.config import TileRTNode

NODES = [
    TileRTNode(name=f"c-tilert-decode-{i}", http_url=f"http://10.0.0.{i}:5557", ctrl_host=f"10.0.0.{i}")
    for i in range(2)
]
OK = {"age_s": 3.0, "time": 0.0, "bytes": 6_900_000, "seconds": 0.0046, "bandwidth_bytes_per_s": 1.5e9}
TRANSPORT = {"engine": "mooncake", "protocol": "rdma"}


def _rep(pod: str, ok: dict | None = OK, fail: dict | None = None, busy: bool = False) -> observe.NodeReport:
    return observe.NodeReport(pod, {"transport": TRANSPORT, "last_success": ok, "last_failure": fail}, busy)


def _fail(reason: str, age: float = 1.0) -> dict[str, Any]:
    return {"age_s": age, "time": 0.0, "reason": reason, "message": f"scripted {reason}"}


def test_true_with_transport_and_bandwidth() -> None:
    c = status.handoff_ready(2, NODES, [_rep(n.name) for n in NODES])
    assert (c["status"], c["reason"]) == ("True", "HandoffOK")
    assert "c-tilert-decode-1: decoded from a handoff within 120 s, mooncake/rdma at 1-2 GB/s" in c["message"]
    # The message does not change with every handoff's age or exact bandwidth: idle resyncs write nothing.
    again = status.handoff_ready(
        2, NODES, [_rep(n.name, ok=OK | {"age_s": 50.0, "bandwidth_bytes_per_s": 1.9e9}) for n in NODES]
    )
    assert again == c
    assert status.bandwidth_band(5e6) == "4-8 MB/s" and status.bandwidth_band(300.0) == "256-512 B/s"


@pytest.mark.parametrize(("report", "reason"), [
    (_rep("p", fail=_fail("not_authenticated")), "NotAuthenticated"),
    (_rep("p", fail=_fail("layout_mismatch")), "LayoutMismatch"),
    (_rep("p", fail=_fail("timeout")), "Timeout"),
    (_rep("p", fail=_fail("digest_mismatch")), "DigestMismatch"),
    (_rep("p", fail=_fail("transfer_failed")), "TransferFailed"),
    (_rep("p", ok=None, fail=_fail("version_mismatch")), "VersionMismatch"),
    (_rep("p", ok=None), "NoHandoffYet"),
    (_rep("p", ok=OK | {"age_s": 500.0}), "HandoffStale"),
    (observe.NodeReport("p", error="GET /v1/status failed: ClientConnectorError", error_kind="unreachable"), "Unreachable"),
    (observe.NodeReport("p", error="GET /v1/status answered 401", error_kind="not_authorized"), "NotAuthorized"),
])  # fmt: skip
def test_false_with_the_reason(report: observe.NodeReport, reason: str) -> None:
    c = status.handoff_ready(1, NODES[:1], [report])
    assert (c["status"], c["reason"]) == ("False", reason)
    assert "p: " + reason in c["message"]


def test_a_timeout_beside_failed_authentications_hints_at_the_secret_and_quotes_one_clean_line() -> None:
    """The node counts wrong-MAC Auths apart (anyone can send one): only its own timeout fails the
    condition, and then the count turns the hint to the secret."""
    plain = status.handoff_ready(1, NODES[:1], [_rep("p", fail=_fail("timeout"))])
    assert plain["reason"] == "Timeout" and "secret" not in plain["message"]
    counted = _fail("timeout") | {
        "failed_authentication": 3,
        "message": "did not arrive; since the admission,\ncontrol connections: 3 failed authentication",
    }
    c = status.handoff_ready(1, NODES[:1], [_rep("p", fail=counted)])
    assert (c["status"], c["reason"]) == ("False", "Timeout")
    assert "since the admission, control connections: 3 failed authentication" in c["message"]
    assert "handoff secret may differ" in c["message"] and "\n" not in c["message"]
    assert "tilert-pd versions" not in c["message"]
    versions = _fail("timeout") | {"version_mismatches": 1}
    assert (
        "different tilert-pd versions"
        in status.handoff_ready(1, NODES[:1], [_rep("p", fail=versions)])["message"]
    )
    # No handoff arriving and wrong-MAC Auths lately (the router cancels its probe's ticket): the hint
    # names the secret, the condition's reason is still the absence of news.
    quiet = observe.NodeReport(
        "p",
        {
            "transport": TRANSPORT,
            "last_success": None,
            "last_failure": None,
            "recent_failed_authentication": 2,
        },
    )
    c = status.handoff_ready(1, NODES[:1], [quiet])
    assert c["reason"] == "NoHandoffYet" and "handoff secret may differ" in c["message"]
    stale = observe.NodeReport(
        "p",
        {
            "transport": TRANSPORT,
            "last_success": OK | {"age_s": 500.0},
            "last_failure": None,
            "recent_version_mismatches": 5,
        },
    )
    assert "different tilert-pd versions" in status.node_handoff(stale)[1]
    fine = observe.NodeReport(
        "p",
        {"transport": TRANSPORT, "last_success": OK, "last_failure": None, "recent_failed_authentication": 9},
    )
    assert status.node_handoff(fine)[0] == "HandoffOK"
    odd = status.handoff_ready(1, NODES[:1], [_rep("p", fail=_fail("timeout") | {"reason": "made-up"})])
    assert odd["reason"] == "HandoffFailed" and "made-up" not in odd["message"]


def test_a_failure_older_than_the_last_success_is_history_and_busy_nodes_are_not_stale() -> None:
    assert status.node_handoff(_rep("p", fail=_fail("timeout", age=10.0)))[0] == "HandoffOK"
    assert status.node_handoff(_rep("p", ok=OK | {"age_s": 500.0}, busy=True))[0] == "HandoffOK"


def test_ready_needs_a_working_handoff() -> None:
    pools = {c: observe.PoolState(1, 1) for c in (constants.PREFILL, constants.ROUTER, constants.NATIVE)}
    pools[constants.TILERT] = observe.PoolState(2, 2)

    def ready(reports: list[observe.NodeReport]) -> dict[str, Any]:
        conds = status.conditions(
            "c",
            pools,
            NODES,
            handoff=status.handoff_ready(2, NODES, reports),
            handoff_working=status.any_handoff_working(reports),
        )
        assert [c["type"] for c in conds].count("HandoffReady") == 1
        return next(c for c in conds if c["type"] == "Ready")

    assert (ready([_rep(n.name) for n in NODES])["reason"]) == "Serving"
    both_bad = ready([_rep(n.name, fail=_fail("not_authenticated")) for n in NODES])
    assert both_bad["status"] == "False" and "NotAuthenticated" in both_bad["message"]
    one_bad = ready([_rep(NODES[0].name), _rep(NODES[1].name, fail=_fail("layout_mismatch"))])
    assert (one_bad["status"], one_bad["reason"]) == ("True", "Degraded") and "HandoffReady" in one_bad[
        "message"
    ]
    # Not checked (TILERT_PD_HANDOFF_CHECK=0): present, True, and Ready does not wait for it.
    conds = {c["type"]: c for c in status.conditions("c", pools, NODES)}
    assert conds["HandoffReady"]["reason"] == "NotChecked" and conds["Ready"]["reason"] == "Serving"


def test_network_policy_admits_the_operator_on_the_http_port_only() -> None:
    spec = specmod.parse(helpers.example("tiny-cpu")["spec"])
    [pol] = [
        p
        for p in network.network_policies(spec, "tiny", "default")
        if p["metadata"]["name"] == "tiny-tilert-decode"
    ]
    rules = [r for r in pol["spec"]["ingress"] if network.OPERATOR_PEER in r["from"]]
    assert rules == [
        {
            "from": [network.OPERATOR_PEER],
            "ports": [{"protocol": "TCP", "port": spec.decode.tilert.http_port}],
        }
    ]


def test_the_operator_reaches_vllms_port_only_where_it_runs_the_autoscaler() -> None:
    doc = helpers.example("tiny-cpu")["spec"]

    def operator_rules(spec_doc: dict[str, Any]) -> dict[str, list[Any]]:
        pols = network.network_policies(specmod.parse(spec_doc), "tiny", "default")
        return {
            p["metadata"]["name"]: [
                r["ports"] for r in p["spec"]["ingress"] if network.OPERATOR_PEER in r["from"]
            ]
            for p in pols
        }

    vllm_port = [{"protocol": "TCP", "port": defaults.VLLM_PORT}]
    fixed = operator_rules(doc)
    assert fixed["tiny-prefill"] == [] and fixed.get("tiny-native-decode", []) == []
    doc["decode"]["native"]["replicas"] = 1
    doc["decode"]["native"]["autoscaling"] = {"enabled": True, "minReplicas": 1, "maxReplicas": 2}
    scaled = operator_rules(doc)
    # On vLLM's API port only (its /metrics is there), never on the transfer ports the prefill opens.
    assert scaled["tiny-prefill"] == [vllm_port] and scaled["tiny-native-decode"] == [vllm_port]
    doc["autoscaling"] = {"actuator": "HPA"}  # the HPA acts: the operator scrapes nothing
    assert operator_rules(doc)["tiny-prefill"] == []


# -- end to end: the operator polls a fake node's authenticated /v1/status --------------------------------


class FakeNodeStatus:
    """A TileRT node's GET /v1/status, requiring the cluster's node-API token as the real node does."""

    def __init__(self) -> None:
        self.token: str | None = None
        self.handoff: dict[str, Any] = {
            "transport": TRANSPORT,
            "successes": 0,
            "failures": 0,
            "last_success": None,
            "last_failure": None,
        }
        self.calls = 0
        self.runner: web.AppRunner | None = None
        self.port = 0

    async def status(self, request: web.Request) -> web.Response:
        self.calls += 1
        if request.headers.get("Authorization") != f"Bearer {self.token}":
            return web.json_response({"error": {"type": "unauthorized", "message": "no"}}, status=401)
        return web.json_response(
            {"name": "n", "slots": [{"index": 0, "state": "free"}], "handoff": self.handoff}
        )

    async def start(self) -> None:
        app = web.Application()
        app.add_routes([web.get("/v1/status", self.status)])
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

    async def stop(self) -> None:
        assert self.runner is not None
        await self.runner.cleanup()


def test_operator_sets_handoff_ready_from_the_nodes_status(
    apiserver: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TILERT_PD_HANDOFF_CHECK", "1")
    monkeypatch.setenv("TILERT_PD_RESYNC_S", "0.5")
    monkeypatch.setenv("TILERT_PD_METRICS_PORT", "0")
    srv = apiserver.server
    node = FakeNodeStatus()
    apiserver.call(node.start())
    doc = h.pdc(helpers.example("tiny-cpu"))
    doc["spec"]["decode"]["tilert"] |= {"replicas": 1, "httpPort": node.port}

    def cond(type_: str = "HandoffReady") -> dict[str, Any]:
        return h.condition(srv.get("pdclusters", "default", "tiny"), type_)

    def until(reason: str, type_: str = "HandoffReady") -> dict[str, Any]:
        return h.wait_for(
            f"{type_} {reason}",
            lambda: cond(type_) if cond(type_).get("reason") == reason else None,
            timeout=20,
        )

    try:
        with KopfRunner(h.ARGS, timeout=30):
            apiserver.call(srv.put(h.PDC, doc))
            sts = h.wait_for(
                "TileRT StatefulSet", lambda: srv.get("statefulsets", "default", "tiny-tilert-decode")
            )
            secret = h.wait_for("node API Secret", lambda: srv.get("secrets", "default", "tiny-node-api"))
            node.token = (
                base64.b64decode(secret["data"][constants.NODE_API_TOKEN_KEY]).decode().splitlines()[0]
            )
            for comp in (constants.PREFILL, constants.ROUTER, constants.NATIVE):
                apiserver.call(
                    srv.put(
                        h.POD, h.pod("tiny", comp, 0, owner=srv.get("deployments", "default", f"tiny-{comp}"))
                    )
                )
            apiserver.call(srv.put(h.POD, h.pod("tiny", constants.TILERT, 0, ip="127.0.0.1", owner=sts)))

            c = until("NoHandoffYet")
            assert c["status"] == "False" and "tiny-tilert-decode-0" in c["message"]
            assert cond("Ready")["status"] == "False" and "HandoffReady" in cond("Ready")["message"]

            node.handoff = node.handoff | {"successes": 1, "last_success": OK}
            c = until("HandoffOK")
            assert c["status"] == "True" and "mooncake/rdma at 1-2 GB/s" in c["message"]
            until("Serving", "Ready")
            # Later probes (another age, another bandwidth in the same band): idle resyncs write nothing.

            def status_writes() -> int:
                return sum(
                    1
                    for c in srv.calls
                    if c.resource == "pdclusters/status"
                    and c.verb in ("patch", "update")
                    and c.user_agent.startswith(constants.FIELD_MANAGER)
                )

            node.handoff = node.handoff | {
                "successes": 5,
                "last_success": OK | {"age_s": 20.0, "bandwidth_bytes_per_s": 1.2e9},
            }
            before, polls = status_writes(), node.calls
            h.wait_for("three more polls", lambda: node.calls >= polls + 3, timeout=10)
            assert before > 0 and status_writes() == before

            node.handoff = node.handoff | {"last_failure": _fail("not_authenticated")}
            c = until("NotAuthenticated")
            assert c["status"] == "False" and "scripted not_authenticated" in c["message"]
            assert cond("Ready")["status"] == "False"

            node.handoff = node.handoff | {"last_success": OK | {"age_s": 0.1}}  # recovered
            until("HandoffOK")

            node.token = "another-token"  # the node no longer takes the cluster's token
            until("NotAuthorized")
            apiserver.call(node.stop())
            until("Unreachable")
    finally:
        if node.runner is not None:
            apiserver.call(node.stop())
