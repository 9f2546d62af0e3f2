"""Production pod hygiene from the spec (render/hygiene.py, render/disruption.py): PodDisruptionBudgets,
topology spread, rollout strategies fit for whole-node GPU pools, preStop and grace periods matching the
processes' drain, requests and a restricted securityContext; no BestEffort pod in the examples."""

from __future__ import annotations

from typing import Any

import kubernetes_validate
import pdc_crd_validator as crd_validator
import pdc_helpers as helpers
import pytest
import yaml

from tilert_operator import cli_render, constants, render
from tilert_operator import spec as specmod
from tilert_operator.render import commands

ALL_POOLS = {"decode": {"tilert": {"replicas": 2}, "native": {"replicas": 1}}}


def _render(spec: dict[str, Any]) -> list[dict[str, Any]]:
    return render.children(specmod.parse(spec), "t", "ns")


def _kind(objs: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {o["metadata"]["name"]: o for o in objs if o["kind"] == kind}


def _workloads(objs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {o["metadata"]["name"]: o for o in objs if o["kind"] in ("Deployment", "StatefulSet")}


def _arg(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_every_pool_gets_a_pdb_and_none_for_an_empty_or_disabled_pool() -> None:
    objs = _render(helpers.minimal(**ALL_POOLS))
    pdbs = _kind(objs, "PodDisruptionBudget")
    assert sorted(pdbs) == ["t-native-decode", "t-prefill", "t-router", "t-tilert-decode"]
    for name, pdb in pdbs.items():
        kubernetes_validate.validate(pdb, helpers.K8S_VERSION, strict=True)
        workload = _workloads(objs)[name]
        assert pdb["spec"]["selector"] == workload["spec"]["selector"]
        assert pdb["spec"]["maxUnavailable"] == 1
        # A pool's budget spans both slots of a rollout: the workload's generation and slot are not its.
        per_generation = (constants.LABEL_GENERATION, constants.LABEL_SLOT)
        assert pdb["metadata"]["labels"] == {
            k: v for k, v in workload["metadata"]["labels"].items() if k not in per_generation
        }
    none = _render(
        helpers.minimal(
            decode={"tilert": {"replicas": 1}, "native": {"replicas": 0}},
            router={"disruptionBudget": {"enabled": False}},
            prefill={"disruptionBudget": {"maxUnavailable": 0}},
        )
    )
    pdbs = _kind(none, "PodDisruptionBudget")
    assert sorted(pdbs) == ["t-prefill", "t-tilert-decode"]
    assert pdbs["t-prefill"]["spec"]["maxUnavailable"] == 0


def test_topology_spread_prefers_hosts_and_zones_and_is_configurable() -> None:
    objs = _render(helpers.minimal(**ALL_POOLS))
    for name, w in _workloads(objs).items():
        spread = w["spec"]["template"]["spec"]["topologySpreadConstraints"]
        assert [c["topologyKey"] for c in spread] == ["kubernetes.io/hostname", "topology.kubernetes.io/zone"]
        assert all(c["whenUnsatisfiable"] == "ScheduleAnyway" and c["maxSkew"] == 1 for c in spread), name
        assert all(c["labelSelector"]["matchLabels"] == w["spec"]["selector"]["matchLabels"] for c in spread)
    strict = _render(
        helpers.minimal(
            decode={
                "tilert": {
                    "topologySpread": {
                        "topologyKeys": ["kubernetes.io/hostname"],
                        "whenUnsatisfiable": "DoNotSchedule",
                        "maxSkew": 2,
                    }
                }
            },
            router={"topologySpread": {"topologyKeys": []}},
        )
    )
    ws = _workloads(strict)
    assert ws["t-tilert-decode"]["spec"]["template"]["spec"]["topologySpreadConstraints"] == [
        {
            "maxSkew": 2,
            "topologyKey": "kubernetes.io/hostname",
            "whenUnsatisfiable": "DoNotSchedule",
            "labelSelector": {
                "matchLabels": {constants.LABEL_CLUSTER: "t", constants.LABEL_COMPONENT: constants.TILERT}
            },
        }
    ]
    assert "topologySpreadConstraints" not in ws["t-router"]["spec"]["template"]["spec"]


def test_gpu_pools_never_surge_and_cpu_pools_surge_first() -> None:
    glm = specmod.parse(helpers.example("glm5-b200-rdma")["spec"])
    ws = _workloads(render.children(glm, "g", "ns"))
    for name in ("g-prefill", "g-native-decode"):
        assert ws[name]["spec"]["strategy"] == {
            "type": "RollingUpdate",
            "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1},
        }, name
    assert ws["g-router"]["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}
    assert ws["g-tilert-decode"]["spec"]["updateStrategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"partition": 0},
    }
    tiny = _workloads(_render(helpers.minimal(**ALL_POOLS)))
    assert tiny["t-prefill"]["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}


@pytest.mark.parametrize(
    ("rollout", "gpus", "want"),
    [
        ({"maxSurge": 2}, 8, (2, 1)),
        ({"maxUnavailable": 0}, 8, (1, 0)),  # never both 0: the rollout could not progress
        ({"maxSurge": 0}, 0, (0, 1)),
        ({"maxSurge": 3, "maxUnavailable": 2}, 8, (3, 2)),
    ],
)
def test_a_rollout_value_set_alone_gets_a_partner_that_lets_it_progress(
    rollout: dict[str, int], gpus: int, want: tuple[int, int]
) -> None:
    ws = _workloads(
        _render(
            helpers.minimal(prefill={"gpus": gpus, "tensorParallelSize": max(gpus, 1), "rollout": rollout})
        )
    )
    got = ws["t-prefill"]["spec"]["strategy"]["rollingUpdate"]
    assert (got["maxSurge"], got["maxUnavailable"]) == want


def test_statefulset_partition_and_its_opt_in_max_unavailable() -> None:
    ws = _workloads(
        _render(
            helpers.minimal(
                decode={"tilert": {"replicas": 4, "rollout": {"partition": 3, "maxUnavailable": 2}}}
            )
        )
    )
    assert ws["t-tilert-decode"]["spec"]["updateStrategy"]["rollingUpdate"] == {
        "partition": 3,
        "maxUnavailable": 2,
    }


def test_rollout_cannot_set_both_to_zero() -> None:
    _, errors = crd_validator.validate(
        helpers.cr(helpers.minimal(prefill={"rollout": {"maxSurge": 0, "maxUnavailable": 0}}))
    )
    assert any("cannot both be 0" in e for e in errors), errors


def test_prestop_grace_period_and_the_drain_agree() -> None:
    spec = helpers.minimal(**ALL_POOLS)
    ws = _workloads(_render(spec))
    grace = {name: w["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] for name, w in ws.items()}
    assert grace == {"t-prefill": 60, "t-tilert-decode": 120, "t-native-decode": 120, "t-router": 120}
    for name in ("t-tilert-decode", "t-router"):
        c = ws[name]["spec"]["template"]["spec"]["containers"][0]
        assert c["lifecycle"] == {"preStop": {"exec": {"command": ["sleep", "5"]}}}
    # vLLM pools wait in preStop until vLLM and the connector are idle: at least the preStop sleep, at
    # most the grace period less the exit margin (after which SIGTERM's drain has nothing left to wait for).
    for name, timeout in (("t-prefill", "55"), ("t-native-decode", "115")):
        hook = ws[name]["spec"]["template"]["spec"]["containers"][0]["lifecycle"]["preStop"]["exec"][
            "command"
        ]
        assert hook[:2] == ["tilert-pd", "wait-idle"], hook
        assert (_arg(hook, "--min-wait"), _arg(hook, "--timeout")) == ("5", timeout)
        assert _arg(hook, "--url") == "http://127.0.0.1:8100"
    cmds = commands.commands(specmod.parse(spec))
    # The processes drain within what the kubelet leaves them: grace - preStop sleep - 5 s to exit.
    assert _arg(cmds[constants.ROUTER].argv, "--drain-timeout") == "110"
    assert _arg(cmds[constants.TILERT].argv, "--drain-timeout") == "110"
    # vLLM's own drain (its default, 0, aborts what is in flight on SIGTERM).
    assert _arg(cmds[constants.PREFILL].argv, "--shutdown-timeout") == "50"
    assert _arg(cmds[constants.NATIVE].argv, "--shutdown-timeout") == "110"
    custom = helpers.minimal(
        decode={"tilert": {"termination": {"gracePeriodSeconds": 600, "preStopSleepSeconds": 0}}},
        prefill={"termination": {"preStopSleepSeconds": 10}},
    )
    ws = _workloads(_render(custom))
    assert "lifecycle" not in ws["t-tilert-decode"]["spec"]["template"]["spec"]["containers"][0]
    assert ws["t-tilert-decode"]["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == 600
    # A prefill's termination set in part keeps the prefill's own grace default (as the CRD defaults it).
    assert ws["t-prefill"]["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == 60
    assert _arg(commands.commands(specmod.parse(custom))[constants.TILERT].argv, "--drain-timeout") == "595"


def test_security_context_is_restricted_and_mergeable() -> None:
    uid = constants.RUN_AS_USER
    nonroot_pod = {
        "seccompProfile": {"type": "RuntimeDefault"},
        "runAsNonRoot": True,
        "runAsUser": uid,
        "runAsGroup": uid,
        "fsGroup": uid,
    }
    ws = _workloads(_render(helpers.minimal(**ALL_POOLS)))
    for name, w in ws.items():
        pod = w["spec"]["template"]["spec"]
        assert pod["securityContext"] == nonroot_pod, name
        c = pod["containers"][0]
        assert c["securityContext"] == {
            "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"]},
        }, name
    # Over RDMA the data plane runs as root with IPC_LOCK (the memlock limit); the router does not.
    rdma = _workloads(render.children(specmod.parse(helpers.example("glm5-b200-rdma")["spec"]), "g", "ns"))
    for name in ("g-prefill", "g-tilert-decode"):
        pod = rdma[name]["spec"]["template"]["spec"]
        assert pod["securityContext"] == {"seccompProfile": {"type": "RuntimeDefault"}, "runAsUser": 0}, name
        assert pod["containers"][0]["securityContext"]["capabilities"] == {
            "drop": ["ALL"],
            "add": ["IPC_LOCK"],
        }
    assert rdma["g-router"]["spec"]["template"]["spec"]["securityContext"] == nonroot_pod
    # The spec's fields merge over the rendered ones.
    custom = _workloads(
        _render(
            helpers.minimal(
                router={
                    "securityContext": {"readOnlyRootFilesystem": True},
                    "podSecurityContext": {"runAsUser": 1000, "fsGroup": 2000},
                }
            )
        )
    )
    pod = custom["t-router"]["spec"]["template"]["spec"]
    assert pod["securityContext"] == nonroot_pod | {"runAsUser": 1000, "fsGroup": 2000}
    assert pod["containers"][0]["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
        "readOnlyRootFilesystem": True,
    }
    for w in [*custom.values(), *rdma.values()]:
        kubernetes_validate.validate(w, helpers.K8S_VERSION, strict=True)


def test_the_router_has_requests_by_default() -> None:
    router = _workloads(_render(helpers.minimal()))["t-router"]
    assert router["spec"]["template"]["spec"]["containers"][0]["resources"] == {
        "requests": {"cpu": "250m", "memory": "256Mi"},
        "limits": {"memory": "1Gi"},
    }


@pytest.mark.parametrize("path", helpers.EXAMPLES, ids=lambda p: p.stem)
def test_examples_have_no_best_effort_pod(path: Any) -> None:
    """Every pod's container requests CPU and memory (Burstable or Guaranteed): nothing of the stack is
    the first evicted under node pressure."""
    doc = yaml.safe_load(path.read_text())
    for obj in cli_render.render_document(doc, None, with_secret=False):
        if obj["kind"] not in ("Deployment", "StatefulSet"):
            continue
        for c in obj["spec"]["template"]["spec"]["containers"]:
            requests = (c.get("resources") or {}).get("requests") or {}
            assert {"cpu", "memory"} <= set(requests), (
                f"{path.name}: {obj['metadata']['name']}/{c['name']}: {requests}"
            )


def test_every_container_meets_the_restricted_pod_security_standard() -> None:
    """Init containers too (the tiny model's generator): the restricted profile checks every container
    of the pod, so one without the securityContext makes the namespace refuse the pod."""
    for spec in (helpers.minimal(**ALL_POOLS), helpers.example("tiny-cpu")["spec"]):
        for name, w in _workloads(_render(spec)).items():
            pod = w["spec"]["template"]["spec"]
            assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"][
                "seccompProfile"
            ] == {"type": "RuntimeDefault"}
            containers = [*pod.get("initContainers", []), *pod["containers"]]
            assert len(containers) > 1 or name == "t-router", name
            for c in containers:
                sc = c.get("securityContext") or {}
                assert sc.get("allowPrivilegeEscalation") is False and sc.get("capabilities", {}).get(
                    "drop"
                ) == ["ALL"], (name, c["name"])
    # The pool's own securityContext reaches the init container as it reaches the main one.
    w = _workloads(_render(helpers.minimal(prefill={"securityContext": {"readOnlyRootFilesystem": True}})))[
        "t-prefill"
    ]
    [init] = w["spec"]["template"]["spec"]["initContainers"]
    assert init["securityContext"]["readOnlyRootFilesystem"] is True
