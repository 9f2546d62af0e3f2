"""The planner of `tilert-pd local apply` (tilert_serve/local/rollout.py): the steps Kubernetes'
Deployment, ReplicaSet and StatefulSet controllers would take, as tables."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tilert_operator import render, validation
from tilert_serve.local import plan as planmod
from tilert_serve.local import rollout
from tilert_serve.local.rollout import Create, Pod, Remove, Wait, Workload

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tiny-cpu.yaml"


def _pods(workload: str, prefix: str, revision: str, ordinals: range | list[int], **kw: bool) -> list[Pod]:
    return [Pod(f"{prefix}-{o}", workload, revision, o, **kw) for o in ordinals]


def _short(steps: list[rollout.Step]) -> list[str]:
    """Steps as compact strings: +name (create), -name (remove), ?a,b (wait)."""
    out = []
    for s in steps:
        if isinstance(s, Create):
            out.append(f"+{s.pod}")
        elif isinstance(s, Remove):
            out.append(f"-{s.pod}")
        else:
            out.append("?" + ",".join(s.pods))
    return out


@pytest.mark.parametrize(
    ("surge", "unavailable", "replicas", "expected"),
    [
        (None, None, 1, (1, 0)),  # 25 % of 1: surge rounds up, unavailable down
        (None, None, 4, (1, 1)),
        (None, None, 10, (3, 2)),
        ("50%", "50%", 3, (2, 1)),
        (0, 0, 3, (0, 1)),  # both 0: the controller makes the unavailable 1
        ("0%", "0%", 3, (0, 1)),
        (2, "0", 5, (2, 0)),
        ("1%", "99%", 10, (1, 9)),
    ],
)
def test_surge_and_unavailable_resolve_as_the_deployment_controller_does(
    surge: int | str | None, unavailable: int | str | None, replicas: int, expected: tuple[int, int]
) -> None:
    assert rollout.fenceposts(surge, unavailable, replicas) == expected


@pytest.mark.parametrize("bad", ["-1", "x%", "25 %%", "1.5", -1])
def test_a_bad_count_is_refused_with_what_it_should_be(bad: int | str) -> None:
    with pytest.raises(ValueError, match=r"a count nor a percentage such as '25%'|must not be negative"):
        rollout.scaled(bad, 4, round_up=True)


def _deploy(replicas: int, surge: int | str | None, unavailable: int | str | None) -> Workload:
    return Workload("c-prefill", "Deployment", replicas, "new", "prefill", surge, unavailable)


DEPLOYMENT_TABLE = [
    # (replicas, maxSurge, maxUnavailable, running old ordinals, running new ordinals, expected steps)
    ("surge 1/0, 1 replica", 1, 1, 0, [0], [], ["+prefill-1", "?prefill-1", "-prefill-0"]),
    (
        "surge 1/0, 2 replicas: one at a time, never below 2 ready",
        2,
        1,
        0,
        [0, 1],
        [],
        ["+prefill-2", "?prefill-2", "-prefill-1", "+prefill-3", "?prefill-3", "-prefill-0"],
    ),
    (
        "0/1 (a GPU pool's): down first, then up",
        2,
        0,
        1,
        [0, 1],
        [],
        ["-prefill-1", "+prefill-2", "?prefill-2", "-prefill-0", "+prefill-3", "?prefill-3"],
    ),
    (
        "defaults 25 %/25 % of 4 = 1/1: one extra and one down at once",
        4,
        None,
        None,
        [0, 1, 2, 3],
        [],
        [
            "+prefill-4",
            "-prefill-3",
            "+prefill-5",
            "?prefill-4,prefill-5",
            "-prefill-2",
            "-prefill-1",
            "+prefill-6",
            "+prefill-7",
            "?prefill-6,prefill-7",
            "-prefill-0",
        ],
    ),
    (
        "surge 2/0 of 2: both new at once",
        2,
        2,
        0,
        [0, 1],
        [],
        ["+prefill-2", "+prefill-3", "?prefill-2,prefill-3", "-prefill-1", "-prefill-0"],
    ),
    (
        "scale up, same template: at once",
        3,
        1,
        0,
        [],
        [0],
        ["+prefill-1", "+prefill-2", "?prefill-1,prefill-2"],
    ),
    ("scale down, same template: newest first", 1, 1, 0, [], [0, 1, 2], ["-prefill-2", "-prefill-1"]),
    ("scale to 0", 0, 1, 0, [], [0, 1], ["-prefill-1", "-prefill-0"]),
    (
        "roll and grow 1 -> 2 with 1/0",
        2,
        1,
        0,
        [0],
        [],
        ["+prefill-1", "+prefill-2", "?prefill-1,prefill-2", "-prefill-0"],
    ),
    (
        "roll and shrink 2 -> 1 with 1/0: the old go, never below 1 ready",
        1,
        1,
        0,
        [0, 1],
        [],
        ["-prefill-1", "+prefill-2", "?prefill-2", "-prefill-0"],
    ),
    ("nothing to do", 2, 1, 0, [], [0, 1], []),
    (
        "a resumed rollout: one new already there",
        2,
        1,
        0,
        [0],
        [1],
        ["+prefill-2", "?prefill-2", "-prefill-0"],
    ),
]


@pytest.mark.parametrize(
    ("replicas", "surge", "unavailable", "old", "new", "expected"),
    [row[1:] for row in DEPLOYMENT_TABLE],
    ids=[row[0] for row in DEPLOYMENT_TABLE],
)
def test_deployment_rolling_update(
    replicas: int,
    surge: int | None,
    unavailable: int | None,
    old: list[int],
    new: list[int],
    expected: list[str],
) -> None:
    pods = _pods("c-prefill", "prefill", "old", old) + _pods("c-prefill", "prefill", "new", new)
    steps = rollout.plan([_deploy(replicas, surge, unavailable)], pods)
    assert _short(steps) == expected
    _check_availability(steps, pods, replicas, *rollout.fenceposts(surge, unavailable, replicas))


def _check_availability(
    steps: list[rollout.Step], pods: list[Pod], replicas: int, surge: int, unavailable: int
) -> None:
    """Replays the steps: never more than replicas + surge pods, never fewer ready than replicas -
    unavailable (unless there were fewer to begin with), and each created pod waited for."""
    live = {p.name: p.ready for p in pods}
    floor = min(replicas - unavailable, sum(live.values()))
    for s in steps:
        if isinstance(s, Create):
            live[s.pod] = False
        elif isinstance(s, Remove):
            del live[s.pod]
        else:
            for name in s.pods:
                live[name] = True
        assert len(live) <= max(replicas + surge, len(pods)), (s, live)
        assert sum(live.values()) >= floor, (s, live)
    assert all(live.values()) and len(live) == replicas


def test_a_wait_says_how_far_the_rollout_is() -> None:
    steps = rollout.plan([_deploy(2, 1, 0)], _pods("c-prefill", "prefill", "old", [0, 1]))
    waits = [s for s in steps if isinstance(s, Wait)]
    assert [w.progress for w in waits] == [
        "prefill: 1/2 updated, waiting for prefill-2 ready",
        "prefill: 2/2 updated, waiting for prefill-3 ready",
    ]


def test_a_pod_not_ready_goes_first_and_a_dead_one_is_replaced() -> None:
    pods = [
        Pod("prefill-0", "c-prefill", "new", 0),
        Pod("prefill-1", "c-prefill", "new", 1, ready=False),
        Pod("prefill-2", "c-prefill", "new", 2),
    ]
    assert _short(rollout.plan([_deploy(2, 1, 0)], pods)) == ["-prefill-1"]
    dead = [Pod("prefill-0", "c-prefill", "new", 0, running=False, ready=False)]
    assert _short(rollout.plan([_deploy(1, 1, 0)], dead)) == ["-prefill-0", "+prefill-1", "?prefill-1"]


def _sts(replicas: int, partition: int = 0, unavailable: int | str | None = None) -> Workload:
    return Workload("c-tilert-decode", "StatefulSet", replicas, "new", "tilert", None, unavailable, partition)


STATEFULSET_TABLE = [
    # (replicas, partition, maxUnavailable, old ordinals, new ordinals, expected)
    (
        "rolling update from the highest ordinal down, one at a time",
        3,
        0,
        None,
        [0, 1, 2],
        [],
        [
            "-tilert-2",
            "+tilert-2",
            "?tilert-2",
            "-tilert-1",
            "+tilert-1",
            "?tilert-1",
            "-tilert-0",
            "+tilert-0",
            "?tilert-0",
        ],
    ),
    (
        "partition 1 keeps ordinal 0",
        3,
        1,
        None,
        [0, 1, 2],
        [],
        ["-tilert-2", "+tilert-2", "?tilert-2", "-tilert-1", "+tilert-1", "?tilert-1"],
    ),
    ("partition at the replica count: nothing rolls", 2, 2, None, [0, 1], [], []),
    (
        "maxUnavailable 2: two at a time",
        3,
        0,
        2,
        [0, 1, 2],
        [],
        [
            "-tilert-2",
            "-tilert-1",
            "+tilert-2",
            "+tilert-1",
            "?tilert-2,tilert-1",
            "-tilert-0",
            "+tilert-0",
            "?tilert-0",
        ],
    ),
    ("scale up 2 -> 3: the next ordinal", 3, 0, None, [], [0, 1], ["+tilert-2", "?tilert-2"]),
    ("scale down 3 -> 1: highest ordinal first", 1, 0, None, [], [0, 1, 2], ["-tilert-2", "-tilert-1"]),
    (
        "scale down and roll: the condemned go first, never rolled",
        1,
        0,
        None,
        [0, 1, 2],
        [],
        ["-tilert-2", "-tilert-1", "-tilert-0", "+tilert-0", "?tilert-0"],
    ),
    (
        "a resumed rollout: ordinal 1 already new",
        2,
        0,
        None,
        [0],
        [1],
        ["-tilert-0", "+tilert-0", "?tilert-0"],
    ),
]


@pytest.mark.parametrize(
    ("replicas", "partition", "unavailable", "old", "new", "expected"),
    [row[1:] for row in STATEFULSET_TABLE],
    ids=[row[0] for row in STATEFULSET_TABLE],
)
def test_statefulset_rolling_update(
    replicas: int,
    partition: int,
    unavailable: int | None,
    old: list[int],
    new: list[int],
    expected: list[str],
) -> None:
    pods = _pods("c-tilert-decode", "tilert", "old", old) + _pods("c-tilert-decode", "tilert", "new", new)
    assert _short(rollout.plan([_sts(replicas, partition, unavailable)], pods)) == expected


def test_a_new_workload_is_created_and_a_vanished_one_removed_after_it() -> None:
    """A new generation's workload comes up and is waited for before the old one's pods go."""
    old = _pods("c-tilert-decode", "tilert", "old", [0, 1])
    new = Workload("c-tilert-decode-g2", "StatefulSet", 2, "g2", "tilert-g2")
    steps = rollout.plan([new], old)
    assert _short(steps) == [
        "+tilert-g2-0",
        "+tilert-g2-1",
        "?tilert-g2-0,tilert-g2-1",
        "-tilert-1",
        "-tilert-0",
    ]
    assert all(s.why == "its workload is no longer rendered" for s in steps if isinstance(s, Remove))


def test_equal_templates_hash_equal_and_any_change_rolls() -> None:
    template = {"spec": {"containers": [{"name": "vllm", "image": "a", "args": ["--x"]}]}}
    same = {"spec": {"containers": [{"args": ["--x"], "image": "a", "name": "vllm"}]}}
    assert rollout.revision(template) == rollout.revision(same)
    changed = {"spec": {"containers": [{"name": "vllm", "image": "a", "args": ["--y"]}]}}
    assert rollout.revision(template) != rollout.revision(changed)


def test_repeated_workload_names_are_refused() -> None:
    with pytest.raises(ValueError, match="repeat"):
        rollout.plan([_deploy(1, 1, 0), _deploy(2, 1, 0)], [])


def _render(change: Any = None) -> list[rollout.Rendered]:
    doc = yaml.safe_load(EXAMPLE.read_text())
    if change:
        change(doc["spec"])
    spec, problems = validation.validate(doc["spec"], "tiny")
    assert spec is not None, problems
    return rollout.rendered(render.children(spec, "tiny", "default"), "tiny")


def test_the_operators_render_becomes_workloads_with_its_strategies_and_hooks() -> None:
    by = {r.workload.name: r for r in _render()}
    assert set(by) == {"tiny-prefill", "tiny-tilert-decode", "tiny-native-decode", "tiny-router"}
    prefill, tilert = by["tiny-prefill"], by["tiny-tilert-decode"]
    assert (prefill.workload.kind, prefill.workload.prefix, prefill.component) == (
        "Deployment",
        "prefill",
        "prefill",
    )
    # A pool without GPUs surges first (render/hygiene.py).
    assert (prefill.workload.max_surge, prefill.workload.max_unavailable) == (1, 0)
    assert (tilert.workload.kind, tilert.workload.prefix, tilert.workload.replicas) == (
        "StatefulSet",
        "tilert",
        2,
    )
    assert (prefill.grace_s, tilert.grace_s) == (60, 120)
    assert prefill.pre_stop is not None and prefill.pre_stop[:2] == ("tilert-pd", "wait-idle")
    # As a local process runs it: the same translation as the components' commands, and the process's
    # own URL instead of the pod-local port.
    hook = planmod.local_hook(prefill.pre_stop, "http://127.0.0.1:40123")
    assert hook[:4] == [sys.executable, "-m", "tilert_serve.cli", "wait-idle"]
    assert hook[hook.index("--url") + 1] == "http://127.0.0.1:40123"
    assert planmod.local_hook(("sleep", "5"), "http://127.0.0.1:40123") == ["sleep", "5"]
    docker_names = rollout.rendered(
        render.children(
            validation.validate(yaml.safe_load(EXAMPLE.read_text())["spec"], "tiny")[0], "tiny", "default"
        ),  # type: ignore[arg-type]
        "tiny",
        local_names=False,
    )
    assert {r.workload.prefix for r in docker_names} == set(by)


def test_an_argument_rolls_only_its_pool_and_a_replica_count_rolls_nothing() -> None:
    before = {r.workload.name: r.workload.revision for r in _render()}

    def more_args(spec: dict[str, Any]) -> None:
        spec["prefill"]["extraArgs"].append("--max-num-seqs=32")

    def more_nodes(spec: dict[str, Any]) -> None:
        spec["decode"]["tilert"]["replicas"] = 3

    args = {r.workload.name: r.workload.revision for r in _render(more_args)}
    assert {n for n in before if before[n] != args[n]} == {"tiny-prefill"}
    assert {r.workload.name: r.workload.revision for r in _render(more_nodes)} == before
    assert _render() == _render(), "the render is not deterministic"
