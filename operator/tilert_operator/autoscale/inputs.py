"""The load the planner sees, per pool, over one planning interval.

Plain values, no I/O: the edge that fills them (scraping the pods' /metrics, or a Prometheus query)
is not built yet; each field says which metric it comes from, as docs/metrics.md names them.
Rates and means are over the planning interval (`spec.autoscaling.intervalSeconds`); percentiles are
the objective's (`spec.autoscaling.objective.percentile`) over the same interval, None when no request
ended in it (no evidence either way).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class PrefillObserved:
    #: Ready prefill pods (the operator's own pod watch).
    ready: int
    #: Requests arriving per second, each of which needs a prefill: rate of the router's routing
    #: decisions, `tilert_router_routes_total` summed over paths (taken at arrival; the finished-request
    #: counter `tilert_router_requests_total` would saturate with the pool it is meant to size).
    arrival_rate: float
    #: Mean seconds one prefill takes: rate(`tilert_router_prefill_seconds_sum`) / rate(`..._count`).
    mean_prefill_s: float
    #: Requests queued in the prefills' schedulers: sum of vLLM's `vllm:num_requests_waiting`.
    waiting: float = 0.0
    #: TTFT at the objective's percentile: the router's `tilert_router_ttft_seconds` (every path).
    ttft_s: float | None = None


@dataclass(frozen=True)
class TileRTObserved:
    #: Ready TileRT nodes (pods of the StatefulSet, ordinals 0..ready-1).
    ready: int
    #: Slots per node: the node's `tilert_decode_slots` (equal to spec.decode.tilert.slots).
    slots_per_node: int
    #: Busy slots per node by ordinal: each node's `tilert_decode_slots_busy`. A node with a busy slot
    #: holds streams and is never scaled away (StatefulSets remove the highest ordinal first).
    busy_by_node: tuple[int, ...] = ()
    #: Requests admitted to TileRT per second: rate of `tilert_router_routes_total{path="tilert"}`.
    admit_rate: float = 0.0
    #: Requests that wanted TileRT and did not get it, per second: rate of `tilert_router_routes_total`
    #: {path="native", reason in ("tilert full", "no tilert pool", "tilert down")}, plus the 429s a
    #: `whenTilertFull: reject` policy answers (`tilert_router_rejections_total{code="429"}`).
    overflow_rate: float = 0.0
    #: TPOT at the objective's percentile: the nodes' `tilert_decode_tpot_seconds`.
    tpot_s: float | None = None

    @property
    def busy(self) -> int:
        return sum(self.busy_by_node)


@dataclass(frozen=True)
class NativeObserved:
    #: Ready native decode pods.
    ready: int
    #: Mean KV-cache use over the pool, 0..1: vLLM's `vllm:kv_cache_usage_perc`.
    kv_usage: float = 0.0
    #: Requests queued for lack of KV blocks: sum of `vllm:num_requests_waiting`.
    waiting: float = 0.0
    #: Requests routed native per second (their own and TileRT's overflow): rate of
    #: `tilert_router_routes_total{path="native"}`.
    arrival_rate: float = 0.0
    #: TPOT at the objective's percentile: the router's `tilert_router_inter_token_seconds{path="native"}`.
    tpot_s: float | None = None
    #: Streams decoding: sum of vLLM's `vllm:num_requests_running`. With `kv_usage` it gives how many
    #: streams a full replica holds, so demand can be sized beyond what the pool serves today.
    running: float = 0.0
    #: Mean seconds a native stream lasts: the router's `tilert_router_request_duration_seconds`
    #: {path="native"}, sum / count.
    mean_stream_s: float = 0.0


@dataclass(frozen=True)
class Observed:
    """One interval's view of the three pools, and the replicas each workload is asked for now (the
    last decision in status; on the first run, the spec's `replicas`)."""

    prefill: PrefillObserved
    tilert: TileRTObserved
    native: NativeObserved
    #: Replicas each workload has now, by pool name ("prefill", "tilert", "native").
    current: dict[str, int] = field(default_factory=dict)
    #: Mean seconds a stream holds its decode (the router's `tilert_router_request_duration_seconds`,
    #: sum / count): how long a slot wanted by an overflowing request would be held, when TileRT has
    #: admitted nothing this interval to measure it on.
    mean_stream_s: float = 0.0
