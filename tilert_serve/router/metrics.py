"""The router's Prometheus metrics, one registry per app (tests build many apps in one process).

Label values are bounded (paths, route reasons, status codes, error kinds from fixed sets; node names
and endpoint URLs from the config): no value comes from a client, and an upstream's words count as
"other". docs/metrics.md lists them (tilert_serve.metrics_catalogue)."""

from __future__ import annotations

import re
from typing import get_args

from prometheus_client import generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from tilert_serve.metric_defs import Bounded, Registry, Unbounded, Values, counter, gauge, histogram, values
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
#: Read by `tilert-pd local apply`, which waits until the router lists the endpoints it published.
ENDPOINT_HEALTHY = PREFIX + "endpoint_healthy"


class Metrics:
    def __init__(self) -> None:
        self.registry = r = Registry()
        p = PREFIX
        path = {"path": PATHS}
        self.ttft = Bounded(
            histogram(
                r,
                p + "ttft_seconds",
                "Seconds from a request's arrival to its first token written to the client, by decode path.",
                _LATENCY_BUCKETS,
                path,
            )
        )
        self.itl = Bounded(
            histogram(
                r,
                p + "inter_token_seconds",
                "Seconds between two chunks written to a client, by decode path.",
                _ITL_BUCKETS,
                path,
            )
        )
        self.e2e = Bounded(
            histogram(
                r,
                p + "request_duration_seconds",
                "Seconds from a request's arrival to its last byte written, by decode path.",
                _LATENCY_BUCKETS,
                path,
            )
        )
        self.prefill = Bounded(
            histogram(
                r,
                p + "prefill_seconds",
                "Seconds of the prefill call, by decode path.",
                _LATENCY_BUCKETS,
                path,
            )
        )
        self.handoff = histogram(
            r,
            p + "handoff_seconds",
            "Seconds from the prefill's answer to the first token "
            "from the TileRT node (the KV handoff, as the router sees it).",
            _LATENCY_BUCKETS,
        )
        self.requests = Bounded(
            counter(
                r,
                p + "requests_total",
                "Finished requests by decode path and outcome.",
                {"path": PATHS, "outcome": OUTCOMES},
            )
        )
        self.routes = Bounded(
            counter(
                r,
                p + "routes_total",
                "Routing decisions by decode path and reason.",
                {"path": PATHS, "reason": values(get_args(Label))},
            )
        )
        self.admissions = Bounded(
            counter(
                r,
                p + "admissions_total",
                "TileRT admission calls by node and result.",
                {"node": NODE, "result": ADMISSION_RESULTS},
            )
        )
        self.rejections = Bounded(
            counter(
                r,
                p + "rejections_total",
                "Requests the router answered with a 4xx or 5xx status, by status.",
                {"code": CODES},
            )
        )
        self.upstream_errors = Bounded(
            counter(
                r,
                p + "upstream_errors_total",
                "Failed upstream calls by pool and kind.",
                {"pool": POOLS, "kind": KINDS},
            )
        )
        self.probes = Bounded(
            counter(
                r,
                p + "handoff_probes_total",
                "Handoff probes (canary requests to idle TileRT nodes) by node and outcome.",
                {"node": NODE, "outcome": PROBE_OUTCOMES},
            )
        )
        self.retries = Bounded(
            counter(
                r,
                p + "retries_total",
                "Retries of requests that failed before their first byte reached the client, by the "
                "route of the failed attempt and why it failed (admit_failed: another node asked for a "
                "slot; the others re-run the prefill).",
                {"route": PATHS, "reason": RETRY_REASONS},
            )
        )
        self.retries_denied = Bounded(
            counter(
                r,
                p + "retries_denied_total",
                "Failed attempts not retried because the retry budget (policy.retry_budget_*) was "
                "spent, by route.",
                {"route": PATHS},
            )
        )
        self.no_pair = Bounded(
            counter(
                r,
                p + "no_compatible_pair_total",
                "Requests for which a decode pool had a server that could take them but none of a "
                "generation (compatibility fingerprint) any usable prefill has, by that pool; they "
                "were routed as if the pool were full.",
                {"route": PATHS},
            )
        )
        self.compat_mismatches = Bounded(
            counter(
                r,
                p + "compat_mismatches_total",
                "Endpoints found advertising another generation than their configured one (each "
                "change counted once); they take no requests while it lasts.",
                {"pool": POOLS},
            )
        )
        self.stream_errors = Bounded(
            counter(
                r,
                p + "stream_errors_total",
                "Client streams ended with an error event because the decode failed mid-stream, by "
                "decode path and kind.",
                {"path": PATHS, "kind": KINDS},
            )
        )
        self.cancels = Bounded(
            counter(
                r,
                p + "tilert_cancels_total",
                "Ticket cancels sent to TileRT nodes, by reason.",
                {"reason": CANCEL_REASONS},
            )
        )
        self.inflight = Bounded(
            gauge(r, p + "inflight_requests", "Requests in flight, by decode path.", path)
        )
        self.slots = Bounded(
            gauge(r, p + "tilert_slots_in_use", "TileRT slots this router holds, by node.", {"node": NODE})
        )
        self.healthy = Bounded(
            gauge(
                r,
                ENDPOINT_HEALTHY,
                "Endpoint health: 1 healthy, 0 ejected, -1 not probed yet.",
                {"pool": POOLS, "endpoint": ENDPOINT},
            )
        )
        self.breaker_open = Bounded(
            gauge(
                r,
                p + "breaker_open",
                "1 while a TileRT node's circuit breaker is open "
                "or half-open (after failed handoffs), 0 while closed.",
                {"node": NODE},
            )
        )
        self.endpoint_breaker_open = Bounded(
            gauge(
                r,
                p + "endpoint_breaker_open",
                "1 while an endpoint's circuit breaker is open or half-open, 0 while closed (prefill "
                "and native servers: refused connections, resets, 5xx; TileRT nodes: failed handoffs).",
                {"pool": POOLS, "endpoint": ENDPOINT},
            )
        )
        self.path_up = Bounded(
            gauge(
                r,
                p + "path_up",
                "1 when a decode path can take a request, 0 when it is down, -1 when it is not configured.",
                path,
            )
        )
        self.config_reloads = Bounded(
            counter(r, p + "config_reloads_total", "Config reloads by result.", {"result": RELOAD_RESULTS})
        )

        self.prefill_choices = Bounded(
            counter(
                r,
                p + "prefill_choices_total",
                "Prefills chosen for client requests, by prefill policy and why that prefill won: prefix "
                "(it held the longest prefix), imbalance (the best match was too loaded), short_match "
                "(no match covered policy.min_match_ratio of the prompt), least_loaded, round_robin.",
                {"policy": PREFILL_POLICIES, "reason": PREFILL_REASONS},
            )
        )
        self.prefix_prompt_blocks = counter(
            r,
            p + "prefix_prompt_blocks_total",
            "Whole prompt blocks (policy.prefix_block_chars characters or prefix_block_tokens token ids) "
            "of requests routed by cache_aware; prefix_matched_blocks_total over this is the share of "
            "prompt blocks that hit a prefill's cache, as the router sees it.",
        )
        self.prefix_matched_blocks = counter(
            r,
            p + "prefix_matched_blocks_total",
            "Whole prompt blocks of requests routed by cache_aware that the chosen prefill was already "
            "sent, by the router's prefix index.",
        )
        self.prefix_index_blocks = gauge(
            r,
            p + "prefix_index_blocks",
            "Block hashes the router's prefix index holds over all prefills (bounded by "
            "policy.prefix_index_blocks_total).",
        )

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
