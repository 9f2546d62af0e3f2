"""What the operator renders and does for security: the node API credential and its mounts,
the handoff Secret's `accept` key and its rotation in phases without a pod restart, Secrets adopted
only when owned, MultiNetworkPolicies on Multus networks, and the DataPlaneProtected warning.

Pure tests first (renderers, the rotation step, conditions); then the operator over HTTP against the
API test server (KopfRunner), where a test plays the workload controllers."""

from __future__ import annotations

import base64
import itertools
import json
import posixpath
import time
from typing import Any

import pdc_harness as h
import pdc_helpers as helpers
import pytest
from kopf.testing import KopfRunner
from test_op_e2e import decode_arg, wait_condition

from tilert_operator import constants, credentials, render, status
from tilert_operator import spec as specmod
from tilert_operator.render import commands
from tilert_operator.render import router as router_render
from tilert_serve import defaults
from tilert_serve.pd_vllm.config import ConnectorConfig
from tilert_serve.router import config as router_config

NETS = helpers.minimal(transfer={"rdma": {"networks": ["rdma-net"]}})


def _render(
    spec: dict[str, Any], name: str = "t", ns: str = "ns", token: str = "s3cret"
) -> list[dict[str, Any]]:
    return render.all_manifests(specmod.parse(spec), name, ns, secret_token=token, node_api_token="api-token")


def _by(objs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    return next(o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name)


def _decoded(secret: dict[str, Any]) -> dict[str, str]:
    return {k: base64.b64decode(v).decode() for k, v in (secret.get("data") or {}).items()}


def _mounts(workload: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """volume name -> (mount, volume) of a workload's first container."""
    pod = workload["spec"]["template"]["spec"]
    vols = {v["name"]: v for v in pod.get("volumes") or []}
    return {
        m["name"]: {"mount": m, "volume": vols[m["name"]]}
        for m in pod["containers"][0].get("volumeMounts") or []
    }


def _arg(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


# ---- rendering ---------------------------------------------------------------------------------


def test_node_api_secret_is_mounted_on_decode_and_router_pods_only() -> None:
    objs = _render(helpers.example("tiny-cpu")["spec"], "tiny")
    secret = _by(objs, "Secret", "tiny-node-api")
    decoded = _decoded(secret)
    assert decoded.pop("token") == "api-token"
    # The operator's metrics-only token: its own (64 hex digits), not the node token.
    assert set(decoded) == {"metrics-token"} and len(decoded["metrics-token"]) == 64
    token_dir, token_file = posixpath.split(defaults.NODE_API_TOKEN_PATH)
    router_items = [{"key": "token", "path": token_file}, {"key": "metrics-token", "path": "metrics-token"}]
    for kind, name, items in [
        ("StatefulSet", "tiny-tilert-decode", router_items[:1]),
        ("Deployment", "tiny-router", router_items),
    ]:
        m = _mounts(_by(objs, kind, name))["node-api-token"]
        assert m["mount"] == {"name": "node-api-token", "mountPath": token_dir, "readOnly": True}
        assert m["volume"]["secret"] == {"secretName": "tiny-node-api", "defaultMode": 0o400, "items": items}
    for name in ("tiny-prefill", "tiny-native-decode"):
        assert "node-api-token" not in _mounts(_by(objs, "Deployment", name)), (
            f"{name} has no business with the node API"
        )
    # The node requires the token; the router presents it.
    spec = specmod.parse(helpers.example("tiny-cpu")["spec"])
    assert (
        _arg(commands.commands(spec)[constants.TILERT].argv, "--api-token-file")
        == defaults.NODE_API_TOKEN_PATH
    )
    # A local run without a token file runs the node without one (the local runner passes its own).
    local = commands.tilert_decode(spec, commands.Paths(model_dir="/m"))
    assert "--api-token-file" not in local.argv


def test_router_config_names_the_node_api_token_file(tmp_path: Any) -> None:
    spec = specmod.parse(helpers.example("tiny-cpu")["spec"])
    cm = router_render.configmap(spec, "tiny", "ns", [])
    (tmp_path / "config.yaml").write_text(cm["data"]["config.yaml"])
    assert router_config.load(tmp_path / "config.yaml").tilert_api_token_file == defaults.NODE_API_TOKEN_PATH


def test_handoff_digest_is_on_unless_the_spec_turns_it_off_on_both_sides() -> None:
    on = commands.commands(specmod.parse(helpers.minimal()))
    assert "--handoff-digest" not in on[constants.TILERT].argv, "on is the node's default"
    assert "tilert_handoff_digest" not in _arg(on[constants.PREFILL].argv, "--kv-transfer-config")
    off = commands.commands(specmod.parse(helpers.minimal(transfer={"handoffDigest": False})))
    assert _arg(off[constants.TILERT].argv, "--handoff-digest") == "off"
    kv = json.loads(_arg(off[constants.PREFILL].argv, "--kv-transfer-config"))
    tilert = next(
        c for c in kv["kv_connector_extra_config"]["connectors"] if c["kv_connector"] == "TileRTConnector"
    )
    assert tilert["kv_connector_extra_config"]["tilert_handoff_digest"] is False


def test_layerwise_handoff_is_on_unless_the_spec_turns_it_off() -> None:
    on = commands.commands(specmod.parse(helpers.minimal()))
    assert "tilert_layerwise" not in _arg(on[constants.PREFILL].argv, "--kv-transfer-config")
    off = commands.commands(specmod.parse(helpers.minimal(transfer={"layerwise": False})))
    kv = json.loads(_arg(off[constants.PREFILL].argv, "--kv-transfer-config"))
    tilert = next(
        c for c in kv["kv_connector_extra_config"]["connectors"] if c["kv_connector"] == "TileRTConnector"
    )
    assert tilert["kv_connector_extra_config"]["tilert_layerwise"] is False
    # The connector reads the key the operator renders.
    assert ConnectorConfig.from_extra_config(tilert["kv_connector_extra_config"]).layerwise is False


def test_router_metrics_need_a_key_unless_the_spec_opens_them() -> None:
    keys = {"router": {"apiKeysSecret": {"name": "keys"}}}
    closed = router_render.pod_config(specmod.parse(helpers.minimal(**keys)), "t", "ns", [])
    assert closed.api_keys_file and closed.metrics_public is False
    opened = helpers.deep_merge(helpers.minimal(**keys), {"router": {"metricsPublic": True}})
    assert router_render.pod_config(specmod.parse(opened), "t", "ns", []).metrics_public is True


def test_handoff_secret_has_accept_beside_secret_and_the_pods_do_not_depend_on_it() -> None:
    objs = _render(helpers.example("tiny-cpu")["spec"], "tiny")
    assert _decoded(_by(objs, "Secret", "tiny-handoff")) == {"secret": "s3cret", "accept": ""}
    secret_dir = posixpath.dirname(defaults.SECRET_PATH)
    for kind, name in [("Deployment", "tiny-prefill"), ("StatefulSet", "tiny-tilert-decode")]:
        m = _mounts(_by(objs, kind, name))["handoff-secret"]
        # A directory mount (no subPath): the kubelet's updates reach the running pod.
        assert m["mount"] == {"name": "handoff-secret", "mountPath": secret_dir, "readOnly": True}
        assert m["volume"]["secret"]["items"] == [
            {"key": "secret", "path": "secret"},
            {"key": "accept", "path": "accept"},
        ]
    # Nothing the operator applies depends on the handoff secret's value: rotating it restarts no pod.
    other = _render(helpers.example("tiny-cpu")["spec"], "tiny", token="another")
    children = [o for o in objs if o["kind"] != "Secret"]
    assert children == [o for o in other if o["kind"] != "Secret"]
    annotations = [
        o["spec"]["template"]["metadata"].get("annotations") or {}
        for o in children
        if "template" in o.get("spec", {})
    ]
    assert not any("handoff-secret-version" in k for a in annotations for k in a)


def test_multi_network_policies_only_when_networks_are_named() -> None:
    objs = _render(helpers.deep_merge(NETS, {"decode": {"native": {"replicas": 1}}}), "t")
    mnps = {o["metadata"]["name"]: o for o in objs if o["kind"] == "MultiNetworkPolicy"}
    assert sorted(mnps) == ["t-native-decode", "t-prefill", "t-tilert-decode"]

    def peers(name: str) -> list[str]:
        [rule] = mnps[name]["spec"]["ingress"]
        assert "ports" not in rule, "every port from the peers: the ctrl port and the engines' run-time ports"
        return sorted(p["podSelector"]["matchLabels"][constants.LABEL_COMPONENT] for p in rule["from"])

    for name, mnp in mnps.items():
        assert mnp["apiVersion"] == "k8s.cni.cncf.io/v1beta1"
        assert mnp["metadata"]["annotations"] == {"k8s.v1.cni.cncf.io/policy-for": "rdma-net"}
        assert mnp["spec"]["policyTypes"] == ["Ingress"]
        assert mnp["spec"]["podSelector"]["matchLabels"][constants.LABEL_COMPONENT] == name.removeprefix("t-")
    assert peers("t-tilert-decode") == [constants.PREFILL]
    assert peers("t-native-decode") == [constants.PREFILL]
    assert peers("t-prefill") == [constants.NATIVE, constants.TILERT]
    # Two networks: the policy is for both. No TileRT pool: no policy for it.
    two = helpers.deep_merge(
        NETS,
        {
            "transfer": {"rdma": {"networks": ["a", "other/b"]}},
            "decode": {"tilert": {"replicas": 0}, "native": {"replicas": 1}},
        },
    )
    mnps2 = {o["metadata"]["name"]: o for o in _render(two) if o["kind"] == "MultiNetworkPolicy"}
    assert sorted(mnps2) == ["t-native-decode", "t-prefill"]
    assert mnps2["t-prefill"]["metadata"]["annotations"]["k8s.v1.cni.cncf.io/policy-for"] == "a,other/b"
    # Without networks, or with policies off: none.
    assert not [o for o in _render(helpers.minimal()) if o["kind"] == "MultiNetworkPolicy"]
    off = helpers.deep_merge(NETS, {"networkPolicies": {"enabled": False}})
    assert not [o for o in _render(off) if o["kind"] == "MultiNetworkPolicy"]


# ---- rotation, pure ----------------------------------------------------------------------------


def _handoff_accepts(node: dict[str, str], signed_with: str) -> bool:
    """What a node accepts (handoff/auth.py FileKeyring): `secret` or any line of `accept`."""
    return signed_with == node["secret"] or signed_with in [x for x in node["accept"].splitlines() if x]


def _handoff_sends(view: dict[str, str]) -> str:
    return view["secret"]


def _token_accepts(node: dict[str, str], token: str) -> bool:
    """What a node accepts (tilert_serve/bearer.py TokenFile): any line of `token`."""
    return token in node["token"].splitlines()


def _token_sends(view: dict[str, str]) -> str:
    """What the router sends: the first line."""
    return view["token"].splitlines()[0]


ROTATIONS = {
    "handoff": (
        credentials.HANDOFF,
        {"secret": "old", "accept": ""},
        _handoff_accepts,
        _handoff_sends,
        [
            {"secret": "old", "accept": ""},
            {"secret": "old", "accept": "new"},
            {"secret": "new", "accept": "old"},
            {"secret": "new", "accept": ""},
        ],
    ),
    "node-api": (
        credentials.NODE_API,
        {"token": "old\n"},
        _token_accepts,
        _token_sends,
        [{"token": "old\n"}, {"token": "old\nnew\n"}, {"token": "new\nold\n"}, {"token": "new\n"}],
    ),
}


@pytest.mark.parametrize("which", sorted(ROTATIONS))
def test_rotation_phases_never_leave_a_sender_unaccepted(which: str) -> None:
    scheme, data, accepts, sends, expected = ROTATIONS[which]
    rot = credentials.Rotation()
    assert credentials.step(data, rot, None, 100.0, 60.0, "new", scheme) is None, "no request, nothing to do"
    views = [data]
    phases = []
    now = 100.0
    first = credentials.step(data, rot, "r1", now, 60.0, "new", scheme)
    assert first is not None
    data, rot = first
    views.append(data), phases.append(rot.phase)
    assert credentials.step(data, rot, "r1", now + 59.0, 60.0, "x", scheme) is None, (
        "a phase lasts the grace period"
    )
    while rot.phase != credentials.IDLE:
        now += 60.0
        nxt = credentials.step(data, rot, "r1", now, 60.0, "unused", scheme)
        assert nxt is not None
        data, rot = nxt
        views.append(data), phases.append(rot.phase)
    assert phases == [scheme.accepting, scheme.switched, credentials.IDLE]
    assert views == expected
    assert rot.rotated_at == now and rot.request == "r1"
    # Kubelets update pods at different times, but within a grace period: any pod sees the current
    # view or the one before. What every user sends must be accepted by every reader's view.
    for before, after in itertools.pairwise(views):
        for user, reader in itertools.product((before, after), repeat=2):
            assert accepts(reader, sends(user)), (user, reader)
    # The old value is refused at the end; the same request does not rotate again, a new one does.
    assert not accepts(views[-1], "old")
    assert credentials.step(data, rot, "r1", now + 1000, 60.0, "x", scheme) is None
    again = credentials.step(data, rot, "r2", now + 1000, 60.0, "newer", scheme)
    assert (
        again is not None
        and again[1].phase == scheme.accepting
        and accepts(again[0], "newer")
        and accepts(again[0], "new")
    )


def test_a_rotation_whose_new_value_was_edited_away_starts_over() -> None:
    for scheme, data in (
        (credentials.HANDOFF, {"secret": "old", "accept": ""}),
        (credentials.NODE_API, {"token": "old\n"}),
    ):
        rot = credentials.Rotation(scheme.accepting, "r1", 0.0, None)
        nxt = credentials.step(data, rot, "r1", 100.0, 60.0, "fresh", scheme)
        assert nxt is not None and nxt[1].phase == scheme.accepting and nxt[1].since == 100.0
        assert "fresh" in "".join(nxt[0].values())


def test_rotation_state_survives_a_restart_in_the_secrets_annotations() -> None:
    rot = credentials.Rotation(credentials.SIGNING, "r1", 1000.0, None)
    secret = {"metadata": {"annotations": rot.annotations()}}
    assert credentials.Rotation.of(secret) == rot
    assert rot.status(60.0) == {
        "phase": "SigningWithNewSecret",
        "request": "r1",
        "phaseSince": "1970-01-01T00:16:40Z",
        "nextPhaseAt": "1970-01-01T00:17:40Z",
    }


def test_an_adopted_secret_with_arbitrary_bytes_round_trips() -> None:
    raw = base64.b64encode(bytes(range(256))).decode()
    secret = {
        "metadata": {
            "name": "t-handoff",
            "namespace": "ns",
            "annotations": {constants.ADOPT_ANNOTATION: "true"},
        },
        "data": {"secret": raw},
    }
    body = {"metadata": {"name": "t", "uid": "u1"}}
    data = {k: credentials._decode(secret, k) for k in secret["data"]}
    intent = credentials._intent(secret, body, data | {"accept": ""}, {})
    assert intent["data"]["secret"] == raw and intent["data"]["accept"] == ""
    assert intent["metadata"]["ownerReferences"][0]["uid"] == "u1"
    assert constants.ADOPT_ANNOTATION not in intent["metadata"].get("annotations", {}), (
        "the adoption mark has done its job"
    )


# ---- conditions --------------------------------------------------------------------------------


def test_data_plane_protection_is_reported() -> None:
    def cond(*args: Any) -> tuple[str, str]:
        c = status.data_plane(*args)
        assert c["type"] == "DataPlaneProtected" and c["message"]
        return c["status"], c["reason"]

    assert cond([], False, True, None) == ("True", "NetworkPolicy")
    assert cond(["rdma-net"], False, True, True) == ("True", "MultiNetworkPolicy")
    assert cond(["rdma-net"], False, True, False) == ("False", "MultiNetworkPolicyUnavailable")
    assert cond(["rdma-net"], False, True, 404) == ("False", "MultiNetworkPolicyUnavailable")
    assert cond(["rdma-net"], False, True, 403) == ("False", "MultiNetworkPolicyForbidden")
    assert cond(["rdma-net"], False, True, 200) == ("True", "MultiNetworkPolicy")
    assert cond([], True, True, None) == ("False", "HostNetworkUnprotected")
    assert cond([], False, False, None) == ("False", "PoliciesDisabled")
    host = status.data_plane([], True, True, None)["message"]
    assert "firewall" in host and "spec.transfer.rdma.networks" in host, "the message says what to do"


def test_security_warnings_get_an_event_on_the_first_status() -> None:
    conds = [
        status.data_plane([], True, True, None),
        status.secrets_owned(["a"]),
        {"type": "Ready", "status": "True", "reason": "Serving", "message": ""},
    ]
    assert [c["type"] for c in status.transitions(conds, [])] == ["DataPlaneProtected", "Ready"]


# ---- the operator over HTTP --------------------------------------------------------------------


@pytest.fixture(autouse=True)
def fast_operator(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TILERT_PD_RESYNC_S", "1")
    monkeypatch.setenv("TILERT_PD_METRICS_PORT", "0")
    monkeypatch.setenv("TILERT_PD_WATCH_TIMEOUT_S", "10")
    monkeypatch.setenv("TILERT_PD_SECRET_ROTATION_GRACE_S", "1.5")


def _templates(srv: Any, cluster: str) -> dict[str, Any]:
    """Every workload's pod template and resourceVersion: a rotation must change neither."""
    out = {}
    for plural in ("deployments", "statefulsets"):
        for o in srv.objects(plural, "default"):
            if o["metadata"]["name"].startswith(f"{cluster}-"):
                out[f"{plural}/{o['metadata']['name']}"] = (
                    o["spec"]["template"],
                    o["metadata"]["resourceVersion"],
                )
    return out


def _annotate(apiserver: Any, cluster: str, annotations: dict[str, str]) -> None:
    srv = apiserver.server
    body = srv.get("pdclusters", "default", cluster)
    body["metadata"]["annotations"] = (body["metadata"].get("annotations") or {}) | annotations
    apiserver.call(srv.put(h.PDC, body))


def test_rotations_go_through_their_phases_without_touching_a_pod_template(apiserver: Any) -> None:
    """Both credentials rotated at once, each in three phases a grace period apart, with status,
    conditions and Events, and no workload rewritten."""
    srv = apiserver.server
    with KopfRunner(h.ARGS, timeout=40) as runner:
        apiserver.call(srv.put(h.PDC, h.pdc(helpers.example("tiny-cpu"))))
        wait_condition(srv, "tiny", "HandoffSecretRotating", "NotRequested", key="reason")
        body = srv.get("pdclusters", "default", "tiny")
        assert body["status"]["handoffSecret"] == {"phase": "Idle"} and body["status"]["nodeApiToken"] == {
            "phase": "Idle"
        }
        assert h.condition(body, "NodeApiTokenRotating")["reason"] == "NotRequested"
        old = _decoded(srv.get("secrets", "default", "tiny-handoff"))
        old_token = _decoded(srv.get("secrets", "default", "tiny-node-api"))["token"]
        assert old["accept"] == "" and len(old["secret"]) >= 32
        templates = _templates(srv, "tiny")
        assert len(templates) == 4

        _annotate(
            apiserver,
            "tiny",
            {
                constants.ROTATE_HANDOFF_SECRET_ANNOTATION: "2026-12-01",
                constants.ROTATE_NODE_API_TOKEN_ANNOTATION: "t1",
            },
        )
        seen: dict[str, list[dict[str, str]]] = {"tiny-handoff": [], "tiny-node-api": []}

        def phases() -> tuple[str | None, str | None]:
            for name, views in seen.items():
                data = _decoded(srv.get("secrets", "default", name))
                if not views or views[-1] != data:
                    views.append(data)
            st = srv.get("pdclusters", "default", "tiny").get("status") or {}
            return st.get("handoffSecret", {}).get("phase"), st.get("nodeApiToken", {}).get("phase")

        h.wait_for(
            "phase 1",
            lambda: phases() == ("AcceptingNewSecret", "AcceptingNewToken"),
            timeout=5,
            interval=0.05,
        )
        assert (
            h.condition(srv.get("pdclusters", "default", "tiny"), "HandoffSecretRotating")["status"] == "True"
        )
        h.wait_for(
            "phase 2",
            lambda: phases() == ("SigningWithNewSecret", "SendingNewToken"),
            timeout=10,
            interval=0.05,
        )
        h.wait_for("done", lambda: phases() == ("Idle", "Idle"), timeout=10, interval=0.05)
        new = seen["tiny-handoff"][-1]
        assert new["secret"] != old["secret"] and new["accept"] == ""
        assert seen["tiny-handoff"] == [
            old,
            {"secret": old["secret"], "accept": new["secret"]},
            {"secret": new["secret"], "accept": old["secret"]},
            new,
        ]
        new_token = seen["tiny-node-api"][-1]["token"].strip()
        assert [v["token"] for v in seen["tiny-node-api"]] == [
            old_token,
            f"{old_token.strip()}\n{new_token}\n",
            f"{new_token}\n{old_token.strip()}\n",
            f"{new_token}\n",
        ]
        body = srv.get("pdclusters", "default", "tiny")
        assert (
            body["status"]["handoffSecret"]["request"] == "2026-12-01"
            and body["status"]["handoffSecret"]["lastRotated"]
        )
        assert (
            body["status"]["nodeApiToken"]["request"] == "t1"
            and body["status"]["nodeApiToken"]["lastRotated"]
        )
        assert h.condition(body, "HandoffSecretRotating")["reason"] == "Rotated"
        assert h.condition(body, "NodeApiTokenRotating")["reason"] == "Rotated"
        # Each phase is an Event on the PDCluster (posted just after the status write that reports it).
        want = {
            "AcceptingNewSecret",
            "SigningWithNewSecret",
            "AcceptingNewToken",
            "SendingNewToken",
            "Rotated",
        }
        h.wait_for(
            "phase Events", lambda: want <= {e["reason"] for e in srv.objects("events", "default")}, timeout=5
        )
        # No pod template changed, and no workload was even rewritten.
        assert _templates(srv, "tiny") == templates
    assert runner.exception is None


def test_a_foreign_secret_is_left_alone_and_reported_until_adopted(apiserver: Any) -> None:
    srv = apiserver.server
    foreign = {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": {"name": "tiny-handoff", "namespace": "default", "labels": {"app": "someone-else"}},
        "data": {"secret": base64.b64encode(b"known-to-someone").decode()},
    }
    apiserver.call(srv.put(("", "v1", "secrets"), foreign))
    before = srv.get("secrets", "default", "tiny-handoff")
    with KopfRunner(h.ARGS, timeout=40) as runner:
        apiserver.call(srv.put(h.PDC, h.pdc(helpers.example("tiny-cpu"))))
        body = h.wait_for(
            "SecretsOwned=False",
            lambda: (
                h.condition(srv.get("pdclusters", "default", "tiny"), "SecretsOwned").get("status") == "False"
                and srv.get("pdclusters", "default", "tiny")
            ),
        )
        msg = h.condition(body, "SecretsOwned")["message"]
        assert "default/tiny-handoff" in msg and constants.ADOPT_ANNOTATION in msg
        assert h.condition(body, "Ready")["reason"] == "SecretNotOwned"
        h.wait_for(
            "a Warning Event",
            lambda: any(
                e["reason"] == "SecretNotOwned" and e["type"] == "Warning"
                for e in srv.objects("events", "default")
            ),
            timeout=5,
        )
        assert srv.get("secrets", "default", "tiny-handoff") == before, "left untouched"
        assert not srv.objects("deployments", "default") and not srv.objects("statefulsets", "default"), (
            "nothing mounts it"
        )

        # Marked for adoption: the operator takes it (ownerReference), completes it and deploys.
        fixed = srv.get("secrets", "default", "tiny-handoff")
        fixed["metadata"]["labels"] = {
            constants.LABEL_CLUSTER: "tiny",
            constants.LABEL_MANAGED_BY: constants.MANAGED_BY,
        }
        fixed["metadata"]["annotations"] = {constants.ADOPT_ANNOTATION: "true"}
        apiserver.call(srv.put(("", "v1", "secrets"), fixed))
        wait_condition(srv, "tiny", "SecretsOwned", "True")
        adopted = srv.get("secrets", "default", "tiny-handoff")
        uid = srv.get("pdclusters", "default", "tiny")["metadata"]["uid"]
        assert [r["uid"] for r in adopted["metadata"]["ownerReferences"]] == [uid]
        assert _decoded(adopted) == {"secret": "known-to-someone", "accept": ""}
        h.wait_for("stack deployed", lambda: srv.get("statefulsets", "default", "tiny-tilert-decode"))
        assert any(e["reason"] == "SecretAdopted" for e in srv.objects("events", "default"))
    assert runner.exception is None


def test_multi_network_policies_applied_when_served_and_reported_when_not(apiserver: Any) -> None:
    srv = apiserver.server
    with KopfRunner(h.ARGS, timeout=40) as runner:
        apiserver.call(srv.put(h.PDC, h.pdc(helpers.cr(NETS, name="nets"))))
        body = h.wait_for(
            "DataPlaneProtected=False",
            lambda: (
                h.condition(srv.get("pdclusters", "default", "nets"), "DataPlaneProtected").get("status")
                == "False"
                and srv.get("pdclusters", "default", "nets")
            ),
        )
        cond = h.condition(body, "DataPlaneProtected")
        assert cond["reason"] == "MultiNetworkPolicyUnavailable" and "rdma-net" in cond["message"]
        # The rest of the stack is reconciled as usual.
        assert srv.get("statefulsets", "default", "nets-tilert-decode") and srv.get(
            "networkpolicies", "default", "nets-tilert-decode"
        )

        h.install_crd(apiserver, h.MULTI_NETWORK_POLICY_CRD)
        h.wait_for("MultiNetworkPolicies", lambda: len(srv.objects("multi-networkpolicies", "default")) == 2)
        wait_condition(srv, "nets", "DataPlaneProtected", "MultiNetworkPolicy", key="reason")
        uid = srv.get("pdclusters", "default", "nets")["metadata"]["uid"]
        assert all(
            m["metadata"]["ownerReferences"][0]["uid"] == uid
            for m in srv.objects("multi-networkpolicies", "default")
        )

        # A ClusterRole without multi-networkpolicies (403): reported, and the rest still reconciled. The
        # informer holds a watch already: the role's loss shows when that watch must start again (here:
        # its history compacted, so it relists and is refused).
        srv.fail(403, times=10_000, resource="multi-networkpolicies")
        apiserver.call(srv.compact())
        body = srv.get("pdclusters", "default", "nets")
        body["spec"]["decode"]["tilert"]["slots"] = 2
        apiserver.call(
            srv.put(
                h.PDC,
                body | {"metadata": body["metadata"] | {"generation": body["metadata"]["generation"] + 1}},
            )
        )
        wait_condition(srv, "nets", "DataPlaneProtected", "MultiNetworkPolicyForbidden", key="reason")
        h.wait_for("slots applied", lambda: decode_arg(srv, "nets", "--slots") == "2")
        srv.faults.clear()
        wait_condition(srv, "nets", "DataPlaneProtected", "MultiNetworkPolicy", key="reason")

        # The spec stops naming networks: the policies go; hostNetwork instead: a warning.
        body = srv.get("pdclusters", "default", "nets")
        body["spec"]["transfer"]["rdma"] = {"hostNetwork": True}
        apiserver.call(
            srv.put(
                h.PDC,
                body | {"metadata": body["metadata"] | {"generation": body["metadata"]["generation"] + 1}},
            )
        )
        h.wait_for("policies removed", lambda: not srv.objects("multi-networkpolicies", "default"))
        cond = h.wait_for(
            "hostNetwork warning",
            lambda: (lambda c: c.get("reason") == "HostNetworkUnprotected" and c)(
                h.condition(srv.get("pdclusters", "default", "nets"), "DataPlaneProtected")
            ),
        )
        assert cond["status"] == "False"
    assert runner.exception is None


def test_a_regenerated_node_api_token_changes_no_pod_template(apiserver: Any) -> None:
    """The node and the router re-read the token file (tilert_serve/bearer.py): a new token, from a
    deleted and recreated Secret or an edited one, reaches them without a restart."""
    srv = apiserver.server
    with KopfRunner(h.ARGS, timeout=40) as runner:
        apiserver.call(srv.put(h.PDC, h.pdc(helpers.example("tiny-cpu"))))
        h.wait_for(
            "the stack",
            lambda: len(_templates(srv, "tiny")) == 4 and srv.get("secrets", "default", "tiny-node-api"),
        )
        templates = _templates(srv, "tiny")
        old = srv.get("secrets", "default", "tiny-node-api")
        apiserver.call(srv.remove(("", "v1", "secrets"), "default", "tiny-node-api"))
        new = h.wait_for(
            "a new token",
            lambda: (lambda s: s if s and s["metadata"]["uid"] != old["metadata"]["uid"] else None)(
                srv.get("secrets", "default", "tiny-node-api")
            ),
        )
        assert _decoded(new)["token"] != _decoded(old)["token"] and len(_decoded(new)["token"]) >= 32
        time.sleep(1.5)
        assert _templates(srv, "tiny") == templates
    assert runner.exception is None
