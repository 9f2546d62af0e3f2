"""Wake-ups for requests waiting for a decode node to come back (handlers._choose).

A request that finds no TileRT node it can use, while one may come back soon, waits for the next
change to the pools' state (an endpoint's health or breaker turned, the endpoint list was swapped)
instead of polling: whoever makes the change calls `notify`, and every waiter re-checks the pools.
A waiter may be woken by a change that does not help it; it then waits again, within its own bound.

Everything runs on the event loop thread, so no lock.
"""

from __future__ import annotations

import asyncio
from typing import Literal

#: How a request's wait ended: a node came back in time and the request was routed, the bound ran out
#: (its 503), or the client went away (the tilert_waits_total metric's outcome).
WaitOutcome = Literal["resumed", "timed_out", "client_gone"]


class Changes:
    """One generation of waiters at a time: `notify` wakes all waiting now, later ones wait anew."""

    def __init__(self) -> None:
        #: Made by the first waiter after a notify (an Event binds to the running loop when awaited;
        #: none is made while nobody waits).
        self._event: asyncio.Event | None = None
        #: Requests waiting now.
        self.waiting = 0

    def notify(self) -> None:
        if self._event is not None:
            self._event.set()
            self._event = None

    async def wait(self, timeout_s: float) -> bool:
        """Wait for the next `notify`, at most `timeout_s`; False when the time ran out. A cancelled
        waiter (the client went away) leaves nothing behind."""
        if self._event is None:
            self._event = asyncio.Event()
        event = self._event
        self.waiting += 1
        try:
            async with asyncio.timeout(max(timeout_s, 0.0)):
                await event.wait()
            return True
        except TimeoutError:
            return False
        finally:
            self.waiting -= 1
