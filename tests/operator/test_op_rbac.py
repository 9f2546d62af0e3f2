"""The chart's RBAC allows every call the operator makes, and grants nothing it does not use.

The API test server authorizes every request as a real one does (pdc_rbac.py), against the roles and
bindings the chart renders with the real Helm engine, for the cluster-wide install and the
namespaced one (`operator.watchNamespaces`), with OwnerReferencesPermissionEnforcement on (as on
OpenShift). The operator runs as the chart's ServiceAccount with the chart's namespace arguments over
a scenario that exercises every code path: create, Secrets and children adopted, pods ready, a pool
removed, a child deleted, a rotation, MultiNetworkPolicies, an invalid spec, deletion. A refusal
fails the test with the server's 403 message; a rule that no decision used fails it too.
"""

from __future__ import annotations

import asyncio
import base64
import copy
import re
from typing import Any

import pdc_apiserver
import pdc_harness as h
import pdc_helpers as helpers
import pdc_rbac
import pytest
from kopf.testing import KopfRunner
from test_op_e2e import wait_condition

from tilert_operator import constants, credentials
from tilert_operator.kubeapi import ApiError, Client, Connection, Retry

MODES: dict[str, dict[str, Any]] = {
    "cluster-wide": {},
    "namespaced": {"operator": {"watchNamespaces": ["default", "serving"]}},
}


#: The running operator's /metrics port (its reconcile count).
METRICS_PORT: list[int] = []


@pytest.fixture(autouse=True)
def fast_operator(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TILERT_PD_RESYNC_S", "0.5")
    METRICS_PORT[:] = [h.serve_metrics(monkeypatch)]
    monkeypatch.setenv("TILERT_PD_SECRET_ROTATION_GRACE_S", "0.5")


def _bump(body: dict[str, Any]) -> dict[str, Any]:
    return body | {"metadata": body["metadata"] | {"generation": body["metadata"]["generation"] + 1}}


def _marked_for_adoption(kind: str, name: str, cluster: str, extra: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": kind,
        "metadata": {
            "name": name,
            "namespace": "default",
            "labels": {constants.LABEL_CLUSTER: cluster, constants.LABEL_MANAGED_BY: constants.MANAGED_BY},
            "annotations": {constants.ADOPT_ANNOTATION: "true"},
        },
    } | extra


def _refusals(srv: Any) -> list[str]:
    return sorted(
        {
            f"{c.attrs.verb} {pdc_rbac.qualified(c.attrs.group, c.attrs.combined)} in {c.attrs.namespace or 'the cluster scope'}"
            for c in srv.checks
            if not c.allowed and not c.probe
        }
    )


def _no_refusal_logged(log: str) -> bool:
    """No 403 answered, and no kopf fallback for one ("Not enough permissions ...")."""
    return re.search(r'" 403 |HTTP 403|Forbidden|[Nn]ot enough permissions', log) is None


def _wait(srv: Any, what: str, fn: Any) -> Any:
    """h.wait_for, and on a timeout the refusals that explain it."""
    try:
        return h.wait_for(what, fn)
    except AssertionError as e:
        raise AssertionError(f"{e}; refused by the chart's RBAC: {_refusals(srv)}") from None


@pytest.mark.parametrize("mode", list(MODES))
def test_the_charts_rbac_allows_exactly_what_the_operator_does(apiserver: Any, mode: str) -> None:
    srv = apiserver.server
    chart = h.install_chart_rbac(apiserver, MODES[mode])
    # Someone else's Secret and ConfigMap, marked for adoption: taking them changes their ownerReferences.
    apiserver.call(
        srv.put(
            ("", "v1", "secrets"),
            _marked_for_adoption(
                "Secret",
                "tiny-handoff",
                "tiny",
                {"type": "Opaque", "data": {"secret": base64.b64encode(b"s").decode()}},
            ),
        )
    )
    apiserver.call(
        srv.put(
            ("", "v1", "configmaps"),
            _marked_for_adoption("ConfigMap", "tiny-router", "tiny", {"data": {"k": "v"}}),
        )
    )
    with KopfRunner(chart.kopf_args, timeout=60) as runner:
        apiserver.call(srv.put(h.PDC, h.pdc(helpers.example("tiny-cpu"))))
        sts = _wait(srv, "StatefulSet", lambda: srv.get("statefulsets", "default", "tiny-tilert-decode"))
        for comp in (constants.PREFILL, constants.ROUTER, constants.NATIVE):
            apiserver.call(srv.put(h.POD, h.pod("tiny", comp, 0)))
        # Every replica: Ready waits for each workload to have rolled out (tiny-cpu has two TileRT nodes).
        for i in range(sts["spec"]["replicas"]):
            apiserver.call(srv.put(h.POD, h.pod("tiny", constants.TILERT, i, owner=sts)))
        _wait(
            srv,
            "Ready",
            lambda: h.condition(srv.get("pdclusters", "default", "tiny"), "Ready").get("status") == "True",
        )
        # The prefill pod goes unready and back, twice: the second NotServing Event is the first one's count.
        for _ in range(2):
            apiserver.call(srv.put(h.POD, h.pod("tiny", constants.PREFILL, 0, ready=False)))
            _wait(
                srv,
                "NotServing",
                lambda: (
                    h.condition(srv.get("pdclusters", "default", "tiny"), "Ready").get("reason")
                    == "NotServing"
                ),
            )
            apiserver.call(srv.put(h.POD, h.pod("tiny", constants.PREFILL, 0)))
            _wait(
                srv,
                "Ready",
                lambda: (
                    h.condition(srv.get("pdclusters", "default", "tiny"), "Ready").get("status") == "True"
                ),
            )
        h.wait_for(
            "NotServing counted twice",
            lambda: any(
                e["reason"] == "NotServing" and e.get("count") == 2 for e in srv.objects("events", "default")
            ),
        )
        assert _refusals(srv) == [], "the chart's RBAC refuses these calls of the operator"
        assert h.condition(srv.get("pdclusters", "default", "tiny"), "Reconciled")["status"] == "True"
        uid = srv.get("pdclusters", "default", "tiny")["metadata"]["uid"]
        for plural, name in (("secrets", "tiny-handoff"), ("configmaps", "tiny-router")):
            assert [r["uid"] for r in srv.get(plural, "default", name)["metadata"]["ownerReferences"]] == [
                uid
            ]
        body = srv.get("pdclusters", "default", "tiny")
        body["spec"]["decode"]["native"]["replicas"] = 0
        body["spec"]["networkPolicies"] = {"enabled": False}
        apiserver.call(srv.put(h.PDC, _bump(body)))
        h.wait_for("native removed", lambda: srv.get("deployments", "default", "tiny-native-decode") is None)
        h.wait_for("policies removed", lambda: not srv.objects("networkpolicies", "default"))
        body = srv.get("pdclusters", "default", "tiny")
        body["spec"]["decode"] = {"tilert": {"replicas": 0}, "native": {"replicas": 1}}
        apiserver.call(srv.put(h.PDC, _bump(body)))
        h.wait_for(
            "TileRT pool removed", lambda: srv.get("statefulsets", "default", "tiny-tilert-decode") is None
        )
        h.wait_for(
            "its PodDisruptionBudget removed",
            lambda: srv.get("poddisruptionbudgets", "default", "tiny-tilert-decode") is None,
        )
        apiserver.call(srv.remove(("", "v1", "configmaps"), "default", "tiny-router"))
        h.wait_for("ConfigMap back", lambda: srv.get("configmaps", "default", "tiny-router"))
        # Rotate the handoff secret (patches it) and run a stack on Multus networks with the
        # MultiNetworkPolicy CRD served, then without its networks (the policies are deleted).
        rotating = srv.get("pdclusters", "default", "tiny")
        rotating["metadata"]["annotations"] = {constants.ROTATE_HANDOFF_SECRET_ANNOTATION: "1"}
        apiserver.call(srv.put(h.PDC, rotating))
        h.wait_for(
            "rotated",
            lambda: (srv.get("pdclusters", "default", "tiny")["status"].get("handoffSecret") or {}).get(
                "lastRotated"
            ),
        )
        h.install_crd(apiserver, h.MULTI_NETWORK_POLICY_CRD)
        apiserver.call(
            srv.put(
                h.PDC,
                h.pdc(
                    helpers.cr(helpers.minimal(transfer={"rdma": {"networks": ["rdma-net"]}}), name="nets")
                ),
            )
        )
        h.wait_for("MultiNetworkPolicies", lambda: srv.objects("multi-networkpolicies", "default"))
        nets = srv.get("pdclusters", "default", "nets")
        nets["spec"]["transfer"]["rdma"] = {}
        apiserver.call(srv.put(h.PDC, _bump(nets)))
        h.wait_for(
            "MultiNetworkPolicies removed", lambda: not srv.objects("multi-networkpolicies", "default")
        )
        # The HPA actuator: an HPA for the autoscaled pool, deleted when the operator acts instead.
        scaled = helpers.cr(
            helpers.minimal(prefill={"autoscaling": {"enabled": True, "minReplicas": 1, "maxReplicas": 2}}),
            name="hpa",
        )
        scaled["spec"]["autoscaling"] = {"actuator": "HPA"}
        apiserver.call(srv.put(h.PDC, h.pdc(scaled)))
        h.wait_for("the prefill's HPA", lambda: srv.get("horizontalpodautoscalers", "default", "hpa-prefill"))
        hpa = srv.get("pdclusters", "default", "hpa")
        hpa["spec"]["autoscaling"] = {"actuator": "Operator"}
        apiserver.call(srv.put(h.PDC, _bump(hpa)))
        h.wait_for(
            "HPA removed", lambda: srv.get("horizontalpodautoscalers", "default", "hpa-prefill") is None
        )
        bad = h.pdc(helpers.cr(helpers.minimal(prefill={"gpus": 3}), name="bad"))
        apiserver.call(srv.put(h.PDC, bad))
        wait_condition(srv, "bad", "SpecValid", "False")
        apiserver.call(srv.remove(h.PDC, "default", "tiny"))
        assert not [
            d for d in srv.objects("deployments", "default") if d["metadata"]["name"].startswith("tiny-")
        ]
        # Resyncs of the PDClusters left (the watch caches answer their reads: count them from /metrics).
        resynced = h.reconciles(METRICS_PORT[0])
        h.wait_for("a resync after the deletion", lambda: h.reconciles(METRICS_PORT[0]) > resynced + 2)
    assert runner.exception is None

    assert _refusals(srv) == [], "the chart's RBAC refuses these calls of the operator"
    assert _no_refusal_logged(runner.output)
    used = {
        (c.attrs.group, c.attrs.combined, c.attrs.verb)
        for c in srv.checks
        if c.allowed and c.user == chart.user
    }
    unused = chart.granted - used
    assert sorted(unused) == [], "the chart's RBAC grants calls the operator never makes"


@pytest.mark.parametrize("mode", list(MODES))
def test_the_chart_installed_operator_reconciles_every_example_without_a_403(
    apiserver: Any, mode: str
) -> None:
    srv = apiserver.server
    chart = h.install_chart_rbac(apiserver, MODES[mode])
    h.install_crd(apiserver, h.MULTI_NETWORK_POLICY_CRD)
    docs = [h.pdc(helpers.example(p.stem)) for p in helpers.EXAMPLES]
    with KopfRunner(chart.kopf_args, timeout=60) as runner:
        for doc in docs:
            apiserver.call(srv.put(h.PDC, doc))
        for doc in docs:
            ns, name = doc["metadata"]["namespace"], doc["metadata"]["name"]
            _wait(
                srv,
                f"{ns}/{name} Reconciled=True",
                lambda ns=ns, name=name: (
                    h.condition(srv.get("pdclusters", ns, name), "Reconciled").get("status") == "True"
                ),
            )
            assert srv.get("configmaps", ns, f"{name}-router")
    assert runner.exception is None
    assert _refusals(srv) == []
    assert _no_refusal_logged(runner.output)


def _put_tiny_until_forbidden(apiserver: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """Put the tiny example and wait for Reconciled=False; (the PDCluster, that condition), its reason
    checked to be Forbidden."""
    srv = apiserver.server
    apiserver.call(srv.put(h.PDC, h.pdc(helpers.example("tiny-cpu"))))
    body: dict[str, Any] = h.wait_for(
        "Reconciled=False",
        lambda: (lambda b: h.condition(b, "Reconciled").get("status") == "False" and b)(
            srv.get("pdclusters", "default", "tiny")
        ),
    )
    cond: dict[str, Any] = h.condition(body, "Reconciled")
    assert cond["reason"] == "Forbidden", cond
    return body, cond


def test_a_role_without_a_rule_is_reported_as_forbidden_not_as_a_spec_error(apiserver: Any) -> None:
    """An install whose role lacks `create` on PodDisruptionBudgets (the chart before this was fixed):
    Reconciled=False names the verb, the resource and the fix, and does not blame the spec."""
    srv = apiserver.server
    chart = h.install_chart_rbac(apiserver, {}, without=("policy", "poddisruptionbudgets", "create"))
    with KopfRunner(chart.kopf_args, timeout=40) as runner:
        body, cond = _put_tiny_until_forbidden(apiserver)
        assert "PodDisruptionBudget/tiny-prefill" in cond["message"]
        assert "the operator's role lacks create on poddisruptionbudgets" in cond["message"]
        assert "fix the chart's RBAC or install the chart's current version" in cond["message"]
        assert "fix the spec" not in cond["message"]
        assert h.condition(body, "Ready")["status"] == "False"
        events = h.wait_for(
            "Forbidden Events",
            lambda: [e for e in srv.objects("events", "default") if e["reason"] == "Forbidden"],
        )
        assert all(
            e["type"] == "Warning" and "lacks create on poddisruptionbudgets" in e["message"] for e in events
        )
        # The rest of the stack is still applied.
        assert srv.get("statefulsets", "default", "tiny-tilert-decode") and srv.get(
            "services", "default", "tiny-router"
        )
        # The role fixed (the chart's current version installed): Reconciled=True without a restart.
        srv.rbac = pdc_rbac.Rbac(chart.objects)
        wait_condition(srv, "tiny", "Reconciled", "True")
    assert runner.exception is None


def test_a_403_outside_the_children_is_reported_as_forbidden(apiserver: Any) -> None:
    chart = h.install_chart_rbac(apiserver, {}, without=("", "secrets", "create"))
    with KopfRunner(chart.kopf_args, timeout=40) as runner:
        _, cond = _put_tiny_until_forbidden(apiserver)
        assert (
            "the operator's role lacks create on secrets" in cond["message"]
            and "fix the chart's RBAC" in cond["message"]
        )
        assert "fix the spec" not in cond["message"]
    assert runner.exception is None


def _client_call(apiserver: Any, fn: Any) -> Any:
    async def go() -> Any:
        async with Client(
            Connection(server=apiserver.url, token=pdc_apiserver.TOKEN), retry=Retry(attempts=1)
        ) as api:
            return await fn(api)

    return asyncio.run(go())


def _refused(apiserver: Any, fn: Any) -> ApiError:
    with pytest.raises(ApiError) as caught:
        _client_call(apiserver, fn)
    assert caught.value.status == 403 and caught.value.body is not None
    assert (caught.value.body["kind"], caught.value.body["reason"], caught.value.body["code"]) == (
        "Status",
        "Forbidden",
        403,
    )
    return caught.value


def test_the_test_server_authorizes_like_a_real_api_server(apiserver: Any) -> None:
    """The checks test_op_rbac relies on, one by one, with the answers a real API server gives."""
    srv = apiserver.server
    user = pdc_rbac.service_account("ops", "op")
    role = {
        "kind": "ClusterRole",
        "metadata": {"name": "r"},
        "rules": [
            {"apiGroups": [constants.GROUP], "resources": [constants.PLURAL], "verbs": ["list"]},
            {"apiGroups": [""], "resources": ["services"], "verbs": ["patch"]},
        ],
    }
    binding = {
        "kind": "ClusterRoleBinding",
        "metadata": {"name": "r"},
        "roleRef": {"kind": "ClusterRole", "name": "r"},
        "subjects": [{"kind": "ServiceAccount", "name": "op", "namespace": "ops"}],
    }
    srv.rbac, srv.users[pdc_apiserver.TOKEN] = pdc_rbac.Rbac([role, binding]), user
    pdc = apiserver.call(srv.put(h.PDC, h.pdc(helpers.cr(helpers.minimal(), name="o"))))
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "s", "namespace": "default"},
        "spec": {"ports": [{"port": 80}]},
    }

    # The filter: verb, resource and user named. A subresource is its own resource.
    e = _refused(apiserver, lambda api: api.patch_status(constants.KIND, "default", "o", {"conditions": []}))
    assert e.body and e.body["message"] == (
        f'pdclusters.pd.tilert.ai "o" is forbidden: User "{user.name}" cannot patch resource '
        '"pdclusters/status" in API group "pd.tilert.ai" in the namespace "default"'
    )
    assert e.body["details"] == {"name": "o", "group": constants.GROUP, "kind": "pdclusters"}
    # An apply that creates needs create as well as patch; the refusal gives no reason.
    e = _refused(apiserver, lambda api: api.apply(copy.deepcopy(service)))
    assert e.body and e.body["message"] == 'services "s" is forbidden: '
    role["rules"][1]["verbs"] = ["patch", "create"]
    _client_call(apiserver, lambda api: api.apply(copy.deepcopy(service)))
    # OwnerReferencesPermissionEnforcement: off, anyone who may patch sets blockOwnerDeletion; on, it
    # takes delete on the object (its ownerReferences change) and update on the owner's finalizers.
    owned = copy.deepcopy(service)
    owned["metadata"]["ownerReferences"] = [credentials.owner_reference(pdc)]
    srv.owner_references_permission_enforcement = True
    e = _refused(apiserver, lambda api: api.apply(copy.deepcopy(owned)))
    assert (
        e.body
        and e.body["message"]
        == 'services "s" is forbidden: cannot set an ownerRef on a resource you can\'t delete: , <nil>'
    )
    role["rules"][1]["verbs"].append("delete")
    e = _refused(apiserver, lambda api: api.apply(copy.deepcopy(owned)))
    assert e.body and e.body["message"] == (
        'services "s" is forbidden: cannot set blockOwnerDeletion if an ownerReference refers to '
        "a resource you can't set finalizers on: , <nil>"
    )
    assert [c.attrs for c in srv.checks if not c.allowed][-1] == pdc_rbac.Attributes(
        "update", constants.GROUP, constants.PLURAL, "finalizers", "default", "o"
    )
    role["rules"].append(
        {"apiGroups": [constants.GROUP], "resources": [f"{constants.PLURAL}/finalizers"], "verbs": ["update"]}
    )
    _client_call(apiserver, lambda api: api.apply(copy.deepcopy(owned)))
    srv.owner_references_permission_enforcement = False
    # A Role binds only in its namespace.
    srv.rbac = pdc_rbac.Rbac(
        [
            role | {"kind": "Role", "metadata": {"name": "r", "namespace": "other"}},
            binding
            | {
                "kind": "RoleBinding",
                "metadata": {"name": "r", "namespace": "other"},
                "roleRef": {"kind": "Role", "name": "r"},
            },
        ]
    )
    e = _refused(apiserver, lambda api: api.list(constants.KIND, "default", ""))
    assert e.body and e.body["message"].startswith(
        f'pdclusters.pd.tilert.ai is forbidden: User "{user.name}" cannot list'
    )
    assert _client_call(apiserver, lambda api: api.list(constants.KIND, "other", "")) == []
