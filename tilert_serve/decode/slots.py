"""Gated dispatch: a fixed number of decode slots, admission tickets with deadlines; the one owner of
every slot transition.

The router admits a request before its prefill starts: the node reserves a slot and returns a
ticket. The prefill's senders then hand the state over under that ticket, and the router's
generate call decodes it. A slot moves

    FREE -> RESERVED (admit) -> RECEIVING (accept; regions_given: a sender rank may now write)
         -> READY (done: every rank reported its writes) -> DECODING (start_decoding) -> released
    RESERVED | RECEIVING | READY -> FAILED (fail, writer_lost, a rank's failed done) -> released
    released: no write may still land -> scrubbed -> FREE
              a write may still land  -> QUARANTINED -> scrubbed -> FREE (when every writer has
              reported done, or `quarantine_s` after the release, whichever comes first)

and never queues: a full node says so at once. Every state but DECODING has a deadline; `expire`
releases what is past it (and ends quarantines), so an abandoned ticket cannot hold a slot.

Quarantine. The data plane's writes are one-sided: once a sender rank has been given the slot's
regions (`regions_given`, as its Accept goes out), its bytes can land until its write call returns; a
rank accepted whose Accept never went out cannot write, and its loss frees the slot at once. A rank that reports done (ok or
not) says its write call returned; a rank whose connection ended first (killed, timed out, Done after
the deadline) may still be writing. A slot released with such a rank is not reused until the rank
reports done on its still-open connection, or `quarantine_s` has passed: the transfer engines' own
write bound (transfer.WRITE_BOUND_S: Mooncake's MC_TRANSFER_TIMEOUT, NIXL's write timeout) plus a
margin. A process frozen mid-write (SIGSTOP) can outlast any time bound; the node checks and converts
only a snapshot of what landed, so such a late write cannot change a later request's state unseen. A
quarantine that ends by its bound with a writer never confirmed done is reported, not silent: counted
(`unconfirmed_reuses`, and node metrics from the expired copy), logged once as a warning, and shown by
`quarantine_status`.

Every slot is scrubbed (its receive regions zeroed, by the injected `scrub`) before it is FREE again,
so a freed slot's bytes are never a previous request's state. The table is plain data driven by an
injected clock; the node's event loop is its only caller (no locks). Every transition calls
`on_change(slot, event)`, so callers never notify anyone themselves.
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

log = logging.getLogger(__name__)


class SlotState(StrEnum):
    FREE = "free"
    RESERVED = "reserved"
    RECEIVING = "receiving"
    READY = "ready"
    DECODING = "decoding"
    FAILED = "failed"
    #: Released while a writer may still be writing; not reusable until no write can land.
    QUARANTINED = "quarantined"


class NodeFull(Exception):
    """Every slot is taken."""


class UnknownTicket(Exception):
    """No live slot holds this ticket (never issued, expired, cancelled or finished)."""


class AlreadyClaimed(Exception):
    """A generate call already holds this ticket."""


class DuplicateSender(Exception):
    """A sender rank reported twice, or disagrees with the other ranks."""


@dataclass
class Slot:
    index: int
    state: SlotState = SlotState.FREE
    #: Bumped on every reuse; a message carrying an older generation is stale.
    generation: int = 0
    #: Sender ranks given this generation's regions whose write call has not been reported done: their
    #: bytes may still land (see Quarantine above). Survives the release of the request.
    in_flight: set[int] = field(default_factory=set)
    ticket: str | None = None
    request_id: str | None = None
    #: A generate call holds the ticket: a second one is refused.
    claimed: bool = False
    deadline: float = 0.0
    num_tokens: int = 0
    last_prompt_token: int = 0
    prompt_token_ids: list[int] = field(default_factory=list)
    #: Sender ranks expected and those that reported a successful write.
    ranks_expected: int = 0
    ranks_accepted: set[int] = field(default_factory=set)
    ranks_done: set[int] = field(default_factory=set)
    #: Each rank's digest of what it wrote ("ALGORITHM:HEX", or None when it sent none).
    digests: dict[int, str | None] = field(default_factory=dict)
    nbytes: int = 0
    #: Each rank's seconds in its write calls (Done.write_s); None where a sender did not say.
    write_s: dict[int, float | None] = field(default_factory=dict)
    error: str | None = None
    #: Clock readings for the timings reported with the stream.
    t_admit: float = 0.0
    t_accept: float = 0.0
    t_ready: float = 0.0

    @property
    def busy(self) -> bool:
        return self.state is not SlotState.FREE


def _ignore(slot: Slot, event: str) -> None:
    pass


def _no_scrub(index: int) -> None:
    pass


class SlotTable:
    def __init__(
        self,
        num_slots: int,
        *,
        ticket_ttl_s: float,
        handoff_timeout_s: float,
        quarantine_s: float = 90.0,
        clock: Callable[[], float] = time.monotonic,
        scrub: Callable[[int], None] = _no_scrub,
        on_change: Callable[[Slot, str], None] = _ignore,
    ) -> None:
        if num_slots < 1:
            raise ValueError(f"a decode node needs at least 1 slot, got {num_slots}")
        self.slots = [Slot(i) for i in range(num_slots)]
        self.ticket_ttl_s = ticket_ttl_s
        self.handoff_timeout_s = handoff_timeout_s
        self.quarantine_s = quarantine_s
        self.clock = clock
        self.scrub = scrub
        self.on_change = on_change
        self._by_ticket: dict[str, Slot] = {}
        #: Quarantines that ended by their bound with a writer never confirmed done: each such slot went
        #: back into use while a late write could still land.
        self.unconfirmed_reuses = 0

    # -- queries ---------------------------------------------------------------------------------

    @property
    def free(self) -> int:
        return sum(s.state is SlotState.FREE for s in self.slots)

    @property
    def busy(self) -> int:
        return len(self.slots) - self.free

    def by_ticket(self, ticket: str) -> Slot:
        slot = self.find(ticket)
        if slot is None:
            raise UnknownTicket(
                f"ticket {ticket[:8]}... is unknown, expired, cancelled or already used; "
                "admit the request again"
            )
        return slot

    def find(self, ticket: str) -> Slot | None:
        """The live slot holding `ticket`, or None."""
        return self._by_ticket.get(ticket)

    def by_request(self, request_id: str) -> Slot | None:
        return next((s for s in self.slots if s.ticket is not None and s.request_id == request_id), None)

    # -- transitions -----------------------------------------------------------------------------

    def _take(self, request_id: str) -> Slot:
        for slot in self.slots:
            if slot.state is SlotState.FREE:
                slot.generation += 1
                now = self.clock()
                slot.state, slot.ticket, slot.request_id = (
                    SlotState.RESERVED,
                    secrets.token_urlsafe(18),
                    request_id,
                )
                slot.deadline, slot.t_admit = now + self.ticket_ttl_s, now
                self._by_ticket[slot.ticket] = slot
                return slot
        raise NodeFull(f"all {len(self.slots)} decode slots are busy")

    def admit(self, request_id: str) -> Slot:
        """FREE -> RESERVED under a new ticket that lives `ticket_ttl_s` unless used."""
        slot = self._take(request_id)
        self.on_change(slot, "admitted")
        return slot

    def accept(
        self,
        *,
        ticket: str | None,
        request_id: str,
        rank: int,
        num_senders: int,
        num_tokens: int,
        last_prompt_token: int,
        prompt_token_ids: list[int],
    ) -> Slot:
        """RESERVED | RECEIVING -> RECEIVING: sender `rank` may write from now on. Without a ticket a
        free slot is taken directly (ungated callers)."""
        slot = self._take(request_id) if ticket is None else self.by_ticket(ticket)
        if slot.state not in (SlotState.RESERVED, SlotState.RECEIVING):
            raise DuplicateSender(f"ticket's slot is {slot.state.value}, not waiting for state")
        if slot.state is SlotState.RECEIVING:
            if rank in slot.ranks_accepted:
                raise DuplicateSender(f"sender rank {rank} of request {request_id} is already writing")
            if (num_senders, num_tokens) != (slot.ranks_expected, slot.num_tokens):
                raise DuplicateSender(
                    f"rank {rank} says {num_senders} senders / {num_tokens} tokens, earlier ranks "
                    f"said {slot.ranks_expected} / {slot.num_tokens}"
                )
        else:
            slot.state, slot.request_id = SlotState.RECEIVING, request_id
            slot.ranks_expected, slot.num_tokens = num_senders, num_tokens
            slot.last_prompt_token, slot.prompt_token_ids = last_prompt_token, prompt_token_ids
            slot.t_accept = self.clock()
            slot.deadline = slot.t_accept + self.handoff_timeout_s
        slot.ranks_accepted.add(rank)
        self.on_change(slot, "accepted")
        return slot

    def regions_given(self, slot: Slot, generation: int, rank: int) -> None:
        """Sender `rank` is handed the slot's regions (its Accept goes out): from now on its bytes may
        land until it reports done, so losing it quarantines the slot on release."""
        if generation == slot.generation and rank in slot.ranks_accepted:
            slot.in_flight.add(rank)

    def done(
        self,
        slot: Slot,
        generation: int,
        rank: int,
        *,
        ok: bool,
        nbytes: int,
        error: str | None,
        digest: str | None = None,
        writes_started: bool = True,
        write_s: float | None = None,
    ) -> bool:
        """A rank reports its writes. RECEIVING -> READY when every rank has written, or -> FAILED when
        one failed. A rank that wrote everything (ok) or nothing (not `writes_started`) can no longer
        land bytes; one whose write failed part-way (a transfer engine's error or timeout) still may,
        and keeps the slot in quarantine after its release. A QUARANTINED slot whose last writer
        reports is scrubbed and freed at once. Returns True when the slot became READY; reports of an
        older generation are ignored."""
        if generation != slot.generation:
            return False
        if ok or not writes_started:
            slot.in_flight.discard(rank)
        if slot.state is SlotState.QUARANTINED:
            if not slot.in_flight:
                self._recycle(slot, "writers_done")
            return False
        if (
            slot.state is not SlotState.RECEIVING
            or rank not in slot.ranks_accepted
            or rank in slot.ranks_done
        ):
            return False
        if not ok:
            self.fail(slot, f"sender rank {rank} failed to write: {error or 'no reason given'}")
            return False
        slot.ranks_done.add(rank)
        slot.digests[rank] = digest
        slot.write_s[rank] = write_s
        slot.nbytes += nbytes
        if len(slot.ranks_done) == slot.ranks_expected:
            slot.state = SlotState.READY
            slot.t_ready = self.clock()
            slot.deadline = slot.t_ready + self.ticket_ttl_s
            self.on_change(slot, "complete")
            return True
        self.on_change(slot, "rank_done")
        return False

    def writer_lost(self, slot: Slot, generation: int, rank: int | None, error: str) -> None:
        """A sender's connection ended before it reported done: its write may still land (it stays in
        flight), and the request fails."""
        if generation == slot.generation:
            self.fail(slot, error)

    def fail(self, slot: Slot, error: str) -> None:
        """RESERVED | RECEIVING | READY -> FAILED; the generate call (or the deadline) releases it."""
        if slot.state in (SlotState.RESERVED, SlotState.RECEIVING, SlotState.READY):
            slot.state, slot.error = SlotState.FAILED, error
            slot.deadline = self.clock() + self.ticket_ttl_s
            self.on_change(slot, "failed")

    def claim(self, ticket: str) -> Slot:
        """The generate call takes the ticket; a second generate on it is refused (AlreadyClaimed)."""
        slot = self.by_ticket(ticket)
        if slot.claimed:
            raise AlreadyClaimed("a generate call is already waiting on or streaming this ticket")
        slot.claimed = True
        return slot

    def start_decoding(self, slot: Slot) -> None:
        """READY -> DECODING: no deadline while the engine runs."""
        if slot.state is not SlotState.READY:
            raise ValueError(f"slot {slot.index} is {slot.state.value}, not ready to decode")
        slot.state = SlotState.DECODING
        slot.deadline = float("inf")
        self.on_change(slot, "decoding")

    def release(self, slot: Slot) -> None:
        """End the slot's request (decode finished, cancelled, expired, failure answered): scrubbed and
        FREE, or QUARANTINED while a write may still land. Releasing a free or quarantined slot is a no-op."""
        if slot.state in (SlotState.FREE, SlotState.QUARANTINED):
            return
        if slot.ticket is not None:
            self._by_ticket.pop(slot.ticket, None)
        if slot.in_flight:
            generation, in_flight, index = slot.generation, slot.in_flight, slot.index
            slot.__init__(index)  # type: ignore[misc]
            slot.generation, slot.in_flight = generation, in_flight
            slot.state = SlotState.QUARANTINED
            slot.deadline = self.clock() + self.quarantine_s
            self.on_change(slot, "quarantined")
            return
        self._recycle(slot, "released")

    def _recycle(self, slot: Slot, event: str) -> None:
        """Scrub the slot's regions and make it FREE (keeping its generation)."""
        self.scrub(slot.index)
        generation = slot.generation
        slot.__init__(slot.index)  # type: ignore[misc]
        slot.generation = generation
        self.on_change(slot, event)

    def expire(self) -> list[Slot]:
        """Release every slot past its deadline and end quarantines past theirs; returns copies of what
        each slot held before (for logs and metrics)."""
        now = self.clock()
        out = []
        for slot in self.slots:
            if slot.state in (SlotState.FREE, SlotState.DECODING) or now < slot.deadline:
                continue
            out.append(dataclasses.replace(slot, in_flight=set(slot.in_flight)))
            if slot.state is SlotState.QUARANTINED:
                self.unconfirmed_reuses += 1
                log.warning(
                    "slot %d back in use after its %.0f s quarantine although sender rank(s) %s of generation "
                    "%d never reported their writes done: a write still landing goes into the next request's "
                    "receive region, where the node's snapshot and digest check refuse it",
                    slot.index,
                    self.quarantine_s,
                    sorted(slot.in_flight),
                    slot.generation,
                )
                slot.in_flight.clear()
                self._recycle(slot, "quarantine_over")
            else:
                self.release(slot)
        return out

    def quarantine_status(self) -> dict[str, Any]:
        """The quarantines now (slot, generation, ranks not confirmed done, seconds left) and how many
        ended with a writer unconfirmed (for /v1/status)."""
        now = self.clock()
        return {
            "unconfirmed_reuses": self.unconfirmed_reuses,
            "quarantined": [
                {
                    "index": s.index,
                    "generation": s.generation,
                    "ranks_in_flight": sorted(s.in_flight),
                    "ends_in_s": round(max(s.deadline - now, 0.0), 3),
                }
                for s in self.slots
                if s.state is SlotState.QUARANTINED
            ],
        }
