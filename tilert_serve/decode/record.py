"""The node's record of its data plane: the last handoff it decoded from, the last data-plane
failure, the transport, and their metrics. GET /v1/status serves it (the operator's HandoffReady
condition reads it); it holds no request ids.

One owner: the node and its control server report events here (`ctrl_error`, `failure`,
`success`); nothing else writes the record.

Only authenticated peers' facts are the data plane's failures. Anyone who reaches the control port can
open a connection and close it, or send an Auth with a wrong MAC: those connections are counted apart
(`unauthenticated`, and a metric by a bounded reason) and never become the last failure, so they
cannot flip HandoffReady. A prefill with another secret (or of another protocol version) still shows:
the router's tickets for it then expire unused (the node records `timeout`, its own fact), and that
failure says how many control connections failed authentication (or spoke another version) meanwhile;
/v1/status also counts those of the last RECENT_S, which the operator's hint reads when no handoff
arrives (counts, never what the peer sent).

The record's messages are the node's own words and reason enums only: the operator copies them into
a condition, so nothing a peer wrote (an Error's text, a request id) may reach them.
"""

from __future__ import annotations

import os
import re
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tilert_serve import metric_defs
from tilert_serve.decode.metrics import NodeMetrics
from tilert_serve.decode.slots import Slot
from tilert_serve.transfer import TransferEngine

#: Failure categories that say the data plane is broken (as opposed to a node that is busy, a ticket
#: that expired unused, or a request too long): these, and only these, are the node's last failure.
DATA_PLANE_FAILURES = frozenset(
    {
        "not_authenticated",
        "layout_mismatch",
        "compat_mismatch",
        "version_mismatch",
        "bad_request",
        "timeout",
        "digest_mismatch",
        "transfer_failed",
        "disconnected",
        "decode_failed",
        "internal",
    }
)
#: Why an unauthenticated control connection ended (the metric's label values: a peer cannot add one).
UNAUTHENTICATED_REASONS = frozenset(
    {
        "not_authenticated",
        "auth_timeout",
        "evicted",
        "refused_busy",
        "version_mismatch",
        "bad_request",
        "disconnected",
        "peer_error",
        "internal",
    }
)
#: Unauthenticated endings that, with no handoff arriving, point at a misconfigured prefill rather than
#: at noise: each is timed (to count them since an admission) and counted in /v1/status over the last
#: RECENT_S. Values: the status and failure keys they are counted under.
SIGNALS = {"not_authenticated": "failed_authentication", "version_mismatch": "version_mismatches"}
#: Endings of each signal remembered; past this many a count says "at least".
_SIGNALS_KEPT = 4096
#: /v1/status counts the signals of this many recent seconds (the operator's HandoffReady window).
RECENT_S = 120.0
#: How the timeout's message words each signal.
_SIGNAL_WORDS = {
    "not_authenticated": "failed authentication (a prefill with another handoff secret?)",
    "version_mismatch": "spoke another protocol version (a prefill of another tilert-pd release?)",
}


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
    #: The SIGNALS counted into the last failure (a timeout) since its admission, by their key.
    fail_signals: dict[str, int] = field(default_factory=dict)
    #: Unauthenticated control connections by how they ended (UNAUTHENTICATED_REASONS).
    unauthenticated: dict[str, int] = field(default_factory=dict)
    #: Clock readings of the latest endings of each of SIGNALS, oldest first.
    signal_at: dict[str, deque[float]] = field(
        default_factory=lambda: {r: deque(maxlen=_SIGNALS_KEPT) for r in SIGNALS}
    )

    def success(self, nbytes: int, seconds: float | None) -> None:
        self.successes += 1
        self.ok_at, self.ok_wall, self.ok_bytes, self.ok_seconds = self.clock(), time.time(), nbytes, seconds

    def failure(self, reason: str, message: str, signals: dict[str, int] | None = None) -> bool:
        """Record a failure; False (nothing recorded) for reasons that are not the data plane's."""
        if reason not in DATA_PLANE_FAILURES:
            return False
        self.failures += 1
        self.fail_at, self.fail_wall = self.clock(), time.time()
        self.fail_reason, self.fail_message, self.fail_signals = reason, message[:500], dict(signals or {})
        return True

    def unauthenticated_ended(self, reason: str) -> None:
        self.unauthenticated[reason] = self.unauthenticated.get(reason, 0) + 1
        if reason in self.signal_at:
            self.signal_at[reason].append(self.clock())

    def signals_since(self, reason: str, since: float) -> tuple[int, bool]:
        """(endings of signal `reason` since `since`, whether that is all of them: False when more came
        than are kept)."""
        times = self.signal_at[reason]
        n = sum(1 for t in times if t >= since)
        return n, n < len(times) or len(times) < _SIGNALS_KEPT

    @property
    def bandwidth(self) -> float | None:
        """Bytes per second of the last successful handoff (None before one, when not measured, or
        when instantaneous)."""
        return self.ok_bytes / self.ok_seconds if self.ok_at is not None and self.ok_seconds else None

    def as_dict(self) -> dict[str, Any]:
        now = self.clock()
        out: dict[str, Any] = {
            "transport": {"engine": self.engine, "protocol": self.protocol},
            "successes": self.successes,
            "failures": self.failures,
            "unauthenticated": dict(sorted(self.unauthenticated.items())),
            **{f"recent_{key}": self.signals_since(r, now - RECENT_S)[0] for r, key in SIGNALS.items()},
            "last_success": None,
            "last_failure": None,
        }
        if self.ok_at is not None:
            out["last_success"] = {
                "age_s": round(now - self.ok_at, 3),
                "time": self.ok_wall,
                "bytes": self.ok_bytes,
                "seconds": None if self.ok_seconds is None else round(self.ok_seconds, 6),
                "bandwidth_bytes_per_s": self.bandwidth,
            }
        if self.fail_at is not None:
            out["last_failure"] = {
                "age_s": round(now - self.fail_at, 3),
                "time": self.fail_wall,
                "reason": self.fail_reason,
                "message": self.fail_message,
            }
            out["last_failure"].update(self.fail_signals)
        return out


_RANK_FAILED = re.compile(r"sender rank (\d+) failed to write")


def _own_words(message: str) -> str:
    """A sender rank's failed write as the slot table words it, without the reason the sender gave."""
    m = _RANK_FAILED.match(message)
    return (
        f"{m.group(0)} (its reason is in the generate call's error and the prefill's log)"
        if m
        else "a sender rank failed to write"
    )


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
        self._m_last_ok = metric_defs.gauge(
            r,
            "tilert_decode_last_handoff_success_timestamp_seconds",
            "Unix time, in seconds, of the last handoff this node decoded from.",
        )
        self._m_bandwidth = metric_defs.gauge(
            r,
            "tilert_decode_last_handoff_bandwidth_bytes_per_second",
            "Bytes per second of the last successful handoff on the link (Accept to last Done, or the "
            "senders' own write time).",
        )
        self._m_failures = metric_defs.counter(
            r,
            "tilert_decode_handoff_failures_total",
            "Data-plane handoff failures, by reason.",
            {"reason": metric_defs.values(DATA_PLANE_FAILURES, other=False)},
        )
        self._m_unauthenticated = metric_defs.counter(
            r,
            "tilert_decode_ctrl_unauthenticated_total",
            "Control connections that ended before "
            "authenticating, by how (anyone reaching the port can cause these; they are not the data "
            "plane's failures).",
            {"reason": metric_defs.values(UNAUTHENTICATED_REASONS, other=False)},
        )

    def ctrl_error(
        self, reason: str, message: str, *, authenticated: bool, peer_reason: str | None = None
    ) -> None:
        """A control connection was refused or broke (ctrl.py). From an authenticated peer: counted,
        and recorded when it is the data plane's failure. Before authentication: counted apart, never
        recorded. `message` must be the node's own words (ctrl.py keeps the peer's text to its log);
        `peer_reason`: the RejectReason of a `peer_error` (the sender's own Error)."""
        if not authenticated:
            label = reason if reason in UNAUTHENTICATED_REASONS else "bad_request"
            self.record.unauthenticated_ended(label)
            self._m_unauthenticated.labels(label).inc()
            if reason == "internal":  # our bug, whoever triggered it
                self.metrics.ctrl_errors.labels(reason).inc()
            return
        self.metrics.ctrl_errors.labels(reason).inc()
        if reason == "peer_error":
            # The sender found the layouts differ from our Hello, or our frames failed its session check,
            # or its write failed: without a reason of ours, the transfer failed.
            reason = peer_reason if peer_reason in DATA_PLANE_FAILURES else "transfer_failed"
        self.failure(reason, message)

    def unauthenticated(self, reason: str) -> None:
        """An unauthenticated control connection refused or ended before it could speak (ctrl.py's gate)."""
        self.ctrl_error(reason, "", authenticated=False)

    def failure(self, reason: str, message: str, since: float | None = None) -> None:
        """A data-plane failure the node saw itself (node.py) or an authenticated peer caused. A
        `timeout` says how many control connections failed authentication or spoke another protocol
        version since `since` (the ticket's admission; without it, since the previous recorded event)."""
        signals: dict[str, int] = {}
        if reason == "timeout":
            h = self.record
            last = [t for t in (h.ok_at, h.fail_at) if t is not None]
            what = (
                "the admission"
                if since is not None
                else "the last handoff event"
                if last
                else "the node started"
            )
            if since is None:
                since = max(last, default=float("-inf"))
            said = []
            for signal, key in SIGNALS.items():
                n, complete = h.signals_since(signal, since)
                if n:
                    signals[key] = n
                    said.append(f"{'' if complete else 'at least '}{n} {_SIGNAL_WORDS[signal]}")
            if said:
                message = f"{message}; since {what}, control connections: {'; '.join(said)}"
        elif reason == "transfer_failed":
            message = _own_words(message)
        if self.record.failure(reason, message, signals):
            self._m_failures.labels(reason).inc()

    def success(self, slot: Slot, layerwise: bool) -> None:
        self.record.success(slot.nbytes, link_seconds(slot, layerwise))
        self._m_last_ok.set(self.record.ok_wall)
        bandwidth = self.record.bandwidth
        if bandwidth is not None:
            self._m_bandwidth.set(bandwidth)


@dataclass
class GenerateStamps:
    """perf_counter readings of one traced generate call, taken on the way (the HTTP handler and the
    decode thread fill them; nothing is read until the stream has ended), and the handoff's earlier
    facts, which happened before the call and so are attributes rather than spans of it."""

    received: float
    #: The handoff's state had landed (every rank's Done): the wait for it ended.
    landed: float = 0.0
    #: The decode thread found the slot (pipeline.timings' t0), had the assembled state, injected it.
    found: float = 0.0
    assembled: float = 0.0
    injected: float = 0.0
    first_step: float = 0.0
    ended: float = 0.0
    #: The converter's work: (kind "digest"|"convert", start, end), as pipeline.Build.spans.
    work: list[tuple[str, float, float]] = field(default_factory=list)
    #: Milliseconds of what happened before the call: admission to Accept (the prefill's start and the
    #: handshake: Challenge, Auth, Hello, Request), Accept to the last Done (the bytes landing).
    before: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Stage:
    """One span the node reports for a generate call: `parent` indexes the list (None: the span the
    router's traceparent names)."""

    name: str
    start: float
    end: float
    parent: int | None
    attributes: dict[str, float | int | str] = field(default_factory=dict)


def stage_spans(s: GenerateStamps) -> list[Stage]:
    """The spans of one generate call, from its stamps: one `tilert.generate` from the call to the end
    of its stream, with its stages in order inside it (the wait for the state to land, the state's
    remaining digest check and conversion and their pieces, the injection, the first engine step, the
    rest of the decode). A stage not reached (a refused state, max_tokens 0) is left out. Pure."""
    end = max(s.ended, s.received)
    out = [Stage("tilert.generate", s.received, end, None, {f"tilert.{k}": v for k, v in s.before.items()})]

    def stage(name: str, lo: float, hi: float, parent: int = 0) -> int:
        lo, hi = max(lo, out[parent].start), min(hi, out[parent].end)
        out.append(Stage(name, lo, max(hi, lo), parent))
        return len(out) - 1

    if s.landed:
        stage("tilert.layers", s.received, s.landed)
    if s.found and s.assembled:
        state = stage("tilert.state", s.found, s.assembled)
        lo, hi = out[state].start, out[state].end
        for kind, a, b in sorted(s.work, key=lambda w: w[1]):
            if b > lo and a < hi:  # the converter's work still on the critical path
                stage("tilert.digest" if kind == "digest" else "tilert.conversion", a, b, state)
    if s.assembled and s.injected:
        stage("tilert.injection", s.assembled, s.injected)
    if s.injected and s.first_step:
        stage("tilert.first_step", s.injected, s.first_step)
        stage("tilert.decode", s.first_step, end)
    return out
