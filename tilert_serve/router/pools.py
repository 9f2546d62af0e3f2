"""Endpoint state: health, in-flight counts and the TileRT slot table. Plain objects, no I/O.

Everything here runs on the event loop thread, and the check-and-reserve of a TileRT slot happens
without an `await` in between, so two requests can never take the same last slot.
"""

from __future__ import annotations

import itertools
import random
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Literal

from tilert_serve.router import pairing, prefill_choice, prefix_index
from tilert_serve.router.changes import Changes
from tilert_serve.router.config import CircuitBreaker, HealthChecks, RouterConfig, RoutingPolicy, TileRTNode
from tilert_serve.router.config import Endpoint as EndpointSpec
from tilert_serve.router.native_pairs import PairTable
from tilert_serve.router.openai_request import ParsedRequest

TileRTState = Literal["free", "full", "down"]
BreakerState = Literal["closed", "open", "half-open"]


@dataclass(eq=False)
class Endpoint:
    url: str
    pool: str  # "prefill" | "native" | "tilert"
    #: None until the first probe: routable (optimistic) but not counted as ready.
    healthy: bool | None = None
    fails: int = 0
    #: The failures in a row so far were all timeouts (HealthChecks.timeouts_to_eject says why).
    fails_timed_out: bool = True
    oks: int = 0
    inflight: int = 0
    #: Last failure, for /ready's reasons.
    last_error: str = ""
    #: The compatibility generation the config gives it (None: unknown, pairs with anything).
    compat: str | None = None
    #: The generation the endpoint itself last advertised (a TileRT node's /v1/status or /ready, a
    #: prefill's kv_transfer_params); None = not known.
    advertised: str | None = None
    #: The circuit breaker (config.CircuitBreaker): failures in a row (handoffs for a TileRT node; refused
    #: connections, resets, 5xx and timeouts for a vLLM server), the open period in force (0 = closed)
    #: and its end (monotonic), and whether a half-open trial request holds the endpoint.
    breaker_cfg: CircuitBreaker = field(default_factory=CircuitBreaker)
    breaker_fails: int = 0
    open_s: float = 0.0
    open_until: float = 0.0
    trial: bool = False
    #: When the trial began (monotonic): a trial whose request never reported (a client gone before
    #: the upstream answered) lapses after one open period instead of holding the endpoint for ever.
    trial_at: float = 0.0
    #: Why the breaker last counted a failure (for /ready and /v1/status).
    breaker_error: str = ""
    #: A health probe of it is under way (health.probe): one at a time, whoever asks.
    checking: bool = False
    #: Bumped whenever the server may have lost its prefix cache (it was ejected, or refused a
    #: connection: nothing listened, so a process that comes back there is a new one); the prefix
    #: index forgets what it was sent when this moves.
    cache_epoch: int = 0

    @property
    def routable(self) -> bool:
        return self.healthy is not False and not self.compat_mismatch

    @property
    def compat_mismatch(self) -> bool:
        """It advertises another generation than the config gives it: it runs something else than its
        spec says (a pod of the old generation behind the new Service, a half-done rollout)."""
        return self.compat is not None and self.advertised is not None and self.advertised != self.compat

    @property
    def generation(self) -> str | None:
        """The generation pairing uses: the configured one, else what the endpoint advertised."""
        return self.compat if self.compat is not None else self.advertised

    def record_ok(self, hc: HealthChecks) -> None:
        self.fails = 0
        self.fails_timed_out = True
        self.oks += 1
        if self.healthy is not True and (self.healthy is None or self.oks >= hc.successes_to_return):
            self.healthy = True

    def record_failure(self, hc: HealthChecks, why: str, *, timed_out: bool = False) -> None:
        """Count a failed probe or call; `timed_out`: it got no answer in time (a slow server, or a
        router too busy to read it), which ejects only after `timeouts_to_eject` in a row."""
        self.oks = 0
        self.fails += 1
        self.fails_timed_out = self.fails_timed_out and timed_out
        self.last_error = why
        needed = max(hc.failures_to_eject, hc.timeouts_to_eject if self.fails_timed_out else 0)
        if self.fails >= needed:
            if self.healthy is not False:
                self.cache_epoch += 1
            self.healthy = False

    def breaker_ok(self) -> None:
        self.breaker_fails, self.open_s, self.open_until, self.trial = 0, 0.0, 0.0, False

    def breaker_failed(self, now: float, why: str, *, at_once: bool = False) -> None:
        """Count a failure; `at_once` (a refused connection: nothing listens there) opens the breaker
        whatever the count."""
        self.breaker_error = why[:300]
        self.breaker_fails += 1
        if at_once:
            self.cache_epoch += 1
        self.trial = False
        cfg = self.breaker_cfg
        if self.open_s == 0.0:
            if at_once or self.breaker_fails >= cfg.failures_to_open:
                self.open_s, self.open_until = cfg.open_s, now + cfg.open_s
        elif now >= self.open_until:
            # The half-open trial failed (requests that were in flight when it opened do not extend it).
            self.open_s = min(self.open_s * 2, cfg.max_open_s)
            self.open_until = now + self.open_s

    def probe_answered(self, now: float) -> None:
        """An active health check reached it: an open breaker goes half-open at once (one request
        tries it) instead of waiting out its period, so a restarted server is back within a probe."""
        if self.open_s and now < self.open_until:
            self.open_until = now

    @property
    def breaker(self) -> BreakerState:
        if self.open_s == 0.0:
            return "closed"
        return "open" if time.monotonic() < self.open_until else "half-open"

    @property
    def takes_requests(self) -> bool:
        """Not behind an open breaker: closed, or half-open with no trial under way."""
        state = self.breaker
        if state == "half-open" and self.trial and time.monotonic() - self.trial_at > self.open_s:
            self.trial = False
        return state == "closed" or (state == "half-open" and not self.trial)

    def take(self) -> None:
        """A request was sent its way: a half-open breaker's trial is under way."""
        if self.breaker == "half-open":
            self.trial, self.trial_at = True, time.monotonic()


@dataclass(eq=False)
class Node(Endpoint):
    """A TileRT decode node: an endpoint with a slot table."""

    spec: TileRTNode = field(default=None)  # type: ignore[assignment]
    #: Slots this router holds on the node (admitted or being admitted, not yet known to be free).
    in_use: int = 0
    #: The node answered 429 although we counted a free slot: do not ask it again before this time.
    full_until: float = 0.0
    #: The data plane as this router saw it (user requests and probes): when a handoff to the node last
    #: decoded, when one last failed and why (monotonic clock; None = never).
    handoff_ok_at: float | None = None
    handoff_fail_at: float | None = None
    handoff_error: str = ""
    #: A probe (canary.py) is running on the node / when the last one started.
    probing: bool = False
    probe_at: float = -1e18

    @property
    def handoff_fails(self) -> int:
        return self.breaker_fails

    def handoff_ok(self, now: float) -> None:
        self.handoff_ok_at = now
        self.breaker_ok()

    def handoff_failed(self, now: float, why: str) -> None:
        self.handoff_fail_at, self.handoff_error = now, why[:300]
        self.breaker_failed(now, why)

    @property
    def handoff_ready(self) -> bool:
        """A handoff decoded on this node, and none failed since."""
        return self.handoff_ok_at is not None and (
            self.handoff_fail_at is None or self.handoff_fail_at < self.handoff_ok_at
        )

    @property
    def free(self) -> int:
        if self.full_until > time.monotonic():
            return 0
        return max(self.spec.slots - self.in_use, 0)


@dataclass(frozen=True)
class PrefillChoice:
    """What a prefill choice saw, for the metrics: the policy, why the winner won, the prompt's whole
    blocks and how many of them the winner holds (by the prefix index)."""

    policy: prefill_choice.PrefillPolicy
    reason: prefill_choice.Reason
    prompt_blocks: int
    matched_blocks: int
    #: Block hashes the prefix index holds after this choice was recorded.
    index_blocks: int


#: Told of every prefill choice made for a client's request (metrics.Metrics.observe_prefill_choice).
ChoiceObserver = Callable[[PrefillChoice], None]


def _live(eps: Iterable[Endpoint]) -> list[Endpoint]:
    """The routable endpoints not behind an open breaker; when a pool has none, all that do not run
    another generation than configured ("panic" routing, as Envoy does): probes that time out under
    overload would otherwise eject the last prefill or decode server and turn a slow pool into a dead
    one. /ready still reports the pool unhealthy."""
    eps = [e for e in eps if not e.compat_mismatch]
    return [e for e in eps if e.routable and e.takes_requests] or eps


def _keep(
    old: dict[str, Endpoint], configured: list[EndpointSpec], pool: str, breaker: CircuitBreaker
) -> dict[str, Endpoint]:
    """The configured endpoints by URL, the ones already known kept (their health, counters)."""
    out: dict[str, Endpoint] = {}
    for spec in configured:
        ep = old.get(spec.url) or Endpoint(spec.url, pool)
        if ep.compat != spec.compat:
            ep.advertised = None  # judged against the new generation from the next answer on
        ep.compat = spec.compat
        ep.breaker_cfg = breaker
        out[spec.url] = ep
    return out


class Pools:
    def __init__(self, config: RouterConfig, rng: random.Random | None = None) -> None:
        self.prefill: dict[str, Endpoint] = {}
        self.native: dict[str, Endpoint] = {}
        self.tilert: dict[str, Node] = {}
        self._rr = itertools.count()
        #: The native choice's own turn (ties between its two draws), apart from the prefill's: each
        #: native request also picks a prefill, which would otherwise see every other turn only.
        self._native_turn = itertools.count()
        #: Draws for the native decode's power of two choices (tests pass a seeded one).
        self._rng = rng or random.Random()
        self.policy: RoutingPolicy = config.policy
        #: What each prefill was sent (cache_aware); its caps follow the config in force.
        self.prefixes = prefix_index.PrefixIndex(
            config.policy.prefix_index_blocks_per_endpoint, config.policy.prefix_index_blocks_total
        )
        #: Each prefill's cache_epoch when the index last learnt about it.
        self._epochs: dict[str, int] = {}
        #: Which (prefill, native) pairs have moved KV (native_pairs.py): native requests prefer warm
        #: pairs while `native_warmup` is on.
        self.pairs = PairTable()
        self.warmup = False
        #: Told of every change that may let a waiting request through (a new endpoint list here; an
        #: endpoint's health or breaker turning, by the health checks).
        self.changes = Changes()
        self.apply(config)

    def apply(self, config: RouterConfig) -> None:
        """Take a new endpoint list; endpoints that stay keep their health and counters.

        Requests in flight hold their own Endpoint objects, so one removed mid-request is released
        on that object and simply forgotten afterwards.
        """
        self.prefill = _keep(self.prefill, config.prefill, "prefill", config.endpoint_breaker)
        self.policy = config.policy
        self.prefixes.max_per_endpoint = config.policy.prefix_index_blocks_per_endpoint
        self.prefixes.max_total = config.policy.prefix_index_blocks_total
        # A prefill that left takes its cache with it (one that comes back at the same address starts
        # cold too, and is relearnt).
        self.prefixes.keep_only(self.prefill)
        self._epochs = {url: n for url, n in self._epochs.items() if url in self.prefill}
        self.native = _keep(self.native, config.native, "native", config.endpoint_breaker)
        self.pairs.keep_only(self.prefill, self.native)
        self.warmup = config.native_warmup.enabled
        # A node is its address: one found through DNS that the ConfigMap then names (another name, the
        # same pod) keeps the slots this router holds on it.
        by_url = {n.url: n for n in self.tilert.values()}
        nodes: dict[str, Node] = {}
        for spec in config.tilert:
            old = by_url.get(spec.http_url)
            if old is not None:
                old.spec = spec
                nodes[spec.name] = old
            else:
                nodes[spec.name] = Node(spec.http_url, "tilert", spec=spec)
            node = nodes[spec.name]
            node.breaker_cfg = config.breaker
            if node.compat != spec.compat:
                node.advertised = None
            node.compat = spec.compat
        self.tilert = nodes
        self.changes.notify()

    def all(self) -> Iterable[Endpoint]:
        yield from self.prefill.values()
        yield from self.native.values()
        yield from self.tilert.values()

    def _least_loaded(
        self, eps: Iterable[Endpoint], exclude: set[str], cap: int | None = None
    ) -> Endpoint | None:
        """The routable endpoint with the fewest requests in flight. `exclude` (endpoints that failed
        this request) is a preference: with no other choice, a retry goes to the same one again."""
        up = [e for e in _live(eps) if cap is None or e.inflight < cap]
        cands = [e for e in up if e.url not in exclude] or up
        if not cands:
            return None
        low = min(e.inflight for e in cands)
        best = [e for e in cands if e.inflight == low]
        # Rotate among equals so an idle pool spreads requests instead of always using the first.
        ep = best[next(self._rr) % len(best)]
        ep.take()
        return ep

    def prefill_generations(self) -> set[str | None]:
        """The generations of the prefills a request may use now."""
        return {e.generation for e in _live(self.prefill.values())}

    def prefix_key(self, req: ParsedRequest) -> prefix_index.PrefixKey:
        """The request's chained block hashes, at the configured block sizes."""
        p = self.policy
        return prefix_index.request_key(
            req.kind,
            req.body,
            block_chars=p.prefix_block_chars,
            block_tokens=p.prefix_block_tokens,
            limit=p.prefix_index_blocks_per_endpoint,
        )

    def pick_prefill(
        self,
        exclude: set[str],
        decode: str | None = None,
        req: ParsedRequest | None = None,
        observe: ChoiceObserver | None = None,
        native: Endpoint | None = None,
    ) -> Endpoint | None:
        """The usable prefill, of those that may hand a request to a decode of generation `decode`, that
        `policy.prefill` picks for `req` (prefill_choice.py). `exclude` (prefills that failed this
        request) is a preference: with no other choice, a retry goes to the same one again. Without
        `req` (a handoff probe) the least loaded one, and nothing is recorded.

        The prompt is recorded as sent to the chosen prefill at once, not when its prefill succeeds: the
        next request with the same prefix, arriving while this one computes it, should go there too
        (vLLM shares the blocks, or finds them cached). A failed prefill leaves a false entry behind;
        the retry excludes that prefill anyway, and the entry ages out of the LRU. While warm-ups are
        on (native_pairs.py), prefills that have moved KV to the `native` decode come first; for
        another route, prefills that have moved KV to any native decode."""
        live = _live(self.prefill.values())
        up = pairing.for_decode(decode, ((e.generation, e) for e in live))
        cands = [e for e in up if e.url not in exclude] or up
        if self.warmup and native is not None:
            cands = [e for e in cands if self.pairs.warm(e, native)] or cands
        elif self.warmup and self.native:
            # Any route: a prefill that has met no native decode yet is new, and its first requests pay
            # its first contact and first forward; while one that has met one exists, it goes first.
            natives = _live(self.native.values())
            cands = [e for e in cands if any(self.pairs.warm(e, n) for n in natives)] or cands
        if not cands:
            return None
        policy = self.policy.prefill if req is not None else "least_loaded"
        key = (
            self.prefix_key(req) if req is not None and policy == "cache_aware" else prefix_index.PrefixKey()
        )
        for e in cands:
            if self._epochs.setdefault(e.url, e.cache_epoch) != e.cache_epoch:
                self.prefixes.forget(e.url)  # a restarted server has an empty cache
                self._epochs[e.url] = e.cache_epoch
        matched = [self.prefixes.matched(key, e.url) for e in cands] if key.blocks else [0] * len(cands)
        choice = prefill_choice.choose_prefill(
            policy,
            [prefill_choice.Candidate(e.inflight, m) for e, m in zip(cands, matched, strict=True)],
            len(key),
            next(self._rr),
            self.policy.thresholds(),
        )
        ep = cands[choice.index]
        ep.take()
        self.prefixes.record(ep.url, key)
        if observe is not None:
            observe(PrefillChoice(policy, choice.reason, len(key), matched[choice.index], len(self.prefixes)))
        return ep

    def pick_native(self, exclude: set[str], cap: int) -> Endpoint | None:
        """A native server under `cap` that some usable prefill can pair with, by `policy.native`:
        the less loaded of two drawn at random, or the least loaded."""
        gens = self.prefill_generations()
        live = [e for e in _live(self.native.values()) if pairing.pairable(e.generation, gens)]
        if self.warmup:  # one that has met no live prefill yet waits for its warm-up, if another has
            prefills = _live(self.prefill.values())
            live = [e for e in live if any(self.pairs.warm(p, e) for p in prefills)] or live
        if self.policy.native == "least_loaded":
            return self._least_loaded(live, exclude, cap)
        up = [e for e in live if e.inflight < cap]
        cands = [e for e in up if e.url not in exclude] or up
        if not cands:
            return None
        ep = cands[
            prefill_choice.power_of_two([e.inflight for e in cands], self._rng, next(self._native_turn))
        ]
        ep.take()
        return ep

    def native_pairing(self, cap: int) -> pairing.PoolState:
        up = _live(self.native.values())
        decodes = [pairing.Decode(e.generation, e.inflight < cap) for e in up]
        return pairing.pool_state(decodes, self.prefill_generations())

    def native_state(self, cap: int) -> str:
        """'ok' when a native decode can take a request now, 'full' when all are at the cap or none
        pairs with a usable prefill (native_pairing says which), else 'none'."""
        state = self.native_pairing(cap)
        return {"free": "ok", "no_pair": "full", "full": "full", "down": "none"}[state]

    def _tilert_up(self, exclude: set[str] | frozenset[str]) -> list[Node]:
        return [n for n in self.tilert.values() if n.routable and n.url not in exclude and n.takes_requests]

    def tilert_pairing(self, exclude: set[str] | frozenset[str] = frozenset()) -> pairing.PoolState:
        decodes = [pairing.Decode(n.generation, n.free > 0) for n in self._tilert_up(exclude)]
        return pairing.pool_state(decodes, self.prefill_generations())

    def tilert_state(self, exclude: set[str] | frozenset[str] = frozenset()) -> TileRTState:
        """'free' when a node outside `exclude` has a free slot and pairs with a usable prefill, 'full'
        when such nodes are up but none can take the request (no slot, or no prefill of its
        generation), 'down' when none is up (every node ejected, or failed this request)."""
        state = self.tilert_pairing(exclude)
        return "full" if state == "no_pair" else state

    def reserve_tilert(self, exclude: set[str]) -> Node | None:
        """Take one slot on the node with the most free slots that pairs with a usable prefill; None
        when there is none."""
        gens = self.prefill_generations()
        cands = [n for n in self._tilert_up(exclude) if n.free > 0 and pairing.pairable(n.generation, gens)]
        if not cands:
            return None
        # A closed breaker first: a half-open node gets a trial only when no other node can serve.
        node = max(cands, key=lambda n: (n.breaker == "closed", n.free))
        node.take()
        node.in_use += 1
        return node

    def tilert_may_return(self, exclude: set[str] | frozenset[str]) -> list[Node]:
        """The TileRT nodes outside `exclude` (those that failed this request) that may take it soon,
        when none can now: ejected by the health checks, failing this request's admission, or half-open
        with another request's trial under way. A node behind an open breaker (its handoffs failed, or
        nothing listened) or advertising another generation is not waited for: those requests get
        their answer at once."""
        return [
            n
            for n in self.tilert.values()
            if n.url not in exclude and not n.compat_mismatch and n.breaker != "open"
        ]

    def tilert_path_up(self) -> bool:
        """Whether some TileRT node may take a request: probed healthy (or not probed yet) and not
        behind an open breaker."""
        return any(n.routable and n.breaker != "open" for n in self.tilert.values())

    def release(self, node: Node) -> None:
        node.in_use = max(node.in_use - 1, 0)
        # A trial that ended without a handoff's verdict (node full, prefill failed, client gone)
        # leaves the node to the next request.
        node.trial = False
        # A request waiting for a node may have one now (a trial over, its breaker closed by a decoded
        # handoff); nothing to do while none waits.
        self.changes.notify()
