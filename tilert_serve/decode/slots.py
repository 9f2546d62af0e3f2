"""Gated dispatch: a fixed number of decode slots, admission tickets with deadlines.

The router admits a request before its prefill starts: the node reserves a slot and returns a
ticket. The prefill's senders then hand the state over under that ticket, and the router's
generate call decodes it. A slot moves

    FREE -> RESERVED (admit) -> RECEIVING (sender accepted) -> READY (all ranks done)
         -> DECODING (generate) -> FREE
    any  -> FAILED (write failed, sender vanished) -> FREE (generate answered, or deadline)
    any  -> FREE (cancel, deadline)

and never queues: a full node says so at once. Every state but DECODING has a deadline; `expire`
frees what is past it, so an abandoned ticket cannot hold a slot. The table is plain data driven by
an injected clock; the node's event loop is its only caller (no locks).
"""

from __future__ import annotations

import dataclasses
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum


class SlotState(StrEnum):
    FREE = "free"
    RESERVED = "reserved"
    RECEIVING = "receiving"
    READY = "ready"
    DECODING = "decoding"
    FAILED = "failed"


class NodeFull(Exception):
    """Every slot is taken."""


class UnknownTicket(Exception):
    """No live slot holds this ticket (never issued, expired, cancelled or finished)."""


@dataclass
class Slot:
    index: int
    state: SlotState = SlotState.FREE
    #: Bumped on every reuse; a message carrying an older generation is stale.
    generation: int = 0
    #: Sender connections accepted on this slot and not yet finished. A one-sided writer of an
    #: abandoned request may still be writing: the slot is not reused until its connection ends.
    writers: int = 0
    ticket: str | None = None
    request_id: str | None = None
    deadline: float = 0.0
    num_tokens: int = 0
    last_prompt_token: int = 0
    prompt_token_ids: list[int] = field(default_factory=list)
    #: Sender ranks expected and those that reported a successful write.
    ranks_expected: int = 0
    ranks_accepted: set[int] = field(default_factory=set)
    ranks_done: set[int] = field(default_factory=set)
    nbytes: int = 0
    error: str | None = None
    #: Clock readings for the timings reported with the stream.
    t_admit: float = 0.0
    t_accept: float = 0.0
    t_ready: float = 0.0

    @property
    def busy(self) -> bool:
        return self.state is not SlotState.FREE


class SlotTable:
    def __init__(self, num_slots: int, *, ticket_ttl_s: float, handoff_timeout_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if num_slots < 1:
            raise ValueError(f"a decode node needs at least 1 slot, got {num_slots}")
        self.slots = [Slot(i) for i in range(num_slots)]
        self.ticket_ttl_s = ticket_ttl_s
        self.handoff_timeout_s = handoff_timeout_s
        self.clock = clock
        self._by_ticket: dict[str, Slot] = {}

    # -- queries ---------------------------------------------------------------------------------

    @property
    def free(self) -> int:
        return sum(not s.busy and s.writers == 0 for s in self.slots)

    @property
    def busy(self) -> int:
        return len(self.slots) - self.free

    def by_ticket(self, ticket: str) -> Slot:
        slot = self._by_ticket.get(ticket)
        if slot is None:
            raise UnknownTicket(f"ticket {ticket[:8]}... is unknown, expired, cancelled or already used; "
                                "admit the request again")
        return slot

    def by_request(self, request_id: str) -> Slot | None:
        return next((s for s in self.slots if s.busy and s.request_id == request_id), None)

    # -- transitions -----------------------------------------------------------------------------

    def _take(self) -> Slot:
        for slot in self.slots:
            if not slot.busy and slot.writers == 0:
                slot.generation += 1
                return slot
        raise NodeFull(f"all {len(self.slots)} decode slots are busy")

    def admit(self, request_id: str) -> Slot:
        """Reserve a slot under a new ticket that lives `ticket_ttl_s` unless used."""
        slot = self._take()
        now = self.clock()
        slot.state, slot.ticket, slot.request_id = SlotState.RESERVED, secrets.token_urlsafe(18), request_id
        slot.deadline, slot.t_admit = now + self.ticket_ttl_s, now
        self._by_ticket[slot.ticket] = slot
        return slot

    def accept(self, *, ticket: str | None, request_id: str, rank: int, num_senders: int, num_tokens: int,
               last_prompt_token: int, prompt_token_ids: list[int]) -> Slot:
        """A sender rank starts writing. Without a ticket a free slot is taken directly."""
        if ticket is None:
            slot = self._take()
            slot.ticket = secrets.token_urlsafe(18)
            slot.t_admit = self.clock()
            self._by_ticket[slot.ticket] = slot
            slot.state = SlotState.RESERVED
        else:
            slot = self.by_ticket(ticket)
        if slot.state not in (SlotState.RESERVED, SlotState.RECEIVING):
            raise DuplicateSender(f"ticket's slot is {slot.state.value}, not waiting for state")
        if slot.state is SlotState.RECEIVING:
            if rank in slot.ranks_accepted:
                raise DuplicateSender(f"sender rank {rank} of request {request_id} is already writing")
            if (num_senders, num_tokens) != (slot.ranks_expected, slot.num_tokens):
                raise DuplicateSender(f"rank {rank} says {num_senders} senders / {num_tokens} tokens, earlier ranks "
                                      f"said {slot.ranks_expected} / {slot.num_tokens}")
        else:
            slot.state, slot.request_id = SlotState.RECEIVING, request_id
            slot.ranks_expected, slot.num_tokens = num_senders, num_tokens
            slot.last_prompt_token, slot.prompt_token_ids = last_prompt_token, prompt_token_ids
            slot.t_accept = self.clock()
            slot.deadline = slot.t_accept + self.handoff_timeout_s
        slot.ranks_accepted.add(rank)
        return slot

    def done(self, slot: Slot, generation: int, rank: int, ok: bool, nbytes: int, error: str | None) -> bool:
        """A rank reports its writes. Returns True when the slot became READY. Stale reports are ignored."""
        if generation != slot.generation or slot.state is not SlotState.RECEIVING:
            return False
        if not ok:
            self.fail(slot, f"sender rank {rank} failed to write: {error or 'no reason given'}")
            return False
        slot.ranks_done.add(rank)
        slot.nbytes += nbytes
        if len(slot.ranks_done) == slot.ranks_expected:
            slot.state = SlotState.READY
            slot.t_ready = self.clock()
            slot.deadline = slot.t_ready + self.ticket_ttl_s
            return True
        return False

    def fail(self, slot: Slot, error: str) -> None:
        if slot.state in (SlotState.RESERVED, SlotState.RECEIVING, SlotState.READY):
            slot.state, slot.error = SlotState.FAILED, error
            slot.deadline = self.clock() + self.ticket_ttl_s

    def start_decoding(self, slot: Slot) -> None:
        slot.state = SlotState.DECODING
        slot.deadline = float("inf")

    def release(self, slot: Slot) -> None:
        """Free the slot (decode finished, cancelled, expired, or failure reported)."""
        if slot.ticket is not None:
            self._by_ticket.pop(slot.ticket, None)
        generation, writers = slot.generation, slot.writers
        slot.__init__(slot.index)  # type: ignore[misc]
        slot.generation, slot.writers = generation, writers

    def expire(self) -> list[Slot]:
        """Free every slot past its deadline; returns copies of what was freed (for logs and metrics)."""
        now = self.clock()
        freed = []
        for slot in self.slots:
            if slot.busy and slot.state is not SlotState.DECODING and now >= slot.deadline:
                freed.append(dataclasses.replace(slot))
                self.release(slot)
        return freed


class DuplicateSender(Exception):
    """A sender rank reported twice, or disagrees with the other ranks."""
