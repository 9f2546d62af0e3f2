"""The prefill's compatibility generation (tilert_serve/compat.py), derived from vLLM's config.

The scheduler half of the connector puts the fingerprint in every claimed request's kv_transfer_params
(`compat`, which the router compares with the chosen decode's) before any worker has registered its
caches, so it derives the handoff layout from the same inputs the caches are built from: the model
family, the KV-cache dtype (the model's dtype under "auto"), the checkpoint's layer count and, with an
MTP drafter, its layers. Each worker derives the layout from the caches it registered
(worker.classify) and sends that generation in its handshake; the two must agree, and a worker that
finds otherwise says so at start (worker.py), since the router would otherwise pair the prefill by a
generation its handoffs do not carry.
"""

from __future__ import annotations

from typing import Any

import torch

from tilert_serve import layouts
from tilert_serve.compat import Compat

#: vLLM KV-cache dtype names of the torch dtypes a model runs in, for a cache dtype of "auto".
_MODEL_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def served_model_name(vllm_config: Any) -> str:
    """The name clients send (vLLM's --served-model-name; without it, the model path)."""
    name = getattr(vllm_config.model_config, "served_model_name", None) or vllm_config.model_config.model
    return str(name[0] if isinstance(name, (list, tuple)) else name)


def mtp_layers(vllm_config: Any) -> int:
    """KV-cache layers the MTP drafter adds past the checkpoint's main layers (0 without one)."""
    spec = getattr(vllm_config, "speculative_config", None)
    if spec is None or getattr(spec, "method", None) != "mtp":
        return 0
    return int(getattr(vllm_config.model_config.hf_config, "num_nextn_predict_layers", 0) or 0)


def expected_layout(tilert_model: str, vllm_config: Any) -> layouts.Layout:
    """The handoff layout this vLLM's caches will have (worker.classify derives it from them)."""
    dtype = str(vllm_config.cache_config.cache_dtype)
    if dtype == "auto":
        model_dtype = vllm_config.model_config.dtype
        if model_dtype not in _MODEL_DTYPES:
            raise ValueError(f"TileRTConnector: no handoff layout for a {model_dtype} KV cache")
        dtype = _MODEL_DTYPES[model_dtype]
    mtp = mtp_layers(vllm_config)
    num_layers = int(vllm_config.model_config.hf_config.num_hidden_layers) + mtp
    if tilert_model == "mla":
        return layouts.get("mla", dtype, num_layers=num_layers, num_mtp_layers=mtp)
    return layouts.get(tilert_model, dtype, num_layers=num_layers)


def prefill_compat(tilert_model: str, model_revision: str, vllm_config: Any) -> Compat:
    return Compat(
        served_model_name(vllm_config), model_revision, expected_layout(tilert_model, vllm_config).fingerprint
    )
