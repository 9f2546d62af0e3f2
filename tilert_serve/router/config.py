"""The router's configuration: what the operator writes into the router's ConfigMap (config.yaml) and
what `tilert-pd local` writes for local runs. One model, parsed in one place.

Every field added after the first version has a default, so a config.yaml rendered by an older operator
still parses (the operator's renderer and this model are edited by different people).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from tilert_serve import defaults
from tilert_serve.router.prefill_choice import PrefillPolicy, Thresholds

NativeConnector = Literal["NixlConnector", "MooncakeConnector"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


#: What a compat field holds: `tilert_serve.compat.Compat.fingerprint` (12 hex digits), or None for an
#: endpoint of unknown generation, which pairs with anything (`tilert_serve.compat.compatible`).
CompatField = str | None


class Endpoint(_Strict):
    """A vLLM server (a prefill or a native decode) and its compatibility generation.

    A plain URL string validates as `Endpoint(url=...)` with compat None: configs written before
    generations existed (and renderers that still pass strings) keep working."""

    url: str
    compat: CompatField = None

    @model_validator(mode="before")
    @classmethod
    def _from_url(cls, data: Any) -> Any:
        return {"url": data} if isinstance(data, str) else data


class TileRTNode(_Strict):
    """One TileRT decode node (a pod of the TileRT StatefulSet)."""

    name: str
    #: Base URL of the node's HTTP API (admit, generate, cancel, health).
    http_url: str
    #: Where the prefill's sender reaches the node's control plane (passed in kv_transfer_params).
    ctrl_host: str
    ctrl_port: int = defaults.DECODE_CTRL_PORT
    slots: int = Field(default=1, ge=1)
    #: The node's context limit, when known: caps the tokens asked for a request without max_tokens.
    max_seq_len: int | None = Field(default=None, ge=1)
    #: The compatibility fingerprint the node should advertise (its generation's); None = unknown, pairs
    #: with any prefill. A node whose /v1/status advertises another one is not routed to.
    compat: CompatField = None


class RoutingPolicy(_Strict):
    #: Request header that picks the path: tilert | native | auto.
    header: str = "x-pd-route"
    #: Model names (aliases) that always go to TileRT / to the native pool.
    tilert_aliases: list[str] = []
    native_aliases: list[str] = []
    #: Path for requests that name neither alias nor header. auto = TileRT when a slot is free.
    default: Literal["auto", "tilert", "native"] = "auto"
    #: What happens when TileRT is asked for but has no free slot.
    when_tilert_full: Literal["native", "reject"] = "native"
    #: What happens to requests using features the TileRT engine lacks (penalties, grammars, ...).
    unsupported_on_tilert: Literal["native", "reject"] = "native"
    retry_after_s: int = Field(default=1, ge=0)
    #: Retries of a request that failed before its first byte reached the client (another prefill,
    #: node or native server; each re-runs the prefill), within the retry budget below.
    retries: int = Field(default=2, ge=0)
    #: The retry budget: over the last `retry_budget_window_s`, retries may be at most this fraction
    #: of the requests that arrived, plus `retry_budget_min` (so that a quiet router still retries).
    #: A pool where everything fails then costs at most that much extra load instead of (1 + retries)x.
    retry_budget_ratio: float = Field(default=0.2, ge=0)
    retry_budget_min: int = Field(default=5, ge=0)
    retry_budget_window_s: float = Field(default=10.0, gt=0)
    #: How a prefill is chosen among those that may serve the request (prefill_choice.py says how each
    #: works): cache_aware (the one holding the longest prefix of the prompt, within the balance
    #: thresholds), least_loaded (fewest prefills in flight) or round_robin.
    prefill: PrefillPolicy = "cache_aware"
    #: cache_aware: the best prefix match loses to the least loaded prefill when it has more than
    #: `balance_abs` more prefills in flight AND more than `balance_rel` times as many.
    balance_abs: int = Field(default=8, ge=0)
    balance_rel: float = Field(default=1.5, ge=1.0)
    #: cache_aware: a match covering less than this share of the prompt's whole blocks is ignored (the
    #: least loaded prefill takes the request, and becomes the prompt's home).
    min_match_ratio: float = Field(default=0.3, ge=0.0, le=1.0)
    #: The prefix index's block: characters of a text prompt (a chat's rendered messages), token ids
    #: of a prompt given as ids (vLLM's default block is 16 tokens; about 4 characters a token).
    prefix_block_chars: int = Field(default=128, ge=1)
    prefix_block_tokens: int = Field(default=16, ge=1)
    #: The prefix index's memory bound, in block hashes (about 90 bytes each in CPython): per prefill (32768
    #: blocks of 128 characters, about a million tokens, what one prefill's KV cache holds on a large
    #: GPU) and over all prefills; the least recently sent are evicted first.
    prefix_index_blocks_per_endpoint: int = Field(default=32768, ge=1)
    prefix_index_blocks_total: int = Field(default=262144, ge=1)
    #: How a native decode server is chosen: power_of_two (the less loaded of two drawn at random:
    #: router replicas do not herd onto one server) or least_loaded.
    native: Literal["power_of_two", "least_loaded"] = "power_of_two"
    #: A request the TileRT path must serve (asked for by header or alias, or with no native pool to
    #: fall back to) that finds no node it can use, while some node may come back soon (ejected by the
    #: health checks, failing its admission, half-open: not behind an open breaker, not running another
    #: generation), waits up to this many seconds for one before its 503: a generation change swaps
    #: the node list while the new nodes may be ejected for a moment (a probe late on a loaded host).
    #: The bound is per request, over all its attempts; 0 = the 503 at once.
    tilert_wait_s: float = Field(default=5.0, ge=0)

    def thresholds(self) -> Thresholds:
        return Thresholds(self.balance_abs, self.balance_rel, self.min_match_ratio)


#: RoutingPolicy's fields added with the prefill choice; `dump` leaves them out at defaults.
_CHOICE_FIELDS = (
    "prefill",
    "balance_abs",
    "balance_rel",
    "min_match_ratio",
    "prefix_block_chars",
    "prefix_block_tokens",
    "prefix_index_blocks_per_endpoint",
    "prefix_index_blocks_total",
    "native",
    "tilert_wait_s",
)


class Timeouts(_Strict):
    connect_s: float = 5.0
    #: Prefill of the whole prompt, first token included.
    prefill_s: float = 600.0
    #: Between two tokens of a decode stream.
    idle_stream_s: float = 60.0
    #: One admission call on a TileRT node (it answers from memory: short).
    admit_s: float = 2.0
    #: From the generate call to its response headers: the node waits for the KV handoff before it
    #: answers, and answers 504 itself when the handoff is late; this bounds a node that never answers.
    decode_start_s: float = 60.0
    #: A cancel call; it runs in the background, so it only bounds how long a slot may stay unknown.
    cancel_s: float = 2.0
    #: A client connection with no request in progress is closed after this long: idle keep-alive
    #: connections, and connections whose request line and headers have not all arrived (aiohttp's
    #: keep-alive timer bounds both; its default holds them for an hour). Read when the router starts.
    client_idle_s: float = Field(default=15.0, gt=0)
    #: A request body must have arrived this long after its headers, else 408.
    client_body_s: float = Field(default=30.0, gt=0)


class HealthChecks(_Strict):
    #: Seconds between two probes of every endpoint (GET /health on vLLM, GET /ready on TileRT nodes).
    interval_s: float = Field(default=2.0, gt=0)
    timeout_s: float = Field(default=1.0, gt=0)
    #: Consecutive failures (probes or transport errors) that eject an endpoint.
    failures_to_eject: int = Field(default=2, ge=1)
    #: Consecutive probes that time out that eject it (never fewer than failures_to_eject). A probe
    #: that times out reached a server that is slow, or a router too busy to read the answer in time
    #: (both share a few cores in a local run): on a loaded host that says little about health, and
    #: ejecting every node of a pool for one late round fails requests a slow node would have served.
    #: An answer that says "not ready" or a refused connection still ejects after failures_to_eject.
    timeouts_to_eject: int = Field(default=4, ge=1)
    #: Consecutive successful probes that bring an ejected endpoint back.
    successes_to_return: int = Field(default=1, ge=1)


#: What the operator renders for handoff_probe.interval_s.
HANDOFF_PROBE_INTERVAL_S = 30.0


class HandoffProbe(_Strict):
    """Probe handoffs (canary.py): a minimal real request to each TileRT node that has had no successful
    handoff for `interval_s`, only while it is idle and no request waits for a slot."""

    #: Seconds without a successful handoff before a node is probed; 0 = never (then /ready counts a
    #: probed-healthy node as a route, as before). The operator renders 30.
    interval_s: float = Field(default=0.0, ge=0)
    #: After a failed handoff (a user's or a probe's), probe again this soon: one transient failure must
    #: not keep a node (and, without a native pool, the router) unready for a whole interval.
    retry_s: float = Field(default=5.0, gt=0)
    #: The probe's prompt (a few tokens in any tokenizer).
    prompt: str = "ping"
    #: Bound on the probe's prefill and on its decode: longer than the node's ticket TTL (30 s), so that a
    #: state that never arrives is the node's own 504 (recorded as a timeout there), not our give-up.
    timeout_s: float = Field(default=60.0, gt=0)


class NativeWarmup(_Strict):
    """Warm-up requests for new (prefill, native decode) pairs (native_pairs.py): the first KV a native
    decode pulls from a prefill pays the connector's first contact (seconds); one small request of the
    router's own pays it before users do, and while some pair is warm native requests go through warm
    pairs. Off unless asked for; the operator renders it on."""

    enabled: bool = False
    #: Bound on a warm-up's prefill and decode calls, each.
    timeout_s: float = Field(default=60.0, gt=0)
    #: After a failed warm-up, try the pair again this much later.
    retry_s: float = Field(default=10.0, gt=0)


class CircuitBreaker(_Strict):
    """Per TileRT node: after `failures_to_open` failed handoffs in a row (a user's or a probe's: the
    node's control port refusing, a state that never arrives), the node takes no request for `open_s`,
    doubled after each failed trial up to `max_open_s`. Then one request tries it (half-open; handoff
    probes try it too) and a handoff that decodes closes the breaker. While every node's breaker is open
    the TileRT path is down: requests go native or get a 503 at once, by the routing policy."""

    failures_to_open: int = Field(default=1, ge=1)
    open_s: float = Field(default=5.0, gt=0)
    max_open_s: float = Field(default=60.0, gt=0)


class Limits(_Strict):
    #: Largest accepted request body; larger bodies get a 413 before anything is parsed.
    max_body_bytes: int = Field(default=8 * 1024 * 1024, ge=1024)
    #: Concurrent requests per native decode server; beyond it the native pool counts as full.
    native_max_inflight: int = Field(default=256, ge=1)
    #: Tokens to generate on the TileRT path when the client gives no max_tokens (the node needs a
    #: number; vLLM's own default is "up to the context length", which the router cannot know).
    default_max_tokens: int = Field(default=4096, ge=1)
    #: Pooled upstream connections per host (prefill, native decode, TileRT node).
    connections_per_host: int = Field(default=0, ge=0)
    #: Client connections held at once; past it the connection idle the longest is closed to make room
    #: (httpserver.py). None = half the open-file limit (raised to the hard limit at start), which keeps
    #: descriptors for upstream connections however many clients connect. Read when the router starts.
    max_client_connections: int | None = Field(default=None, ge=1)


class TileRTDiscovery(_Strict):
    """Find TileRT nodes through the DNS name of their pool's headless Service.

    Kubernetes answers that name with the addresses of the pool's ready pods only, within seconds of a
    readiness change; a mounted ConfigMap reaches the router only when the kubelet syncs it (up to
    about a minute). Nodes found here join the configured list (which wins for an address in both).
    """

    service: str
    http_port: int = defaults.DECODE_HTTP_PORT
    ctrl_port: int = defaults.DECODE_CTRL_PORT
    slots: int = Field(default=1, ge=1)
    max_seq_len: int | None = Field(default=None, ge=1)
    interval_s: float = Field(default=2.0, gt=0)
    #: The generation of the nodes behind this Service (each generation has its own headless Service).
    compat: CompatField = None


class Tracing(_Strict):
    """OpenTelemetry traces of each request (tilert_serve/tracing.py; docs/observability.md, "Traces").
    Read when the router starts: a reload does not change them."""

    #: The collector's OTLP/HTTP traces URL (http://collector:4318/v1/traces); "" = no tracing.
    endpoint: str = ""
    #: Share of requests without a client's sampled traceparent that start a trace.
    sample_ratio: float = Field(default=1.0, ge=0.0, le=1.0)
    #: The service.name the router's spans carry.
    service_name: str = "tilert-router"

    @field_validator("endpoint")
    @classmethod
    def _url(cls, value: str) -> str:
        from tilert_serve.tracing import TracingConfig

        TracingConfig(endpoint=value)  # raises with what to give instead
        return value


class RouterConfig(_Strict):
    #: The served model name clients use.
    model: str
    #: The vLLM prefill servers (a URL string is an Endpoint of unknown generation).
    prefill: list[Endpoint]
    tilert: list[TileRTNode] = []
    #: Also take TileRT nodes from DNS (in a cluster: one headless Service per live generation). A single
    #: mapping is a one-item list; null, none. Read it through `discoveries()`.
    tilert_discovery: list[TileRTDiscovery] = []
    #: The native vLLM decode servers.
    native: list[Endpoint] = []
    policy: RoutingPolicy = RoutingPolicy()
    timeouts: Timeouts = Timeouts()
    #: File with one API key per line (clients send `Authorization: Bearer <key>`); None = no
    #: authentication. Re-read within about a second of a change (a removed key stops working); an
    #: empty file admits nobody.
    api_keys_file: str | None = None
    #: With API keys: whether /metrics (which names every endpoint's address) answers without a key.
    #: Default no: a scraper sends one of the keys. Without API keys everything is open anyway.
    metrics_public: bool = False
    #: File with tokens (one a line) that open GET /metrics and nothing else: the operator's
    #: metrics-only token (its autoscaler reads the router's load). None = none.
    metrics_token_file: str | None = None
    #: The TileRT nodes' API token file (the `<cluster>-node-api` Secret, one token a line): the first
    #: token goes in `Authorization: Bearer` on every call to a node's /v1/*. None = send none.
    tilert_api_token_file: str | None = None
    health: HealthChecks = HealthChecks()
    handoff_probe: HandoffProbe = HandoffProbe()
    native_warmup: NativeWarmup = NativeWarmup()
    breaker: CircuitBreaker = CircuitBreaker()
    #: Per prefill and native decode server: refused connections, resets, 5xx answers and timeouts in
    #: a row (a refused connection opens it at once: nothing listens there any more).
    endpoint_breaker: CircuitBreaker = CircuitBreaker(failures_to_open=3)
    limits: Limits = Limits()
    #: Model name sent to the vLLM servers, when it differs from the served name (vLLM checks it).
    upstream_model: str | None = None
    #: Seconds between two checks of the config file for changes (ConfigMap symlink swaps included).
    reload_interval_s: float = Field(default=2.0, gt=0)
    #: The vLLM connector the native decode pool reads the prefill's KV with (the prefill runs the same
    #: one beside TileRTConnector). Each needs different kv_transfer_params (native_path.py).
    native_connector: NativeConnector = "NixlConnector"
    #: Where each prefill server's MooncakeConnector serves its bootstrap registry: vLLM's
    #: VLLM_MOONCAKE_BOOTSTRAP_PORT (default 8998) on the prefill's host.
    mooncake_bootstrap_port: int = Field(default=8998, ge=1, le=65535)
    tracing: Tracing = Tracing()

    @field_validator("tilert_discovery", mode="before")
    @classmethod
    def _one_or_many(cls, value: Any) -> Any:
        if value is None:
            return []
        return [value] if isinstance(value, dict | TileRTDiscovery) else value

    def discoveries(self) -> list[TileRTDiscovery]:
        """The discovery entries, also when a caller set the field with model_copy(update=...), which
        does not validate (a single TileRTDiscovery then stands where the list should)."""
        value: object = self.tilert_discovery
        if value is None:
            return []
        if isinstance(value, TileRTDiscovery):
            return [value]
        assert isinstance(value, list)
        return [d if isinstance(d, TileRTDiscovery) else TileRTDiscovery.model_validate(d) for d in value]

    def served_models(self) -> list[str]:
        """Every name a client may put in `model`: the served name and the routing aliases."""
        names = [self.model, *self.policy.tilert_aliases, *self.policy.native_aliases]
        return list(dict.fromkeys(names))


def with_discovered(config: RouterConfig, discovered: list[TileRTNode]) -> RouterConfig:
    """The configured TileRT nodes, then discovered ones at addresses the configuration does not name."""
    known = {n.http_url for n in config.tilert}
    extra = [n for n in discovered if n.http_url not in known]
    return config.model_copy(update={"tilert": [*config.tilert, *extra]}) if extra else config


def load(path: str | Path) -> RouterConfig:
    """Parse a config file; errors name the field (pydantic's messages)."""
    data = yaml.safe_load(Path(path).read_text()) or {}
    return RouterConfig.model_validate(data)


def dump(config: RouterConfig) -> str:
    """config.yaml for `config`, in the older shape wherever it means the same (an endpoint without
    compat as its URL, no `compat: null`, a single discovery as a mapping, none as null), so that a
    router of the previous release reads a config that uses no generation."""
    data = config.model_copy(update={"tilert_discovery": config.discoveries()}).model_dump(mode="json")
    for pool in ("prefill", "native"):
        data[pool] = [e["url"] if e["compat"] is None else e for e in data[pool]]
    for item in [*data["tilert"], *data["tilert_discovery"]]:
        if item["compat"] is None:
            del item["compat"]
    found = data["tilert_discovery"]
    data["tilert_discovery"] = None if not found else found[0] if len(found) == 1 else found
    # The prefill and native choice at their defaults are what the previous release did
    # (least loaded, near enough): left out, a router of that release (which refuses unknown keys)
    # still reads the file during a rolling upgrade.
    defaults_ = RoutingPolicy()
    for name in _CHOICE_FIELDS:
        if data["policy"][name] == getattr(defaults_, name):
            del data["policy"][name]
    if data["health"]["timeouts_to_eject"] == HealthChecks().timeouts_to_eject:
        del data["health"]["timeouts_to_eject"]  # the same reason
    if data["native_warmup"] == NativeWarmup().model_dump(mode="json"):
        del data["native_warmup"]  # the same reason
    if data["tracing"] == Tracing().model_dump(mode="json"):
        # Off: left out, as the choice's defaults are, so that a router of the previous release reads it.
        del data["tracing"]
    return yaml.safe_dump(data, sort_keys=False)
