"""apply.converge against a recording runtime: the order of endpoint changes, stops and state saves
that the planner's steps turn into, and a stalled rollout leaving the old pods serving."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import pytest

from tilert_operator import constants
from tilert_operator import spec as specmod
from tilert_serve.local import apply, rollout
from tilert_serve.local import plan as planmod
from tilert_serve.local.rollout import Pod, Rendered, Workload


@dataclass
class Recorder:
    """A runtime whose pods are names; every call recorded in order."""

    pods_now: list[Pod]
    never_ready: set[str] = field(default_factory=set)
    calls: list[str] = field(default_factory=list)
    endpoints: set[str] = field(default_factory=set)

    def pods(self) -> list[Pod]:
        return list(self.pods_now)

    def create(self, step: rollout.Create, rendered: Rendered) -> None:
        self.calls.append(f"create {step.pod}")
        self.pods_now.append(Pod(step.pod, step.workload, step.revision, step.ordinal, ready=False))

    def wait(self, pods: Sequence[str], timeout: float, say: Callable[[str], None]) -> None:
        self.calls.append(f"wait {','.join(pods)}")
        if set(pods) & self.never_ready:
            raise apply.Stalled(f"{', '.join(pods)} not ready")

    def publish(self, serving: set[str], say: Callable[[str], None]) -> None:
        self.endpoints = set(serving)
        self.calls.append(f"endpoints {','.join(sorted(serving))}")

    def stop(self, pod: str, say: Callable[[str], None]) -> None:
        assert pod not in self.endpoints, f"{pod} stopped while still an endpoint"
        self.calls.append(f"stop {pod}")
        self.pods_now = [p for p in self.pods_now if p.name != pod]

    def save(self) -> None:
        self.calls.append("save")


def _prefill(replicas: int = 1) -> Rendered:
    return Rendered(
        Workload("c-prefill", "Deployment", replicas, "new", "prefill", 1, 0), "prefill", 60, ("sleep", "1")
    )


def test_a_rolled_pod_joins_the_endpoints_before_the_old_one_leaves_them_and_then_stops() -> None:
    rt = Recorder([Pod("prefill-0", "c-prefill", "old", 0)])
    lines: list[str] = []
    assert apply.converge(rt, [_prefill()], 60, lines.append) == 3
    assert rt.calls == [
        "endpoints prefill-0",
        "create prefill-1",
        "save",
        "wait prefill-1",
        "endpoints prefill-0,prefill-1",
        "save",
        "endpoints prefill-1",
        "stop prefill-0",
        "save",
    ]
    assert "  prefill: 1/1 updated, waiting for prefill-1 ready" in lines


def test_a_pod_that_never_gets_ready_stalls_the_rollout_with_the_old_one_serving() -> None:
    rt = Recorder([Pod("prefill-0", "c-prefill", "old", 0)], never_ready={"prefill-1"})
    with pytest.raises(apply.Stalled, match="prefill-1"):
        apply.converge(rt, [_prefill()], 60, lambda _m: None)
    assert rt.endpoints == {"prefill-0"}
    assert "stop prefill-0" not in rt.calls
    assert rt.calls[-1] == "wait prefill-1"  # the create before it was saved
    assert "save" in rt.calls


def test_nothing_to_change_touches_nothing() -> None:
    rt = Recorder([Pod("prefill-0", "c-prefill", "new", 0)])
    lines: list[str] = []
    assert apply.converge(rt, [_prefill()], 60, lines.append) == 0
    assert rt.calls == [] and "nothing to change" in lines[0]


def test_router_replicas_share_the_stack_port_and_answer_probes_on_their_own() -> None:
    """The process runtime's stand-in for a Service over router pods: every replica listens on the
    stack's port with SO_REUSEPORT and is probed (and told its config was loaded) on a port of its own."""
    spec = specmod.parse({"model": {"name": "m", "weights": {"tiny": True}, "tilertModel": "mla"}})
    ports = planmod.Ports(router=8000, prefill=[9001], native=[], tilert=[], router_replicas=[7001, 7002])
    p = planmod.plan(spec, ports=ports, model_dir="/m", secret_file="/s", router_config_file="/r")
    routers = [c for c in p.components if c.kind == constants.ROUTER]
    assert [c.name for c in routers] == ["router", "router-1"]
    for c, own in zip(routers, (7001, 7002), strict=True):
        assert c.url == "http://127.0.0.1:8000" and c.ready_url == f"http://127.0.0.1:{own}/ready"
        assert c.argv[-3:] == ["--reuse-port", "--replica-port", str(own)]
    (alone,) = [
        c
        for c in planmod.plan(
            spec,
            ports=planmod.Ports(8000, [9001], [], []),
            model_dir="/m",
            secret_file="/s",
            router_config_file="/r",
        ).components
        if c.kind == constants.ROUTER
    ]
    assert "--reuse-port" not in alone.argv and alone.ready_url == "http://127.0.0.1:8000/ready"
