"""The prefill's compatibility generation (pd_vllm/generation.py): derived from vLLM's config before any
cache exists, it must be the layout the registered caches give (worker.classify), so the fingerprint
the scheduler advertises is the one the workers' handshakes carry; a worker whose caches say otherwise
refuses to start."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tilert_serve.compat import Compat
from tilert_serve.pd_vllm.config import ConnectorConfig
from tilert_serve.pd_vllm.generation import expected_layout, prefill_compat
from tilert_serve.pd_vllm.worker import TileRTWorker, classify

BASE = {"tilert_model": "mla", "tilert_max_seq_len": 256, "tilert_local_host": "127.0.0.1"}


def _vllm_config(
    *, cache_dtype: str = "auto", dtype: torch.dtype = torch.float32, mtp: bool = True, name: str = "tiny"
) -> SimpleNamespace:
    return SimpleNamespace(
        model_config=SimpleNamespace(
            served_model_name=name,
            model="/models/tiny",
            dtype=dtype,
            hf_config=SimpleNamespace(num_hidden_layers=2, num_nextn_predict_layers=1),
        ),
        cache_config=SimpleNamespace(cache_dtype=cache_dtype),
        speculative_config=SimpleNamespace(method="mtp") if mtp else None,
    )


def _caches(layers: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    return {
        f"model.layers.{i}.self_attn.attn": torch.zeros(4, 1, 16, 576, dtype=dtype) for i in range(layers)
    }


@pytest.mark.parametrize(
    ("config", "caches"),
    [
        (_vllm_config(), _caches(3, torch.float32)),  # MTP drafter: its layer has a cache too
        (_vllm_config(mtp=False), _caches(2, torch.float32)),
        (_vllm_config(dtype=torch.bfloat16), _caches(3, torch.bfloat16)),
        (_vllm_config(cache_dtype="bfloat16", dtype=torch.float32), _caches(3, torch.bfloat16)),
    ],
)
def test_the_derived_layout_is_the_caches_layout(
    config: SimpleNamespace, caches: dict[str, torch.Tensor]
) -> None:
    derived = expected_layout("mla", config)
    registered, _ = classify(caches, "mla", {}, {0: 16}, num_hidden_layers=2)
    assert derived.fingerprint == registered.fingerprint, (derived.describe(), registered.describe())


def test_the_generation_names_model_revision_and_layout() -> None:
    cfg = ConnectorConfig.from_extra_config({**BASE, "model_revision": "rev-7"})
    c = prefill_compat(cfg.tilert_model, cfg.model_revision, _vllm_config())
    assert (c.model, c.revision) == ("tiny", "rev-7")
    assert c == Compat("tiny", "rev-7", expected_layout("mla", _vllm_config()).fingerprint)
    assert c.fingerprint != prefill_compat("mla", "rev-8", _vllm_config()).fingerprint
    assert c.fingerprint != prefill_compat("mla", "rev-7", _vllm_config(name="other")).fingerprint
    assert c.fingerprint != prefill_compat("mla", "rev-7", _vllm_config(mtp=False)).fingerprint
    assert ConnectorConfig.from_extra_config(BASE).model_revision == ""


def test_a_worker_whose_caches_disagree_with_the_advertised_generation_refuses_to_start(tmp_path) -> None:
    secret = tmp_path / "secret"
    secret.write_text("ab" * 32)
    advertised = prefill_compat("mla", "", _vllm_config(mtp=False))  # the scheduler thought: no MTP
    w = TileRTWorker(
        ConnectorConfig.from_extra_config({**BASE, "tilert_secret_path": str(secret)}),
        rank=0,
        world_size=1,
        group_of={},
        block_size_of={0: 16},
        num_hidden_layers=2,
        compat=advertised,
    )
    with pytest.raises(ValueError, match="not the one derived from vLLM's config"):
        w.register(_caches(3, torch.float32))
