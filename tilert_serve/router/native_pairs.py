"""Which (prefill, native decode) pairs have moved KV before (pure; the warm-up requests are in
native_warmup.py).

The first KV a native vLLM decode pulls from a prefill pays the connector's first contact: with
NixlConnector the decode fetches the prefill's agent metadata over its side channel and the transport
opens its first connection; with MooncakeConnector the bootstrap and the first transfer session. Seen on
the tiny CPU stack: after a prefill rollout, the native decode's first transfers from the new prefill
took up to 6 s and the requests queued behind them up to 20 s to their first token, against
milliseconds once the pair had met. Every rollout, scale-up or restart of a prefill or a native decode
makes such pairs.

So the router pays it itself (`config.NativeWarmup`, native_warmup.py): a pair of healthy endpoints of one generation that
has not moved KV gets one small request of the router's own (the handoff probe's prompt, one token),
through the same connector path a user's request takes; and while some pair is warm, native requests
go through warm pairs (pools.Pools.pick_native / pick_prefill). The operator keeps the old pods
serving while the new ones warm (local apply waits for the router to report them warm before it
removes the old ones).

A pair, as PairTable holds it:

    cold --(warm-up starts)--> warming --(ok)--> warm
                                       --(failed)--> failed --(retry_s)--> cold
    cold | failed --(a user's request moved KV through it)--> warm

and it is forgotten (cold again) when either side leaves the config or restarts (its cache_epoch moves:
a new process has met nobody). PairTable is the one owner of those transitions; it is pure (the
clock is passed in). The warm-up requests are not user traffic: not in the request, TTFT or route
metrics, only in `tilert_router_native_warmups_total{outcome}`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from tilert_serve.router import pairing

if TYPE_CHECKING:
    from tilert_serve.router.pools import Endpoint

PairState = Literal["cold", "warming", "warm", "failed"]
Key = tuple[str, str]


@dataclass
class _Pair:
    state: PairState
    #: Each side's cache_epoch when the state was set: a side that restarted since has met nobody.
    epochs: tuple[int, int]
    #: When the last warm-up failed (monotonic).
    failed_at: float = 0.0


@dataclass
class PairTable:
    """The (prefill URL, native URL) pairs and their states; see the module docstring."""

    _pairs: dict[Key, _Pair] = field(default_factory=dict)

    def state(self, prefill: Endpoint, native: Endpoint) -> PairState:
        pair = self._pairs.get((prefill.url, native.url))
        if pair is None or pair.epochs != (prefill.cache_epoch, native.cache_epoch):
            return "cold"
        return pair.state

    def warm(self, prefill: Endpoint, native: Endpoint) -> bool:
        return self.state(prefill, native) == "warm"

    def _set(self, prefill: Endpoint, native: Endpoint, state: PairState, now: float = 0.0) -> None:
        self._pairs[(prefill.url, native.url)] = _Pair(state, (prefill.cache_epoch, native.cache_epoch), now)

    def started(self, prefill: Endpoint, native: Endpoint) -> None:
        self._set(prefill, native, "warming")

    def succeeded(self, prefill: Endpoint, native: Endpoint) -> None:
        """A warm-up, or a user's request, moved KV through the pair."""
        self._set(prefill, native, "warm")

    def failed(self, prefill: Endpoint, native: Endpoint, now: float) -> None:
        self._set(prefill, native, "failed", now)

    def due(
        self, prefills: Iterable[Endpoint], natives: Iterable[Endpoint], now: float, retry_s: float
    ) -> list[tuple[Endpoint, Endpoint]]:
        """The pairs to warm now: both sides probed healthy and taking requests, of one generation, and
        cold (or failed more than `retry_s` ago)."""
        up = [e for e in prefills if _ready(e)]
        out = []
        for n in natives:
            if not _ready(n):
                continue
            for p in up:
                if not pairing.pairable(n.generation, {p.generation}):
                    continue
                state = self.state(p, n)
                if state == "cold" or (
                    state == "failed" and now - self._pairs[(p.url, n.url)].failed_at >= retry_s
                ):
                    out.append((p, n))
        return out

    def keep_only(self, prefills: Iterable[str], natives: Iterable[str]) -> None:
        """Forget pairs with a side that left the config (one that comes back starts cold)."""
        ps, ns = set(prefills), set(natives)
        self._pairs = {k: v for k, v in self._pairs.items() if k[0] in ps and k[1] in ns}

    def counts(self, prefills: Iterable[Endpoint], natives: Iterable[Endpoint]) -> dict[PairState, int]:
        """Pairs of the current endpoints (of one generation; none known unhealthy) by state: what
        local apply waits on."""
        out: dict[PairState, int] = {"cold": 0, "warming": 0, "warm": 0, "failed": 0}
        ps = [p for p in prefills if p.healthy is not False]
        for n in natives:
            if n.healthy is False:
                continue
            for p in ps:
                if pairing.pairable(n.generation, {p.generation}):
                    out[self.state(p, n)] += 1
        return out


def _ready(ep: Endpoint) -> bool:
    return ep.healthy is True and ep.takes_requests and not ep.compat_mismatch
