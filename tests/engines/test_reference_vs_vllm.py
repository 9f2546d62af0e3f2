"""The reference engine against real vLLM (CPU build) on the generated tiny model.

One vLLM instance (float32, real weights, MTP speculative config) produces greedy token ids for a
dozen prompts of different lengths, several longer than one 16-token CPU block; the reference
engine's prefill + MTP decode must give the same ids for every prompt. The same instance also
hands back the MLA cache rows its prefill wrote (main layers and the MTP layer), which must equal
the reference engine's own prefill state.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
from engine_helpers import GREEDY, assert_prefill_state_equals, decode, run_vllm

MAX_TOKENS = 16
LENGTHS = [1, 2, 4, 7, 11, 15, 16, 17, 24, 33, 48, 65]
DUMPED = [0, 7, 9]  # prompts (1, 17 and 33 tokens) whose cache rows vLLM hands back


def _prompts() -> list[list[int]]:
    rng = random.Random(2024)
    return [[rng.randrange(2, 512) for _ in range(n)] for n in LENGTHS]


@pytest.fixture(scope="module")
def vllm_run(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    prompts = _prompts()
    return run_vllm(
        tiny_model_dir,
        tmp_path_factory.mktemp("vllm"),
        prompts=prompts,
        max_tokens=MAX_TOKENS,
        num_speculative_tokens=1,
        dump_prompts=[prompts[i] for i in DUMPED],
    )


@pytest.mark.slow
def test_reference_engine_matches_vllm_greedy(make_engine, vllm_run: dict[str, Any]) -> None:
    vllm_outputs = vllm_run["outputs"]
    engine = make_engine(num_speculative_tokens=1)
    drafted = accepted = 0
    mismatches = []
    for prompt, want in zip(_prompts(), vllm_outputs, strict=True):
        assert len(want) == MAX_TOKENS
        got, d, a = decode(engine, prompt, GREEDY, MAX_TOKENS - 1)
        drafted += d
        accepted += a
        if got != want:
            mismatches.append(f"prompt of {len(prompt)} tokens:\n  vLLM      {want}\n  reference {got}")
    spec = vllm_run["spec_decode"]
    vllm_drafted = spec["vllm:spec_decode_num_draft_tokens"]
    vllm_accepted = spec["vllm:spec_decode_num_accepted_tokens"]
    print(
        f"MTP acceptance on these prompts: reference {accepted}/{drafted}, vLLM {vllm_accepted}/{vllm_drafted}"
    )
    # The MTP layer is useful to vLLM's own speculative decoding too.
    assert vllm_drafted > 0 and vllm_accepted / vllm_drafted > 0.25
    assert not mismatches, "\n".join(mismatches)
    # The outputs are not degenerate: prompts lead to different continuations.
    assert len({tuple(o) for o in vllm_outputs}) == len(vllm_outputs)


@pytest.mark.slow
def test_prefill_state_equals_vllm_cache_rows(make_engine, vllm_run: dict[str, Any]) -> None:
    """What ``prefill`` returns is what vLLM's MLA cache holds after its prefill step: normalised
    kv_c || roped k_pe for every main layer, and the MTP layer's rows from the drafter's pass over
    the prompt shifted by one token (the sampled first token last, position 0's embedding zeroed)."""
    engine = make_engine(num_speculative_tokens=1)
    prompts = _prompts()
    for i, rows, vllm_first in zip(DUMPED, vllm_run["cache_rows"], vllm_run["first_tokens"], strict=True):
        assert assert_prefill_state_equals(engine, prompts[i], rows) == vllm_first
