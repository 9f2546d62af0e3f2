"""The node's record of its data plane: the last handoff it decoded from, the last data-plane
failure, the transport, and their metrics. GET /v1/status serves it (the operator's HandoffReady
condition reads it); it holds no request ids.

One owner: the node and its control server report events here (`ctrl_error`, `failure`,
`success`); nothing else writes the record.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from prometheus_client import Counter, Gauge

from tilert_serve.decode.metrics import NodeMetrics
from tilert_serve.decode.slots import Slot
from tilert_serve.transfer import TransferEngine

#: Failure categories that say the data plane is broken (as opposed to a node that is busy, a ticket
#: that expired unused, or a request too long): these, and only these, are the node's last failure.
DATA_PLANE_FAILURES = frozenset({
    "not_authenticated", "layout_mismatch", "version_mismatch", "bad_request", "timeout", "digest_mismatch",
    "transfer_failed", "disconnected", "decode_failed", "internal",
})


@dataclass
class HandoffRecord:
    """What the node knows of the handoffs that reached it (see the module docstring)."""

    engine: str
    protocol: str | None
    clock: Callable[[], float]
    successes: int = 0
    failures: int = 0
    #: Last success: clock and wall time, bytes, and the seconds its bytes took on the link (None when
    #: not measured: see link_seconds).
    ok_at: float | None = None
    ok_wall: float = 0.0
    ok_bytes: int = 0
    ok_seconds: float | None = None
    #: Last data-plane failure.
    fail_at: float | None = None
    fail_wall: float = 0.0
    fail_reason: str = ""
    fail_message: str = ""

    def success(self, nbytes: int, seconds: float | None) -> None:
        self.successes += 1
        self.ok_at, self.ok_wall, self.ok_bytes, self.ok_seconds = self.clock(), time.time(), nbytes, seconds

    def failure(self, reason: str, message: str) -> bool:
        """Record a failure; False (nothing recorded) for reasons that are not the data plane's."""
        if reason not in DATA_PLANE_FAILURES:
            return False
        self.failures += 1
        self.fail_at, self.fail_wall = self.clock(), time.time()
        self.fail_reason, self.fail_message = reason, message[:500]
        return True

    @property
    def bandwidth(self) -> float | None:
        """Bytes per second of the last successful handoff (None before one, when not measured, or
        when instantaneous)."""
        return self.ok_bytes / self.ok_seconds if self.ok_at is not None and self.ok_seconds else None

    def as_dict(self) -> dict[str, Any]:
        now = self.clock()
        out: dict[str, Any] = {"transport": {"engine": self.engine, "protocol": self.protocol},
                               "successes": self.successes, "failures": self.failures,
                               "last_success": None, "last_failure": None}
        if self.ok_at is not None:
            out["last_success"] = {"age_s": round(now - self.ok_at, 3), "time": self.ok_wall, "bytes": self.ok_bytes,
                                   "seconds": None if self.ok_seconds is None else round(self.ok_seconds, 6),
                                   "bandwidth_bytes_per_s": self.bandwidth}
        if self.fail_at is not None:
            out["last_failure"] = {"age_s": round(now - self.fail_at, 3), "time": self.fail_wall,
                                   "reason": self.fail_reason, "message": self.fail_message}
        return out


def link_seconds(slot: Slot, layerwise: bool) -> float | None:
    """Seconds the slot's bytes took on the link: the slowest sender rank's write calls (ranks write
    side by side, each over its own NIC). From senders that do not report theirs, Accept to the last
    Done, unless the handoff was layer-wise: that span holds the prefill's forward, and a bandwidth
    measured over it would blame the link for the model's compute, so none is claimed."""
    reported = [s for s in slot.write_s.values() if s is not None]
    if reported and len(reported) == len(slot.write_s):
        return max(reported)
    return None if layerwise else max(slot.t_ready - slot.t_accept, 0.0)


def transport_protocol(transfer: TransferEngine) -> str | None:
    """The transport the byte mover uses: Mooncake says it; NIXL's UCX is told by transfer_env (tcp) or
    picks IB/RoCE itself (rdma)."""
    protocol = getattr(transfer, "protocol", None)
    if isinstance(protocol, str):
        return protocol
    if transfer.name == "nixl":
        return "tcp" if os.environ.get("UCX_TLS") == "tcp" else "ucx"
    return None


class Recorder:
    """The record plus its metrics; the only writer of either."""

    def __init__(self, transfer: TransferEngine, metrics: NodeMetrics, clock: Callable[[], float]) -> None:
        self.record = HandoffRecord(engine=transfer.name, protocol=transport_protocol(transfer), clock=clock)
        self.metrics = metrics
        r = metrics.registry
        self._m_last_ok = Gauge("tilert_decode_last_handoff_success_timestamp_seconds",
                                "Wall time of the last handoff this node decoded from", registry=r)
        self._m_bandwidth = Gauge("tilert_decode_last_handoff_bandwidth_bytes_per_second",
                                  "Bytes per second of the last successful handoff (Accept to last Done)", registry=r)
        self._m_failures = Counter("tilert_decode_handoff_failures", "Data-plane handoff failures by reason",
                                   ["reason"], registry=r)

    def ctrl_error(self, reason: str, message: str) -> None:
        """A control connection was refused or broke (ctrl.py): count it, and record it when it is the
        data plane's failure."""
        self.metrics.ctrl_errors.labels(reason).inc()
        if reason == "peer_error":
            # The sender's own Error ("the sender reported REASON: ..."): it found the layouts differ
            # from our Hello, or its write failed; without a reason of ours, the transfer failed.
            said = message.removeprefix("the sender reported ").split(":", 1)[0]
            reason = said if said in DATA_PLANE_FAILURES and said != message else "transfer_failed"
        self.failure(reason, message)

    def failure(self, reason: str, message: str) -> None:
        if self.record.failure(reason, message):
            self._m_failures.labels(reason).inc()

    def success(self, slot: Slot, layerwise: bool) -> None:
        self.record.success(slot.nbytes, link_seconds(slot, layerwise))
        self._m_last_ok.set(self.record.ok_wall)
        bandwidth = self.record.bandwidth
        if bandwidth is not None:
            self._m_bandwidth.set(bandwidth)
