"""Observed state and status, pure: readiness, RDMA addresses, conditions, idle comparison, metrics."""

from __future__ import annotations

from collections import Counter

import pdc_harness as h
import pdc_helpers as helpers

from tilert_operator import constants, credentials, observe, reconcile_compare, status
from tilert_operator import spec as specmod
from tilert_operator.metrics import Metrics


def test_the_ctrl_address_is_the_multus_rdma_address_and_a_node_without_one_is_not_wired() -> None:
    spec = specmod.parse(helpers.example("glm5-b200-rdma")["spec"])
    pods = [
        h.pod(
            "glm5",
            constants.TILERT,
            0,
            "serving",
            ip="10.0.0.1",
            rdma_net="serving/rdma-net",
            rdma_ip="192.168.0.1",
        ),
        h.pod("glm5", constants.TILERT, 1, "serving", ip="10.0.0.2"),
        h.pod("glm5", constants.TILERT, 2, "serving", ip="10.0.0.3", ready=False),
    ]
    nodes, unwired = observe.tilert_nodes(spec, pods)
    assert [(n.name, n.ctrl_host, n.http_url) for n in nodes] == [
        ("glm5-tilert-decode-0", "192.168.0.1", "http://10.0.0.1:5557"),
    ]
    # Not wired over the pod network: reported, with the network it lacks and what to check.
    assert [u.pod for u in unwired] == ["glm5-tilert-decode-1"]
    assert "rdma-net" in unwired[0].problem and "NetworkAttachmentDefinition" in unwired[0].problem
    pools = {
        constants.PREFILL: observe.PoolState(1, 1),
        constants.TILERT: observe.PoolState(2, 3),
        constants.NATIVE: observe.PoolState(1, 1),
        constants.ROUTER: observe.PoolState(1, 1),
    }
    conds = {c["type"]: c for c in status.conditions("glm5", pools, nodes, unwired)}
    assert conds["EndpointsWired"]["status"] == "False"
    assert conds["EndpointsWired"]["reason"] == "DataPlaneAddressMissing"
    assert "glm5-tilert-decode-1" in conds["EndpointsWired"]["message"]
    assert conds["Ready"]["reason"] == "Degraded"
    terminating = h.pod("glm5", constants.TILERT, 0, "serving")
    terminating["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    assert not observe.is_ready(terminating)


def test_without_secondary_networks_the_pod_ip_is_the_data_plane_and_ipv6_urls_have_brackets() -> None:
    spec = specmod.parse(helpers.example("tiny-cpu")["spec"])
    nodes, unwired = observe.tilert_nodes(spec, [h.pod("tiny", constants.TILERT, 0, ip="fd00:10:244::5")])
    assert not unwired
    assert [(n.ctrl_host, n.http_url) for n in nodes] == [("fd00:10:244::5", "http://[fd00:10:244::5]:5557")]


def test_conditions_say_what_is_missing() -> None:
    pools = {
        constants.PREFILL: observe.PoolState(0, 1),
        constants.TILERT: observe.PoolState(0, 2),
        constants.NATIVE: observe.PoolState(0, 0),
        constants.ROUTER: observe.PoolState(1, 1),
    }
    security = [
        status.secrets_owned(["c-handoff", "c-node-api"]),
        status.rotation("c", credentials.HANDOFF, {"phase": "Idle"}),
        status.rotation("c", credentials.NODE_API, {"phase": "Idle"}),
        status.data_plane([], False, True, None),
    ]
    conds = {c["type"]: c for c in status.conditions("c", pools, [], security=security)}
    assert set(conds) == set(status.CONDITION_TYPES)
    assert conds["Ready"]["status"] == "False" and "no prefill pod is ready" in conds["Ready"]["message"]
    assert conds["PrefillReady"]["message"].endswith("pd.tilert.ai/component=prefill")
    assert conds["NativeDecodeReady"]["reason"] == "NoReplicas"
    assert conds["EndpointsWired"]["reason"] == "NoReadyNodes"


def test_status_comparison_ignores_transition_times() -> None:
    pools = {c: observe.PoolState(1, 1) for c in status.POOL_CONDITIONS}
    first = status.build(generation=1, conditions_=status.conditions("c", pools, []), old={}, pools=pools)
    again = status.build(generation=1, conditions_=status.conditions("c", pools, []), old=first, pools=pools)
    assert status.same(again, first)
    assert status.transitions(again["conditions"], first["conditions"]) == []
    newer = status.build(generation=2, conditions_=status.conditions("c", pools, []), old=first, pools=pools)
    assert not status.same(newer, first)


def test_contains_tolerates_server_defaults_and_canonical_quantities() -> None:
    want = {
        "spec": {
            "replicas": 1,
            "template": {
                "spec": {"containers": [{"name": "a", "resources": {"limits": {"nvidia.com/gpu": 8}}}]}
            },
        }
    }
    have = {
        "spec": {
            "replicas": 1,
            "revisionHistoryLimit": 10,
            "template": {
                "spec": {
                    "dnsPolicy": "ClusterFirst",
                    "containers": [
                        {
                            "name": "a",
                            "imagePullPolicy": "Always",
                            "resources": {"limits": {"nvidia.com/gpu": "8"}},
                        }
                    ],
                }
            },
        }
    }
    assert reconcile_compare.contains(have, want)
    assert not reconcile_compare.contains({"spec": {"replicas": 2}}, {"spec": {"replicas": 1}})


def test_metrics_text() -> None:
    calls: Counter[str] = Counter()
    m = Metrics(api_calls=calls)
    m.reconcile_duration.observe(0.02)
    m.reconcile_errors.inc()
    m.writes.inc(4)
    m.states[("ns", "a")] = "ready"
    calls["list"] += 3  # counted by the API client after the Metrics exists: read at scrape time
    text = m.render().decode()
    assert helpers.sample(text, "tilert_pd_reconcile_duration_seconds_bucket", le="0.01") == 0
    assert helpers.sample(text, "tilert_pd_reconcile_duration_seconds_bucket", le="0.025") == 1
    assert helpers.sample(text, "tilert_pd_reconcile_duration_seconds_count") == 1
    assert helpers.sample(text, "tilert_pd_reconcile_errors_total") == 1
    assert helpers.sample(text, "tilert_pd_writes_total") == 4
    assert helpers.sample(text, "tilert_pd_pdclusters", state="ready") == 1
    assert helpers.sample(text, "tilert_pd_pdclusters", state="invalid") == 0
    assert helpers.sample(text, "tilert_pd_api_calls_total", verb="list") == 3
    # Conditions as the last reconcile left them: 1 for the status held, 0 for the others.
    m.conditions[("ns", "a")] = {"Ready": "True", "HandoffReady": "False", "NotOurs": "True"}
    text = m.render().decode()
    cond = "tilert_pd_pdcluster_condition"
    assert (
        helpers.sample(
            text, cond, pdcluster_namespace="ns", pdcluster="a", type="HandoffReady", status="False"
        )
        == 1
    )
    assert (
        helpers.sample(
            text, cond, pdcluster_namespace="ns", pdcluster="a", type="HandoffReady", status="True"
        )
        == 0
    )
    assert (
        helpers.sample(text, cond, pdcluster_namespace="ns", pdcluster="a", type="Ready", status="True") == 1
    )
    assert helpers.sample(text, cond, type="NotOurs", status="True") is None  # not a condition we set


def test_applied_hash_changes_when_a_field_is_removed() -> None:
    """A removed field must still trigger an apply (SSA then drops it): the hash annotation differs."""
    with_field = reconcile_compare.stamp({"metadata": {"name": "a"}, "spec": {"x": 1, "y": 2}})
    without = reconcile_compare.stamp({"metadata": {"name": "a"}, "spec": {"x": 1}})
    key = constants.APPLIED_HASH_ANNOTATION
    assert with_field["metadata"]["annotations"][key] != without["metadata"]["annotations"][key]
    assert not reconcile_compare.contains(with_field, without), (
        "the live object (old hash) no longer contains the new intent"
    )
