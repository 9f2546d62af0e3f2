"""Which prefill takes a request, and which native decode: pure functions over the candidates' loads
and matched prefixes (pools.py gathers those and applies the answer).

The prefill policies (`policy.prefill`):

- `cache_aware` (default): the candidate holding the longest prefix of the prompt (prefix_index.py),
  unless the load is out of balance or the match is too short to matter:
  * imbalance: the best match has more than `balance_abs` more prefills in flight than the least
    loaded candidate AND more than `balance_rel` times as many; then the least loaded wins (SGLang's
    router uses the same two thresholds). A cached prefix saves compute, not queueing: past that gap the
    queue costs more than recomputing the prefix does.
  * the best match covers less than `min_match_ratio` of the prompt's whole blocks (or the prompt has
    none): the least loaded wins, and the prompt makes that one its home.
  Among equal matches the less loaded one wins; among equal loads the choice rotates.
- `least_loaded`: the fewest prefills in flight, rotating among equals (the behaviour before policies).
- `round_robin`: each candidate in turn, whatever its load.

How it combines with pairing: the decode side is chosen first (a TileRT slot, a native server), and
the prefill among those of the decode's generation only, so a cached prefix on a prefill of another
generation never pulls a request across generations.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

PrefillPolicy = Literal["cache_aware", "round_robin", "least_loaded"]
#: Why a prefill was chosen (a metric label): the prefix match won, the load was out of balance, the
#: match was below the minimum ratio (or the prompt had no whole block), or the plain policies.
Reason = Literal["prefix", "imbalance", "short_match", "least_loaded", "round_robin"]
REASONS: tuple[Reason, ...] = ("prefix", "imbalance", "short_match", "least_loaded", "round_robin")


@dataclass(frozen=True)
class Thresholds:
    """cache_aware's thresholds (RoutingPolicy's fields of the same names)."""

    balance_abs: int = 8
    balance_rel: float = 1.5
    min_match_ratio: float = 0.3


@dataclass(frozen=True)
class Candidate:
    #: Prefill requests in flight on it (the router's count).
    inflight: int
    #: Leading blocks of the prompt it holds, by the prefix index.
    matched: int = 0


@dataclass(frozen=True)
class Choice:
    index: int
    reason: Reason


def _least_loaded(cands: Sequence[Candidate], among: Sequence[int], turn: int) -> int:
    low = min(cands[i].inflight for i in among)
    best = [i for i in among if cands[i].inflight == low]
    return best[turn % len(best)]


def choose_prefill(
    policy: PrefillPolicy,
    cands: Sequence[Candidate],
    prompt_blocks: int,
    turn: int,
    thresholds: Thresholds = Thresholds(),
) -> Choice:
    """The index in `cands` (not empty) of the prefill to use. `turn` is a counter the caller advances
    on every choice: it rotates among equals and drives round_robin."""
    if not cands:
        raise ValueError("choose_prefill needs at least one candidate")
    every = range(len(cands))
    if policy == "round_robin":
        return Choice(turn % len(cands), "round_robin")
    if policy == "least_loaded":
        return Choice(_least_loaded(cands, every, turn), "least_loaded")
    top = max(c.matched for c in cands)
    if prompt_blocks <= 0 or top < thresholds.min_match_ratio * prompt_blocks or top == 0:
        return Choice(_least_loaded(cands, every, turn), "short_match")
    holders = [i for i in every if cands[i].matched == top]
    best = _least_loaded(cands, holders, turn)
    low = min(c.inflight for c in cands)
    load = cands[best].inflight
    if load - low > thresholds.balance_abs and load > low * thresholds.balance_rel:
        return Choice(_least_loaded(cands, every, turn), "imbalance")
    return Choice(best, "prefix")


def power_of_two(inflight: Sequence[int], rng: random.Random, turn: int = 0) -> int:
    """The index of the less loaded of two candidates drawn at random (distinct when there are two or
    more): the "power of two choices", which keeps the worst queue near the mean without herding every
    router replica onto the same least loaded server between two updates of its count. A tie goes by
    `turn` (a counter the caller advances), so two idle servers take requests in turn."""
    if not inflight:
        raise ValueError("power_of_two needs at least one candidate")
    if len(inflight) == 1:
        return 0
    a, b = sorted(rng.sample(range(len(inflight)), 2))
    if inflight[a] == inflight[b]:
        return (a, b)[turn % 2]
    return a if inflight[a] < inflight[b] else b
