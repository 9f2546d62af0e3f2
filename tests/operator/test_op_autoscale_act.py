"""From a decision to replicas without ping-pong: the status holds the decision, the renderers take
replicas from it, a resync renders the same number, and the windows survive an operator restart."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import pdc_crd_validator as crd_validator
import pdc_helpers as helpers

from tilert_operator import spec as specmod
from tilert_operator.autoscale import act, planner
from tilert_operator.autoscale.decision import History
from tilert_operator.autoscale.inputs import NativeObserved, Observed, PrefillObserved, TileRTObserved


def _spec(actuator: str = "Operator", prefill: dict[str, Any] | None = None) -> specmod.PDClusterSpec:
    return specmod.parse(
        helpers.minimal(
            prefill=prefill
            or {"replicas": 2, "autoscaling": {"enabled": True, "minReplicas": 1, "maxReplicas": 6}},
            decode={"native": {"replicas": 1}},
            autoscaling={"actuator": actuator},
        )
    )


def _load(rate: float) -> Observed:
    return Observed(
        prefill=PrefillObserved(2, rate, 0.2),
        tilert=TileRTObserved(1, 1, (0,)),
        native=NativeObserved(1, 0.3, 0, 0.5),
    )


def _roundtrip(patch: dict[str, Any]) -> act.AutoscalingStatus:
    status = act.parse_status(json.loads(json.dumps(patch))["autoscaling"])
    assert status is not None
    return status


def test_a_pool_not_autoscaled_renders_its_replicas() -> None:
    spec = _spec(prefill={"replicas": 3})
    assert act.replicas(spec, None) == {"prefill": 3, "tilert": 1, "native": 1}


def test_the_decision_in_status_is_what_is_rendered_and_a_resync_renders_it_again() -> None:
    spec = _spec()
    assert act.replicas(spec, None)["prefill"] == 2  # before any decision: the starting point
    obs = replace(_load(20.0), current=act.current(spec, None))
    d = planner.plan(spec, obs, History(), 0.0)
    assert d.prefill.desired == 6  # 20/s x 0.2 s = 4 busy at 0.7 -> 6
    status = _roundtrip(act.status_patch(spec, None, d, "2026-12-03T17:00:00Z"))
    assert act.replicas(spec, status)["prefill"] == 6
    assert act.replicas(spec, status) == act.replicas(spec, status)  # a resync: nothing moves
    # Editing spec.replicas of an autoscaled pool changes nothing: it is only the starting point.
    edited = _spec(
        prefill={"replicas": 4, "autoscaling": {"enabled": True, "minReplicas": 1, "maxReplicas": 6}}
    )
    assert act.replicas(edited, status)["prefill"] == 6
    # Lowered bounds clamp at once; turning autoscaling off goes back to replicas.
    lowered = _spec(
        prefill={"replicas": 2, "autoscaling": {"enabled": True, "minReplicas": 1, "maxReplicas": 3}}
    )
    assert act.replicas(lowered, status)["prefill"] == 3
    assert act.replicas(_spec(prefill={"replicas": 2}), status)["prefill"] == 2


def test_with_the_hpa_actuator_the_operator_leaves_replicas_alone() -> None:
    spec = _spec(actuator="HPA")
    assert act.replicas(spec, None) == {"prefill": None, "tilert": 1, "native": 1}
    assert act.current(spec, None)["prefill"] == 1


def test_the_windows_survive_a_restart_through_status() -> None:
    spec = _spec()
    history, status = History(), None
    keep = planner.history_keep_s(spec)
    loads = [20.0] * 3 + [1.0] * 5
    for i, rate in enumerate(loads):
        now = i * 15.0
        obs = replace(_load(rate), current=act.current(spec, status))
        in_memory = planner.plan(spec, obs, history, now)
        from_status = planner.plan(spec, obs, status.history if status else History(), now)
        assert in_memory == from_status
        history = history.add(in_memory, keep)
        status = _roundtrip(act.status_patch(spec, status, from_status, f"2026-12-03T17:00:{i:02d}Z"))
    assert status is not None
    # The fall to 1/s is held by the 300 s window: still 6, the reason says why.
    assert status.pools["prefill"].desired == 6 and "held at 6" in status.pools["prefill"].reason
    assert status.pools["prefill"].last_scale_time == "2026-12-03T17:00:00Z"  # moved once, at the start


def test_the_status_patch_passes_the_crd_schema() -> None:
    spec = _spec()
    obs = replace(_load(20.0), current=act.current(spec, None))
    d = planner.plan(spec, obs, History(), 0.0)
    patch = act.status_patch(spec, None, d, "2026-12-03T17:00:00Z")
    obj = {**helpers.cr(helpers.minimal()), "status": patch}
    assert crd_validator.validate(obj)[1] == []
    bad = {**obj, "status": {"autoscaling": {**patch["autoscaling"], "unknown": 1}}}
    assert crd_validator.validate(bad)[1]


def test_a_status_the_operator_did_not_write_is_not_trusted() -> None:
    raw = {
        "pools": {"prefill": {"desired": -1}, "tilert": {"desired": "3"}, "native": {"desired": 2}},
        "recommendations": [{"at": "x", "prefill": 1, "tilert": 1, "native": 1}, {"at": 5, "prefill": 2}],
        "drainFirst": [1, "2"],
    }
    status = act.parse_status(raw)
    assert status is not None
    assert set(status.pools) == {"native"} and status.history.records == () and status.drain_first == (1,)
    assert act.parse_status(None) is None and act.parse_status({}) is None
