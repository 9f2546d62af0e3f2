"""Token choice for speculative decoding: greedy verification and exact speculative sampling.

Drafts are always the MTP layer's argmax (a one-hot draft distribution q). Verification with
temperature > 0 is then standard speculative sampling with q = one-hot(d): accept d with probability
p(d); on rejection sample from p with d removed (that is norm(max(0, p - q))); after k accepted drafts
sample a bonus token from p. The output distribution equals sampling from p token by token.

Everything stays on the device and consumes a fixed amount of randomness per step (k uniforms and
k + 1 categorical draws, whatever gets accepted), so a seeded generator gives the same tokens on
every run, and the caller reads the result back with one host transfer per step.
"""

from __future__ import annotations

import torch

from tilert_serve.decode.engines.base import InvalidRequest, Sampling

#: vLLM's bounds (vllm/sampling_params.py), so that the node samples as the prefill sampled the first
#: token: a positive temperature below MIN_TEMPERATURE is raised to it (below it float logits overflow:
#: 5e-39 turned every row into inf/nan), and one below GREEDY_BELOW is greedy.
MIN_TEMPERATURE = 1e-2
GREEDY_BELOW = 1e-5


def vllm_temperature(temperature: float) -> float:
    """The temperature vLLM samples with for a requested one (0 stays 0: greedy)."""
    return max(temperature, MIN_TEMPERATURE) if temperature > 0 else temperature


def greedy(sampling: Sampling) -> bool:
    return vllm_temperature(sampling.temperature) < GREEDY_BELOW


def validate(sampling: Sampling) -> None:
    if not sampling.temperature >= 0.0:
        raise InvalidRequest(f"sampling.temperature={sampling.temperature}: must be >= 0 (0 means greedy)")
    if not 0.0 < sampling.top_p <= 1.0:
        raise InvalidRequest(f"sampling.top_p={sampling.top_p}: must be in (0, 1]")
    if sampling.top_k < 0:
        raise InvalidRequest(f"sampling.top_k={sampling.top_k}: must be >= 0 (0 means off)")


def probabilities(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """Rows of float32 logits -> probabilities after temperature, top-k, then top-p (vLLM's order).

    Always a distribution, whatever slipped past validation: the temperature is taken as vLLM takes it
    (greedy: all mass on the argmax), and scaled logits that overflowed or were not numbers to begin with
    are made finite (NaN counts as the lowest), so softmax never sees inf - inf."""
    if greedy(sampling):
        x = torch.nan_to_num(logits.float(), nan=float("-inf"))
        return torch.nn.functional.one_hot(x.argmax(dim=-1), x.shape[-1]).float()
    finfo = torch.finfo(torch.float32)
    x = logits.float() / vllm_temperature(sampling.temperature)
    x = torch.nan_to_num(x, nan=finfo.min, posinf=finfo.max, neginf=finfo.min)
    if 0 < sampling.top_k < x.shape[-1]:
        kth = torch.topk(x, sampling.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if sampling.top_p < 1.0:
        sorted_x, idx = torch.sort(x, dim=-1, descending=True)
        sorted_p = torch.softmax(sorted_x, dim=-1)
        # Drop a token once the mass before it already reaches top_p; the best token always stays.
        drop = (torch.cumsum(sorted_p, dim=-1) - sorted_p) >= sampling.top_p
        drop[..., 0] = False
        x = x.masked_fill(torch.zeros_like(drop).scatter(-1, idx, drop), float("-inf"))
    return torch.softmax(x, dim=-1)


def greedy_verify(logits: torch.Tensor, drafts: torch.Tensor) -> torch.Tensor:
    """logits [k+1, V] for the pending token and k drafts [k] -> [k + 2]: the k + 1 target tokens,
    then the number a of accepted drafts. The tokens to emit are the first a + 1."""
    targets = logits.argmax(dim=-1)
    k = drafts.shape[0]
    accepted = torch.cumprod((targets[:k] == drafts).long(), dim=0).sum().reshape(1)
    return torch.cat([targets, accepted])


def sample_verify(
    logits: torch.Tensor, drafts: torch.Tensor, sampling: Sampling, generator: torch.Generator
) -> torch.Tensor:
    """Speculative sampling of one step. Same output layout as ``greedy_verify``: [k + 2] where
    entries 0..k are, per row, the token emitted if that row is where acceptance stops (drafts
    before it are accepted), and the last entry is the number a of accepted drafts."""
    k = drafts.shape[0]
    p = probabilities(logits, sampling)  # [k+1, V]
    rows = torch.arange(k, device=p.device)
    u = torch.rand(k, generator=generator, device=p.device)
    accept = u < p[rows, drafts]
    accepted = torch.cumprod(accept.long(), dim=0).sum().reshape(1)
    # Rows 0..k-1: p without the draft (the residual after rejecting it); row k: p itself.
    residual = p.clone()
    residual[rows, drafts] = 0.0
    empty = residual.sum(dim=-1, keepdim=True) <= 0  # draft held all the mass: it is always accepted
    residual = torch.where(empty, p, residual)
    choice = torch.multinomial(residual, 1, generator=generator).squeeze(-1)
    # An accepted row emits its draft; only the row where acceptance stops uses `choice`.
    emitted = choice.clone()
    emitted[:k] = torch.where(accept, drafts, choice[:k])
    return torch.cat([emitted, accepted])
