"""An object someone else made under a child's name is never taken over: left untouched, reported,
and spared when the PDCluster is deleted (the API test server garbage-collects by ownerReference);
adopted only when marked for it, with the Secrets' mark."""

from __future__ import annotations

from typing import Any

import pdc_harness as h
import pdc_helpers as helpers
import pytest
from kopf.testing import KopfRunner

from tilert_operator import constants, reconcile

THEIR_LABELS = {"app": "their-app", "team": "search"}
THEIR_POD = {
    "metadata": {"labels": THEIR_LABELS},
    "spec": {"containers": [{"name": "app", "image": "their/app:1"}]},
}
#: kind -> (resource, the child's name it takes, the rest of their object).
FOREIGN: dict[str, tuple[tuple[str, str, str], str, dict[str, Any]]] = {
    "Service": (
        ("", "v1", "services"),
        "tiny-router",
        {"spec": {"selector": THEIR_LABELS, "ports": [{"name": "https", "port": 443, "targetPort": 8443}]}},
    ),
    "ConfigMap": (("", "v1", "configmaps"), "tiny-router", {"data": {"their.conf": "x = 1"}}),
    "Deployment": (
        ("apps", "v1", "deployments"),
        "tiny-prefill",
        {"spec": {"replicas": 3, "selector": {"matchLabels": THEIR_LABELS}, "template": THEIR_POD}},
    ),
    "StatefulSet": (
        ("apps", "v1", "statefulsets"),
        "tiny-tilert-decode",
        {
            "spec": {
                "replicas": 2,
                "serviceName": "theirs",
                "selector": {"matchLabels": THEIR_LABELS},
                "template": THEIR_POD,
            }
        },
    ),
}


#: The running operator's /metrics port (its reconcile count).
METRICS_PORT: list[int] = []


@pytest.fixture(autouse=True)
def fast_operator(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TILERT_PD_RESYNC_S", "0.5")
    METRICS_PORT[:] = [h.serve_metrics(monkeypatch)]


def _put_foreign(apiserver: Any, kind: str) -> dict[str, Any]:
    res, name, rest = FOREIGN[kind]
    obj = {
        "apiVersion": "/".join(p for p in res[:2] if p),
        "kind": kind,
        "metadata": {"name": name, "namespace": "default", "labels": dict(THEIR_LABELS)},
    } | rest
    apiserver.call(apiserver.server.put(res, obj))
    # As its controller left it (a Deployment's and a StatefulSet's report their status at once).
    out: dict[str, Any] = apiserver.server.get(res[2], "default", name)
    return out


def _tiny(srv: Any) -> dict[str, Any] | None:
    return srv.get("pdclusters", "default", "tiny")


@pytest.mark.parametrize("kind", list(FOREIGN))
def test_a_foreign_object_with_a_childs_name_is_left_alone_reported_and_survives_the_deletion(
    apiserver: Any, kind: str
) -> None:
    srv = apiserver.server
    res, name, _ = FOREIGN[kind]
    before = _put_foreign(apiserver, kind)
    with KopfRunner(h.ARGS, timeout=40) as runner:
        apiserver.call(srv.put(h.PDC, h.pdc(helpers.example("tiny-cpu"))))
        body = h.wait_for(
            "ChildrenOwned=False",
            lambda: (lambda b: h.condition(b, "ChildrenOwned").get("status") == "False" and b)(_tiny(srv)),
        )
        cond = h.condition(body, "ChildrenOwned")
        assert cond["reason"] == "ChildNotOwned"
        assert f"{kind} default/{name} exists but is not this PDCluster's" in cond["message"]
        assert constants.ADOPT_ANNOTATION in cond["message"] and "Delete or rename it" in cond["message"]
        assert (h.condition(body, "Reconciled")["status"], h.condition(body, "Reconciled")["reason"]) == (
            "False",
            "ChildNotOwned",
        )
        assert (h.condition(body, "Ready")["status"], h.condition(body, "Ready")["reason"]) == (
            "False",
            "ChildNotOwned",
        )
        event = h.wait_for(
            "a Warning Event naming it",
            lambda: next(
                (
                    e
                    for e in srv.objects("events", "default")
                    if e["reason"] == "ChildNotOwned" and e.get("related")
                ),
                None,
            ),
            timeout=5,
        )
        assert (
            event["type"] == "Warning"
            and event["related"]["kind"] == kind
            and event["related"]["name"] == name
        )
        # The rest of the stack is applied; theirs is untouched, however many reconciles pass.
        h.wait_for(
            "the other children",
            lambda: (
                srv.get("networkpolicies", "default", "tiny-native-decode")
                and srv.get("services", "default", "tiny-native-decode")
                and srv.get("poddisruptionbudgets", "default", "tiny-native-decode")
            ),
        )
        resyncs = h.reconciles(METRICS_PORT[0])
        h.wait_for("more reconciles", lambda: h.reconciles(METRICS_PORT[0]) >= resyncs + 3)
        assert srv.get(res[2], "default", name) == before
        # Deleting the PDCluster collects its children, not theirs.
        apiserver.call(srv.remove(h.PDC, "default", "tiny"))
        assert srv.get("networkpolicies", "default", "tiny-native-decode") is None
        assert srv.get(res[2], "default", name) == before
    assert runner.exception is None


def test_a_foreign_object_marked_for_adoption_is_adopted(apiserver: Any) -> None:
    srv = apiserver.server
    _put_foreign(apiserver, "Service")
    with KopfRunner(h.ARGS, timeout=40) as runner:
        apiserver.call(srv.put(h.PDC, h.pdc(helpers.example("tiny-cpu"))))
        h.wait_for(
            "ChildrenOwned=False", lambda: h.condition(_tiny(srv), "ChildrenOwned").get("status") == "False"
        )
        # Marked on purpose, as the message says: the operator takes it over and applies the spec to it.
        theirs = srv.get("services", "default", "tiny-router")
        theirs["metadata"]["labels"] |= {
            constants.LABEL_CLUSTER: "tiny",
            constants.LABEL_MANAGED_BY: constants.MANAGED_BY,
        }
        theirs["metadata"]["annotations"] = {constants.ADOPT_ANNOTATION: "true"}
        apiserver.call(srv.put(("", "v1", "services"), theirs))
        h.wait_for(
            "ChildrenOwned=True", lambda: h.condition(_tiny(srv), "ChildrenOwned").get("status") == "True"
        )
        h.wait_for("Reconciled=True", lambda: h.condition(_tiny(srv), "Reconciled").get("status") == "True")
        adopted = srv.get("services", "default", "tiny-router")
        uid = _tiny(srv)["metadata"]["uid"]
        assert [r["uid"] for r in adopted["metadata"]["ownerReferences"]] == [uid]
        assert adopted["spec"]["selector"] == {
            constants.LABEL_CLUSTER: "tiny",
            constants.LABEL_COMPONENT: constants.ROUTER,
        }
        # Posted after the status write that reported it: waited for, not read at once.
        h.wait_for(
            "ChildAdopted",
            lambda: any(
                e["reason"] == "ChildAdopted" and "Service/tiny-router" in e["message"]
                for e in srv.objects("events", "default")
            ),
            timeout=5,
        )
        assert h.condition(_tiny(srv), "Ready")["reason"] != "ChildNotOwned"
        # Now the PDCluster's: deleted with it.
        apiserver.call(srv.remove(h.PDC, "default", "tiny"))
        assert srv.get("services", "default", "tiny-router") is None
    assert runner.exception is None


def test_a_child_of_an_earlier_pdcluster_of_the_same_name_is_waited_for_not_blamed(apiserver: Any) -> None:
    """Deleted and created again at once: the old children wait for the garbage collector. The report
    says so instead of asking someone to delete or adopt them."""
    srv = apiserver.server
    obj = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "data": {"old": "1"},
        "metadata": {
            "name": "tiny-router",
            "namespace": "default",
            "ownerReferences": [
                {
                    "apiVersion": constants.API_VERSION,
                    "kind": constants.KIND,
                    "name": "tiny",
                    "uid": "0b5e7c1e-dead-4bee-8000-000000000001",
                    "controller": True,
                }
            ],
        },
    }
    before = apiserver.call(srv.put(("", "v1", "configmaps"), obj))
    apiserver.call(srv.put(h.PDC, h.pdc(helpers.example("tiny-cpu"))))

    out = h.run(apiserver, lambda api: reconcile.reconcile(api, _tiny(srv) or {}))
    [failed] = out.failed
    assert (failed.key, failed.reason) == ("ConfigMap/tiny-router", "ChildNotOwned")
    assert "an earlier PDCluster default/tiny" in failed.message and "garbage collector" in failed.message
    assert constants.ADOPT_ANNOTATION not in failed.message
    assert srv.get("configmaps", "default", "tiny-router") == before
