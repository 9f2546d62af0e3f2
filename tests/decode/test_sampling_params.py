"""Sampling parameters that overflow: `"temperature": 5e-39` passed the router's
and the node's checks and turned the sampler's logits into inf/nan, failing the decode on every node.
The node now takes temperatures as vLLM does (a positive one below 0.01 is 0.01: the prefill sampled the
first token so), and the sampler yields a distribution for any temperature and any logits."""

from __future__ import annotations

import pytest
import torch

from tilert_serve.decode.engines import sampling as smp
from tilert_serve.decode.engines.base import Sampling
from tilert_serve.decode.http import GenerateBody

HOSTILE_TEMPERATURES = [5e-39, 1e-45, 1e-30, 1e-6, 1e-5, 0.009, 1e30, 1e308]


def _logits() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 50, generator=g) * 30
    x[1, 7] = 3.0e38  # a bf16/fp32 extreme, as an overflowing layer gives
    x[2, :5] = float("inf")
    x[2, 5:8] = float("nan")
    x[2, 8:] = float("-inf")
    return x


@pytest.mark.parametrize("temperature", HOSTILE_TEMPERATURES)
@pytest.mark.parametrize("top_p, top_k", [(1.0, 0), (1e-30, 0), (0.5, 3), (1.0, 10**9)])
def test_probabilities_are_a_distribution_whatever_the_temperature(
    temperature: float, top_p: float, top_k: int
) -> None:
    p = smp.probabilities(_logits(), Sampling(temperature=temperature, top_p=top_p, top_k=top_k))
    assert torch.isfinite(p).all(), p
    assert (p >= 0).all()
    assert torch.allclose(p.sum(dim=-1), torch.ones(3), atol=1e-5)


@pytest.mark.parametrize("temperature", HOSTILE_TEMPERATURES)
def test_sampling_a_step_never_fails(temperature: float) -> None:
    g = torch.Generator().manual_seed(1)
    s = Sampling(temperature=temperature, seed=1)
    logits = _logits()
    verdict = smp.sample_verify(logits, torch.tensor([7, 2]), s, g)
    assert verdict.shape == (4,) and 0 <= int(verdict[-1]) <= 2
    # A step without drafts (no MTP, or the last token): what the engine samples its token with.
    alone = smp.sample_verify(logits[:1], torch.empty(0, dtype=torch.long), s, g)
    assert alone.shape == (2,) and 0 <= int(alone[0]) < 50 and int(alone[1]) == 0


def test_a_tiny_temperature_samples_like_vllm_at_its_floor() -> None:
    logits = _logits()[:1]
    tiny = smp.probabilities(logits, Sampling(temperature=5e-39))
    floor = smp.probabilities(logits, Sampling(temperature=0.01))
    assert torch.equal(tiny, floor)


@pytest.mark.parametrize(
    "given, taken", [(5e-39, 0.01), (1e-6, 0.01), (0.009, 0.01), (0.0, 0.0), (0.7, 0.7), (1e30, 1e30)]
)
def test_the_node_takes_temperatures_as_vllm_does(given: float, taken: float) -> None:
    body = GenerateBody.model_validate(
        {"ticket": "t", "first_token": 1, "max_tokens": 2, "sampling": {"temperature": given}}
    )
    assert body.sampling.temperature == taken
