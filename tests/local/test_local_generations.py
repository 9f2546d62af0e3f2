"""`tilert-pd local apply` across a change of compatibility generation, without processes: which
generations each phase renders (the operator's tilert_operator.rollout decisions fed from a local
state), the workloads and pod names of each slot, the order of endpoint changes, waits and stops that
apply_generations runs against a recording runtime, and each endpoint's compat in the router config."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from tilert_operator import constants, render
from tilert_operator import rollout as op_rollout
from tilert_operator.observe import PoolState
from tilert_operator.render.generations import Live, generation, spec_json
from tilert_operator.spec import PDClusterSpec, parse
from tilert_serve.local import apply, cli, rollout, runner
from tilert_serve.local.rollout import Pod, RecordedGeneration

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tiny-cpu.yaml"
CLUSTER = "tiny"


def _spec(**model: Any) -> PDClusterSpec:
    doc: dict[str, Any] = yaml.safe_load(EXAMPLE.read_text())
    doc["spec"]["model"].update(model)
    doc["spec"]["decode"]["native"]["replicas"] = 0
    doc["spec"]["decode"]["tilert"]["replicas"] = 1
    return parse(doc["spec"])


OLD = _spec()
NEW = _spec(kvCacheDtype="bfloat16")


def _record(spec: PDClusterSpec, slot: str, created: str = "2026-01-01T00:00:00Z") -> RecordedGeneration:
    return RecordedGeneration.of(Live(spec, slot), created)


def _phases(spec: PDClusterSpec, records: dict[str, RecordedGeneration]) -> list[list[tuple[str, str]]]:
    pods = {slot: r.fingerprint for slot, r in records.items()}
    _, phases = rollout.generation_phases(spec, rollout.occupied(records, pods))
    return [[(g.slot, g.generation.fingerprint) for g in lives] for lives in phases]


def _rendered(spec: PDClusterSpec, lives: Sequence[Live]) -> list[rollout.Rendered]:
    return rollout.rendered(render.children(spec, CLUSTER, "default", lives=lives), CLUSTER)


def test_the_kv_cache_dtype_and_the_prefills_mtp_each_change_the_generation() -> None:
    assert generation(NEW).fingerprint != generation(OLD).fingerprint
    doc: dict[str, Any] = yaml.safe_load(EXAMPLE.read_text())
    doc["spec"]["prefill"]["mtp"] = {"enabled": not OLD.prefill.mtp.enabled}
    assert generation(parse(doc["spec"])).fingerprint != generation(OLD).fingerprint
    # An image or a replica count is no new generation.
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["spec"]["decode"]["tilert"]["replicas"] = 3
    doc["spec"]["prefill"]["extraArgs"] += ["--max-num-seqs", "8"]
    assert generation(parse(doc["spec"])).fingerprint == generation(_spec()).fingerprint


def test_the_same_generation_rolls_in_its_own_slot() -> None:
    old, new = generation(OLD).fingerprint, generation(_spec(maxSeqLen=1024)).fingerprint
    assert old == new
    assert _phases(_spec(maxSeqLen=1024), {"a": _record(OLD, "a")}) == [[("a", old)]]
    # ... and in slot b after a rollout moved it there.
    assert _phases(OLD, {"b": _record(OLD, "b")}) == [[("b", old)]]


def test_a_new_generation_comes_up_in_the_other_slot_then_serves_alone() -> None:
    old, new = generation(OLD).fingerprint, generation(NEW).fingerprint
    assert _phases(NEW, {"a": _record(OLD, "a")}) == [[("a", old), ("b", new)], [("b", new)]]
    assert _phases(NEW, {"b": _record(OLD, "b")}) == [[("b", old), ("a", new)], [("a", new)]]


def test_an_apply_after_a_stalled_phase_one_resumes_it() -> None:
    old, new = generation(OLD).fingerprint, generation(NEW).fingerprint
    both = {"a": _record(OLD, "a"), "b": _record(NEW, "b", "2026-01-02T00:00:00Z")}
    assert _phases(NEW, both) == [[("a", old), ("b", new)], [("b", new)]]
    # The old spec applied again: the new generation is the one that goes (after the old one, which
    # still runs, is found ready).
    assert _phases(OLD, both) == [[("b", new), ("a", old)], [("a", old)]]


def test_a_third_generation_during_a_rollout_replaces_the_one_coming_up() -> None:
    third = _spec(kvCacheDtype="bfloat16", revision="v2")
    both = {"a": _record(OLD, "a"), "b": _record(NEW, "b", "2026-01-02T00:00:00Z")}
    phases = _phases(third, both)
    assert phases == [
        [("a", generation(OLD).fingerprint), ("b", generation(third).fingerprint)],
        [("b", generation(third).fingerprint)],
    ]


def test_pods_from_before_generations_roll_in_place() -> None:
    """A state without recorded generations whose spec file is gone: its pods are taken as the new
    spec's generation, as the operator takes workloads without a generation label."""
    _, phases = rollout.generation_phases(NEW, rollout.occupied({}, {"a": None}))
    assert [[g.slot for g in lives] for lives in phases] == [["a"]]


def test_the_recorded_generations_round_trip_through_the_state_meta() -> None:
    rec = _record(NEW, "b")
    meta = {rollout.GENERATIONS_KEY: {"b": asdict(rec)}}
    assert rollout.recorded(meta) == {"b": rec}
    assert rollout.recorded({}) == {}
    slot = rollout.occupied(rollout.recorded(meta), {})["b"]
    assert slot.spec is not None and spec_json(slot.spec) == spec_json(NEW)
    with pytest.raises(ValueError, match=r"generations\.b is not a mapping.*local down"):
        rollout.recorded({rollout.GENERATIONS_KEY: {"b": "x"}})


def test_phase_one_renders_the_new_slot_beside_the_old_pools_unchanged() -> None:
    alone = {r.workload.name: r for r in _rendered(OLD, [Live(OLD)])}
    _, phases = rollout.generation_phases(NEW, rollout.occupied({"a": _record(OLD, "a")}, {}))
    both = {r.workload.name: r for r in _rendered(NEW, phases[0])}
    for name, r in alone.items():  # the old generation's pods (and the router) do not roll
        assert both[name].workload.revision == r.workload.revision, name
    new = {n: r for n, r in both.items() if n not in alone}
    assert {(r.workload.prefix, r.slot) for r in new.values()} == {
        ("prefill-b", "b"),
        ("tilert-b", "b"),
    }
    last = {r.workload.name for r in _rendered(NEW, phases[1])}
    assert last == {*new, f"{CLUSTER}-router"}


def test_pool_states_count_ready_pods_of_the_current_template_in_the_slot() -> None:
    rendered = [r for r in _rendered(NEW, [Live(NEW, "b")]) if r.workload.replicas]
    pre = next(r.workload for r in rendered if r.component == constants.PREFILL)
    til = next(r.workload for r in rendered if r.component == constants.TILERT)
    pods = [
        Pod("prefill-b-0", pre.name, pre.revision, 0),
        Pod("tilert-b-0", til.name, til.revision, 0, ready=False),
    ]
    states = rollout.pool_states(rendered, pods, "b")
    assert states[constants.PREFILL] == PoolState(1, 1)
    assert states[constants.TILERT].ready == 0 and states[constants.TILERT].rolling is not None
    assert rollout.pool_states(rendered, pods, "a") == {}


@dataclass
class Recorder:
    """A GenerationRuntime whose pods are names; every call recorded in order. The new generation
    is HandoffReady after `handoff_after` readiness reads (never with None)."""

    pods_now: list[Pod]
    handoff_after: int | None = 1
    calls: list[str] = field(default_factory=list)
    endpoints: set[str] = field(default_factory=set)
    reads: int = 0

    def pods(self) -> list[Pod]:
        return list(self.pods_now)

    def create(self, step: rollout.Create, rendered: rollout.Rendered) -> None:
        self.calls.append(f"create {step.pod}")
        self.pods_now.append(Pod(step.pod, step.workload, step.revision, step.ordinal, ready=False))

    def wait(self, pods: Sequence[str], timeout: float, say: Callable[[str], None]) -> None:
        self.calls.append(f"wait {','.join(pods)}")
        self.pods_now = [Pod(p.name, p.workload, p.revision, p.ordinal) for p in self.pods_now]

    def publish(self, serving: set[str], say: Callable[[str], None]) -> None:
        if serving != self.endpoints:
            self.calls.append(f"endpoints {','.join(sorted(serving))}")
        self.endpoints = set(serving)

    def stop(self, pod: str, say: Callable[[str], None]) -> None:
        assert pod not in self.endpoints, f"{pod} stopped while still an endpoint"
        self.calls.append(f"stop {pod}")
        self.pods_now = [p for p in self.pods_now if p.name != pod]

    def save(self) -> None:
        pass

    def use(self, lives: Sequence[Live]) -> None:
        self.calls.append("use " + ",".join(g.slot for g in lives))

    def readiness(self, live: Live, rendered: Sequence[rollout.Rendered]) -> tuple[op_rollout.Readiness, str]:
        self.reads += 1
        ok = self.handoff_after is not None and self.reads > self.handoff_after
        pools = rollout.pool_states(rendered, self.pods_now, live.slot)
        handoff = [("tilert-b-0", "HandoffOK" if ok else "NoHandoffYet")]
        return op_rollout.readiness(pools, handoff), "tilert-b-0: " + handoff[0][1]


def _old_pods() -> list[Pod]:
    out = []
    for r in _rendered(OLD, [Live(OLD)]):
        out += [
            Pod(f"{r.workload.prefix}-{o}", r.workload.name, r.workload.revision, o)
            for o in range(r.workload.replicas)
        ]
    return out


def _run(rt: Recorder, timeout: float = 60.0) -> list[str]:
    _, phases = rollout.generation_phases(NEW, rollout.occupied({"a": _record(OLD, "a")}, {}))
    out: list[str] = []
    apply.apply_generations(rt, phases, lambda lives: _rendered(NEW, lives), timeout, out.append)
    return out


def test_the_new_generation_serves_beside_the_old_one_before_the_old_one_drains(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(apply, "READINESS_POLL_S", 0.0)
    rt = Recorder(_old_pods(), handoff_after=2)
    out = _run(rt)
    calls = rt.calls
    assert calls[0] == "use a,b" and "use b" in calls
    # Phase 1: created, waited for, then endpoints beside the old generation's.
    both = "endpoints prefill-0,prefill-b-0,router-0,tilert-0,tilert-b-0"
    assert calls.index("create prefill-b-0") < calls.index(both) < calls.index("use b")
    # HandoffReady read until it holds, then phase 2: the old pods leave the endpoints together, then stop.
    assert rt.reads == 3
    alone = "endpoints prefill-b-0,router-0,tilert-b-0"
    assert (
        calls.index("use b")
        < calls.index(alone)
        < calls.index("stop prefill-0")
        < calls.index("stop tilert-0")
    )
    assert {p.name for p in rt.pods_now} == {"prefill-b-0", "tilert-b-0", "router-0"}
    text = "\n".join(out)
    assert "NoHandoffYet" in text and "ready and HandoffReady" in text


def test_a_new_generation_never_handoff_ready_stalls_with_the_old_one_serving(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(apply, "READINESS_POLL_S", 0.0)
    rt = Recorder(_old_pods(), handoff_after=None)
    with pytest.raises(
        apply.Stalled, match=r"TileRT handoff 0/1 nodes HandoffReady.*old generation keeps serving"
    ):
        _run(rt, timeout=0.0)
    assert not any(c.startswith("stop") for c in rt.calls)
    assert {"prefill-0", "tilert-0", "prefill-b-0", "tilert-b-0"} <= rt.endpoints


def _running(name: str, kind: str, slot: str, compat: str | None, ctrl: int | None = None) -> runner.Running:
    return runner.Running(
        name,
        kind,
        1,
        f"http://127.0.0.1:{hash(name) % 1000 + 20000}",
        "",
        "",
        ctrl_port=ctrl,
        slot=slot,
        compat=compat,
    )


def test_each_endpoint_carries_its_own_generations_compat() -> None:
    old, new = generation(OLD).compat, generation(NEW).compat
    pods = [
        _running("prefill-0", constants.PREFILL, "a", old),
        _running("tilert-0", constants.TILERT, "a", old, 1),
        _running("prefill-b-0", constants.PREFILL, "b", new),
        _running("tilert-b-0", constants.TILERT, "b", new, 2),
    ]
    cfg = apply.endpoints_config(NEW, pods, None, {"a": OLD, "b": NEW})
    assert {e.url: e.compat for e in cfg.prefill} == {pods[0].url: old, pods[2].url: new}
    assert {n.name: n.compat for n in cfg.tilert} == {"tilert-0": old, "tilert-b-0": new}
    assert old != new


def test_a_new_generations_pods_all_start_before_the_first_wait() -> None:
    _, phases = rollout.generation_phases(NEW, rollout.occupied({"a": _record(OLD, "a")}, {}))
    steps = rollout.plan([r.workload for r in _rendered(NEW, phases[0])], _old_pods())
    kinds = [type(s).__name__ for s in steps]
    assert kinds == ["Create", "Create", "Wait", "Wait"], steps
    assert {s.pod for s in steps if isinstance(s, rollout.Create)} == {"prefill-b-0", "tilert-b-0"}


def test_phase_one_leaves_the_old_generation_as_it_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """An old generation whose own rollout stalled before (its pods run another template than its
    recorded spec renders) keeps serving untouched while the new one comes up; phase 2 removes it."""
    monkeypatch.setattr(apply, "READINESS_POLL_S", 0.0)
    pods = [
        Pod(p.name, p.workload, "stale" if p.name == "prefill-0" else p.revision, p.ordinal)
        for p in _old_pods()
    ]
    rt = Recorder(pods)
    _run(rt)
    phase1 = rt.calls[: rt.calls.index("use b")]
    assert [c for c in phase1 if c.startswith(("create", "stop"))] == [
        "create prefill-b-0",
        "create tilert-b-0",
    ]
    assert "stop prefill-0" in rt.calls


def _old_state(tmp_path: Path, spec_file: Path) -> Path:
    """A state.json as a tilert-pd from before generations wrote it (no slot, generation or compat)."""
    comps = [
        {
            "name": n,
            "kind": k,
            "pid": 1,
            "url": "http://127.0.0.1:1",
            "ready_url": "",
            "log": "",
            "started": None,
            "workload": w,
            "revision": "r",
            "ordinal": 0,
            "ctrl_port": None,
            "grace_s": 30.0,
            "pre_stop": None,
        }
        for n, k, w in (
            ("prefill-0", constants.PREFILL, "tiny-prefill"),
            ("router", constants.ROUTER, "tiny-router"),
        )
    ]
    meta = {"cluster": CLUSTER, "file": str(spec_file), "started": 0.0, "router": "http://127.0.0.1:2"}
    (tmp_path / runner.STATE_FILE).write_text(json.dumps({**meta, "components": comps}))
    return tmp_path


def test_a_state_from_before_generations_loads_as_one_generation_in_slot_a(tmp_path: Path) -> None:
    doc: dict[str, Any] = yaml.safe_load(EXAMPLE.read_text())
    spec_file = tmp_path / "spec.yaml"
    spec_file.write_text(yaml.safe_dump(doc))
    meta, procs = runner.load(_old_state(tmp_path, spec_file))
    cli.adopt_generations(meta, procs)
    fp = generation(parse(doc["spec"])).fingerprint
    assert {s: r.fingerprint for s, r in rollout.recorded(meta).items()} == {"a": fp}
    assert [(p.name, p.slot, p.generation) for p in procs] == [("prefill-0", "a", fp), ("router", "", "")]
    # So a changed generation is a blue/green rollout from slot a.
    slots = rollout.occupied(rollout.recorded(meta), cli._pod_generations(procs))
    assert [[g.slot for g in lives] for lives in rollout.generation_phases(NEW, slots)[1]] == [
        ["a", "b"],
        ["b"],
    ]


def test_a_state_from_before_generations_whose_spec_file_is_gone_rolls_in_place(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    meta, procs = runner.load(_old_state(tmp_path, tmp_path / "gone.yaml"))
    cli.adopt_generations(meta, procs)
    assert rollout.GENERATIONS_KEY not in meta and "rolling in place" in capsys.readouterr().out
    slots = rollout.occupied(rollout.recorded(meta), cli._pod_generations(procs))
    assert [[g.slot for g in lives] for lives in rollout.generation_phases(NEW, slots)[1]] == [["a"]]
