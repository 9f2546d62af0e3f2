"""Rollouts that change the compatibility generation: the new generation comes up
beside the old one under slot b's names, the router lists both with their fingerprints, the old one
goes only once the new one is ready, and Progressing says where it stands. An image change stays an
ordinary rolling update. Against the strict API test server (pdc_apiserver), which refuses status
fields the CRD does not declare; the tests play the workload controllers and kubelet (pdc_harness)."""

from __future__ import annotations

import copy
import time
from typing import Any

import pdc_crd_validator as crd_validator
import pdc_harness as h
import pdc_helpers as helpers
import pytest
import yaml

from tilert_operator import constants, reconcile, rollout, validation
from tilert_operator import spec as specmod
from tilert_operator.render import commands, generations
from tilert_operator.render import router as router_render
from tilert_serve import defaults, layouts
from tilert_serve.compat import Compat
from tilert_serve.router import config as router_config

COMPONENTS = (constants.PREFILL, constants.TILERT, constants.NATIVE, constants.ROUTER)
#: A spec with every pool: prefill, TileRT and native decode.
SPEC = helpers.minimal(decode={"native": {"replicas": 1}})


def serving(apiserver: Any, name: str) -> None:
    """A PDCluster created, reconciled, every pool's pods rolled to its template and ready, reconciled."""
    h.run(apiserver, lambda api: api.create(h.pdc(helpers.cr(copy.deepcopy(SPEC), name))))
    h.reconcile_once(apiserver, name)
    for comp in COMPONENTS:
        h.roll(apiserver, name, comp)
    h.reconcile_once(apiserver, name)


def cond(apiserver: Any, name: str, type_: str) -> tuple[str, str, str]:
    c = h.condition(h.body(apiserver, name), type_)
    return c.get("status", ""), c.get("reason", ""), c.get("message", "")


def fingerprint(spec: dict[str, Any]) -> str:
    return generations.generation(specmod.parse(spec)).fingerprint


def router_cfg(apiserver: Any, name: str) -> router_config.RouterConfig:
    cm = apiserver.server.get("configmaps", "default", f"{name}-router")
    return router_config.RouterConfig.model_validate(yaml.safe_load(cm["data"]["config.yaml"]))


def printer_column(apiserver: Any, name: str, column: str) -> str:
    """What `kubectl get pdc` prints in `column`: its jsonPath from the CRD, evaluated on the object
    (the column's filter form, `.status.conditions[?(@.type=="X")].field`, the only one used here)."""
    crd = yaml.safe_load(helpers.ROOT.joinpath("crds", "pdcluster.yaml").read_text())
    cols = {c["name"]: c["jsonPath"] for c in crd["spec"]["versions"][0]["additionalPrinterColumns"]}
    path = cols[column]
    prefix, _, rest = path.partition('[?(@.type=="')
    assert prefix == ".status.conditions", path
    type_, _, field = rest.partition('")].')
    return str(h.condition(h.body(apiserver, name), type_).get(field, ""))


def workloads(apiserver: Any) -> set[str]:
    srv = apiserver.server
    return {
        f"{kind}/{o['metadata']['name']}"
        for kind, plural in (("Deployment", "deployments"), ("StatefulSet", "statefulsets"))
        for o in srv.objects(plural, "default")
    }


def roll_slot_b(apiserver: Any, name: str, *, ready: bool = True) -> None:
    h.roll_workload(apiserver, "Deployment", f"{name}-prefill-b", ready=ready, net=2)
    h.roll_workload(apiserver, "StatefulSet", f"{name}-tilert-b", ready=ready, net=2)
    h.roll_workload(apiserver, "Deployment", f"{name}-native-b", ready=ready, net=2)


def test_a_dtype_change_brings_the_new_generation_up_beside_the_old_and_removes_the_old_once_ready(
    apiserver: Any,
) -> None:
    serving(apiserver, "bg")
    old_fp = fingerprint(SPEC)
    assert cond(apiserver, "bg", "Ready")[:2] == ("True", "Serving")
    assert cond(apiserver, "bg", "Progressing")[:2] == ("False", "RolloutComplete")
    assert printer_column(apiserver, "bg", "Rollout") == "RolloutComplete"
    assert [g["fingerprint"] for g in h.body(apiserver, "bg")["status"]["generations"]] == [old_fp]

    # float32 changes the handoff layout: no prefill of one dtype can hand off to a node of the other.
    new_spec = helpers.deep_merge(SPEC, {"model": {"kvCacheDtype": "float32"}})
    new_fp = fingerprint(new_spec)
    assert new_fp != old_fp
    h.patch_spec(apiserver, "bg", {"model": {"kvCacheDtype": "float32"}})
    out = h.reconcile_once(apiserver, "bg")
    assert {"Deployment/bg-prefill-b", "StatefulSet/bg-tilert-b", "Deployment/bg-native-b"} <= set(
        out.applied
    )
    assert {"Service/bg-prefill-b", "Service/bg-tilert-b", "Service/bg-native-b"} <= set(out.applied)
    assert not out.deleted, "nothing of the old generation goes before the new one is ready"
    assert {
        "Deployment/bg-prefill",
        "StatefulSet/bg-tilert-decode",
        "Deployment/bg-native-decode",
    } <= workloads(apiserver)
    srv = apiserver.server
    new_sts = srv.get("statefulsets", "default", "bg-tilert-b")
    assert new_sts["metadata"]["labels"][constants.LABEL_GENERATION] == new_fp
    assert new_sts["spec"]["template"]["metadata"]["labels"][constants.LABEL_SLOT] == constants.SLOT_B
    assert "--kv-cache-dtype" in (argv := new_sts["spec"]["template"]["spec"]["containers"][0]["command"])
    assert argv[argv.index("--kv-cache-dtype") + 1] == "float32"
    # The old generation is left as it was: its StatefulSet still runs the old dtype.
    old_argv = srv.get("statefulsets", "default", "bg-tilert-decode")["spec"]["template"]["spec"][
        "containers"
    ][0]["command"]
    assert old_argv[old_argv.index("--kv-cache-dtype") + 1] == "bfloat16"
    # Each slot's Service selects its own slot's pods only while both run.
    assert srv.get("services", "default", "bg-prefill")["spec"]["selector"][constants.LABEL_SLOT] == "a"
    assert srv.get("services", "default", "bg-prefill-b")["spec"]["selector"][constants.LABEL_SLOT] == "b"

    # The router lists both generations, each endpoint with its generation's compat.
    cfg = router_cfg(apiserver, "bg")
    assert {(e.url.split("//")[1].split(".")[0], e.compat) for e in cfg.prefill} == {
        ("bg-prefill", old_fp),
        ("bg-prefill-b", new_fp),
    }
    assert {(e.url.split("//")[1].split(".")[0], e.compat) for e in cfg.native} == {
        ("bg-native-decode", old_fp),
        ("bg-native-b", new_fp),
    }
    assert {(d.service.split(".")[0], d.compat) for d in cfg.discoveries()} == {
        ("bg-tilert-decode", old_fp),
        ("bg-tilert-b", new_fp),
    }
    assert {n.compat for n in cfg.tilert} == {old_fp}, "only the old generation's nodes are ready yet"

    # Ready stays True: the old generation serves. Progressing says the new one is starting.
    status, reason, message = cond(apiserver, "bg", "Progressing")
    assert (status, reason) == ("True", "NewGenerationStarting")
    assert new_fp in message and old_fp in message and "prefill 0/1 ready" in message
    assert cond(apiserver, "bg", "Ready")[:2] == ("True", "Serving")
    assert printer_column(apiserver, "bg", "Rollout") == "NewGenerationStarting"
    gens = {g["fingerprint"]: g for g in h.body(apiserver, "bg")["status"]["generations"]}
    assert (gens[old_fp]["phase"], gens[new_fp]["phase"]) == ("Serving", "Starting")
    assert gens[new_fp]["slot"] == "b" and gens[new_fp]["pools"]["tilert"] == {"ready": 0, "desired": 1}

    # Not ready yet: the old generation stays, Progressing waits and counts.
    roll_slot_b(apiserver, "bg", ready=False)
    out = h.reconcile_once(apiserver, "bg")
    assert not out.deleted
    status, reason, message = cond(apiserver, "bg", "Progressing")
    assert (status, reason) == ("True", "WaitingForNewGeneration")
    assert "tilert-decode 0/1 ready" in message and "native-decode 0/1 ready" in message
    assert cond(apiserver, "bg", "Ready")[:2] == ("True", "Serving")
    assert printer_column(apiserver, "bg", "Rollout") == "WaitingForNewGeneration"

    # Ready: the old generation's workloads and Services go, and the router lists the new one alone.
    roll_slot_b(apiserver, "bg")
    out = h.reconcile_once(apiserver, "bg")
    assert {
        "Deployment/bg-prefill",
        "StatefulSet/bg-tilert-decode",
        "Deployment/bg-native-decode",
        "Service/bg-prefill",
        "Service/bg-tilert-decode",
        "Service/bg-native-decode",
    } <= set(out.deleted)
    assert cond(apiserver, "bg", "Progressing")[:2] == ("True", "DrainingOldGeneration")
    assert printer_column(apiserver, "bg", "Rollout") == "DrainingOldGeneration"
    cfg = router_cfg(apiserver, "bg")
    assert [(e.compat) for e in cfg.prefill] == [new_fp]
    assert [d.compat for d in cfg.discoveries()] == [new_fp]
    assert [n.compat for n in cfg.tilert] == [new_fp] and cfg.tilert[0].name == "bg-tilert-b-0"
    assert cond(apiserver, "bg", "Ready")[:2] == ("True", "Serving")

    # The old pods are gone (the garbage collector took them with their workloads): complete.
    h.reconcile_once(apiserver, "bg")
    assert cond(apiserver, "bg", "Progressing")[:2] == ("False", "RolloutComplete")
    assert [
        (g["fingerprint"], g["slot"], g["phase"]) for g in h.body(apiserver, "bg")["status"]["generations"]
    ] == [(new_fp, "b", "Serving")]
    assert workloads(apiserver) == {"Deployment/bg-prefill-b", "StatefulSet/bg-tilert-b", "Deployment/bg-native-b",
                                    "Deployment/bg-router"}  # fmt: skip
    # At rest: nothing more to write.
    again = h.reconcile_once(apiserver, "bg")
    assert again.writes == 0, (again.applied, again.deleted, again.events)
    # Progressing's transitions were Events; none of a rollout doing what it was asked is a Warning.
    events = [e for e in apiserver.server.objects("events", "default") if e["involvedObject"]["name"] == "bg"]
    reasons = [e["reason"] for e in events]
    for r in ("NewGenerationStarting", "WaitingForNewGeneration", "DrainingOldGeneration", "RolloutComplete"):
        assert r in reasons, reasons
    assert all(
        e["type"] == "Normal"
        for e in events
        if e["reason"] in reasons[reasons.index("NewGenerationStarting") :]
    )


def test_the_next_generation_change_moves_back_to_slot_a(apiserver: Any) -> None:
    serving(apiserver, "ab")
    h.patch_spec(apiserver, "ab", {"model": {"revision": "r2"}})
    h.reconcile_once(apiserver, "ab")
    roll_slot_b(apiserver, "ab")
    h.reconcile_once(apiserver, "ab")
    h.reconcile_once(apiserver, "ab")
    assert workloads(apiserver) >= {"Deployment/ab-prefill-b"} and "Deployment/ab-prefill" not in workloads(
        apiserver
    )

    h.patch_spec(apiserver, "ab", {"model": {"revision": "r3"}})
    out = h.reconcile_once(apiserver, "ab")
    assert "Deployment/ab-prefill" in out.applied and not out.deleted
    prefill = apiserver.server.get("deployments", "default", "ab-prefill")
    cmd = prefill["spec"]["template"]["spec"]["containers"][0]["command"]
    assert '"model_revision":"r3"' in cmd[cmd.index("--kv-transfer-config") + 1]
    sts = apiserver.server.get("statefulsets", "default", "ab-tilert-decode")
    argv = sts["spec"]["template"]["spec"]["containers"][0]["command"]
    assert argv[argv.index("--model-revision") + 1] == "r3"
    assert cond(apiserver, "ab", "Progressing")[1] == "NewGenerationStarting"


def test_an_image_change_is_an_ordinary_rolling_update(apiserver: Any) -> None:
    serving(apiserver, "img")
    before = fingerprint(SPEC)
    h.patch_spec(
        apiserver,
        "img",
        {"prefill": {"image": "example.com/vllm:2"}, "decode": {"tilert": {"image": "example.com/serve:2"}}},
    )
    out = h.reconcile_once(apiserver, "img")
    assert {"Deployment/img-prefill", "StatefulSet/img-tilert-decode"} <= set(out.applied)
    assert not any(k.endswith("-b") for k in out.applied), out.applied
    assert not out.deleted
    assert cond(apiserver, "img", "Progressing")[:2] == ("False", "RolloutComplete")
    # The pods roll in place (Ready: RollingOut, as any template change), in the same generation.
    assert cond(apiserver, "img", "Ready")[:2] == ("False", "RollingOut")
    gens = h.body(apiserver, "img")["status"]["generations"]
    assert [(g["fingerprint"], g["slot"]) for g in gens] == [(before, "a")]
    assert [e.compat for e in router_cfg(apiserver, "img").prefill] == [before]


def test_a_spec_change_during_a_rollout_replaces_the_generation_coming_up(apiserver: Any) -> None:
    serving(apiserver, "mid")
    first = fingerprint(SPEC)
    h.patch_spec(apiserver, "mid", {"model": {"revision": "r2"}})
    h.reconcile_once(apiserver, "mid")
    # Another change before r2 is ready: r3 takes slot b; the generation that served keeps serving.
    h.patch_spec(apiserver, "mid", {"model": {"revision": "r3"}})
    out = h.reconcile_once(apiserver, "mid")
    assert "Deployment/mid-prefill-b" in out.applied and not out.deleted
    r3 = fingerprint(helpers.deep_merge(SPEC, {"model": {"revision": "r3"}}))
    assert {e.compat for e in router_cfg(apiserver, "mid").prefill} == {first, r3}
    # Back to the spec that serves: slot b goes at once, no rollout is left.
    h.patch_spec(apiserver, "mid", {"model": {"revision": ""}})
    out = h.reconcile_once(apiserver, "mid")
    assert "Deployment/mid-prefill-b" in out.deleted
    assert [e.compat for e in router_cfg(apiserver, "mid").prefill] == [first]


def test_recreate_removes_the_old_generation_as_the_new_one_starts(apiserver: Any) -> None:
    serving(apiserver, "rc")
    h.patch_spec(
        apiserver, "rc", {"model": {"revision": "r2"}, "generationRollout": {"strategy": "Recreate"}}
    )
    out = h.reconcile_once(apiserver, "rc")
    assert "Deployment/rc-prefill-b" in out.applied and "Deployment/rc-prefill" in out.deleted
    assert cond(apiserver, "rc", "Progressing")[1] == "NewGenerationStarting"


def test_a_stuck_new_generation_is_reported_stalled_and_the_old_one_keeps_serving(apiserver: Any) -> None:
    serving(apiserver, "st")
    h.patch_spec(
        apiserver, "st", {"model": {"revision": "r2"}, "generationRollout": {"progressDeadlineSeconds": 60}}
    )
    h.reconcile_once(apiserver, "st")
    roll_slot_b(apiserver, "st", ready=False)
    h.reconcile_once(apiserver, "st")
    assert cond(apiserver, "st", "Progressing")[1] == "WaitingForNewGeneration"
    out = h.run(
        apiserver, lambda api: reconcile.reconcile(api, h.body(apiserver, "st"), now=time.time() + 120)
    )
    assert not out.deleted
    status, reason, message = cond(apiserver, "st", "Progressing")
    assert (status, reason) == (
        "False",
        "RolloutStalled",
    ) and "kubectl get pods -l pd.tilert.ai/generation=" in message
    assert cond(apiserver, "st", "Ready")[:2] == ("True", "Serving")
    assert printer_column(apiserver, "st", "Rollout") == "RolloutStalled"
    warnings = [
        e for e in apiserver.server.objects("events", "default")
        if e["involvedObject"]["name"] == "st" and e["reason"] == "RolloutStalled"
    ]  # fmt: skip
    assert warnings and {e["type"] for e in warnings} == {"Warning"}


# ---- pure parts --------------------------------------------------------------------------------


@pytest.mark.parametrize(("prefill_mtp", "node_mtp"), [(True, True), (True, False), (False, False)])
def test_the_rendered_node_computes_the_operators_layout(prefill_mtp: bool, node_mtp: bool) -> None:
    """The node's layout comes from its rendered flags and the checkpoint's config.json (which has an
    MTP layer): it follows the prefill's MTP setting (what the prefill hands over), not the node's own."""
    import argparse

    from tilert_serve.decode import cli as node_cli
    from tilert_serve.tinymodel.generate import TinySpec, model_config

    spec = specmod.parse(
        helpers.minimal(prefill={"mtp": {"enabled": prefill_mtp}}, decode={"tilert": {"mtp": node_mtp}})
    )
    argv = commands.commands(spec)[constants.TILERT].argv
    assert argv[:2] == ["tilert-pd", "decode-node"]
    parser = argparse.ArgumentParser()
    node_cli.add_arguments(parser)
    node = node_cli._layout(parser.parse_args(argv[2:]), model_config(TinySpec(), 0, 1))
    assert node.num_mtp_layers == int(prefill_mtp)
    assert generations.layout_fingerprint(spec) == node.fingerprint


def test_the_operator_computes_the_layout_the_tiny_node_and_prefill_compute() -> None:
    """The node's layout for the tiny checkpoint (from its config.json) and the prefill's (from its
    registered caches, MTP on) are what the operator fingerprints; with MTP off the prefill's has no MTP
    layer, and so a new generation."""
    from tilert_serve.tinymodel.generate import TinySpec, model_config

    assert generations.TINY_MAIN_LAYERS == TinySpec().layers
    for dtype in ("bfloat16", "float32"):
        spec = specmod.parse(helpers.minimal(model={"kvCacheDtype": dtype}))
        node = layouts.for_hf_config("mla", model_config(TinySpec(), 0, 1), dtype)
        assert generations.layout_fingerprint(spec) == node.fingerprint
        g = generations.generation(spec)
        assert g.compat == Compat(model="m", revision="", layout=node.fingerprint).fingerprint
    off = specmod.parse(
        helpers.minimal(prefill={"mtp": {"enabled": False}}, decode={"tilert": {"mtp": False}})
    )
    prefill_view = layouts.get("mla", "bfloat16", num_layers=TinySpec().layers, num_mtp_layers=0)
    assert generations.layout_fingerprint(off) == prefill_view.fingerprint
    # The DSA models' layout is fixed; an mla checkpoint from a volume is not readable by the operator.
    glm = specmod.parse(helpers.example("glm5-b200-rdma")["spec"])
    assert generations.layout_fingerprint(glm) == layouts.get("glm5", "fp8_ds_mla").fingerprint
    vol = specmod.parse(helpers.minimal(model={"weights": {"tiny": False, "volume": {"emptyDir": {}}}}))
    assert generations.generation(vol).compat is None
    assert (
        generations.generation(vol).fingerprint
        != generations.generation(
            specmod.parse(
                helpers.minimal(
                    model={"weights": {"tiny": False, "volume": {"emptyDir": {}}}, "revision": "x"}
                )
            )
        ).fingerprint
    )


@pytest.mark.parametrize(
    ("patch", "same"),
    [
        ({"prefill": {"image": "x:2"}}, True),
        ({"prefill": {"replicas": 3}}, True),
        ({"decode": {"tilert": {"slots": 4}}}, True),
        ({"router": {"replicas": 2}}, True),
        ({"model": {"revision": "2026-12-01"}}, False),
        ({"model": {"kvCacheDtype": "float32"}}, False),
        ({"prefill": {"mtp": {"enabled": False}}, "decode": {"tilert": {"mtp": False}}}, False),
    ],
)
def test_what_changes_the_generation(patch: dict[str, Any], same: bool) -> None:
    assert (fingerprint(helpers.deep_merge(SPEC, patch)) == fingerprint(SPEC)) is same


def test_the_revision_reaches_nodes_and_prefills_only_when_set() -> None:
    plain = specmod.parse(SPEC)
    paths = commands.Paths.pod(plain)
    assert "--model-revision" not in commands.tilert_decode(plain, paths).argv
    assert "model_revision" not in str(commands.prefill_kv_transfer_config(plain, paths))
    rev = specmod.parse(helpers.deep_merge(SPEC, {"model": {"revision": "abc"}}))
    argv = commands.tilert_decode(rev, paths).argv
    assert argv[argv.index("--model-revision") + 1] == "abc"
    cfg: Any = commands.prefill_kv_transfer_config(rev, paths)
    assert (
        cfg["kv_connector_extra_config"]["connectors"][0]["kv_connector_extra_config"]["model_revision"]
        == "abc"
    )


def test_a_steady_cluster_renders_todays_names_with_its_generation() -> None:
    spec = specmod.parse(SPEC)
    cfg = router_render.pod_config(spec, "t", "ns", [])
    fp = fingerprint(SPEC)
    assert [(e.url, e.compat) for e in cfg.prefill] == [(f"http://t-prefill.ns.svc:{defaults.VLLM_PORT}", fp)]
    assert [(d.service, d.compat) for d in cfg.discoveries()] == [("t-tilert-decode.ns.svc", fp)]


def test_choose_keeps_the_generation_that_served() -> None:
    spec = specmod.parse(SPEC)
    fp = fingerprint(SPEC)
    old = specmod.parse(helpers.deep_merge(SPEC, {"model": {"revision": "old"}}))

    def slot(
        name: str, gen: str | None, recorded: specmod.PDClusterSpec | None, created: str
    ) -> rollout.Slot:
        return rollout.Slot(name, gen, recorded, {constants.PREFILL: {}}, created)

    assert rollout.choose(spec, fp, {}) == rollout.Choice("a")
    assert rollout.choose(spec, fp, {"b": slot("b", fp, spec, "1")}) == rollout.Choice("b")
    # Workloads from before generations: the spec's generation, rolled in place.
    assert rollout.choose(spec, fp, {"a": slot("a", None, None, "1")}) == rollout.Choice("a")
    assert rollout.choose(spec, fp, {"a": slot("a", "0ld", old, "1")}) == rollout.Choice(
        "b", ("a", old), starting=True
    )
    two = {"a": slot("a", "0ld", old, "1"), "b": slot("b", fp, spec, "2")}
    assert rollout.choose(spec, fp, two) == rollout.Choice("b", ("a", old))
    # Neither is the spec's: the older keeps serving, the newer makes room.
    other = {"a": slot("a", "0ld", old, "2"), "b": slot("b", "mid", old, "1")}
    assert rollout.choose(spec, fp, other) == rollout.Choice("a", ("b", old), starting=True)
    recreate = specmod.parse(helpers.deep_merge(SPEC, {"generationRollout": {"strategy": "Recreate"}}))
    assert rollout.choose(recreate, fp, {"a": slot("a", "0ld", old, "1")}) == rollout.Choice(
        "b", None, starting=True
    )


@pytest.mark.parametrize(
    ("patch", "field", "words"),
    [
        (
            {
                "prefill": {"gpus": 1, "replicas": 2},
                "decode": {"tilert": {"gpus": 8, "replicas": 1}},
                "generationRollout": {"maxSurgeGpus": 8},
            },
            "spec.generationRollout.maxSurgeGpus",
            ["starts 10 GPUs", "raise it to 10", "strategy: Recreate"],
        ),
        (
            {"generationRollout": {"strategy": "Recreate", "maxSurgeGpus": 4}},
            "spec.generationRollout.maxSurgeGpus",
            ["strategy Recreate adds none", "remove maxSurgeGpus"],
        ),
        ({"model": {"revision": "has space"}}, "spec.model.revision", ["should match pattern"]),
        (
            {"generationRollout": {"strategy": "Canary"}},
            "spec.generationRollout.strategy",
            ["BlueGreen", "Recreate"],
        ),
        (
            {"generationRollout": {"progressDeadlineSeconds": 5}},
            "spec.generationRollout.progressDeadlineSeconds",
            ["60"],
        ),
    ],
)
def test_rollout_fields_are_validated_with_clear_errors(
    patch: dict[str, Any], field: str, words: list[str]
) -> None:
    _, problems = validation.validate(helpers.minimal(**patch), "t")
    found = [p for p in problems if p.field == field]
    assert found, problems
    for w in words:
        assert w in found[0].message, found[0].message


def test_a_bound_the_surge_fits_is_accepted() -> None:
    ok = helpers.minimal(prefill={"gpus": 1, "replicas": 2}, decode={"tilert": {"gpus": 8, "replicas": 1}},
                         generationRollout={"maxSurgeGpus": 10})  # fmt: skip
    spec, problems = validation.validate(ok, "t")
    assert spec is not None and not [p for p in problems if "generationRollout" in p.field], problems


@pytest.mark.parametrize(
    ("patch", "words"),
    [
        (
            {"generationRollout": {"strategy": "Recreate", "maxSurgeGpus": 4}},
            "maxSurgeGpus bounds a BlueGreen",
        ),
        ({"generationRollout": {"strategy": "Canary"}}, "strategy"),
        ({"model": {"revision": "has space"}}, "revision"),
        ({"generationRollout": {"progressDeadlineSeconds": 5}}, "progressDeadlineSeconds"),
    ],
)
def test_the_crd_refuses_what_it_can_express_of_the_rollout_fields(patch: dict[str, Any], words: str) -> None:
    """Without the webhook, kubectl apply is refused for these as the operator refuses them."""
    _, errors = crd_validator.validate(helpers.cr(helpers.minimal(**patch)))
    assert any(words in e for e in errors), errors
    ok = {"model": {"revision": "r-2026.12_01:a/b+c"}, "generationRollout": {"maxSurgeGpus": 0}}
    obj, errors = crd_validator.validate(helpers.cr(helpers.minimal(**ok)))
    assert not errors, errors
    assert obj["spec"]["generationRollout"] == {
        "strategy": "BlueGreen",
        "maxSurgeGpus": 0,
        "progressDeadlineSeconds": 3600,
    }


@pytest.fixture()
def fast_operator(monkeypatch: pytest.MonkeyPatch) -> None:
    # The resync far away: the operator must follow the pods' and workloads' watch events.
    monkeypatch.setenv("TILERT_PD_RESYNC_S", "300")
    monkeypatch.setenv("TILERT_PD_METRICS_PORT", "0")
    monkeypatch.setenv("TILERT_PD_WATCH_TIMEOUT_S", "10")


def progressing_reason(apiserver: Any, name: str) -> str:
    obj = apiserver.server.get("pdclusters", "default", name)
    return str(h.condition(obj, "Progressing").get("reason", "")) if obj else ""


@pytest.mark.usefixtures("fast_operator")
def test_the_running_operator_carries_a_generation_change_through(apiserver: Any) -> None:
    """The operator as deployed (kopf, watches): a dtype change moves through its phases as the new
    generation's pods become ready, driven by watch events alone."""
    from kopf.testing import KopfRunner

    srv = apiserver.server
    with KopfRunner(h.ARGS, timeout=90) as runner:
        h.run(apiserver, lambda api: api.create(h.pdc(helpers.cr(copy.deepcopy(SPEC), "run"))))
        h.wait_for("children", lambda: srv.get("statefulsets", "default", "run-tilert-decode"))
        for comp in COMPONENTS:
            h.roll(apiserver, "run", comp)
        h.wait_for("Serving", lambda: cond(apiserver, "run", "Ready")[:2] == ("True", "Serving"))
        h.patch_spec(apiserver, "run", {"model": {"kvCacheDtype": "float32"}})
        h.wait_for(
            "the new generation's workloads", lambda: srv.get("statefulsets", "default", "run-tilert-b")
        )
        h.wait_for(
            "waiting for it",
            lambda: (
                progressing_reason(apiserver, "run") in ("NewGenerationStarting", "WaitingForNewGeneration")
            ),
        )
        assert srv.get("statefulsets", "default", "run-tilert-decode") is not None
        assert cond(apiserver, "run", "Ready")[0] == "True"
        roll_slot_b(apiserver, "run")
        h.wait_for(
            "the old generation removed", lambda: srv.get("deployments", "default", "run-prefill") is None
        )
        h.wait_for("RolloutComplete", lambda: progressing_reason(apiserver, "run") == "RolloutComplete")
        assert {e.compat for e in router_cfg(apiserver, "run").prefill} == {fingerprint(
            helpers.deep_merge(SPEC, {"model": {"kvCacheDtype": "float32"}})
        )}  # fmt: skip
        assert cond(apiserver, "run", "Ready")[:2] == ("True", "Serving")
    assert runner.exception is None


def test_the_new_generation_is_ready_only_with_every_pool_ready_and_its_nodes_handoff_ready() -> None:
    from tilert_operator.observe import PoolState

    pools = {
        constants.PREFILL: PoolState(2, 2),
        constants.TILERT: PoolState(2, 2),
        constants.NATIVE: PoolState(0, 0),
        constants.ROUTER: PoolState(0, 1),  # the router is shared: not the generation's to wait for
    }
    assert rollout.readiness(pools, None).ready, "without node reports, ready pools are enough"
    ok = [("n-0", "HandoffOK"), ("n-1", "HandoffOK")]
    assert rollout.readiness(pools, ok).ready
    half = rollout.readiness(pools, [("n-0", "HandoffOK"), ("n-1", "NoHandoffYet")])
    assert not half.ready and half.waiting == ["TileRT handoff 1/2 nodes HandoffReady"]
    rolling = pools | {
        constants.PREFILL: PoolState(1, 2, 2, "Deployment p: stuck (ProgressDeadlineExceeded)")
    }
    stuck = rollout.readiness(rolling, ok)
    assert not stuck.ready and stuck.stuck is not None and "prefill 1/2 ready" in stuck.waiting
