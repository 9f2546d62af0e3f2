"""The node's receive buffers: allocated, touched and registered once, at start.

One buffer per shard (per GPU on a TileRT node, one on a CPU node) holds every slot's region back to
back; the layout's placement says where each (plane, layer) sits inside a region. First-touch page
faults cost more than any transfer (reference/transfer-engines.md §6.1), so memory is zeroed here.
"""

from __future__ import annotations

import torch

from tilert_serve.handoff.messages import Region
from tilert_serve.layouts import Layout, Placement
from tilert_serve.transfer import TransferEngine


class ReceiveBuffers:
    def __init__(self, layout: Layout, *, max_seq_len: int, slots: int, shards: int = 1,
                 devices: list[str] | None = None) -> None:
        self.placement = Placement(layout, max_tokens=max_seq_len, shards=shards)
        self.slots = slots
        self.devices = devices or ["cpu"] * shards
        if len(self.devices) != shards:
            raise ValueError(f"{shards} shards need {shards} devices, got {self.devices}")
        self.region_nbytes = [self.placement.shard_nbytes(s) for s in range(shards)]
        self.buffers = [torch.zeros(slots * n, dtype=torch.uint8, device=d)
                        for n, d in zip(self.region_nbytes, self.devices, strict=True)]
        self._engine: TransferEngine | None = None

    @property
    def nbytes(self) -> int:
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
        return [Region(shard=s, addr=buf.data_ptr() + slot * n, nbytes=n)
                for s, (buf, n) in enumerate(zip(self.buffers, self.region_nbytes, strict=True))]

    def scrub(self, slot: int) -> None:
        """Zero the slot's regions on every shard, and wait for it on a GPU: the next write into the slot
        is a NIC's, which no CUDA stream orders after a queued memset."""
        for view in self.views(slot):
            view.zero_()
            if view.is_cuda:
                torch.cuda.current_stream(view.device).synchronize()

    def views(self, slot: int) -> list[torch.Tensor]:
        """The slot's region on each shard as uint8 tensors (for conversion)."""
        return [buf[slot * n:(slot + 1) * n] for buf, n in zip(self.buffers, self.region_nbytes, strict=True)]
