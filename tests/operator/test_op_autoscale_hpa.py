"""The HPA actuator: one valid autoscaling/v2 HorizontalPodAutoscaler per autoscaled pool (bounds and
windows from the spec), and workloads applied without `replicas`, so a resync never sets back what
an HPA decided (against the API test server)."""

from __future__ import annotations

from typing import Any

import kubernetes_validate
import pdc_harness as h
import pdc_helpers as helpers

from tilert_operator import constants, reconcile, render
from tilert_operator.render import autoscaling
from tilert_operator.render.generations import single
from tilert_operator.spec import parse

AUTO = {"enabled": True, "minReplicas": 1, "maxReplicas": 5, "scaleDownStabilizationSeconds": 600}


def _spec(actuator: str = "HPA") -> dict[str, Any]:
    return helpers.minimal(
        decode={
            "tilert": {"replicas": 2, "slots": 4, "autoscaling": AUTO},
            "native": {"replicas": 1, "autoscaling": AUTO},
        },
        autoscaling={"actuator": actuator, "targetUtilization": 0.5},
    )


def test_hpa_actuator_renders_valid_hpas_from_the_spec() -> None:
    spec = parse(_spec())
    hpas = [o for o in render.children(spec, "t", "default") if o["kind"] == "HorizontalPodAutoscaler"]
    assert {o["spec"]["scaleTargetRef"]["name"] for o in hpas} == {"t-tilert-decode", "t-native-decode"}
    for o in hpas:
        kubernetes_validate.validate(o, helpers.K8S_VERSION, strict=True)
        assert o["spec"]["minReplicas"] == 1 and o["spec"]["maxReplicas"] == 5
        assert o["spec"]["behavior"]["scaleDown"]["stabilizationWindowSeconds"] == 600
    tilert = next(o for o in hpas if o["spec"]["scaleTargetRef"]["kind"] == "StatefulSet")
    # 4 slots at a target utilization of 0.5: 2 busy slots per node on average.
    assert tilert["spec"]["metrics"][0]["pods"]["target"]["averageValue"] == "2"
    native = next(o for o in hpas if o["metadata"]["name"] == "t-native-decode")
    assert native["spec"]["metrics"][0]["pods"]["target"]["averageValue"] == "500m"
    # The operator actuator renders none.
    assert (
        autoscaling.render(parse(_spec("Operator")), "t", "default", single(parse(_spec("Operator")))) == []
    )


def test_workloads_under_an_hpa_are_applied_without_replicas_and_not_fought(apiserver: Any) -> None:
    srv = apiserver.server
    apiserver.call(srv.put(h.PDC, h.pdc(helpers.cr(_spec()))))
    h.reconcile_once(apiserver, "t")
    name = constants.child_name("t", constants.TILERT)
    assert srv.get("statefulsets", "default", name) is not None
    # The HPA scales the StatefulSet (its own field manager, through the scale subresource's field).
    h.run(
        apiserver,
        lambda api: api.request(
            "patch",
            "PATCH",
            f"/apis/apps/v1/namespaces/default/statefulsets/{name}",
            body={"spec": {"replicas": 4}},
            content_type="application/merge-patch+json",
            params={"fieldManager": "horizontal-pod-autoscaler"},
        ),
    )
    for _ in range(2):  # resyncs
        out: reconcile.Outcome = h.reconcile_once(apiserver, "t")
        assert f"StatefulSet/{name}" not in out.applied, out.applied
    assert srv.get("statefulsets", "default", name)["spec"]["replicas"] == 4
    # kubectl get pdc: desired is what the HPA decided, not the spec's starting point.
    assert h.body(apiserver, "t")["status"]["pools"]["tilert"]["desired"] == 4
    # The prefill is not autoscaled: the operator keeps its replicas.
    prefill = srv.get("deployments", "default", constants.child_name("t", constants.PREFILL))
    assert prefill["spec"]["replicas"] == 1
