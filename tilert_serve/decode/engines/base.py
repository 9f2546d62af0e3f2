"""The interface every decode engine implements (reference PyTorch engine, real TileRT).

The decode node owns the protocol, the buffers and the stop rules; an engine only turns injected
attention state plus a first token into more tokens. One engine is loaded per node; each admitted
request gets its own `Sequence` (TileRT holds one at a time, the reference engine as many as the node
has slots).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

from tilert_serve.layouts.state import InjectedState, LayerState

__all__ = [
    "DecodeEngine",
    "DecodeStep",
    "InjectedState",
    "InvalidRequest",
    "LayerState",
    "Sampling",
    "Sequence",
]


class InvalidRequest(ValueError):
    """A request's own parameters cannot be decoded (a sampling value out of range): the request's
    fault, not the node's or the data plane's."""


@dataclass(frozen=True)
class Sampling:
    """Sampling settings the engine applies itself. temperature 0 means greedy."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None


@dataclass(frozen=True)
class DecodeStep:
    """What one engine step produced: one or more tokens (MTP accepts drafts)."""

    token_ids: list[int]
    #: Draft tokens proposed by MTP this step and how many of them were accepted.
    drafted: int = 0
    accepted: int = 0


class Sequence(Protocol):
    """One request's decode, started from injected state."""

    def decode(self, first_token: int, sampling: Sampling, max_new_tokens: int) -> Iterator[DecodeStep]:
        """Yield steps after `first_token` (the token the prefill sampled) until max_new_tokens."""
        ...

    def close(self) -> None:
        """Release this sequence's engine-side state. Idempotent."""
        ...


class DecodeEngine(Protocol):
    name: str
    #: Attention layers the engine takes state for, main layers first, then MTP layers.
    num_layers: int
    num_mtp_layers: int
    max_seq_len: int
    #: How many sequences the engine can hold at once (TileRT: 1).
    max_sequences: int

    def load(self) -> None:
        """Load weights and prepare the engine. Called once at node start."""
        ...

    def start(self, state: InjectedState) -> Sequence:
        """Inject a prefilled request's state and return its sequence, ready to decode."""
        ...
