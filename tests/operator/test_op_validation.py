"""Cross-field rules: each bad spec is rejected with a message naming the field and the fix."""

from __future__ import annotations

import re
from typing import Any

import pdc_crd_validator as crd_validator
import pdc_helpers as helpers
import pytest
import yaml

from tilert_operator import render, validation
from tilert_operator import spec as specmod

BAD: list[tuple[str, dict[str, Any], str, str]] = [
    (
        "prefill-gpus-vs-tp",
        {"prefill": {"gpus": 4, "tensorParallelSize": 8}},
        "spec.prefill.gpus",
        "set gpus: 8 or tensorParallelSize: 4",
    ),
    (
        "native-gpus-vs-tp",
        {"decode": {"native": {"replicas": 1, "gpus": 2, "tensorParallelSize": 1}}},
        "spec.decode.native.gpus",
        "set gpus: 1",
    ),
    (
        "gpu-in-resources",
        {"prefill": {"resources": {"limits": {"nvidia.com/gpu": 8}}}},
        "spec.prefill.resources.limits",
        "set spec.prefill.gpus instead",
    ),
    (
        "tilert-engine-gpus",
        {
            "model": {"tilertModel": "glm5", "kvCacheDtype": "fp8_ds_mla"},
            "decode": {"tilert": {"engine": "tilert", "gpus": 4}},
        },
        "spec.decode.tilert.gpus",
        "set gpus: 8, or engine: reference",
    ),
    (
        "tilert-engine-mla",
        {"decode": {"tilert": {"engine": "tilert", "gpus": 8}}},
        "spec.decode.tilert.engine",
        "set engine: reference",
    ),
    (
        "kv-dtype-vs-model",
        {"model": {"kvCacheDtype": "fp8_ds_mla"}},
        "spec.model.kvCacheDtype",
        "set kvCacheDtype: bfloat16",
    ),
    (
        "float32-vs-dsa-model",
        {"model": {"tilertModel": "glm5", "kvCacheDtype": "float32"}},
        "spec.model.kvCacheDtype",
        "set kvCacheDtype: auto",
    ),
    (
        "mtp-on-prefill",
        {"prefill": {"mtp": {"enabled": False}}},
        "spec.prefill.mtp.enabled",
        "set spec.prefill.mtp.enabled: true",
    ),
    (
        "no-decode-pool",
        {"decode": {"tilert": {"replicas": 0}}},
        "spec.decode",
        "set spec.decode.tilert.replicas or",
    ),
    (
        "native-needs-connector",
        {"prefill": {"nativeConnector": "none"}, "decode": {"native": {"replicas": 1}}},
        "spec.prefill.nativeConnector",
        "set NixlConnector",
    ),
    (
        "rdma-needs-resources",
        {"transfer": {"protocol": "rdma"}},
        "spec.transfer.rdma.resources",
        "set them, or protocol: tcp",
    ),
    (
        "hostnet-port-clash",
        {"transfer": {"rdma": {"hostNetwork": True}}, "decode": {"tilert": {"httpPort": 8100}}},
        "spec.decode.tilert.httpPort",
        "pick another port",
    ),
    (
        "hostnet-nixl-port",
        {"transfer": {"rdma": {"hostNetwork": True}}, "decode": {"tilert": {"ctrlPort": 5600}}},
        "spec.decode.tilert.ctrlPort",
        "NIXL side channel",
    ),
    (
        "ctrl-equals-http",
        {"decode": {"tilert": {"ctrlPort": 6000, "httpPort": 6000}}},
        "spec.decode.tilert.httpPort",
        "set different ports",
    ),
    (
        "hostnet-and-multus",
        {"transfer": {"rdma": {"hostNetwork": True, "networks": ["n"]}}},
        "spec.transfer.rdma.networks",
        "remove networks",
    ),
    (
        "weights-both",
        {"model": {"weights": {"tiny": True, "volume": {"emptyDir": {}}}}},
        "spec.model.weights",
        "set exactly one of volume",
    ),
    ("schema-type", {"prefill": {"replicas": "two"}}, "spec.prefill.replicas", "valid integer"),
    ("schema-enum", {"transfer": {"engine": "ucx"}}, "spec.transfer.engine", "'mooncake' or 'nixl'"),
    (
        "schema-list-item",
        {"transfer": {"rdma": {"networks": ["n", 5]}}},
        "spec.transfer.rdma.networks[1]",
        "valid string (got 5)",
    ),
    # What the API server and the controllers refuse in the children.
    (
        "rdma-env-pod-ip",
        {"transfer": {"rdma": {"env": {"POD_IP": "10.0.0.1"}}}},
        "spec.transfer.rdma.env.POD_IP",
        "remove it from spec.transfer.rdma.env",
    ),
    (
        "rdma-env-name",
        {"transfer": {"rdma": {"env": {"1X": "y"}}}},
        "spec.transfer.rdma.env.1X",
        "not a valid environment variable name",
    ),
    (
        "extra-args-port",
        {"prefill": {"extraArgs": ["--port", "9000"]}},
        "spec.prefill.extraArgs[0]",
        "--port is rendered by the operator",
    ),
    (
        "extra-args-host",
        {"decode": {"native": {"replicas": 1, "extraArgs": ["--enforce-eager", "--host=::"]}}},
        "spec.decode.native.extraArgs[1]",
        "--host is rendered by the operator",
    ),
    (
        "extra-args-model-len",
        {"prefill": {"extraArgs": ["--max-model-len=4096"]}},
        "spec.prefill.extraArgs[0]",
        "set spec.model.maxSeqLen",
    ),
    (
        "default-tilert-no-pool",
        {
            "decode": {"tilert": {"replicas": 0}, "native": {"replicas": 1}},
            "router": {"policy": {"default": "tilert"}},
        },
        "spec.router.policy.default",
        "set default: auto",
    ),
    (
        "default-native-no-pool",
        {"router": {"policy": {"default": "native"}}},
        "spec.router.policy.default",
        "give the native pool replicas",
    ),
    (
        "alias-in-both",
        {"router": {"policy": {"tilertAliases": ["fast", "m"], "nativeAliases": ["m"]}}},
        "spec.router.policy.nativeAliases",
        "remove it from one of the lists",
    ),
    (
        "toleration-unknown-field",
        {"prefill": {"tolerations": [{"key": "k", "operatr": "Exists"}]}},
        "spec.prefill.tolerations[0].operatr",
        "unknown field; a toleration has effect, key",
    ),
    (
        "toleration-exists-value",
        {"decode": {"tilert": {"tolerations": [{"key": "k", "operator": "Exists", "value": "v"}]}}},
        "spec.decode.tilert.tolerations[0].value",
        "remove it or use operator: Equal",
    ),
    (
        "toleration-effect",
        {"router": {"tolerations": [{"key": "k", "effect": "NoScheduling"}]}},
        "spec.router.tolerations[0].effect",
        "use NoSchedule, PreferNoSchedule or NoExecute",
    ),
    (
        "overrides-delete-selector",
        {"prefill": {"overrides": {"spec": {"selector": None}}}},
        "spec.prefill.overrides",
        "do not override spec.selector",
    ),
    (
        "overrides-relabel",
        {
            "router": {
                "overrides": {"spec": {"template": {"metadata": {"labels": {"pd.tilert.ai/component": "x"}}}}}
            }
        },
        "spec.router.overrides",
        "keep the operator's labels",
    ),
    (
        "overrides-env-twice",
        {
            "decode": {
                "tilert": {
                    "overrides": {
                        "spec": {
                            "template": {
                                "spec": {
                                    "containers": [
                                        {
                                            "name": "decode",
                                            "env": [{"name": "A", "value": "1"}, {"name": "A", "value": "2"}],
                                        }
                                    ]
                                }
                            }
                        }
                    }
                }
            }
        },
        "spec.decode.tilert.overrides",
        "sets the environment variable A",
    ),
    (
        "metrics-from-empty-peer",
        {"networkPolicies": {"metricsFrom": [{"podSelector": {}}, {}]}},
        "spec.networkPolicies.metricsFrom[1]",
        "set podSelector, namespaceSelector or ipBlock",
    ),
    (
        "metrics-from-unknown",
        {"networkPolicies": {"metricsFrom": [{"podSelecter": {}}]}},
        "spec.networkPolicies.metricsFrom[0].podSelecter",
        "unknown field",
    ),
    (
        "quantity-unparsable",
        {"prefill": {"resources": {"requests": {"cpu": "lots"}}}},
        "spec.prefill.resources.requests.cpu",
        "write a quantity such as 500m",
    ),
    (
        "quantity-negative",
        {"router": {"resources": {"limits": {"memory": "-1Gi"}}}},
        "spec.router.resources.limits.memory",
        "is negative",
    ),
    (
        "request-over-limit",
        {"prefill": {"resources": {"requests": {"memory": "2Gi"}, "limits": {"memory": "1.5Gi"}}}},
        "spec.prefill.resources.requests.memory",
        "raise the limit",
    ),
    (
        "resources-unknown-field",
        {"prefill": {"resources": {"request": {"cpu": 1}}}},
        "spec.prefill.resources.request",
        "unknown field",
    ),
    ("shm-size", {"transfer": {"shmSize": "lots"}}, "spec.transfer.shmSize", "write a size such as 2Gi"),
    (
        "node-selector-value",
        {"decode": {"tilert": {"nodeSelector": {"gpu": "b200 x8"}}}},
        "spec.decode.tilert.nodeSelector.gpu",
        "not a valid label value",
    ),
    (
        "node-selector-key",
        {"prefill": {"nodeSelector": {"-gpu": "b200"}}},
        "spec.prefill.nodeSelector.-gpu",
        "not a valid label key",
    ),
    (
        "metrics-from-label",
        {"networkPolicies": {"metricsFrom": [{"namespaceSelector": {"matchLabels": {"team": "-x"}}}]}},
        "spec.networkPolicies.metricsFrom[0].namespaceSelector.matchLabels.team",
        "not a valid label value",
    ),
]


@pytest.mark.parametrize(("patch", "field", "fix"), [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_spec_names_field_and_fix(patch: dict[str, Any], field: str, fix: str) -> None:
    _, problems = validation.validate(helpers.minimal(**patch), "t")
    assert any(p.field == field and fix in p.message for p in problems), [str(p) for p in problems]


@pytest.mark.parametrize("path", helpers.EXAMPLES, ids=lambda p: p.stem)
def test_examples_are_valid(path: Any) -> None:
    import yaml

    doc = yaml.safe_load(path.read_text())
    parsed, problems = validation.validate(doc["spec"], doc["metadata"]["name"])
    assert parsed is not None and problems == []


def test_pool_rules_skip_a_pool_with_no_replicas() -> None:
    # A native-only mla cluster keeps the TileRT pool's defaults (engine tilert, 8 GPUs) unused.
    spec = helpers.minimal(
        decode={"tilert": {"replicas": 0, "engine": "tilert", "gpus": 8}, "native": {"replicas": 1}}
    )
    assert validation.validate(spec, "t")[1] == []


def test_name_length_follows_from_the_children_names() -> None:
    """The longest name whose TileRT StatefulSet fits 52 (its pods' controller-revision-hash label,
    <statefulset>-<10-character hash>, must fit 63) and whose Services fit 63."""
    limit = validation.max_name_length()
    assert limit == 52 - len("-tilert-decode") == 38
    assert validation.validate(helpers.minimal(), "x" * limit)[1] == []
    [problem] = validation.validate(helpers.minimal(), "x" * (limit + 1))[1]
    assert (
        problem.field == "metadata.name"
        and f"at most {limit}" in problem.message
        and "controller-revision-hash" in problem.message
    )
    spec = specmod.parse(helpers.minimal(decode={"native": {"replicas": 1}}))
    for obj in render.children(spec, "x" * limit, "default"):
        name = obj["metadata"]["name"]
        assert len(name) <= (validation.STATEFULSET_NAME_MAX if obj["kind"] == "StatefulSet" else 63), name
        if obj["kind"] == "Service":
            assert validation.DNS1035_LABEL.fullmatch(name), name
    sts = [o for o in render.children(spec, "x" * (limit + 1), "default") if o["kind"] == "StatefulSet"]
    assert len(sts[0]["metadata"]["name"]) == validation.STATEFULSET_NAME_MAX + 1


@pytest.mark.parametrize("name", ["1tiny", "tiny.v2", "-x", "x-"])
def test_a_name_that_cannot_name_a_service_is_refused(name: str) -> None:
    [problem] = validation.validate(helpers.minimal(), name)[1]
    assert (
        problem.field == "metadata.name"
        and "a Service name must start with a lowercase letter" in problem.message
    )


def _cel(schema: dict[str, Any], path: list[str]) -> list[str]:
    for key in path:
        schema = schema["properties"][key]
    return [r["rule"] for r in schema.get("x-kubernetes-validations") or []]


def test_the_crd_refuses_the_operators_env_names_and_flags() -> None:
    """The CRD's CEL lists (what kubectl apply refuses) are the operator's own: its downward-API env
    names over every example and a Multus spec, and the flags it renders."""
    schema = crd_validator.load_schema()["properties"]["spec"]
    [env_rule] = _cel(schema, ["transfer", "rdma", "env"])
    listed = set(re.findall(r"'([A-Z_]+)' in self", env_rule))
    specs = [yaml.safe_load(p.read_text())["spec"] for p in helpers.EXAMPLES]
    specs.append(
        helpers.minimal(transfer={"rdma": {"networks": ["rdma-net"]}}, decode={"native": {"replicas": 1}})
    )
    rendered = set().union(*(validation.operator_env_names(specmod.parse(s)) for s in specs))
    assert listed == rendered
    [args_rule] = _cel(schema, ["prefill", "extraArgs"])
    assert set(re.findall(r"'(--[a-z-]+)'", args_rule)) == set(validation.RENDERED_FLAGS)
    assert set(re.findall(r"'(--[a-z-]+)='", args_rule)) == set(validation.RENDERED_FLAGS)


CEL_TOO = [
    "rdma-env-pod-ip",
    "extra-args-port",
    "extra-args-host",
    "default-tilert-no-pool",
    "default-native-no-pool",
    "alias-in-both",
    "toleration-unknown-field",
    "toleration-exists-value",
    "toleration-effect",
    "metrics-from-empty-peer",
    "metrics-from-unknown",
    "quantity-unparsable",
    "resources-unknown-field",
    "shm-size",
]


@pytest.mark.parametrize("case", CEL_TOO)
def test_kubectl_apply_refuses_what_the_crd_can_express(case: str) -> None:
    """Admission without the webhook: the CRD's schema and CEL refuse these as the operator does."""
    [patch] = [b[1] for b in BAD if b[0] == case]
    _, errors = crd_validator.validate(helpers.cr(helpers.minimal(**patch)))
    assert errors, case
    for name in ("1tiny", "x" * 39):
        _, errors = crd_validator.validate(helpers.cr(helpers.minimal(), name))
        assert any("metadata.name must" in e for e in errors), errors


@pytest.mark.parametrize(
    ("name", "patch", "field"),
    [
        ("1tiny", {}, "metadata.name"),
        ("t", {"transfer": {"rdma": {"env": {"POD_IP": "x"}}}}, "spec.transfer.rdma.env.POD_IP"),
        ("t", {"networkPolicies": {"metricsFrom": [{}]}}, "spec.networkPolicies.metricsFrom[0]"),
    ],
)
def test_the_webhook_refuses_what_the_api_server_would_refuse_in_the_children(
    name: str, patch: dict[str, Any], field: str
) -> None:
    import kopf

    from tilert_operator import admission

    with pytest.raises(kopf.AdmissionError) as refused:
        admission.check(helpers.minimal(**patch), name)
    assert f"{field}: " in str(refused.value)
