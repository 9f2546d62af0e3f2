"""The reference engine against real vLLM (CPU build) on the generated tiny model.

One vLLM instance (float32, real weights, MTP speculative config) produces greedy token ids for a
dozen prompts of different lengths, several longer than one 16-token CPU block; the reference
engine's prefill + MTP decode must give the same ids for every prompt.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from tilert_serve.decode.engines.base import Sampling

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
MAX_TOKENS = 16
LENGTHS = [1, 2, 4, 7, 11, 15, 16, 17, 24, 33, 48, 65]


def _prompts() -> list[list[int]]:
    rng = random.Random(2024)
    return [[rng.randrange(2, 512) for _ in range(n)] for n in LENGTHS]


@pytest.fixture(scope="module")
def vllm_outputs(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> list[list[int]]:
    work = tmp_path_factory.mktemp("vllm")
    requests = work / "requests.json"
    requests.write_text(
        json.dumps({"prompts": _prompts(), "max_tokens": MAX_TOKENS, "num_speculative_tokens": 1})
    )
    out = work / "out.json"
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run(
        [sys.executable, str(HERE / "vllm_greedy.py"), str(tiny_model_dir), str(requests), str(out)],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, f"vLLM run failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}"
    result = json.loads(out.read_text())
    print(f"vLLM init {result['seconds_init']:.1f} s, generate {result['seconds_generate']:.2f} s")
    return result["outputs"]


@pytest.mark.slow
def test_reference_engine_matches_vllm_greedy(make_engine, vllm_outputs: list[list[int]]) -> None:
    engine = make_engine(num_speculative_tokens=1)
    drafted = accepted = 0
    mismatches = []
    for prompt, want in zip(_prompts(), vllm_outputs, strict=True):
        assert len(want) == MAX_TOKENS
        state, first = engine.prefill(prompt)
        seq = engine.start(state)
        try:
            got = [first]
            for step in seq.decode(first, Sampling(), MAX_TOKENS - 1):
                got += step.token_ids
                drafted += step.drafted
                accepted += step.accepted
        finally:
            seq.close()
        if got != want:
            mismatches.append(f"prompt of {len(prompt)} tokens:\n  vLLM      {want}\n  reference {got}")
    print(f"reference MTP acceptance on these prompts: {accepted}/{drafted}")
    assert not mismatches, "\n".join(mismatches)
    # The outputs are not degenerate: prompts lead to different continuations.
    assert len({tuple(o) for o in vllm_outputs}) == len(vllm_outputs)
