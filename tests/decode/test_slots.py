"""The slot table alone, on a fake clock: every transition, the quarantine rule, scrubbing before
reuse, and the one-generate-per-ticket claim. Every transition is reported to `on_change`."""

from __future__ import annotations

import pytest

from tilert_serve.decode.slots import (
    AlreadyClaimed,
    DuplicateSender,
    NodeFull,
    Slot,
    SlotState,
    SlotTable,
    UnknownTicket,
)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Table:
    """A two-slot table with a recorded scrub and event log."""

    def __init__(self, slots: int = 2) -> None:
        self.clock = Clock()
        self.scrubbed: list[int] = []
        self.events: list[tuple[int, str]] = []
        self.t = SlotTable(
            slots,
            ticket_ttl_s=5.0,
            handoff_timeout_s=1.0,
            quarantine_s=30.0,
            clock=self.clock,
            scrub=self.scrubbed.append,
            on_change=lambda s, e: self.events.append((s.index, e)),
        )

    def accept(self, slot: Slot, rank: int, senders: int, prompt: list[int], request_id: str = "r") -> None:
        """Sender `rank` of `senders` announces a 7-token prompt for `slot`'s ticket."""
        self.t.accept(
            ticket=slot.ticket,
            request_id=request_id,
            rank=rank,
            num_senders=senders,
            num_tokens=7,
            last_prompt_token=3,
            prompt_token_ids=prompt,
        )

    def receiving(self, request_id: str = "r", senders: int = 1) -> Slot:
        slot = self.t.admit(request_id)
        for rank in range(senders):
            self.accept(slot, rank, senders, list(range(7)), request_id)
            self.t.regions_given(slot, slot.generation, rank)
        return slot


def test_admit_accept_done_decode_release_is_the_happy_path():
    tb = Table()
    slot = tb.receiving(senders=2)
    assert slot.state is SlotState.RECEIVING and slot.in_flight == {0, 1}
    assert not tb.t.done(slot, slot.generation, 0, ok=True, nbytes=10, error=None, digest="blake3:aa")
    assert tb.t.done(slot, slot.generation, 1, ok=True, nbytes=5, error=None, digest="blake3:bb")
    assert slot.state is SlotState.READY and slot.nbytes == 15 and slot.in_flight == set()
    assert slot.digests == {0: "blake3:aa", 1: "blake3:bb"}
    tb.t.start_decoding(slot)
    assert slot.deadline == float("inf")
    tb.clock.now += 1000
    assert tb.t.expire() == []  # decoding has no deadline
    tb.t.release(slot)
    assert slot.state is SlotState.FREE and tb.scrubbed == [0]
    assert [e for _, e in tb.events] == [
        "admitted",
        "accepted",
        "accepted",
        "rank_done",
        "complete",
        "decoding",
        "released",
    ]
    with pytest.raises(UnknownTicket):
        tb.t.by_ticket("x")


def test_a_full_table_refuses_and_tickets_die_with_their_request():
    tb = Table(1)
    slot = tb.t.admit("a")
    ticket = slot.ticket
    with pytest.raises(NodeFull):
        tb.t.admit("b")
    tb.t.release(slot)
    with pytest.raises(UnknownTicket):
        tb.t.by_ticket(ticket)  # type: ignore[arg-type]
    assert tb.t.admit("b").generation == slot.generation  # the same slot, reused: generation bumped again
    assert slot.generation == 2


def test_second_generate_on_one_ticket_is_refused():
    tb = Table()
    slot = tb.t.admit("a")
    assert tb.t.claim(slot.ticket) is slot  # type: ignore[arg-type]
    with pytest.raises(AlreadyClaimed):
        tb.t.claim(slot.ticket)  # type: ignore[arg-type]


def test_duplicate_and_inconsistent_ranks_are_refused():
    tb = Table()
    slot = tb.receiving(senders=2)
    with pytest.raises(DuplicateSender, match="already writing"):
        tb.accept(slot, 0, 2, [])
    tb.t.done(slot, slot.generation, 0, ok=True, nbytes=1, error=None)
    tb.t.done(slot, slot.generation, 1, ok=True, nbytes=1, error=None)
    with pytest.raises(DuplicateSender, match="not waiting for state"):
        tb.accept(slot, 2, 3, [])


def test_failed_write_fails_the_request_and_quarantines_the_slot_until_the_bound():
    tb = Table(1)
    slot = tb.receiving()
    tb.t.done(slot, slot.generation, 0, ok=False, nbytes=0, error="rc -1")  # the write failed part-way
    assert slot.state is SlotState.FAILED and "rc -1" in (slot.error or "")
    tb.t.release(slot)
    assert slot.state is SlotState.QUARANTINED and tb.scrubbed == []
    with pytest.raises(NodeFull):
        tb.t.admit("next")  # not reusable while a write may land
    tb.clock.now += 29
    assert tb.t.expire() == []
    tb.clock.now += 1
    (held,) = tb.t.expire()
    assert held.state is SlotState.QUARANTINED and slot.state is SlotState.FREE and tb.scrubbed == [0]
    assert tb.events[-1] == (0, "quarantine_over")


def test_a_sender_that_wrote_nothing_frees_the_slot_at_once():
    tb = Table(1)
    slot = tb.receiving()
    tb.t.done(slot, slot.generation, 0, ok=False, nbytes=0, error="prefill failed", writes_started=False)
    tb.t.release(slot)
    assert slot.state is SlotState.FREE and tb.scrubbed == [0]


def test_vanished_writer_quarantines_until_it_reports_or_the_bound():
    tb = Table(1)
    slot = tb.receiving()
    generation = slot.generation
    tb.t.writer_lost(slot, generation, 0, "disconnected")
    assert slot.state is SlotState.FAILED
    tb.t.release(slot)
    assert slot.state is SlotState.QUARANTINED and slot.in_flight == {0}
    with pytest.raises(NodeFull):
        tb.t.admit("next")
    assert tb.t.by_request("r") is None  # the request is gone; only the slot is held


def test_cancel_while_receiving_waits_for_the_writer_to_report():
    tb = Table(1)
    slot = tb.receiving()
    generation = slot.generation
    tb.t.release(slot)  # cancelled while its sender writes
    assert slot.state is SlotState.QUARANTINED
    assert not tb.t.done(slot, generation, 0, ok=True, nbytes=10, error=None)
    assert slot.state is SlotState.FREE and tb.scrubbed == [0] and tb.events[-1] == (0, "writers_done")
    assert tb.t.admit("next").generation == generation + 1


def test_expired_receiving_slot_with_a_writer_is_quarantined_not_reused():
    tb = Table(1)
    slot = tb.receiving()
    tb.clock.now += 2  # past the handoff timeout
    (late,) = tb.t.expire()
    assert (late.state, late.request_id, late.num_tokens, late.in_flight) == (
        SlotState.RECEIVING,
        "r",
        7,
        {0},
    )
    assert slot.state is SlotState.QUARANTINED
    # A Done of that generation arriving now (its connection still open) ends the quarantine.
    tb.t.done(slot, late.generation, 0, ok=True, nbytes=1, error=None)
    assert slot.state is SlotState.FREE


def test_stale_reports_are_ignored():
    tb = Table(1)
    slot = tb.receiving()
    old = slot.generation
    tb.t.done(slot, old, 0, ok=True, nbytes=1, error=None)
    tb.t.release(slot)
    new = tb.receiving("r2")
    assert not tb.t.done(new, old, 0, ok=True, nbytes=1, error=None)
    tb.t.writer_lost(new, old, 0, "old connection")
    assert new.state is SlotState.RECEIVING


def test_every_released_slot_is_scrubbed_before_reuse():
    tb = Table(1)
    for i in range(3):
        slot = tb.t.admit(f"r{i}")
        tb.t.release(slot)
    assert tb.scrubbed == [0, 0, 0]


def test_unused_ticket_expires_and_start_decoding_needs_ready():
    tb = Table()
    slot = tb.t.admit("a")
    with pytest.raises(ValueError, match="not ready"):
        tb.t.start_decoding(slot)
    tb.clock.now += 5
    (freed,) = tb.t.expire()
    assert (freed.state, freed.request_id) == (SlotState.RESERVED, "a") and slot.state is SlotState.FREE
    assert tb.t.free == 2 and tb.t.expire() == []


def test_a_writer_lost_before_its_regions_were_given_frees_the_slot_at_once():
    """Issue 22: only a sender that was handed the slot's regions (Accept) can write; one whose
    connection ended before that leaves nothing in flight, so the slot is not quarantined."""
    tb = Table(1)
    slot = tb.t.admit("r")
    tb.accept(slot, 0, 1, [])
    assert slot.state is SlotState.RECEIVING and slot.in_flight == set()
    tb.t.writer_lost(slot, slot.generation, 0, "protocol error before the Accept went out")
    tb.t.release(slot)
    assert slot.state is SlotState.FREE and tb.scrubbed == [0]
    # Given the regions, the same loss quarantines.
    slot = tb.receiving()
    assert slot.in_flight == {0}
    tb.t.writer_lost(slot, slot.generation, 0, "disconnected")
    tb.t.release(slot)
    assert slot.state is SlotState.QUARANTINED


def test_a_quarantine_that_ends_with_its_writer_unconfirmed_is_reported(caplog: pytest.LogCaptureFixture):
    """Issue 22: the quarantine's bound may end before a writer that never reported: the slot goes back
    into use anyway (a late write is refused by the node's snapshot and digest), and that is counted,
    logged once and visible in the table's status, never silent."""
    tb = Table(1)
    slot = tb.receiving()
    tb.t.writer_lost(slot, slot.generation, 0, "disconnected")
    tb.t.release(slot)
    assert tb.t.quarantine_status() == {
        "unconfirmed_reuses": 0,
        "quarantined": [
            {"index": 0, "generation": slot.generation, "ranks_in_flight": [0], "ends_in_s": 30.0}
        ],
    }
    tb.clock.now += 30
    with caplog.at_level("WARNING", logger="tilert_serve.decode.slots"):
        tb.t.expire()
        tb.t.expire()
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "sender rank(s) [0]" in warnings[0] and "slot 0" in warnings[0], warnings
    assert tb.t.unconfirmed_reuses == 1 and slot.state is SlotState.FREE
    assert tb.t.quarantine_status() == {"unconfirmed_reuses": 1, "quarantined": []}
    # A quarantine its writer ends by reporting is no such case.
    slot = tb.receiving()
    tb.t.release(slot)
    tb.t.done(slot, slot.generation, 0, ok=True, nbytes=1, error=None)
    assert slot.state is SlotState.FREE and tb.t.unconfirmed_reuses == 1
