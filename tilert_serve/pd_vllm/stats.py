"""Handoff statistics, reported through vLLM's own connector-stats path so they appear in the
prefill's log and on its /metrics endpoint (as vllm:tilert_* counters; docs/metrics.md lists them)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, cast

from prometheus_client import Counter
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)

from tilert_serve.handoff.errors import RejectReason
from tilert_serve.metric_defs import Domain, Unbounded, declare, values

#: How a handoff ends, the outcome label's values: ok, the sender's failures (handoff/sender.py), the
#: node's refusals, and the worker's own (internal: the sender crashed; failed: no reason given).
#: Anything else counts as "other".
HANDOFF_OUTCOMES = values(
    {
        "ok",
        "failed",
        "internal",
        "unreachable",
        "timeout",
        "protocol",
        "prefill_failed",
        "transfer_failed",
        *RejectReason,
    }
)
#: The labels vLLM gives its metrics, ours included.
VLLM_LABELS: dict[str, Domain] = {
    "model_name": Unbounded("the served model's name (vLLM's label)"),
    "engine": Unbounded("the engine core's index, one per data-parallel rank (vLLM's label)"),
}


def _empty() -> dict[str, Any]:
    return {
        "handoffs": {},
        "bytes": 0,
        "extract_s": 0.0,
        "send_s": 0.0,
        "layers_sent": 0,
        "layers_early": 0,
        "ack_s": 0.0,
        "write_s": 0.0,
        "chunk_bytes": 0,
    }


@dataclass
class TileRTStats(KVConnectorStats):
    data: dict[str, Any] = field(default_factory=_empty)

    def record(
        self,
        outcome: str,
        nbytes: int = 0,
        extract_s: float = 0.0,
        send_s: float = 0.0,
        *,
        layers_sent: int = 0,
        layers_early: int = 0,
        ack_s: float = 0.0,
        write_s: float = 0.0,
        chunk_bytes: int = 0,
    ) -> None:
        """`layers_sent`: layers reported one by one (LayersDone); `layers_early`: those before the
        last batch; `ack_s`: from the end of the last write to the node's Ack; `write_s`: inside the
        transfer engine's write calls alone (bytes / write_s is the link's bandwidth; send_s holds
        the waits for the forward when layer-wise); `chunk_bytes`: bytes sent during a chunked
        prefill's steps before its last (of `nbytes`)."""
        outcome = HANDOFF_OUTCOMES.bound(outcome)
        self.data["handoffs"][outcome] = self.data["handoffs"].get(outcome, 0) + 1
        self.data["bytes"] += nbytes
        self.data["extract_s"] += extract_s
        self.data["send_s"] += send_s
        self.data["layers_sent"] += layers_sent
        self.data["layers_early"] += layers_early
        self.data["ack_s"] += ack_s
        self.data["write_s"] += write_s
        self.data["chunk_bytes"] += chunk_bytes

    def reset(self) -> None:
        self.data = _empty()

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for k, v in other.data.get("handoffs", {}).items():
            self.data["handoffs"][k] = self.data["handoffs"].get(k, 0) + v
        for k in (
            "bytes",
            "extract_s",
            "send_s",
            "layers_sent",
            "layers_early",
            "ack_s",
            "write_s",
            "chunk_bytes",
        ):
            self.data[k] = self.data.get(k, 0) + other.data.get(k, 0)
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {f"tilert_{k}": v for k, v in sorted(self.data["handoffs"].items())}
        out["tilert_bytes"] = self.data["bytes"]
        out["tilert_extract_s"] = round(self.data["extract_s"], 4)
        out["tilert_send_s"] = round(self.data["send_s"], 4)
        out["tilert_layers_sent"] = self.data.get("layers_sent", 0)
        out["tilert_layers_early"] = self.data.get("layers_early", 0)
        out["tilert_ack_s"] = round(self.data.get("ack_s", 0.0), 4)
        out["tilert_write_s"] = round(self.data.get("write_s", 0.0), 4)
        out["tilert_chunk_bytes"] = self.data.get("chunk_bytes", 0)
        return out

    def is_empty(self) -> bool:
        return not self.data["handoffs"]


class TileRTPromMetrics(KVConnectorPromMetrics):
    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        # vLLM maps each prometheus_client class to a compatible one (its own, or Ray's wrapper): the
        # class under the Counter key is a Counter.
        counter_cls = cast("type[Counter]", self._counter_cls)
        vllm_labels = {
            n: VLLM_LABELS.get(n, Unbounded("a label vLLM gives all its metrics")) for n in labelnames
        }

        def counter(name: str, documentation: str, labels: dict[str, Domain] | None = None) -> Counter:
            domains = {**vllm_labels, **(labels or {})}
            return declare(counter_cls(name, documentation, labelnames=list(domains)), domains)

        self._handoffs = counter(
            "vllm:tilert_handoffs_total",
            "Handoffs to TileRT nodes by outcome: ok, or why the handoff failed.",
            {"outcome": HANDOFF_OUTCOMES},
        )
        self._bytes = counter("vllm:tilert_handoff_bytes_total", "Bytes of state sent to TileRT nodes.")
        self._send_s = counter(
            "vllm:tilert_handoff_seconds_total",
            "Seconds sending state to TileRT nodes: "
            "handshake, writes (and, layer-wise, the waits for the forward) and Ack.",
        )
        self._extract_s = counter(
            "vllm:tilert_extract_seconds_total", "Seconds gathering state from the KV cache into staging."
        )
        self._layers_sent = counter(
            "vllm:tilert_layers_sent_total", "Layers handed over one by one (layer-wise handoff)."
        )
        self._layers_early = counter(
            "vllm:tilert_layers_early_total",
            "Layers handed over before a handoff's last batch, while the forward still ran.",
        )
        self._ack_s = counter(
            "vllm:tilert_ack_seconds_total", "Seconds from a handoff's last write to the node's Ack."
        )
        self._write_s = counter(
            "vllm:tilert_write_seconds_total",
            "Seconds inside the transfer engine's writes; "
            "handoff bytes over these seconds is the link's bandwidth.",
        )
        self._chunk_bytes = counter(
            "vllm:tilert_handoff_chunk_bytes_total",
            "Bytes of state, of the handoff bytes, sent while a chunked prefill's later "
            "chunks were still being computed.",
        )

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        labels = self.per_engine_labelvalues[engine_idx]
        for outcome, n in transfer_stats_data.get("handoffs", {}).items():
            self._handoffs.labels(*labels, outcome).inc(n)
        self._bytes.labels(*labels).inc(transfer_stats_data.get("bytes", 0))
        self._send_s.labels(*labels).inc(transfer_stats_data.get("send_s", 0.0))
        self._extract_s.labels(*labels).inc(transfer_stats_data.get("extract_s", 0.0))
        self._layers_sent.labels(*labels).inc(transfer_stats_data.get("layers_sent", 0))
        self._layers_early.labels(*labels).inc(transfer_stats_data.get("layers_early", 0))
        self._ack_s.labels(*labels).inc(transfer_stats_data.get("ack_s", 0.0))
        self._write_s.labels(*labels).inc(transfer_stats_data.get("write_s", 0.0))
        self._chunk_bytes.labels(*labels).inc(transfer_stats_data.get("chunk_bytes", 0))
