"""Which prefill may hand a request to which decode server: pure functions over generations.

A generation is a `tilert_serve.compat.Compat` fingerprint (or None: unknown, pairs with anything). The
router picks the decode side first (a TileRT slot, a native server under its cap) among those that some
usable prefill can pair with, then a prefill of that decode's generation; so during a rollout that
changes the fingerprint, requests stay inside one generation, whichever of its servers are up.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import Literal, TypeVar

from tilert_serve.compat import compatible

#: A decode pool's state for one request: some pairable server can take it ("free"); servers can take
#: it but none pairs with a usable prefill ("no_pair", which the router treats as full and counts);
#: servers are up but none can take it now ("full"); none is up ("down").
PoolState = Literal["free", "no_pair", "full", "down"]
E = TypeVar("E")


@dataclass(frozen=True)
class Decode:
    generation: str | None
    #: Can take this request now (a free slot; under the in-flight cap).
    free: bool


def pairable(decode: str | None, prefills: Collection[str | None]) -> bool:
    """Whether some prefill of `prefills` (their generations) may hand a request to `decode`. With no
    prefill at all pairing does not constrain: the request fails later for want of a prefill."""
    return not prefills or any(compatible(p, decode) for p in prefills)


def pool_state(decodes: Sequence[Decode], prefills: Collection[str | None]) -> PoolState:
    """The decode pool's state given the usable prefills' generations (`decodes`: its up servers)."""
    if not decodes:
        return "down"
    free = [d for d in decodes if d.free]
    if not free:
        return "full"
    return "free" if any(pairable(d.generation, prefills) for d in free) else "no_pair"


def for_decode(decode: str | None, prefills: Iterable[tuple[str | None, E]]) -> list[E]:
    """The prefills (generation, item) that may hand a request to a decode of generation `decode`."""
    return [item for gen, item in prefills if compatible(gen, decode)]
