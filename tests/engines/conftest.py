"""Fixtures for the engine tests: one generated tiny model per session, engines built on it."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from tilert_serve.decode.engines.reference import ReferenceEngine, ReferenceSettings
from tilert_serve.tinymodel.generate import TinySpec, generate


@pytest.fixture(scope="module", autouse=True)
def single_torch_thread() -> Iterator[None]:
    """One intra-op thread while these tests run: the tiny model gains nothing from more, and on a
    shared 2-core machine busy-waiting torch threads made the same tests 100x slower."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tiny-dsv3")
    generate(TinySpec(seed=0), out)
    return out


@pytest.fixture(scope="session")
def make_engine(tiny_model_dir: Path) -> Iterator[Callable[..., ReferenceEngine]]:
    """Build and load a reference engine on the tiny model; settings override the test defaults.
    Engines with the same settings are shared across the session (loading is the slow part)."""
    cache: dict[tuple, ReferenceEngine] = {}

    def build(**overrides: object) -> ReferenceEngine:
        settings = {"model_dir": str(tiny_model_dir), "max_seq_len": 256, "max_sequences": 4, **overrides}
        key = tuple(sorted(settings.items()))
        if key not in cache:
            engine = ReferenceEngine(ReferenceSettings(**settings))  # type: ignore[arg-type]
            engine.load()
            cache[key] = engine
        return cache[key]

    yield build
