"""Renderers: every example and a matrix of specs render to objects that pass kubernetes-validate
--strict; commands follow the components' contracts; RDMA, hostNetwork and overrides are wired."""

from __future__ import annotations

import itertools
import json
from typing import Any

import kubernetes_validate
import pdc_harness as h
import pdc_helpers as helpers
import pytest
import yaml

from tilert_operator import cli_render, constants, observe, render, validation
from tilert_operator import spec as specmod
from tilert_operator.render import commands, prefill
from tilert_serve import defaults
from tilert_serve.router import config as router_config
from tilert_serve.router import discovery


def _render(spec: dict[str, Any], name: str = "t", ns: str = "ns") -> list[dict[str, Any]]:
    return render.all_manifests(specmod.parse(spec), name, ns, secret_token="s3cret")


def _by(objs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    return next(o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name)


def _strict(objs: list[dict[str, Any]]) -> None:
    for obj in objs:
        if obj["kind"] == "MultiNetworkPolicy":
            # A custom resource kubernetes-validate has no schema for; its spec is a NetworkPolicySpec.
            assert obj["apiVersion"] == constants.MULTI_NETWORK_POLICY_API_VERSION
            obj = {**obj, "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy"}
        kubernetes_validate.validate(obj, helpers.K8S_VERSION, strict=True)


@pytest.mark.parametrize("path", helpers.EXAMPLES, ids=lambda p: p.stem)
def test_examples_render_valid_manifests(path: Any) -> None:
    doc = yaml.safe_load(path.read_text())
    objs = cli_render.render_document(doc, None, with_secret=True)
    _strict(objs)
    ns = doc["metadata"].get("namespace", "default")
    assert all(o["metadata"]["namespace"] == ns for o in objs)
    assert render.all_manifests(
        specmod.parse(doc["spec"]), "x", "y", secret_token="a"
    ) == render.all_manifests(specmod.parse(doc["spec"]), "x", "y", secret_token="a"), (
        "rendering must be deterministic"
    )


MATRIX = list(itertools.product(
    ["mooncake", "nixl"], ["tcp", "rdma"], [False, True],  # engine, protocol, hostNetwork
    [(1, 0), (0, 1), (2, 1)],  # tilert, native replicas
    ["tiny", "volume"],
))  # fmt: skip


@pytest.mark.parametrize(("engine", "protocol", "host_net", "pools", "weights"), MATRIX)
def test_matrix_renders_valid_manifests(
    engine: str, protocol: str, host_net: bool, pools: tuple[int, int], weights: str
) -> None:
    rdma: dict[str, Any] = {"hostNetwork": host_net}
    if protocol == "rdma":
        rdma["resources"] = {"rdma/ib": 1}
        if not host_net:
            rdma["networks"] = ["rdma-net"]
    w = (
        {"tiny": True}
        if weights == "tiny"
        else {"tiny": False, "volume": {"persistentVolumeClaim": {"claimName": "c"}}}
    )
    spec = helpers.minimal(
        model={"weights": w},
        transfer={"engine": engine, "protocol": protocol, "rdma": rdma},
        decode={"tilert": {"replicas": pools[0]}, "native": {"replicas": pools[1]}},
    )
    parsed, problems = validation.validate(spec, "t")
    assert problems == []
    objs = _render(spec)
    _strict(objs)
    kinds = sorted(f"{o['kind']}/{o['metadata']['name']}" for o in objs)
    assert ("StatefulSet/t-tilert-decode" in kinds) == bool(pools[0])
    assert ("Deployment/t-native-decode" in kinds) == bool(pools[1])
    assert any(k.startswith("NetworkPolicy/") for k in kinds) != host_net
    # MultiNetworkPolicies exactly when the spec names Multus networks.
    assert any(k.startswith("MultiNetworkPolicy/") for k in kinds) == bool(rdma.get("networks"))
    prefill = _by(objs, "Deployment", "t-prefill")["spec"]["template"]
    c = prefill["spec"]["containers"][0]
    if protocol == "rdma":
        assert c["securityContext"]["capabilities"]["add"] == ["IPC_LOCK"]
        assert c["resources"]["limits"]["rdma/ib"] == 1
    else:
        assert "add" not in c["securityContext"]["capabilities"]
    assert c["securityContext"]["capabilities"]["drop"] == ["ALL"]
    if host_net:
        assert prefill["spec"]["hostNetwork"] and prefill["spec"]["dnsPolicy"] == "ClusterFirstWithHostNet"
        assert prefill["spec"]["affinity"]["podAntiAffinity"]
    assert bool(prefill["spec"].get("initContainers")) == (weights == "tiny")
    assert parsed == specmod.parse(spec), "renderers must not change the spec"


def _arg(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_prefill_command_follows_the_connector_contract() -> None:
    spec = specmod.parse(helpers.example("glm5-b200-rdma")["spec"])
    argv = commands.commands(spec)[constants.PREFILL].argv
    assert argv[:3] == ["vllm", "serve", "/models/GLM-5-FP8"]
    assert _arg(argv, "--port") == str(defaults.VLLM_PORT)
    assert _arg(argv, "--kv-cache-dtype") == "fp8_ds_mla"
    assert json.loads(_arg(argv, "--speculative-config")) == {"method": "mtp", "num_speculative_tokens": 1}
    kv = json.loads(_arg(argv, "--kv-transfer-config"))
    assert kv["kv_connector"] == "MultiConnector" and kv["kv_role"] == "kv_producer"
    tilert, native = kv["kv_connector_extra_config"]["connectors"]
    assert tilert == {
        "kv_connector": "TileRTConnector",
        "kv_connector_module_path": "tilert_serve.pd_vllm.prefill_connector",
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {
            "tilert_model": "glm5", "tilert_max_seq_len": 202752, "tilert_transfer": "mooncake",
            "tilert_protocol": "rdma", "tilert_secret_path": defaults.SECRET_PATH,
            # The prefill finds its own address on the handoff's Multus network, as the node does.
            "tilert_data_plane_networks": ["serving/rdma-net"],
            # Part of the compatibility fingerprint the prefill advertises (spec.model.revision).
            "model_revision": "glm-5-fp8-2026-11",
        },
    }  # fmt: skip
    assert native == {"kv_connector": "NixlConnector", "kv_role": "kv_producer"}


def test_prefill_without_native_pool_runs_tilert_connector_alone() -> None:
    spec = specmod.parse(helpers.example("deepseek-v32")["spec"])
    kv = json.loads(_arg(commands.commands(spec)[constants.PREFILL].argv, "--kv-transfer-config"))
    assert kv["kv_connector"] == "TileRTConnector"
    assert kv["kv_connector_extra_config"]["tilert_transfer"] == "nixl"


def test_decode_node_and_router_commands() -> None:
    spec = specmod.parse(helpers.example("tiny-cpu")["spec"])
    cmds = commands.commands(spec)
    argv = cmds[constants.TILERT].argv
    assert argv[:2] == ["tilert-pd", "decode-node"]
    expect = {
        "--tilert-model": "mla",
        "--engine": "reference",
        "--slots": "4",
        "--ctrl-port": str(defaults.DECODE_CTRL_PORT),
        "--http-port": str(defaults.DECODE_HTTP_PORT),
        "--transfer": "mooncake",
        "--protocol": "tcp",
        "--secret-file": defaults.SECRET_PATH,
        "--max-seq-len": "2048",
        "--kv-cache-dtype": "float32",
        "--host": "0.0.0.0",
        "--num-speculative-tokens": "1",
    }
    assert {f: _arg(argv, f) for f in expect} == expect
    assert "--device" not in argv, "a CPU node keeps decode-node's cpu default"
    # vLLM has no float32 cache dtype: its cache follows a float32 model instead.
    prefill = cmds[constants.PREFILL].argv
    assert (_arg(prefill, "--kv-cache-dtype"), _arg(prefill, "--dtype")) == ("auto", "float32")
    glm = commands.commands(specmod.parse(helpers.example("glm5-b200-rdma")["spec"]))[constants.TILERT].argv
    assert (_arg(glm, "--device"), _arg(glm, "--shards")) == ("cuda:0", "8")
    no_mtp = commands.commands(specmod.parse(helpers.minimal(decode={"tilert": {"mtp": False}})))[
        constants.TILERT
    ].argv
    assert _arg(no_mtp, "--num-speculative-tokens") == "0"
    assert cmds[constants.ROUTER].argv == [
        "tilert-pd",
        "router",
        "--config",
        "/etc/tilert-pd/router/config.yaml",
        "--host",
        "0.0.0.0",
        "--port",
        str(defaults.ROUTER_PORT),
        "--drain-timeout",
        "110",
    ]
    native = cmds[constants.NATIVE].argv
    assert json.loads(_arg(native, "--kv-transfer-config")) == {
        "kv_connector": "NixlConnector",
        "kv_role": "kv_consumer",
    }
    local = commands.commands(
        spec, commands.Paths(model_dir="/tmp/m", secret_file="/tmp/s", host="127.0.0.1")
    )
    assert _arg(local[constants.TILERT].argv, "--secret-file") == "/tmp/s"
    # A local run gives each process its own ports; everything else is what the pods run.
    node1 = commands.tilert_decode(spec, commands.Paths(model_dir="/tmp/m", ctrl_port=6001, http_port=6002))
    assert (_arg(node1.argv, "--ctrl-port"), _arg(node1.argv, "--http-port")) == ("6001", "6002")
    native = commands.native_decode(spec, commands.Paths(model_dir="/tmp/m", vllm_port=8200))
    assert _arg(native.argv, "--port") == "8200"


def test_router_configmap_holds_a_loadable_config(tmp_path: Any) -> None:
    spec = specmod.parse(helpers.example("glm5-b200-rdma")["spec"])
    node = router_config.TileRTNode(
        name="glm5-tilert-decode-0", http_url="http://10.0.0.5:5557", ctrl_host="192.168.1.5"
    )
    cm = render.router.configmap(spec, "glm5", "serving", [node])
    (tmp_path / "config.yaml").write_text(cm["data"]["config.yaml"])
    cfg = router_config.load(tmp_path / "config.yaml")
    # Every endpoint carries its generation's compatibility fingerprint (render/generations.py).
    compat = render.generations.generation(spec).compat
    assert compat is not None
    assert cfg.tilert == [node.model_copy(update={"compat": compat})]
    assert cfg.prefill == [router_config.Endpoint(url="http://glm5-prefill.serving.svc:8100", compat=compat)]
    assert cfg.native == [
        router_config.Endpoint(url="http://glm5-native-decode.serving.svc:8100", compat=compat)
    ]
    assert cfg.api_keys_file == "/etc/tilert-pd/router-keys/keys"
    assert cfg.policy.tilert_aliases == ["glm-5-turbo"]
    # The spec's prefill policy reaches the router (cache-aware unless the spec says otherwise).
    assert cfg.policy.prefill == "cache_aware"
    doc = helpers.example("glm5-b200-rdma")["spec"]
    doc["router"].setdefault("policy", {})["prefill"] = "round_robin"
    cm = render.router.configmap(specmod.parse(doc), "glm5", "serving", [node])
    assert yaml.safe_load(cm["data"]["config.yaml"])["policy"]["prefill"] == "round_robin"
    # A secondary network: the wired nodes listed here are all the router uses (no DNS discovery,
    # which would name every ready pod by its pod IP).
    assert spec.transfer.rdma.networks and cfg.discoveries() == []


def test_only_the_router_gets_the_operators_metrics_token_and_only_where_a_key_guards_metrics() -> None:
    doc = helpers.example("glm5-b200-rdma")["spec"]
    assert doc["router"]["apiKeysSecret"]
    cfg = render.router.pod_config(specmod.parse(doc), "glm5", "serving", [])
    assert cfg.metrics_token_file == constants.ROUTER_METRICS_TOKEN_PATH
    router = render.router.deployment(specmod.parse(doc), "glm5", "serving")
    (vol,) = [v for v in router["spec"]["template"]["spec"]["volumes"] if v["name"] == "node-api-token"]
    assert {i["key"]: i["path"] for i in vol["secret"]["items"]} == {
        "token": "token",
        "metrics-token": "metrics-token",
    }
    (mount,) = [
        m
        for m in router["spec"]["template"]["spec"]["containers"][0]["volumeMounts"]
        if m["name"] == "node-api-token"
    ]
    assert f"{mount['mountPath']}/metrics-token" == cfg.metrics_token_file
    # The decode pods mount the node API token alone.
    node_vols = render.tilert_decode.statefulset(specmod.parse(doc), "glm5", "serving")["spec"]["template"][
        "spec"
    ]
    (nvol,) = [v for v in node_vols["volumes"] if v["name"] == "node-api-token"]
    assert [i["key"] for i in nvol["secret"]["items"]] == ["token"]
    # Open metrics, or no keys at all: nothing to present a token to.
    doc["router"]["metricsPublic"] = True
    assert render.router.pod_config(specmod.parse(doc), "glm5", "serving", []).metrics_token_file is None
    del doc["router"]["apiKeysSecret"], doc["router"]["metricsPublic"]
    assert render.router.pod_config(specmod.parse(doc), "glm5", "serving", []).metrics_token_file is None


def test_without_a_secondary_network_new_nodes_are_found_through_dns() -> None:
    spec = specmod.parse(helpers.example("tiny-cpu")["spec"])
    assert not spec.transfer.rdma.networks
    cfg = render.router.pod_config(spec, "tiny", "ns", [])
    # New TileRT pods reach the router through the headless Service's DNS within seconds.
    (d,) = cfg.discoveries()
    assert d.service == "tiny-tilert-decode.ns.svc" and d.compat == render.generations.generation(spec).compat
    assert (d.http_port, d.ctrl_port, d.slots, d.max_seq_len) == (
        spec.decode.tilert.http_port,
        spec.decode.tilert.ctrl_port,
        spec.decode.tilert.slots,
        spec.model.max_seq_len,
    )


def test_a_ready_node_without_its_data_plane_address_is_not_routed() -> None:
    """EndpointsWired=False (DataPlaneAddressMissing) means the router does not use the node: not in
    the endpoint list, and not added by the router's DNS discovery either, though DNS names it (the
    headless Service names every ready pod)."""
    spec = specmod.parse(helpers.example("glm5-b200-rdma")["spec"])
    wired = h.pod(
        "glm5",
        constants.TILERT,
        0,
        "serving",
        ip="10.0.0.1",
        rdma_net="serving/rdma-net",
        rdma_ip="192.168.0.1",
    )
    unwired = h.pod("glm5", constants.TILERT, 1, "serving", ip="10.0.0.2")
    nodes, left_out = observe.tilert_nodes(spec, [wired, unwired])
    assert [u.pod for u in left_out] == ["glm5-tilert-decode-1"]
    cfg = router_config.RouterConfig.model_validate(
        yaml.safe_load(render.router.configmap(spec, "glm5", "serving", nodes)["data"]["config.yaml"])
    )
    # What the router routes to: the configured nodes plus what its discovery finds, with DNS
    # answering both ready pods' IPs.
    found = [n for d in cfg.discoveries() for n in discovery.nodes_from(["10.0.0.1", "10.0.0.2"], d)]
    routed = router_config.with_discovered(cfg, found).tilert
    assert [(n.name, n.http_url, n.ctrl_host) for n in routed] == [
        ("glm5-tilert-decode-0", "http://10.0.0.1:5557", "192.168.0.1")
    ]


def test_secret_and_multus_wiring() -> None:
    objs = _render(helpers.example("glm5-b200-rdma")["spec"], "glm5", "serving")
    sts = _by(objs, "StatefulSet", "glm5-tilert-decode")
    tmpl = sts["spec"]["template"]
    assert tmpl["metadata"]["annotations"]["k8s.v1.cni.cncf.io/networks"] == "serving/rdma-net"
    mounts = {m["name"]: m["mountPath"] for m in tmpl["spec"]["containers"][0]["volumeMounts"]}
    assert mounts["handoff-secret"] + "/secret" == defaults.SECRET_PATH
    assert tmpl["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 8
    assert sts["spec"]["serviceName"] == "glm5-tilert-decode"
    assert _by(objs, "Service", "glm5-tilert-decode")["spec"]["clusterIP"] == "None"
    env = {e["name"]: e.get("value") for e in tmpl["spec"]["containers"][0]["env"]}
    assert env["MC_GID_INDEX"] == "3"


def test_network_policies_fence_the_ports() -> None:
    objs = _render(helpers.example("tiny-cpu")["spec"], "tiny")
    pol = _by(objs, "NetworkPolicy", "tiny-tilert-decode")["spec"]["ingress"]
    assert pol[0] == {
        "from": [
            {
                "podSelector": {
                    "matchLabels": {
                        constants.LABEL_CLUSTER: "tiny",
                        constants.LABEL_COMPONENT: constants.PREFILL,
                    }
                }
            }
        ]
    }
    assert pol[1]["ports"] == [{"protocol": "TCP", "port": defaults.DECODE_HTTP_PORT}]
    assert pol[1]["from"][0]["podSelector"]["matchLabels"][constants.LABEL_COMPONENT] == constants.ROUTER


def test_overrides_are_a_merge_patch() -> None:
    spec = helpers.minimal(
        prefill={
            "overrides": {
                "spec": {"template": {"spec": {"priorityClassName": "high"}}},
                "metadata": {"annotations": {"a": "b"}},
            }
        }
    )
    dep = _by(_render(spec), "Deployment", "t-prefill")
    assert dep["spec"]["template"]["spec"]["priorityClassName"] == "high"
    assert dep["metadata"]["annotations"]["a"] == "b"
    # The generation's recorded spec stays beside an override's annotations (render/generations.py).
    assert constants.GENERATION_SPEC_ANNOTATION in dep["metadata"]["annotations"]
    assert dep["spec"]["template"]["spec"]["containers"][0]["name"] == "vllm"


def test_cli_render_prints_yaml_and_rejects_bad_files(tmp_path: Any, capsys: Any) -> None:
    assert cli_render.main(["-f", str(helpers.EXAMPLES[0])]) == 0
    docs = list(yaml.safe_load_all(capsys.readouterr().out))
    assert docs[0]["kind"] == "Secret"
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(helpers.cr(helpers.minimal(prefill={"mtp": {"enabled": False}}))))
    assert cli_render.main(["-f", str(bad)]) == 1
    assert "spec.prefill.mtp.enabled" in capsys.readouterr().err


def test_tilert_pd_render_subcommand(capsys: Any) -> None:
    from tilert_serve import cli

    assert (
        cli.main(["render", "-f", str(helpers.ROOT / "examples" / "deepseek-v32.yaml"), "--no-secret"]) == 0
    )
    kinds = [d["kind"] for d in yaml.safe_load_all(capsys.readouterr().out)]
    assert "Secret" not in kinds and kinds.count("StatefulSet") == 1


def test_metrics_scrapers_reach_http_ports_only() -> None:
    prom = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
    objs = _render(
        helpers.minimal(networkPolicies={"metricsFrom": [prom]}, decode={"native": {"replicas": 1}})
    )
    _strict(objs)
    tilert = _by(objs, "NetworkPolicy", "t-tilert-decode")["spec"]["ingress"]
    assert prom not in tilert[0]["from"], "never on the ctrl or transfer ports"
    assert prom in tilert[1]["from"] and tilert[1]["ports"] == [
        {"protocol": "TCP", "port": defaults.DECODE_HTTP_PORT}
    ]
    for name in ("t-prefill", "t-native-decode"):
        assert prom in _by(objs, "NetworkPolicy", name)["spec"]["ingress"][0]["from"]


def test_scaling_the_native_pool_never_changes_the_prefill_pods() -> None:
    """A change to the prefill's pod template restarts every prefill pod (minutes for a large model):
    the native pool's size must not reach it, between 0 and N or N and M."""
    doc = helpers.example("tiny-cpu")["spec"]
    templates = []
    for replicas in (0, 1, 3):
        spec = specmod.parse(
            doc | {"decode": doc["decode"] | {"native": doc["decode"]["native"] | {"replicas": replicas}}}
        )
        templates.append(prefill.deployment(spec, "tiny", "default")["spec"]["template"])
    assert templates[0] == templates[1] == templates[2]
    kv = json.loads(_arg(templates[0]["spec"]["containers"][0]["command"], "--kv-transfer-config"))
    assert [c["kv_connector"] for c in kv["kv_connector_extra_config"]["connectors"]] == [
        "TileRTConnector",
        "NixlConnector",
    ]
