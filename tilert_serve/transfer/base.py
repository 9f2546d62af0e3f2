"""The byte movers' one small interface: register memory, describe it to a peer, write ranges.

The handoff protocol owns meaning (who, which layout, where); an engine only moves bytes from our
registered memory into a peer's registered memory with one-sided writes. Writes are blocking: the
sender calls them from its own background thread, never from vLLM's forward pass.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol


class TransferError(Exception):
    """A registration or write failed; the message names the engine, the peer and what to check."""


@dataclass(frozen=True)
class WriteOp:
    local_addr: int
    remote_addr: int
    nbytes: int


class TransferEngine(Protocol):
    #: "mooncake" or "nixl".
    name: str

    def register(self, addr: int, nbytes: int, device: str = "cpu") -> None:
        """Register [addr, addr+nbytes) for transfers (device "cpu" or "cuda:N")."""
        ...

    def unregister(self, addr: int) -> None: ...

    def peer_info(self) -> dict[str, Any]:
        """What a peer needs to write into our registered memory; JSON-safe, sent in Hello."""
        ...

    def connect(self, peer: dict[str, Any]) -> str:
        """Make a peer known (from its peer_info); returns the handle `write` takes."""
        ...

    def write(self, peer: str, ops: Sequence[WriteOp]) -> None:
        """Write every op into the peer's memory; returns when all bytes landed, or raises TransferError."""
        ...

    def close(self) -> None: ...
