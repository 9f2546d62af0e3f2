"""Failures are visible: a child the API server refuses, or a reconcile that fails, shows as
Reconciled=False with the API server's message and the child, plus a Warning Event naming it, in
the reconcile that failed; the next reconcile that applies everything clears it."""

from __future__ import annotations

import subprocess
from typing import Any, TypeVar

import pdc_harness as h
import pdc_helpers as helpers
import pytest
from kopf.testing import KopfRunner

from tilert_operator import reconcile, reconcile_failures
from tilert_operator.kubeapi import ApiError

T = TypeVar("T")
#: A label value the API server refuses (it must start and end with an alphanumeric character); the
#: spec's own validation does not look inside overrides' labels, so only the server catches it.
#: A valid override that the cluster refuses anyway (as an admission policy of its own would): the
#: operator checks what the API server itself checks, not a cluster's policies, so this reaches the apply.
BAD_OVERRIDE = {"spec": {"template": {"metadata": {"labels": {"team": "ml"}}}}}
DEPLOYMENTS = ("apps", "v1", "deployments")


def _no_ml_team(obj: dict[str, Any], old: dict[str, Any] | None) -> tuple[dict[str, Any], list[str]]:
    labels = ((obj.get("spec") or {}).get("template") or {}).get("metadata", {}).get("labels") or {}
    if labels.get("team") == "ml":
        return obj, [
            'spec.template.metadata.labels: Invalid value: "ml": a policy of this cluster admits no team ml here'
        ]
    return obj, []


def events(apiserver: Any, uid: str, reason: str) -> list[dict[str, Any]]:
    return [
        e
        for e in apiserver.server.objects("events", "default")
        if e["involvedObject"]["uid"] == uid and e["reason"] == reason
    ]


def test_a_refused_child_is_reported_with_the_servers_message_and_cleared_once_applied(
    apiserver: Any,
) -> None:
    srv = apiserver.server
    srv.validators[DEPLOYMENTS] = _no_ml_team
    h.run(
        apiserver,
        lambda api: api.create(h.pdc(helpers.cr(helpers.minimal(router={"overrides": BAD_OVERRIDE}), "f"))),
    )
    uid = h.body(apiserver, "f")["metadata"]["uid"]

    out = h.run(apiserver, lambda api: reconcile.reconcile(api, h.body(apiserver, "f"), now=1000.0))
    assert [f.key for f in out.failed] == ["Deployment/f-router"]
    assert out.requeue_at == 1000.0 + reconcile_failures.FAILED_RETRY_S
    # The other children were applied all the same.
    assert srv.get("deployments", "default", "f-prefill") and srv.get(
        "statefulsets", "default", "f-tilert-decode"
    )
    assert srv.get("deployments", "default", "f-router") is None
    cond = h.condition(h.body(apiserver, "f"), "Reconciled")
    assert (cond["status"], cond["reason"]) == ("False", "ApplyRejected")
    assert cond["message"].startswith(
        'Deployment/f-router: HTTP 422: Deployment.apps "f-router" is invalid: '
        'spec.template.metadata.labels: Invalid value: "ml": a policy of this cluster'
    )
    [event] = events(apiserver, uid, "ApplyRejected")
    assert event["type"] == "Warning" and event["message"].startswith("Deployment/f-router: HTTP 422")
    assert event["related"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": "f-router",
        "namespace": "default",
    }

    # The same failure again: no new Event, no status write (once the workload controllers' first
    # reports, which the status follows, are in).
    h.run(apiserver, lambda api: reconcile.reconcile(api, h.body(apiserver, "f")))
    assert len(events(apiserver, uid, "ApplyRejected")) == 1
    again = h.run(apiserver, lambda api: reconcile.reconcile(api, h.body(apiserver, "f")))
    assert again.failed and not again.status_written and not again.events
    assert len(events(apiserver, uid, "ApplyRejected")) == 1

    # Fixed spec: applied, Reconciled=True, and a Normal Event says so.
    h.run(
        apiserver,
        lambda api: api.request(
            "patch",
            "PATCH",
            "/apis/pd.tilert.ai/v1alpha1/namespaces/default/pdclusters/f",
            body={"spec": {"router": {"overrides": None}}},
            content_type="application/merge-patch+json",
        ),
    )
    fixed = h.run(apiserver, lambda api: reconcile.reconcile(api, h.body(apiserver, "f")))
    assert fixed.applied == ["Deployment/f-router"] and not fixed.failed and fixed.requeue_at is None
    cond = h.condition(h.body(apiserver, "f"), "Reconciled")
    assert (cond["status"], cond["reason"]) == ("True", "Applied")
    [ok] = events(apiserver, uid, "Reconciled")
    assert ok["type"] == "Normal"


def test_a_failed_reconcile_is_reported_before_the_controller_backs_off(apiserver: Any) -> None:
    h.run(apiserver, lambda api: api.create(h.pdc(helpers.cr(helpers.minimal(), "g"))))
    # Not a 403: that is the role's fault, reported as Forbidden (test_op_rbac.py).
    apiserver.server.fail(422, times=1, verb="list", resource="pods")
    with pytest.raises(ApiError):
        h.run(apiserver, lambda api: reconcile.reconcile(api, h.body(apiserver, "g")))
    obj = h.body(apiserver, "g")
    cond = h.condition(obj, "Reconciled")
    assert (cond["status"], cond["reason"]) == ("False", "ReconcileError")
    assert "injected 422 for list pods" in cond["message"] and "fix the spec" not in cond["message"]
    assert events(apiserver, obj["metadata"]["uid"], "ReconcileError")
    # The next reconcile succeeds and clears it.
    h.run(apiserver, lambda api: reconcile.reconcile(api, h.body(apiserver, "g")))
    assert h.condition(h.body(apiserver, "g"), "Reconciled")["status"] == "True"


@pytest.fixture()
def fast_operator(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TILERT_PD_RESYNC_S", "1")
    monkeypatch.setenv("TILERT_PD_METRICS_PORT", "0")
    monkeypatch.setenv("TILERT_PD_WATCH_TIMEOUT_S", "10")


@pytest.mark.usefixtures("fast_operator")
def test_the_running_operator_reports_a_refused_child_and_clears_it(apiserver: Any) -> None:
    srv = apiserver.server
    srv.validators[DEPLOYMENTS] = _no_ml_team
    with KopfRunner(h.ARGS, timeout=40):
        h.run(
            apiserver,
            lambda api: api.create(
                h.pdc(helpers.cr(helpers.minimal(router={"overrides": BAD_OVERRIDE}), "k"))
            ),
        )
        h.wait_for(
            "Reconciled=False",
            lambda: h.condition(srv.get("pdclusters", "default", "k"), "Reconciled").get("status") == "False",
        )
        uid = h.body(apiserver, "k")["metadata"]["uid"]
        # Reported by the reconcile that was refused: one apply of the router so far.
        refused = [
            c
            for c in srv.calls
            if c.verb == "patch" and c.resource == "deployments" and c.user_agent.startswith("tilert-pd")
        ]
        assert refused
        h.wait_for("the Warning Event", lambda: events(apiserver, uid, "ApplyRejected"))
        out = subprocess.run(
            [
                "kubectl",
                "--kubeconfig",
                apiserver.kubeconfig,
                "patch",
                "pdc",
                "k",
                "--type=merge",
                "-p",
                '{"spec":{"router":{"overrides":null}}}',
            ],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert out.returncode == 0, out.stderr
        h.wait_for(
            "Reconciled=True",
            lambda: h.condition(srv.get("pdclusters", "default", "k"), "Reconciled").get("status") == "True",
        )
        assert srv.get("deployments", "default", "k-router") is not None


def test_the_api_servers_message_is_taken_from_the_status_even_after_retries_or_cut() -> None:
    status = (
        '{"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "message": '
        '"failed to create typed patch object (d/x; apps/v1, Kind=Deployment): .spec.template.spec.tolerations[0].foo: '
        'field not declared in schema", "reason": "InternalError", "code": 500}'
    )
    gave_up = ApiError(
        0,
        "PATCH",
        "/apis/apps/v1/namespaces/d/deployments/x",
        f"gave up after 6 attempts; last: HTTP 500: {status}",
    )
    assert reconcile_failures.api_message(gave_up) == (
        "HTTP 500: failed to create typed patch object (d/x; apps/v1, Kind=Deployment): "
        ".spec.template.spec.tolerations[0].foo: field not declared in schema"
    )
    cut = ApiError(422, "PATCH", "/p", status.replace("500", "422")[:150])
    assert reconcile_failures.api_message(cut).startswith(
        "HTTP 422: failed to create"
    ) and reconcile_failures.api_message(cut).endswith("...")
    assert (
        reconcile_failures.api_message(ApiError(403, "GET", "/p", "forbidden"))
        == "GET /p: HTTP 403: forbidden"
    )
