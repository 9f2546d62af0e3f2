"""Helpers shared by the engine tests: prompts and a prefill + decode round trip."""

from __future__ import annotations

import random

from tilert_serve.decode.engines.base import Sampling
from tilert_serve.decode.engines.reference import ReferenceEngine

GREEDY = Sampling()


def prompts(count: int, seed: int = 7) -> list[list[int]]:
    """Token-id prompts of varied lengths (1 to 40), skipping the BOS/EOS ids 0 and 1."""
    rng = random.Random(seed)
    lengths = [1, 2, 5, 16, 17, 23, 40, 9, 31, 3, 12, 28][:count]
    return [[rng.randrange(2, 512) for _ in range(n)] for n in lengths]


def decode(
    engine: ReferenceEngine, prompt: list[int], sampling: Sampling, max_new: int
) -> tuple[list[int], int, int]:
    """prefill + decode; returns (first token + new tokens, drafted, accepted)."""
    state, first = engine.prefill(prompt)
    seq = engine.start(state)
    try:
        tokens, drafted, accepted = [first], 0, 0
        for step in seq.decode(first, sampling, max_new):
            tokens += step.token_ids
            drafted += step.drafted
            accepted += step.accepted
        assert len(tokens) == max_new + 1
        return tokens, drafted, accepted
    finally:
        seq.close()
