"""The ClusterRole allows every call the operator makes, and nothing it does not make.

Every request the operator sends (kopf's watches, identified by its kopf/ User-Agent, and the
reconcile's own calls, by the tilert-pd-operator User-Agent) is recorded by the API test server
over a scenario that exercises every code path: create, pods ready, a pool removed, a child
deleted, an invalid spec, deletion.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pdc_harness as h
import pdc_helpers as helpers
import pytest
import yaml
from kopf.testing import KopfRunner

from tilert_operator import constants

ROLE = Path(__file__).resolve().parents[2] / "operator" / "tilert_operator" / "rbac.yaml"
#: Verbs granted without the test server seeing them, with the reason.
UNSEEN_OK = {
    # Server-side apply that creates an object is authorized as create as well on a real API server;
    # the test server records it as patch only.
    ("", "services", "create"), ("", "configmaps", "create"), ("apps", "deployments", "create"),
    ("apps", "statefulsets", "create"), ("networking.k8s.io", "networkpolicies", "create"),
    ("k8s.cni.cncf.io", "multi-networkpolicies", "create"),
}


@pytest.fixture(autouse=True)
def fast_operator(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TILERT_PD_RESYNC_S", "0.5")
    monkeypatch.setenv("TILERT_PD_METRICS_PORT", "0")
    monkeypatch.setenv("TILERT_PD_SECRET_ROTATION_GRACE_S", "0.5")


def allowed(role: dict[str, Any]) -> set[tuple[str, str, str]]:
    return {(g, r, v) for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"] for v in rule["verbs"]}


def test_role_covers_exactly_the_operators_calls(apiserver: Any) -> None:
    srv = apiserver.server
    doc = h.pdc(helpers.example("tiny-cpu"))
    with KopfRunner(h.ARGS, timeout=30) as runner:
        apiserver.call(srv.put(h.PDC, doc))
        sts = h.wait_for("StatefulSet", lambda: srv.get("statefulsets", "default", "tiny-tilert-decode"))
        for comp in (constants.PREFILL, constants.ROUTER, constants.NATIVE):
            apiserver.call(srv.put(h.POD, h.pod("tiny", comp, 0)))
        apiserver.call(srv.put(h.POD, h.pod("tiny", constants.TILERT, 0, owner=sts)))
        h.wait_for("Ready", lambda: h.condition(srv.get("pdclusters", "default", "tiny"), "Ready").get("status") == "True")
        body = srv.get("pdclusters", "default", "tiny")
        body["spec"]["decode"]["native"]["replicas"] = 0
        body["spec"]["networkPolicies"] = {"enabled": False}
        apiserver.call(srv.put(h.PDC, body | {"metadata": body["metadata"] | {"generation": body["metadata"]["generation"] + 1}}))
        h.wait_for("native removed", lambda: srv.get("deployments", "default", "tiny-native-decode") is None)
        h.wait_for("policies removed", lambda: not srv.objects("networkpolicies", "default"))
        body = srv.get("pdclusters", "default", "tiny")
        body["spec"]["decode"] = {"tilert": {"replicas": 0}, "native": {"replicas": 1}}
        apiserver.call(srv.put(h.PDC, body | {"metadata": body["metadata"] | {"generation": body["metadata"]["generation"] + 1}}))
        h.wait_for("TileRT pool removed", lambda: srv.get("statefulsets", "default", "tiny-tilert-decode") is None)
        apiserver.call(srv.remove(("", "v1", "configmaps"), "default", "tiny-router"))
        h.wait_for("ConfigMap back", lambda: srv.get("configmaps", "default", "tiny-router"))
        # Rotate the handoff secret (patches it) and run a stack on Multus networks with the
        # MultiNetworkPolicy CRD served, then without its networks (the policies are deleted).
        rotating = srv.get("pdclusters", "default", "tiny")
        rotating["metadata"]["annotations"] = {constants.ROTATE_HANDOFF_SECRET_ANNOTATION: "1"}
        apiserver.call(srv.put(h.PDC, rotating))
        h.wait_for("rotated", lambda: (srv.get("pdclusters", "default", "tiny")["status"].get("handoffSecret") or {}).get("lastRotated"))
        h.install_crd(apiserver, h.MULTI_NETWORK_POLICY_CRD)
        apiserver.call(srv.put(h.PDC, h.pdc(helpers.cr(helpers.minimal(transfer={"rdma": {"networks": ["rdma-net"]}}), name="nets"))))
        h.wait_for("MultiNetworkPolicies", lambda: srv.objects("multi-networkpolicies", "default"))
        nets = srv.get("pdclusters", "default", "nets")
        nets["spec"]["transfer"]["rdma"] = {}
        apiserver.call(srv.put(h.PDC, nets | {"metadata": nets["metadata"] | {"generation": nets["metadata"]["generation"] + 1}}))
        h.wait_for("MultiNetworkPolicies removed", lambda: not srv.objects("multi-networkpolicies", "default"))
        bad = h.pdc(helpers.cr(helpers.minimal(prefill={"gpus": 3}), name="bad"))
        apiserver.call(srv.put(h.PDC, bad))
        h.wait_for("SpecValid=False", lambda: h.condition(srv.get("pdclusters", "default", "bad"), "SpecValid").get("status") == "False")
        apiserver.call(srv.remove(h.PDC, "default", "tiny"))
        time.sleep(1)
    assert runner.exception is None

    seen = {(c.group, c.resource, c.verb) for c in srv.calls
            if c.user_agent.startswith(("kopf/", constants.FIELD_MANAGER))}
    role = allowed(yaml.safe_load(ROLE.read_text()))
    assert sorted(seen - role) == [], "the ClusterRole lacks these calls"
    assert sorted(role - seen - UNSEEN_OK) == [], "the ClusterRole grants calls the operator never makes"


def test_invalid_spec_changes_nothing(apiserver: Any) -> None:
    srv = apiserver.server
    bad = h.pdc(helpers.cr(helpers.minimal(prefill={"mtp": {"enabled": False}}), name="bad"))
    with KopfRunner(h.ARGS, timeout=30) as runner:
        apiserver.call(srv.put(h.PDC, bad))
        body = h.wait_for("SpecValid=False", lambda: h.condition(srv.get("pdclusters", "default", "bad"), "SpecValid").get("status") == "False"
                          and srv.get("pdclusters", "default", "bad"))
        msg = h.condition(body, "SpecValid")["message"]
        assert "spec.prefill.mtp.enabled" in msg and "set spec.prefill.mtp.enabled: true" in msg
        assert h.condition(body, "Ready")["status"] == "False"
        time.sleep(1.0)
        assert [c for c in srv.calls if c.user_agent.startswith(constants.FIELD_MANAGER) and c.resource not in ("pdclusters/status", "events") and c.verb != "get"] == []
        assert all(not srv.objects(p, "default") for p in ("deployments", "statefulsets", "services", "configmaps", "secrets"))
        # Fixing the spec brings the stack up.
        body["spec"]["prefill"]["mtp"]["enabled"] = True
        apiserver.call(srv.put(h.PDC, body | {"metadata": body["metadata"] | {"generation": 2}}))
        h.wait_for("children", lambda: srv.get("deployments", "default", "bad-prefill"))
        h.wait_for("SpecValid=True", lambda: h.condition(srv.get("pdclusters", "default", "bad"), "SpecValid").get("status") == "True")
        h.wait_for("SpecValid events", lambda: (lambda ms: any(m.startswith("SpecValid=False") for m in ms) and any(
            m.startswith("SpecValid=True") for m in ms))([e["message"] for e in srv.objects("events", "default")]), timeout=5)
    assert runner.exception is None
    _ = json  # keep the import for debugging dumps
