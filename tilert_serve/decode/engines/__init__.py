"""Decode engines behind one interface (base.DecodeEngine): `reference` (PyTorch, CPU and CUDA) and
`tilert` (the real TileRT, Blackwell only)."""

from __future__ import annotations

from dataclasses import dataclass

from tilert_serve.decode.engines.base import DecodeEngine

ENGINES = ("reference", "tilert")


@dataclass(frozen=True)
class EngineSpec:
    name: str
    model_dir: str
    #: glm5 | deepseek_v3_2 | mla (the tilert engine supports the first two).
    tilert_model: str
    max_seq_len: int
    max_sequences: int
    device: str = "cpu"
    dtype: str = "float32"
    num_speculative_tokens: int = 1


def create(spec: EngineSpec) -> DecodeEngine:
    if spec.name == "reference":
        from tilert_serve.decode.engines.reference import ReferenceEngine, ReferenceSettings

        return ReferenceEngine(
            ReferenceSettings(
                model_dir=spec.model_dir,
                device=spec.device,
                dtype=spec.dtype,
                max_seq_len=spec.max_seq_len,
                max_sequences=spec.max_sequences,
                num_speculative_tokens=spec.num_speculative_tokens,
            )
        )
    if spec.name == "tilert":
        from tilert_serve.decode.engines.tilert import TileRTEngine

        return TileRTEngine(
            model=spec.tilert_model,
            weights_dir=spec.model_dir,
            max_seq_len=spec.max_seq_len,
            with_mtp=spec.num_speculative_tokens > 0,
        )
    raise ValueError(f"unknown decode engine {spec.name!r}; choose one of {', '.join(ENGINES)}")
