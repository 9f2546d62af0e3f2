"""The decode node's Prometheus metrics, one registry per node (tests run several in a process).

record.py registers the data plane's record metrics on the same registry. docs/metrics.md lists
them all (tilert_serve.metrics_catalogue)."""

from __future__ import annotations

from prometheus_client import generate_latest

from tilert_serve import metric_defs as names
from tilert_serve.decode.slots import SlotState
from tilert_serve.handoff.errors import RejectReason
from tilert_serve.metric_defs import Bounded, Registry, counter, gauge, histogram, values

_MS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)

#: POST /v1/admit's answers (http.py).
ADMISSION_OUTCOMES = values({"admitted", "full", "too_long"})
#: How a handoff into a slot ended (node.py): decoded from, failed on the data plane, refused.
HANDOFF_OUTCOMES = values({"complete", "failed", "refused"})
#: A finished request's finish_reason (stopping.py's, and a cancel).
FINISH_REASONS = values({"stop", "length", "cancelled"})
#: Why a control connection was refused or broke (ctrl.py): the node's refusals, and the ends it
#: names itself.
CTRL_ERROR_REASONS = values({*RejectReason, "peer_error", "auth_timeout", "disconnected", "internal"})


class NodeMetrics:
    def __init__(self, slots: int) -> None:
        r = self.registry = Registry()
        self.slots_total = gauge(r, names.DECODE_SLOTS, "Decode slots this node was started with.")
        self.slots_total.set(slots)
        self.slots_busy = gauge(
            r,
            names.DECODE_SLOTS_BUSY,
            "Slots reserved, receiving a state or decoding; at tilert_decode_slots the node "
            "answers admissions with full.",
        )
        self.admissions = Bounded(
            counter(
                r,
                "tilert_decode_admissions_total",
                "Admission requests (POST /v1/admit) by answer.",
                {"outcome": ADMISSION_OUTCOMES},
            )
        )
        self.handoffs = Bounded(
            counter(
                r,
                "tilert_decode_handoffs_total",
                "Handoffs into a slot by how they ended: complete (decoded from), failed "
                "(the data plane broke), refused (the state's digest did not verify).",
                {"outcome": HANDOFF_OUTCOMES},
            )
        )
        self.handoff_bytes = counter(
            r, "tilert_decode_handoff_bytes_total", "Bytes of state received by complete handoffs."
        )
        self.handoff_seconds = histogram(
            r,
            "tilert_decode_handoff_seconds",
            "Seconds from a handoff's Accept to its last rank's Done (the transfer as the node sees it).",
            _MS_BUCKETS,
        )
        self.layers_received = counter(
            r,
            "tilert_decode_layers_received_total",
            "Layers reported written one by one (layer-wise handoff, LayersDone), each "
            "converted as it landed.",
        )
        self.digest_seconds = histogram(
            r,
            "tilert_decode_digest_seconds",
            "Seconds checking a state's digests, after /v1/generate found it.",
            _MS_BUCKETS,
        )
        self.quarantined = counter(
            r,
            "tilert_decode_quarantined_slots_total",
            "Slots released while a sender's write could still land (not reused until no write can).",
        )
        self.convert_seconds = histogram(
            r,
            "tilert_decode_convert_seconds",
            "Seconds converting wire bytes to engine tensors, after /v1/generate found the state.",
            _MS_BUCKETS,
        )
        self.converted_bytes = gauge(
            r,
            "tilert_decode_converted_state_bytes",
            "Bytes of engine-layout state converted ahead of injection and not yet "
            "injected (device memory on top of the receive buffers).",
        )
        self.inject_seconds = histogram(
            r,
            "tilert_decode_inject_seconds",
            "Seconds injecting a converted state into the engine.",
            _MS_BUCKETS,
        )
        self.tpot_seconds = histogram(
            r,
            names.DECODE_TPOT,
            "Seconds per output token, one observation per finished request.",
            _MS_BUCKETS,
        )
        self.mtp_drafted = counter(
            r, "tilert_decode_mtp_drafted_tokens_total", "Tokens drafted by multi-token prediction (MTP)."
        )
        self.mtp_accepted = counter(
            r,
            "tilert_decode_mtp_accepted_tokens_total",
            "Tokens drafted by MTP and accepted; accepted / drafted is the acceptance rate.",
        )
        self.requests = Bounded(
            counter(
                r,
                "tilert_decode_requests_total",
                "Finished decode requests by finish reason.",
                {"finish_reason": FINISH_REASONS},
            )
        )
        self.expired = Bounded(
            counter(
                r,
                "tilert_decode_expired_slots_total",
                "Slots freed by their deadline, by the state they were in; quarantined: the "
                "bound ended a quarantine with a writer never confirmed done, and the slot "
                "went back into use.",
                {"state": values(SlotState)},
            )
        )
        self.ctrl_errors = Bounded(
            counter(
                r,
                "tilert_decode_ctrl_errors_total",
                "Control-plane connections refused or broken, by reason.",
                {"reason": CTRL_ERROR_REASONS},
            )
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)
