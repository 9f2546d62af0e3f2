"""spec.autoscaling and each pool's autoscaling bounds: every bad spec is refused by the operator's
rules with the field and the fix, and the CRD's CEL refuses what it can express (kubectl apply
without the webhook)."""

from __future__ import annotations

from typing import Any

import pdc_crd_validator as crd_validator
import pdc_helpers as helpers
import pytest

from tilert_operator import spec as specmod
from tilert_operator import validation


def _on(**bounds: Any) -> dict[str, Any]:
    return {"autoscaling": {"enabled": True, **bounds}}


#: (id, patch, the field named, a fix the message states, whether the CRD's CEL refuses it too)
BAD: list[tuple[str, dict[str, Any], str, str, bool]] = [
    (
        "no-max",
        {"prefill": {"autoscaling": {"enabled": True}}},
        "spec.prefill.autoscaling.maxReplicas",
        "set it",
        True,
    ),
    (
        "min-above-max",
        {"decode": {"native": {"replicas": 2, **_on(minReplicas=3, maxReplicas=2)}}},
        "spec.decode.native.autoscaling.minReplicas",
        "lower minReplicas or raise maxReplicas",
        True,
    ),
    (
        "replicas-above-max",
        {"decode": {"tilert": {"replicas": 4, **_on(maxReplicas=3)}}},
        "spec.decode.tilert.replicas",
        "set replicas within it",
        True,
    ),
    (
        "replicas-below-min",
        {"prefill": {"replicas": 1, **_on(minReplicas=2, maxReplicas=4)}},
        "spec.prefill.replicas",
        "set replicas within it",
        True,
    ),
    (
        "decode-may-vanish",
        {"decode": {"tilert": {"replicas": 1, **_on(minReplicas=0, maxReplicas=2)}}},
        "spec.decode",
        "minReplicas to 1",
        False,
    ),
    (
        "default-tilert-min-0",
        {
            "router": {"policy": {"default": "tilert"}},
            "decode": {"tilert": _on(minReplicas=0, maxReplicas=2), "native": {"replicas": 1}},
        },
        "spec.decode.tilert.autoscaling.minReplicas",
        "set minReplicas to 1, or the default to auto",
        False,
    ),
    (
        "ratio-min-above-max",
        {"autoscaling": {"prefillToDecodeRatio": {"min": 2, "max": 1}}},
        "spec.autoscaling.prefillToDecodeRatio.min",
        "lower min or raise max",
        True,
    ),
    (
        "ratio-max-unreachable",
        {
            "prefill": {"replicas": 4, **_on(minReplicas=4, maxReplicas=8)},
            "autoscaling": {"prefillToDecodeRatio": {"max": 1}},
        },
        "spec.autoscaling.prefillToDecodeRatio.max",
        "raise max",
        False,
    ),
    (
        "ratio-min-unreachable",
        {
            "decode": {"tilert": {"replicas": 4, **_on(minReplicas=4, maxReplicas=8)}},
            "autoscaling": {"prefillToDecodeRatio": {"min": 0.5}},
        },
        "spec.autoscaling.prefillToDecodeRatio.min",
        "raise spec.prefill.autoscaling.maxReplicas",
        False,
    ),
    (
        "tilert-max-over-surge-gpus",
        {
            "model": {"tilertModel": "glm5", "kvCacheDtype": "auto"},
            "prefill": {"gpus": 8, "tensorParallelSize": 8},
            "decode": {"tilert": {"engine": "tilert", "gpus": 8, **_on(maxReplicas=4)}},
            "generationRollout": {"maxSurgeGpus": 16},
        },
        "spec.generationRollout.maxSurgeGpus",
        "raise it to 40",
        False,
    ),
    (
        "native-max-needs-connector",
        {
            "prefill": {"nativeConnector": "none"},
            "decode": {"native": {"replicas": 0, **_on(minReplicas=0, maxReplicas=2)}},
        },
        "spec.prefill.nativeConnector",
        "set NixlConnector",
        False,
    ),
    (
        "tilert-engine-checked-at-max",
        {
            "decode": {
                "tilert": {"replicas": 0, "engine": "tilert", "gpus": 8, **_on(minReplicas=0, maxReplicas=2)},
                "native": {"replicas": 1},
            }
        },
        "spec.decode.tilert.engine",
        "set engine: reference",
        False,
    ),
]


@pytest.mark.parametrize(("patch", "field", "fix"), [b[1:4] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_autoscaling_names_field_and_fix(patch: dict[str, Any], field: str, fix: str) -> None:
    _, problems = validation.validate(helpers.minimal(**patch), "t")
    assert any(p.field == field and fix in p.message for p in problems), [str(p) for p in problems]


@pytest.mark.parametrize("patch", [b[1] for b in BAD if b[4]], ids=[b[0] for b in BAD if b[4]])
def test_kubectl_apply_refuses_what_the_crd_can_express(patch: dict[str, Any]) -> None:
    _, errors = crd_validator.validate(helpers.cr(helpers.minimal(**patch)))
    assert errors


GOOD: list[dict[str, Any]] = [
    {"prefill": {"replicas": 2, **_on(minReplicas=1, maxReplicas=4)}},
    {
        "decode": {
            "tilert": {"replicas": 1, **_on(minReplicas=1, maxReplicas=4)},
            "native": {"replicas": 0, **_on(minReplicas=0, maxReplicas=3)},
        },
        "autoscaling": {"prefillToDecodeRatio": {"min": 0.1, "max": 1}, "objective": {"ttftSeconds": 1}},
    },
]


@pytest.mark.parametrize("patch", GOOD, ids=["prefill", "decode-with-ratio"])
def test_good_autoscaling_passes_both(patch: dict[str, Any]) -> None:
    spec = helpers.minimal(**patch)
    assert validation.validate(spec, "t")[1] == []
    assert crd_validator.validate(helpers.cr(spec))[1] == []


def test_bounds_of_a_pool_left_alone_are_its_replicas() -> None:
    s = specmod.parse(helpers.minimal(prefill={"replicas": 3}))
    assert s.prefill.autoscaling.bounds(s.prefill.replicas) == (3, 3)
    s = specmod.parse(helpers.minimal(prefill={"replicas": 3, **_on(minReplicas=2, maxReplicas=5)}))
    assert s.prefill.autoscaling.bounds(s.prefill.replicas) == (2, 5)


def test_the_prefill_cannot_scale_to_zero() -> None:
    _, problems = validation.validate(helpers.minimal(prefill=_on(minReplicas=0, maxReplicas=2)), "t")
    assert any(p.field == "spec.prefill.autoscaling.minReplicas" for p in problems), problems
    _, errors = crd_validator.validate(helpers.cr(helpers.minimal(prefill=_on(minReplicas=0, maxReplicas=2))))
    assert any("minReplicas" in e for e in errors), errors
