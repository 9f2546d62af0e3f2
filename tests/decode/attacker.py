"""The data-plane attacker of the integrity tests: a Mooncake engine of its own, holding no handoff
secret, node token or API key, that writes junk (0x41 bytes) into whatever registered memory of a
node or a prefill it is pointed at, as any peer that reaches a transfer engine can."""

from __future__ import annotations

import random
import threading
import time
from typing import Any

import torch

from tilert_serve import transfer

#: (the target engine's peer info, address, nbytes)
Target = tuple[dict[str, Any], int, int]


class DataPlaneWriter:
    def __init__(self, role: str = "attacker", junk_bytes: int = 4 << 20) -> None:
        self.junk = torch.full((junk_bytes,), 0x41, dtype=torch.uint8)
        self.engine = transfer.create("mooncake", host="127.0.0.1", protocol="tcp", role=role)
        self.engine.register(self.junk.data_ptr(), self.junk.numel())
        self.writes = 0

    def write(self, peer_info: dict[str, Any], spans: list[tuple[int, int]]) -> None:
        """Junk over each (address, nbytes) of the peer's registered memory, in one batch."""
        peer = self.engine.connect(peer_info)
        ops = [
            transfer.WriteOp(self.junk.data_ptr(), addr + start, min(self.junk.numel(), nbytes - start))
            for addr, nbytes in spans
            for start in range(0, nbytes, self.junk.numel())
        ]
        self.engine.write(peer, ops)
        self.writes += 1

    def close(self) -> None:
        self.engine.close()


class Scribbler:
    """A DataPlaneWriter on a thread of its own, writing junk at random offsets of `targets` in bursts
    and pauses until the block ends (bounded in time and writes)."""

    def __init__(self, targets: list[Target], max_s: float = 120.0, max_writes: int = 100_000) -> None:
        self.targets, self.max_s, self.max_writes = targets, max_s, max_writes
        self.writer = DataPlaneWriter(junk_bytes=64 << 10)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="scribbler", daemon=True)

    @property
    def writes(self) -> int:
        return self.writer.writes

    def _run(self) -> None:
        rng = random.Random(7)
        deadline = time.monotonic() + self.max_s
        while not self.stop.is_set() and time.monotonic() < deadline and self.writes < self.max_writes:
            info, addr, n = rng.choice(self.targets)
            size = rng.randint(1, min(n, self.writer.junk.numel()))
            self.writer.write(info, [(addr + rng.randrange(0, n - size + 1), size)])
            # Bursts and pauses: some handoffs are hit while they land, some after the node took them.
            self.stop.wait(rng.random() * 0.03)

    def __enter__(self) -> Scribbler:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(30)
        self.writer.close()
