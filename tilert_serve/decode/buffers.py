"""The node's receive buffers: allocated, touched and registered once, at start.

One buffer per shard (per GPU on a TileRT node, one on a CPU node) holds every slot's region back to
back; the layout's placement says where each (plane, layer) sits inside a region. First-touch page
faults cost more than a transfer of the same bytes, so memory is zeroed here.

Beside each receive buffer sits its snapshot twin, of the same size and never registered: the
data plane is unauthenticated, so any peer of the transfer engine can write a receive region at any
time, and a check over bytes that can still change is not a check. The node copies what a sender
reported written into the snapshot (`snapshot`), hashes the copy, and converts only from it
(`snapshot_views`); a write that lands in the receive region after the copy is never read. The cost
is the receive buffers' memory twice over and one device-local copy of each state.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from tilert_serve.handoff.messages import Region
from tilert_serve.layouts import Layout, Placement
from tilert_serve.transfer import TransferEngine


class ReceiveBuffers:
    def __init__(
        self,
        layout: Layout,
        *,
        max_seq_len: int,
        slots: int,
        shards: int = 1,
        devices: list[str] | None = None,
    ) -> None:
        self.placement = Placement(layout, max_tokens=max_seq_len, shards=shards)
        self.slots = slots
        self.devices = devices or ["cpu"] * shards
        if len(self.devices) != shards:
            raise ValueError(f"{shards} shards need {shards} devices, got {self.devices}")
        self.region_nbytes = [self.placement.shard_nbytes(s) for s in range(shards)]
        self.buffers = [
            torch.zeros(slots * n, dtype=torch.uint8, device=d)
            for n, d in zip(self.region_nbytes, self.devices, strict=True)
        ]
        #: Memory no peer can write (see the module docstring); laid out like `buffers`.
        self.snapshots = [torch.zeros_like(b) for b in self.buffers]
        self._engine: TransferEngine | None = None

    @property
    def nbytes(self) -> int:
        """Bytes registered for receiving (the snapshots take as many again)."""
        return sum(b.numel() for b in self.buffers)

    def register(self, engine: TransferEngine) -> None:
        for buf, device in zip(self.buffers, self.devices, strict=True):
            engine.register(buf.data_ptr(), buf.numel(), device)
        self._engine = engine

    def unregister(self) -> None:
        if self._engine is not None:
            for buf in self.buffers:
                self._engine.unregister(buf.data_ptr())
            self._engine = None

    def regions(self, slot: int) -> list[Region]:
        """The slot's region on each shard, as announced to senders."""
        return [
            Region(shard=s, addr=buf.data_ptr() + slot * n, nbytes=n)
            for s, (buf, n) in enumerate(zip(self.buffers, self.region_nbytes, strict=True))
        ]

    def scrub(self, slot: int) -> None:
        """Zero the slot's regions on every shard, and wait for it on a GPU: the next write into the slot
        is a NIC's, which no CUDA stream orders after a queued memset."""
        for view in self.views(slot):
            view.zero_()
            if view.is_cuda:
                torch.cuda.current_stream(view.device).synchronize()

    def views(self, slot: int) -> list[torch.Tensor]:
        """The slot's receive region on each shard as uint8 tensors (writable by any data-plane peer:
        never converted or hashed from; see `snapshot`)."""
        return _slot_views(self.buffers, self.region_nbytes, slot)

    def snapshot_views(self, slot: int) -> list[torch.Tensor]:
        """The slot's snapshot region on each shard: what `snapshot` copied, for hashing and conversion."""
        return _slot_views(self.snapshots, self.region_nbytes, slot)

    def snapshot(self, slot: int, ranges: Iterable[tuple[int, int, int]]) -> None:
        """Copy `ranges` ((shard, slot-relative offset, nbytes)) of the slot's receive region into its
        snapshot region, at the same offsets. On a GPU the copies are queued on the current stream, so
        a digest or conversion queued after them reads the copy."""
        src, dst = self.views(slot), self.snapshot_views(slot)
        for shard, off, n in ranges:
            dst[shard][off : off + n].copy_(src[shard][off : off + n])


def _slot_views(buffers: list[torch.Tensor], region_nbytes: list[int], slot: int) -> list[torch.Tensor]:
    return [buf[slot * n : (slot + 1) * n] for buf, n in zip(buffers, region_nbytes, strict=True)]
