"""The compatibility fingerprint: equal fields give equal fingerprints, any changed field another."""

from __future__ import annotations

import dataclasses

from tilert_serve.compat import Compat, compatible
from tilert_serve.layouts import registry


def _base() -> Compat:
    layout = registry.get("mla", "float32", num_layers=4, num_mtp_layers=1)
    return Compat(model="tiny", revision="tiny", layout=layout.fingerprint)


def test_equal_fields_equal_fingerprint() -> None:
    assert _base().fingerprint == _base().fingerprint
    assert len(_base().fingerprint) == 12


def test_each_field_changes_the_fingerprint() -> None:
    base = _base()
    changes = {"model": "other", "revision": "v2", "layout": "x" * 16, "protocol": base.protocol + 1}
    seen = {base.fingerprint}
    for field, value in changes.items():
        fp = dataclasses.replace(base, **{field: value}).fingerprint
        assert fp not in seen, field
        seen.add(fp)


def test_layout_changes_with_dtype_and_mtp() -> None:
    a = registry.get("mla", "float32", num_layers=4, num_mtp_layers=1).fingerprint
    b = registry.get("mla", "bfloat16", num_layers=4, num_mtp_layers=1).fingerprint
    c = registry.get("mla", "float32", num_layers=4, num_mtp_layers=0).fingerprint
    assert len({a, b, c}) == 3


def test_unadvertised_pairs_with_anything() -> None:
    assert compatible(None, "abc") and compatible("abc", None) and compatible("abc", "abc")
    assert not compatible("abc", "abd")
