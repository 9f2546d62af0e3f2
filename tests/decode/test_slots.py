"""The slot table alone, on a fake clock: what `expire` hands back describes the slot it freed."""

from __future__ import annotations

from tilert_serve.decode.slots import SlotState, SlotTable


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_expire_returns_what_the_freed_slot_held() -> None:
    clock = Clock()
    table = SlotTable(2, ticket_ttl_s=5.0, handoff_timeout_s=1.0, clock=clock)
    reserved = table.admit("req-a")
    ticket, generation = reserved.ticket, reserved.generation
    receiving = table.admit("req-b")
    table.accept(ticket=receiving.ticket, request_id="req-b", rank=0, num_senders=1, num_tokens=7,
                 last_prompt_token=3, prompt_token_ids=list(range(7)))
    clock.now += 2.0  # past the handoff timeout, not the ticket's
    (late,) = table.expire()
    assert (late.index, late.state, late.request_id, late.num_tokens) == (1, SlotState.RECEIVING, "req-b", 7)
    assert late.writers == 0
    clock.now += 5.0
    (freed,) = table.expire()
    assert (freed.index, freed.state, freed.request_id, freed.ticket, freed.generation, freed.writers) == (
        0, SlotState.RESERVED, "req-a", ticket, generation, 0)
    assert table.free == 2 and table.expire() == []
