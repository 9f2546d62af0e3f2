"""The router's Prometheus metrics, one registry per app (tests build many apps in one process).

Label values are bounded (paths, route reasons, status codes, error kinds from fixed sets; node names
and endpoint URLs from the config): no value comes from a client, and an upstream's words count as
"other". docs/metrics.md lists them (tilert_serve.metrics_catalogue)."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from typing import get_args

from prometheus_client import Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from tilert_serve import metric_defs as names
from tilert_serve.metric_defs import (
    Bounded,
    Domain,
    Registry,
    Unbounded,
    Values,
    counter,
    gauge,
    histogram,
    values,
)
from tilert_serve.router.changes import WaitOutcome
from tilert_serve.router.native_pairs import PairState
from tilert_serve.router.policy import Label, Route
from tilert_serve.router.pools import PrefillChoice
from tilert_serve.router.prefill_choice import REASONS, PrefillPolicy

# 0.5 ms .. 4 min: the router adds about a millisecond, prefills of long prompts take minutes.
_LATENCY_BUCKETS = (
    0.0005,
    0.001,
    0.002,
    0.005,
    0.01,
    0.02,
    0.05,
    0.1,
    0.2,
    0.5,
    1.0,
    2.0,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
    240.0,
)
_ITL_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 5.0)

CONTENT_TYPE = CONTENT_TYPE_LATEST


#: Upstream failure kinds the router itself names, and the error types a TileRT node answers a
#: generate call with (prefixed "generate_"); anything else counts as "other", so that an upstream's
#: words never make new series.
_GENERATE_TYPES = (
    "unknown_ticket",
    "already_generating",
    "handoff_timeout",
    "handoff_failed",
    "not_ready",
    "invalid_request",
    "invalid_json",
    "unauthorized",
    "request_too_large",
    "internal_error",
    "decode_failed",
    "timeout",
    "transport",
)
_KINDS = frozenset(
    {
        "timeout",
        "connect",
        "transport",
        "bad_response",
        "no_endpoint",
        "handoff_failed",
        "stream_error",
        "truncated",
        "stream_broken",
        "cancel",
        "bootstrap",
        "compat_mismatch",
        *(f"generate_{t}" for t in _GENERATE_TYPES),
    }
)
_HTTP_KIND = "(admit_|generate_)?http_[1-5][0-9][0-9]"
#: An upstream failure's kind.
KINDS = Values(_KINDS, _HTTP_KIND, "admit_http_NNN, generate_http_NNN, http_NNN: an upstream's HTTP status")
#: The upstream pools (pools.Endpoint.pool).
POOLS = values(("prefill", "native", "tilert"))
#: The decode paths.
PATHS = values(get_args(Route))
#: How a request ended (handlers.py): ok, error (the router's own), client_gone, or http_NNN (the
#: status the router answered).
OUTCOMES = Values(
    frozenset({"ok", "error", "client_gone"}),
    "http_[1-5][0-9][0-9]",
    "http_NNN: the router answered this HTTP status",
)
#: A TileRT node's answer to an admission call (tilert_path.py).
ADMISSION_RESULTS = values({"ok", "full", "too_long", "error"})
#: How a wait for a TileRT node ended (handlers._choose).
TILERT_WAIT_OUTCOMES = values(get_args(WaitOutcome), other=False)
#: Why the router cancelled a TileRT ticket (tilert_path.py).
CANCEL_REASONS = values({"failed", "aborted", "first token ends", "stop string"})
#: How a handoff probe ended (canary.py): its own verdicts, the error type a node's generate call
#: answered, or a failed upstream call's pool and kind.
PROBE_OUTCOMES = Values(
    frozenset(
        {
            "ok",
            "error",
            "busy",
            "admit_failed",
            "no_prefill",
            "handoff_failed",
            "decode_failed",
            *_GENERATE_TYPES,
            *_KINDS,
        }
    ),
    f"(((prefill|native|tilert)_)?({'|'.join(re.escape(k) for k in sorted(_KINDS))})|"
    f"((prefill|native|tilert)_)?{_HTTP_KIND})",
    "POOL_KIND: a failed upstream call's pool and kind (as upstream_errors_total's), generate_http_NNN",
)
#: How a native pair's warm-up ended (native_warmup.py), and the states of a pair (native_pairs.py).
WARMUP_OUTCOMES = values({"ok", "failed"}, other=False)
PAIR_STATES = values(get_args(PairState), other=False)
#: Why a request was retried before its first byte (handlers.retry_reason).
RETRY_REASONS = values(
    {
        "connect",
        "reset",
        "timeout",
        "http_5xx",
        "handoff_failed",
        "decode_failed",
        "compat_mismatch",
        "bad_response",
        "admit_failed",
    }
)
#: A config reload's result (reload.py).
RELOAD_RESULTS = values({"ok", "error"})
#: The HTTP status of a request the router refused.
CODES = Values(frozenset(), "[45][0-9][0-9]", "NNN: the HTTP status, 400 to 599")
#: The prefill policies (config.RoutingPolicy.prefill) and why a choice went where it did.
PREFILL_POLICIES = values(get_args(PrefillPolicy), other=False)
PREFILL_REASONS = values(REASONS, other=False)
NODE = Unbounded("a TileRT node's name (router config tilert[].name): one per node")
ENDPOINT = Unbounded("an endpoint's URL: one per prefill, native and TileRT endpoint")


def bounded_kind(kind: str) -> str:
    """`kind` when it is one of a fixed set (an HTTP status included), else "other"."""
    return KINDS.bound(kind)


PREFIX = "tilert_router_"
_HEALTHY = "endpoint_healthy"
#: Read by `tilert-pd local apply`, which waits until the router lists the endpoints it published.
ENDPOINT_HEALTHY = PREFIX + _HEALTHY
_PAIRS = "native_pairs"
#: Read by `tilert-pd local apply`, which waits for the router's warm-ups before removing old pods.
NATIVE_PAIRS = PREFIX + _PAIRS

_latency = partial(histogram, buckets=_LATENCY_BUCKETS)
_itl = partial(histogram, buckets=_ITL_BUCKETS)
_PATH: Mapping[str, Domain] = {"path": PATHS}


@dataclass(frozen=True)
class _Decl:
    """One of the router's metrics: the Metrics attribute that holds it, how it is declared, its name
    after PREFIX, its labels (none: the bare metric, else held to them by Bounded) and its help."""

    attr: str
    make: Callable[..., Counter | Gauge | Histogram]
    name: str
    labels: Mapping[str, Domain]
    doc: str


def _short(name: str) -> str:
    """A name the operator reads too (tilert_serve.metric_defs), without the prefix added here."""
    return name.removeprefix(PREFIX)


#: Every metric, in the order docs/metrics.md lists them (the registry's).
# fmt: off
_DECLS = (
    _Decl("ttft", _latency, _short(names.ROUTER_TTFT), _PATH,
          "Seconds from a request's arrival to its first token written to the client, by decode path."),
    _Decl("itl", _itl, _short(names.ROUTER_INTER_TOKEN), _PATH,
          "Seconds between two chunks written to a client, by decode path."),
    _Decl("e2e", _latency, _short(names.ROUTER_REQUEST_DURATION), _PATH,
          "Seconds from a request's arrival to its last byte written, by decode path."),
    _Decl("prefill", _latency, _short(names.ROUTER_PREFILL), _PATH, "Seconds of the prefill call, by decode path."),
    _Decl("handoff", _latency, "handoff_seconds", {},
          "Seconds from the prefill's answer to the first token "
          "from the TileRT node (the KV handoff, as the router sees it)."),
    _Decl("requests", counter, "requests_total", {"path": PATHS, "outcome": OUTCOMES},
          "Finished requests by decode path and outcome."),
    _Decl("routes", counter, _short(names.ROUTER_ROUTES), {"path": PATHS, "reason": values(get_args(Label))},
          "Routing decisions by decode path and reason."),
    _Decl("admissions", counter, "admissions_total", {"node": NODE, "result": ADMISSION_RESULTS},
          "TileRT admission calls by node and result."),
    _Decl("rejections", counter, _short(names.ROUTER_REJECTIONS), {"code": CODES},
          "Requests the router answered with a 4xx or 5xx status, by status."),
    _Decl("upstream_errors", counter, "upstream_errors_total", {"pool": POOLS, "kind": KINDS},
          "Failed upstream calls by pool and kind."),
    _Decl("probes", counter, "handoff_probes_total", {"node": NODE, "outcome": PROBE_OUTCOMES},
          "Handoff probes (canary requests to idle TileRT nodes) by node and outcome."),
    _Decl("retries", counter, "retries_total", {"route": PATHS, "reason": RETRY_REASONS},
          "Retries of requests that failed before their first byte reached the client, by the "
          "route of the failed attempt and why it failed (admit_failed: another node asked for a "
          "slot; the others re-run the prefill)."),
    _Decl("retries_denied", counter, "retries_denied_total", {"route": PATHS},
          "Failed attempts not retried because the retry budget (policy.retry_budget_*) was "
          "spent, by route."),
    _Decl("no_pair", counter, "no_compatible_pair_total", {"route": PATHS},
          "Requests for which a decode pool had a server that could take them but none of a "
          "generation (compatibility fingerprint) any usable prefill has, by that pool; they "
          "were routed as if the pool were full."),
    _Decl("compat_mismatches", counter, "compat_mismatches_total", {"pool": POOLS},
          "Endpoints found advertising another generation than their configured one (each "
          "change counted once); they take no requests while it lasts."),
    _Decl("stream_errors", counter, "stream_errors_total", {"path": PATHS, "kind": KINDS},
          "Client streams ended with an error event because the decode failed mid-stream, by "
          "decode path and kind."),
    _Decl("cancels", counter, "tilert_cancels_total", {"reason": CANCEL_REASONS},
          "Ticket cancels sent to TileRT nodes, by reason."),
    _Decl("tilert_waits", counter, "tilert_waits_total", {"outcome": TILERT_WAIT_OUTCOMES},
          "Requests that found no TileRT node they could use while one could come back soon "
          "(ejected by a late probe, the node list being swapped) and waited for it "
          "(policy.tilert_wait_s), by outcome: resumed (a node came back in time and the request "
          "was routed), timed_out (answered 503 after the wait), client_gone."),
    _Decl("tilert_waiting", gauge, "tilert_waiting_requests", {},
          "Requests waiting now for a TileRT node to come back."),
    _Decl("native_warmups", counter, "native_warmups_total", {"outcome": WARMUP_OUTCOMES},
          "Warm-up requests the router sent through (prefill, native decode) pairs that had not "
          "moved KV yet (native_warmup.enabled), by outcome; not counted as requests."),
    _Decl("native_pairs", gauge, _PAIRS, {"state": PAIR_STATES},
          "Pairs of a prefill and a native decode server of one generation among the configured "
          "endpoints, by state: cold (never moved KV, or a side restarted), warming, warm, failed (its warm-up "
          "failed; tried again after native_warmup.retry_s)."),
    _Decl("inflight", gauge, "inflight_requests", _PATH, "Requests in flight, by decode path."),
    _Decl("slots", gauge, "tilert_slots_in_use", {"node": NODE}, "TileRT slots this router holds, by node."),
    _Decl("healthy", gauge, _HEALTHY, {"pool": POOLS, "endpoint": ENDPOINT},
          "Endpoint health: 1 healthy, 0 ejected, -1 not probed yet."),
    _Decl("breaker_open", gauge, "breaker_open", {"node": NODE},
          "1 while a TileRT node's circuit breaker is open "
          "or half-open (after failed handoffs), 0 while closed."),
    _Decl("endpoint_breaker_open", gauge, "endpoint_breaker_open", {"pool": POOLS, "endpoint": ENDPOINT},
          "1 while an endpoint's circuit breaker is open or half-open, 0 while closed (prefill "
          "and native servers: refused connections, resets, 5xx; TileRT nodes: failed handoffs)."),
    _Decl("path_up", gauge, "path_up", _PATH,
          "1 when a decode path can take a request, 0 when it is down, -1 when it is not configured."),
    _Decl("config_reloads", counter, "config_reloads_total", {"result": RELOAD_RESULTS},
          "Config reloads by result."),
    _Decl("prefill_choices", counter, "prefill_choices_total",
          {"policy": PREFILL_POLICIES, "reason": PREFILL_REASONS},
          "Prefills chosen for client requests, by prefill policy and why that prefill won: prefix "
          "(it held the longest prefix), imbalance (the best match was too loaded), short_match "
          "(no match covered policy.min_match_ratio of the prompt), least_loaded, round_robin."),
    _Decl("prefix_prompt_blocks", counter, "prefix_prompt_blocks_total", {},
          "Whole prompt blocks (policy.prefix_block_chars characters or prefix_block_tokens token ids) "
          "of requests routed by cache_aware; prefix_matched_blocks_total over this is the share of "
          "prompt blocks that hit a prefill's cache, as the router sees it."),
    _Decl("prefix_matched_blocks", counter, "prefix_matched_blocks_total", {},
          "Whole prompt blocks of requests routed by cache_aware that the chosen prefill was already "
          "sent, by the router's prefix index."),
    _Decl("prefix_index_blocks", gauge, "prefix_index_blocks", {},
          "Block hashes the router's prefix index holds over all prefills (bounded by "
          "policy.prefix_index_blocks_total)."),
)
# fmt: on


class Metrics:
    """The router's metrics, one attribute each (_DECLS), in a registry of their own."""

    ttft: Bounded
    itl: Bounded
    e2e: Bounded
    prefill: Bounded
    handoff: Histogram
    requests: Bounded
    routes: Bounded
    admissions: Bounded
    rejections: Bounded
    upstream_errors: Bounded
    probes: Bounded
    retries: Bounded
    retries_denied: Bounded
    no_pair: Bounded
    compat_mismatches: Bounded
    stream_errors: Bounded
    cancels: Bounded
    tilert_waits: Bounded
    tilert_waiting: Gauge
    native_warmups: Bounded
    native_pairs: Bounded
    inflight: Bounded
    slots: Bounded
    healthy: Bounded
    breaker_open: Bounded
    endpoint_breaker_open: Bounded
    path_up: Bounded
    config_reloads: Bounded
    prefill_choices: Bounded
    prefix_prompt_blocks: Counter
    prefix_matched_blocks: Counter
    prefix_index_blocks: Gauge

    def __init__(self) -> None:
        self.registry = Registry()
        for d in _DECLS:
            metric = d.make(self.registry, PREFIX + d.name, d.doc, labels=d.labels or None)
            setattr(self, d.attr, Bounded(metric) if d.labels else metric)

    def observe_prefill_choice(self, c: PrefillChoice) -> None:
        """pools.ChoiceObserver: count one prefill choice made for a client's request."""
        self.prefill_choices.labels(c.policy, c.reason).inc()
        self.prefix_index_blocks.set(c.index_blocks)
        if c.policy != "cache_aware" or c.prompt_blocks == 0:
            return
        self.prefix_prompt_blocks.inc(c.prompt_blocks)
        self.prefix_matched_blocks.inc(c.matched_blocks)

    def render(self) -> bytes:
        return generate_latest(self.registry)


# The attribute annotations above are what mypy checks callers against; the table is what is declared.
if set(Metrics.__annotations__) != {d.attr for d in _DECLS}:
    raise ImportError("router.metrics: Metrics' attribute annotations and _DECLS name different metrics")
