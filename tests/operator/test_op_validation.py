"""Cross-field rules: each bad spec is rejected with a message naming the field and the fix."""

from __future__ import annotations

from typing import Any

import pdc_helpers as helpers
import pytest

from tilert_operator import validation

BAD: list[tuple[str, dict[str, Any], str, str]] = [
    ("prefill-gpus-vs-tp", {"prefill": {"gpus": 4, "tensorParallelSize": 8}}, "spec.prefill.gpus", "set gpus: 8 or tensorParallelSize: 4"),
    ("native-gpus-vs-tp", {"decode": {"native": {"replicas": 1, "gpus": 2, "tensorParallelSize": 1}}}, "spec.decode.native.gpus", "set gpus: 1"),
    ("gpu-in-resources", {"prefill": {"resources": {"limits": {"nvidia.com/gpu": 8}}}}, "spec.prefill.resources.limits", "set spec.prefill.gpus instead"),
    ("tilert-engine-gpus", {"model": {"tilertModel": "glm5", "kvCacheDtype": "fp8_ds_mla"}, "decode": {"tilert": {"engine": "tilert", "gpus": 4}}},
     "spec.decode.tilert.gpus", "set gpus: 8, or engine: reference"),
    ("tilert-engine-mla", {"decode": {"tilert": {"engine": "tilert", "gpus": 8}}}, "spec.decode.tilert.engine", "set engine: reference"),
    ("kv-dtype-vs-model", {"model": {"kvCacheDtype": "fp8_ds_mla"}}, "spec.model.kvCacheDtype", "set kvCacheDtype: bfloat16"),
    ("float32-vs-dsa-model", {"model": {"tilertModel": "glm5", "kvCacheDtype": "float32"}}, "spec.model.kvCacheDtype",
     "set kvCacheDtype: auto"),
    ("mtp-on-prefill", {"prefill": {"mtp": {"enabled": False}}}, "spec.prefill.mtp.enabled", "set spec.prefill.mtp.enabled: true"),
    ("no-decode-pool", {"decode": {"tilert": {"replicas": 0}}}, "spec.decode", "set spec.decode.tilert.replicas or"),
    ("native-needs-connector", {"prefill": {"nativeConnector": "none"}, "decode": {"native": {"replicas": 1}}},
     "spec.prefill.nativeConnector", "set NixlConnector"),
    ("rdma-needs-resources", {"transfer": {"protocol": "rdma"}}, "spec.transfer.rdma.resources", "set them, or protocol: tcp"),
    ("hostnet-port-clash", {"transfer": {"rdma": {"hostNetwork": True}}, "decode": {"tilert": {"httpPort": 8100}}},
     "spec.decode.tilert.httpPort", "pick another port"),
    ("hostnet-nixl-port", {"transfer": {"rdma": {"hostNetwork": True}}, "decode": {"tilert": {"ctrlPort": 5600}}},
     "spec.decode.tilert.ctrlPort", "NIXL side channel"),
    ("ctrl-equals-http", {"decode": {"tilert": {"ctrlPort": 6000, "httpPort": 6000}}}, "spec.decode.tilert.httpPort", "set different ports"),
    ("hostnet-and-multus", {"transfer": {"rdma": {"hostNetwork": True, "networks": ["n"]}}}, "spec.transfer.rdma.networks", "remove networks"),
    ("weights-both", {"model": {"weights": {"tiny": True, "volume": {"emptyDir": {}}}}}, "spec.model.weights", "set exactly one of volume"),
    ("schema-type", {"prefill": {"replicas": "two"}}, "spec.prefill.replicas", "valid integer"),
    ("schema-enum", {"transfer": {"engine": "ucx"}}, "spec.transfer.engine", "'mooncake' or 'nixl'"),
    ("schema-list-item", {"transfer": {"rdma": {"networks": ["n", 5]}}}, "spec.transfer.rdma.networks[1]", "valid string (got 5)"),
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
    spec = helpers.minimal(decode={"tilert": {"replicas": 0, "engine": "tilert", "gpus": 8}, "native": {"replicas": 1}})
    assert validation.validate(spec, "t")[1] == []


def test_name_length() -> None:
    assert validation.validate(helpers.minimal(), "x" * 41)[1][0].field == "metadata.name"
