"""The decode node's Prometheus metrics, one registry per node (tests run several in a process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_MS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class NodeMetrics:
    def __init__(self, slots: int) -> None:
        r = self.registry = CollectorRegistry()
        self.slots_total = Gauge("tilert_decode_slots", "Decode slots on this node", registry=r)
        self.slots_total.set(slots)
        self.slots_busy = Gauge("tilert_decode_slots_busy", "Slots reserved, receiving or decoding", registry=r)
        self.admissions = Counter("tilert_decode_admissions", "Admission answers", ["outcome"], registry=r)
        self.handoffs = Counter("tilert_decode_handoffs", "Handoffs by outcome", ["outcome"], registry=r)
        self.handoff_bytes = Counter("tilert_decode_handoff_bytes", "State bytes received", registry=r)
        self.handoff_seconds = Histogram("tilert_decode_handoff_seconds", "Accept to last rank done",
                                         buckets=_MS_BUCKETS, registry=r)
        self.layers_received = Counter("tilert_decode_layers_received",
                                       "Layers reported written one by one (LayersDone), converted as they landed",
                                       registry=r)
        self.digest_seconds = Histogram("tilert_decode_digest_seconds",
                                        "Checking the state's digests, after /generate found it",
                                        buckets=_MS_BUCKETS, registry=r)
        self.quarantined = Counter("tilert_decode_quarantined_slots",
                                   "Slots released while a sender's write could still land", registry=r)
        self.convert_seconds = Histogram("tilert_decode_convert_seconds", "Wire bytes to engine tensors, after /generate found the state",
                                         buckets=_MS_BUCKETS, registry=r)
        self.converted_bytes = Gauge("tilert_decode_converted_state_bytes",
                                     "Engine-layout state converted ahead of injection and not yet injected "
                                     "(device memory on top of the receive buffers)", registry=r)
        self.inject_seconds = Histogram("tilert_decode_inject_seconds", "Injection into the engine",
                                        buckets=_MS_BUCKETS, registry=r)
        self.tpot_seconds = Histogram("tilert_decode_tpot_seconds", "Time per output token, per request",
                                      buckets=_MS_BUCKETS, registry=r)
        self.mtp_drafted = Counter("tilert_decode_mtp_drafted_tokens", "MTP draft tokens proposed", registry=r)
        self.mtp_accepted = Counter("tilert_decode_mtp_accepted_tokens", "MTP draft tokens accepted", registry=r)
        self.requests = Counter("tilert_decode_requests", "Finished decode requests", ["finish_reason"], registry=r)
        self.expired = Counter("tilert_decode_expired_slots",
                               "Slots freed by their deadline, by the state they were in; quarantined: the bound "
                               "ended a quarantine with a writer never confirmed done, and the slot went back into "
                               "use (slots.py)", ["state"], registry=r)
        self.ctrl_errors = Counter("tilert_decode_ctrl_errors", "Control-plane connections refused or broken",
                                   ["reason"], registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)
