"""The reference engine on CUDA (run on the borrowed H200): same tokens as on CPU in float32,
MTP output equal to plain greedy, bfloat16 and seeded sampling working. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import GREEDY, decode, prompts

from tilert_serve.decode.engines.base import Sampling

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def test_cuda_float32_matches_cpu_and_mtp_matches_plain_greedy(make_engine) -> None:
    cpu = make_engine(num_speculative_tokens=0)
    want = [decode(cpu, p, GREEDY, 24)[0] for p in prompts(12)]
    for k in (0, 1, 3):
        gpu = make_engine(device="cuda", num_speculative_tokens=k)
        assert [decode(gpu, p, GREEDY, 24)[0] for p in prompts(12)] == want, f"num_speculative_tokens={k}"


def test_cuda_bfloat16_decodes_and_seeded_sampling_repeats(make_engine) -> None:
    engine = make_engine(device="cuda", dtype="bfloat16", num_speculative_tokens=2)
    tokens, drafted, accepted = decode(engine, prompts(5)[4], GREEDY, 32)
    assert drafted > 0 and accepted > 0 and all(0 <= t < 512 for t in tokens)
    s1 = Sampling(temperature=1.0, top_p=0.9, seed=1)
    assert decode(engine, prompts(5)[4], s1, 32)[0] == decode(engine, prompts(5)[4], s1, 32)[0]
    assert (
        decode(engine, prompts(5)[4], s1, 32)[0]
        != decode(engine, prompts(5)[4], Sampling(temperature=1.0, seed=2), 32)[0]
    )
