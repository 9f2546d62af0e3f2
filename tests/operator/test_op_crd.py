"""The CRD: valid itself, small, documented, defaults equal to spec.py, examples pass schema + CEL,
bad resources rejected with the expected messages."""

from __future__ import annotations

from typing import Any

import kubernetes_validate
import pdc_crd_validator as crd_validator
import pdc_helpers as helpers
import pytest
import yaml

from tilert_operator import constants
from tilert_operator import spec as specmod
from tilert_serve import defaults, tracing


def test_crd_is_a_valid_small_crd() -> None:
    text = crd_validator.CRD_PATH.read_text()
    crd = yaml.safe_load(text)
    kubernetes_validate.validate(crd, helpers.K8S_VERSION, strict=True)
    # Embedding a PodTemplate would take ~600k characters (and kubectl's client-side apply annotation
    # caps an object at 256 KiB); our own sections stay well below this.
    assert len(text) < 60_000, "keep the CRD small: no embedded PodTemplate"
    names = crd["spec"]["names"]
    assert (crd["spec"]["group"], names["kind"], names["plural"], names["shortNames"]) == (
        constants.GROUP,
        constants.KIND,
        constants.PLURAL,
        ["pdc"],
    )
    version = crd["spec"]["versions"][0]
    assert version["name"] == constants.VERSION and version["subresources"] == {"status": {}}
    cols = [c["name"] for c in version["additionalPrinterColumns"]]
    assert cols == ["Ready", "Prefill", "TileRT", "Native", "Router", "Rollout", "Age"]


def _leaves(schema: dict[str, Any], path: str) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for key, sub in (schema.get("properties") or {}).items():
        p = f"{path}.{key}"
        out.append((p, sub))
        out += _leaves(sub, p)
    return out


def test_every_spec_field_is_documented_with_its_default() -> None:
    spec_schema = crd_validator.load_schema()["properties"]["spec"]
    missing = []
    for path, sub in _leaves(spec_schema, "spec"):
        desc = sub.get("description", "")
        if sub.get("type") != "object" and not desc:
            missing.append(f"{path}: no description")
        if "default" in sub and sub.get("type") != "object" and "Default" not in desc:
            missing.append(f"{path}: description does not state the default")
    assert not missing, missing


def test_crd_defaults_equal_the_spec_model() -> None:
    """Default the same minimal object through the CRD and through pydantic: they must agree."""
    raw = {
        "model": {"name": "m", "weights": {"tiny": True}, "tilertModel": "mla"},
        "router": {"apiKeysSecret": {"name": "k"}},
    }
    defaulted, errors = crd_validator.validate(helpers.cr(raw))
    assert not errors
    model = specmod.parse(raw).model_dump(by_alias=True, exclude_none=True)
    assert defaulted["spec"] == model


def test_crd_port_defaults_come_from_tilert_serve_defaults() -> None:
    tilert = crd_validator.load_schema()["properties"]["spec"]["properties"]["decode"]["properties"]["tilert"]
    assert tilert["properties"]["ctrlPort"]["default"] == defaults.DECODE_CTRL_PORT
    assert tilert["properties"]["httpPort"]["default"] == defaults.DECODE_HTTP_PORT
    router = crd_validator.load_schema()["properties"]["spec"]["properties"]["router"]
    assert router["properties"]["service"]["properties"]["port"]["default"] == defaults.ROUTER_PORT


def test_crd_tracing_endpoint_pattern_is_the_components_own() -> None:
    # The router and the node check the URL with tracing.URL_PATTERN; the CRD refuses what they would.
    spec = crd_validator.load_schema()["properties"]["spec"]["properties"]
    endpoint = spec["observability"]["properties"]["tracing"]["properties"]["endpoint"]
    assert endpoint["pattern"] == f"^(|{tracing.URL_PATTERN})$"


@pytest.mark.parametrize("path", helpers.EXAMPLES, ids=lambda p: p.stem)
def test_examples_pass_schema_and_cel(path: Any) -> None:
    obj = yaml.safe_load(path.read_text())
    _, errors = crd_validator.validate(obj)
    assert errors == []


BAD = [
    (
        {"model": {"name": "m", "weights": {"tiny": True}, "tilertModel": "llama"}},
        "spec.model.tilertModel: 'llama' is not one of",
    ),
    (
        {"model": {"name": "m", "weights": {"tiny": True}, "tilertModel": "mla"}, "prefill": {"replicas": 0}},
        "spec.prefill.replicas: 0 is less than the minimum",
    ),
    (
        {"model": {"name": "m", "weights": {"tiny": True}, "tilertModel": "mla"}, "prefil": {}},
        "'prefil' was unexpected",
    ),
    (
        {"model": {"name": "m", "weights": {}, "tilertModel": "mla"}},
        "set exactly one of spec.model.weights.volume",
    ),
    (
        {
            "model": {"name": "m", "weights": {"tiny": True}, "tilertModel": "mla"},
            "transfer": {"protocol": "rdma"},
        },
        "spec.transfer.protocol=rdma needs spec.transfer.rdma.resources",
    ),
    (
        {
            "model": {"name": "m", "weights": {"tiny": True}, "tilertModel": "mla"},
            "decode": {"tilert": {"replicas": 0}},
        },
        "spec.decode needs at least one decode replica",
    ),
    (
        {
            "model": {"name": "m", "weights": {"tiny": True}, "tilertModel": "mla"},
            "decode": {"tilert": {"ctrlPort": 5557}},
        },
        "ctrlPort and httpPort must differ",
    ),
    (
        {
            "model": {"name": "m", "weights": {"tiny": True}, "tilertModel": "mla"},
            "transfer": {"shmSize": "lots"},
        },
        "spec.transfer.shmSize: 'lots' does not match",
    ),
]


@pytest.mark.parametrize(("spec", "expected"), BAD, ids=[e for _, e in BAD])
def test_bad_resources_are_rejected_with_the_expected_message(spec: dict[str, Any], expected: str) -> None:
    _, errors = crd_validator.validate(helpers.cr(spec))
    assert any(expected in e for e in errors), errors


def test_long_name_rejected() -> None:
    _, errors = crd_validator.validate(helpers.cr(helpers.minimal(), name="x" * 39))
    assert any("metadata.name must be at most 38" in e for e in errors)


def test_model_identity_is_immutable() -> None:
    old = helpers.cr(helpers.minimal())
    new = helpers.cr(
        helpers.minimal(
            model={"tilertModel": "glm5"}, decode={"tilert": {"replicas": 0}, "native": {"replicas": 1}}
        )
    )
    _, errors = crd_validator.validate(new, old=old)
    assert any("spec.model.name and spec.model.tilertModel are immutable" in e for e in errors), errors
    _, errors = crd_validator.validate(helpers.cr(helpers.minimal(prefill={"replicas": 3})), old=old)
    assert errors == []
