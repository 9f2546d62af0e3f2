"""The supported layouts: GLM-5, DeepSeek-V3.2 and small DeepSeek-V3-style MLA models.

Facts (docs/reference/kv-layouts.md): vLLM's FLASHMLA_SPARSE cache with fp8_ds_mla stores a
656-byte row per token (512 fp8 latent values, 4 fp32 scales, 64 bf16 RoPE values); bf16 rows are
576 bf16 = 1152 bytes. The DSA indexer key cache stores, per 64-token page, 64x128 fp8 values then
64 fp32 scales = 8448 bytes. Every model here has one MTP draft layer after its main layers.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from tilert_serve.layouts.base import Layout, Plane

# Layout versions. A version changes whenever the bytes of a plane or the order of layers or planes
# change; both sides refuse a peer with another version (hello / request).
#   1: planes "mla" (vLLM row as stored) and, for DSA models, "indexer" (vLLM page as stored);
#      main layers first, then MTP layers.
LAYOUT_VERSION: Final = 1

KV_LORA_RANK: Final = 512
ROPE_DIM: Final = 64
INDEX_HEAD_DIM: Final = 128
INDEXER_PAGE_TOKENS: Final = 64
#: fp8 values then one fp32 scale per token.
INDEXER_PAGE_BYTES: Final = INDEXER_PAGE_TOKENS * INDEX_HEAD_DIM + INDEXER_PAGE_TOKENS * 4  # 8448
#: 512 fp8 latent + 4 fp32 scales (one per 128 values) + 64 bf16 RoPE.
FP8_DS_MLA_ROW_BYTES: Final = KV_LORA_RANK + 4 * 4 + ROPE_DIM * 2  # 656

_ITEMSIZE: Final[Mapping[str, int]] = {"bfloat16": 2, "float16": 2, "float32": 4}

#: name -> (main layers, MTP layers) for the fixed-shape models.
DSA_MODELS: Final[Mapping[str, tuple[int, int]]] = {"glm5": (78, 1), "deepseek_v3_2": (61, 1)}
MODELS: Final = (*DSA_MODELS, "mla")
KV_CACHE_DTYPES: Final[Mapping[str, tuple[str, ...]]] = {
    "glm5": ("fp8_ds_mla", "bfloat16"),
    "deepseek_v3_2": ("fp8_ds_mla", "bfloat16"),
    # vLLM's CPU MLA backend caches in the model dtype.
    "mla": ("bfloat16", "float16", "float32"),
}
#: vLLM spellings that mean the same cache format.
_DTYPE_ALIASES: Final[Mapping[str, str]] = {
    "fp8": "fp8_ds_mla",
    "bf16": "bfloat16",
    "fp32": "float32",
    "half": "float16",
    "float": "float32",
}


def _mla_row_bytes(kv_cache_dtype: str) -> int:
    if kv_cache_dtype == "fp8_ds_mla":
        return FP8_DS_MLA_ROW_BYTES
    return (KV_LORA_RANK + ROPE_DIM) * _ITEMSIZE[kv_cache_dtype]


def normalize_dtype(kv_cache_dtype: str) -> str:
    return _DTYPE_ALIASES.get(kv_cache_dtype, kv_cache_dtype)


def get(model: str, kv_cache_dtype: str, *, num_layers: int | None = None, num_mtp_layers: int = 1) -> Layout:
    """The layout of `model` with vLLM KV-cache dtype `kv_cache_dtype`.

    `num_layers` (main + MTP) is required for `mla`, whose depth depends on the checkpoint, and
    must match the fixed depth when given for the others.
    """
    dtype = normalize_dtype(kv_cache_dtype)
    if model not in MODELS:
        raise ValueError(f"unknown tilert model {model!r}; choose one of {', '.join(MODELS)}")
    if dtype not in KV_CACHE_DTYPES[model]:
        raise ValueError(
            f"model {model!r} does not support KV-cache dtype {kv_cache_dtype!r}; "
            f"use one of {', '.join(KV_CACHE_DTYPES[model])}"
        )
    planes = [Plane("mla", 1, _mla_row_bytes(dtype))]
    if model in DSA_MODELS:
        main, mtp = DSA_MODELS[model]
        if num_layers is not None and num_layers != main + mtp:
            raise ValueError(f"{model} has {main + mtp} layers ({main} main + {mtp} MTP), not {num_layers}")
        planes.append(Plane("indexer", INDEXER_PAGE_TOKENS, INDEXER_PAGE_BYTES))
        index_dim = INDEX_HEAD_DIM
    else:
        if num_layers is None:
            raise ValueError("the mla layout needs num_layers (main + MTP layers) from the model's config")
        if not 0 <= num_mtp_layers < num_layers:
            raise ValueError(f"num_mtp_layers={num_mtp_layers} must be in [0, num_layers={num_layers})")
        main, mtp = num_layers - num_mtp_layers, num_mtp_layers
        index_dim = 0
    return Layout(
        model=model,
        kv_cache_dtype=dtype,
        version=LAYOUT_VERSION,
        num_layers=main + mtp,
        num_mtp_layers=mtp,
        kv_lora_rank=KV_LORA_RANK,
        rope_dim=ROPE_DIM,
        index_head_dim=index_dim,
        planes=tuple(planes),
    )


def for_hf_config(model: str, hf_config: Mapping[str, Any], kv_cache_dtype: str) -> Layout:
    """The layout for a checkpoint's config.json (checks the latent sizes the planes assume)."""
    for key, want in (("kv_lora_rank", KV_LORA_RANK), ("qk_rope_head_dim", ROPE_DIM)):
        got = hf_config.get(key)
        if got != want:
            raise ValueError(f"config.json has {key}={got}; the {model} layout needs {want}")
    mtp = int(hf_config.get("num_nextn_predict_layers", 0) or 0)
    layers = int(hf_config["num_hidden_layers"]) + mtp
    if model == "mla":
        return get(model, kv_cache_dtype, num_layers=layers, num_mtp_layers=mtp)
    return get(model, kv_cache_dtype, num_layers=layers)
