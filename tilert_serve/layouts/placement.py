"""Where each (plane, layer) of a request lives inside a buffer, with sharding across devices.

The same placement describes the sender's staging buffer (one request, usually one shard) and each
slot of the node's receive buffer (one region per shard; layer `lid` on shard `lid % shards`, as
TileRT spreads layers over its GPUs). Writes are then one contiguous range per (plane, layer).
"""

from __future__ import annotations

from dataclasses import dataclass

from tilert_serve.layouts.base import Layout


@dataclass(frozen=True)
class Range:
    """One contiguous copy: `nbytes` from `src` (offset in the source shard) to `dst`."""

    src_shard: int
    src: int
    dst_shard: int
    dst: int
    nbytes: int


@dataclass(frozen=True)
class Placement:
    layout: Layout
    #: Capacity in tokens of every (plane, layer) block.
    max_tokens: int
    shards: int = 1

    def __post_init__(self) -> None:
        if self.shards < 1:
            raise ValueError(f"shards must be >= 1, got {self.shards}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")

    def shard_of(self, layer: int) -> int:
        return layer % self.shards

    def _layers_on(self, shard: int) -> int:
        return len(range(shard, self.layout.num_layers, self.shards))

    def _plane_block(self, plane_index: int) -> int:
        return self.layout.planes[plane_index].nbytes(self.max_tokens)

    def shard_nbytes(self, shard: int) -> int:
        layers = self._layers_on(shard)
        return sum(layers * self._plane_block(i) for i in range(len(self.layout.planes)))

    def offset(self, plane: str, layer: int) -> tuple[int, int]:
        """(shard, byte offset) of the block holding `layer`'s `plane`.

        Within a shard, planes follow each other, and each plane is [local layer][capacity units].
        """
        if not 0 <= layer < self.layout.num_layers:
            raise ValueError(f"layer {layer} is outside 0..{self.layout.num_layers - 1}")
        shard = self.shard_of(layer)
        local = layer // self.shards
        layers = self._layers_on(shard)
        off = 0
        for i, p in enumerate(self.layout.planes):
            if p.name == plane:
                return shard, off + local * self._plane_block(i)
            off += layers * self._plane_block(i)
        raise KeyError(f"layout {self.layout.model} has no plane {plane!r}")

    def total_nbytes(self) -> int:
        return sum(self.shard_nbytes(s) for s in range(self.shards))


def write_ranges(
    src: Placement, dst: Placement, layers: list[int], num_tokens: int, start: int = 0
) -> list[Range]:
    """The copies that move tokens `start` to `num_tokens` of `layers` from one placement to another
    (a paged plane's page holding `start` moves whole: a chunk boundary inside it leaves it partial)."""
    if src.layout.fingerprint != dst.layout.fingerprint:
        raise ValueError("source and destination use different layouts")
    for p in (src, dst):
        if num_tokens > p.max_tokens:
            raise ValueError(f"{num_tokens} tokens exceed the buffer's capacity of {p.max_tokens} tokens")
    out: list[Range] = []
    for layer in layers:
        for plane in src.layout.planes:
            s_shard, s_off = src.offset(plane.name, layer)
            d_shard, d_off = dst.offset(plane.name, layer)
            skip = start // plane.unit_tokens * plane.unit_bytes
            out.append(Range(s_shard, s_off + skip, d_shard, d_off + skip, plane.nbytes(num_tokens) - skip))
    return out
