"""What a layout is: the bytes a request's attention state occupies on the wire and in buffers.

A layout is the one source for sizes. The sender's staging buffer, the node's receive buffer, the
byte ranges of each write, the metrics and the benchmarks all derive from it; nothing else multiplies
rows by layers.

State is kept exactly as vLLM stores it (so the prefill side only gathers, never converts), in
*planes*: per layer, a plane holds `units` of `unit_bytes` each, one unit covering `unit_tokens`
tokens (a 656-byte MLA row covers one token; an 8448-byte indexer page covers 64).
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Plane:
    name: str
    #: Tokens one unit covers: 1 for per-token rows, the page size for paged planes.
    unit_tokens: int
    unit_bytes: int

    def units(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.unit_tokens)

    def nbytes(self, num_tokens: int) -> int:
        return self.units(num_tokens) * self.unit_bytes


@dataclass(frozen=True)
class Layout:
    """A model family's state layout for one KV-cache dtype."""

    #: Model family: glm5 | deepseek_v3_2 | mla.
    model: str
    #: vLLM's KV-cache dtype the wire bytes are in: fp8_ds_mla | bfloat16 | float32.
    kv_cache_dtype: str
    #: Layout version; see VERSIONS in registry.py for what changes a version.
    version: int
    #: Attention layers with state, main model first, then the MTP draft layers.
    num_layers: int
    num_mtp_layers: int
    kv_lora_rank: int
    rope_dim: int
    #: Indexer key width; 0 for models without a sparse-attention indexer.
    index_head_dim: int
    planes: tuple[Plane, ...]

    @property
    def num_main_layers(self) -> int:
        return self.num_layers - self.num_mtp_layers

    def plane(self, name: str) -> Plane:
        for p in self.planes:
            if p.name == name:
                return p
        raise KeyError(f"layout {self.model} has no plane {name!r}; planes: {[p.name for p in self.planes]}")

    def layer_bytes(self, num_tokens: int) -> int:
        """Bytes of one layer's state for `num_tokens` tokens (paged planes rounded up to pages)."""
        return sum(p.nbytes(num_tokens) for p in self.planes)

    def request_bytes(self, num_tokens: int) -> int:
        """Bytes a request of `num_tokens` prompt tokens puts on the wire."""
        return self.num_layers * self.layer_bytes(num_tokens)

    def bytes_per_token(self) -> float:
        """Wire bytes per token of context over all layers, paged planes prorated."""
        return self.num_layers * sum(p.unit_bytes / p.unit_tokens for p in self.planes)

    @property
    def fingerprint(self) -> str:
        """A short hash of everything that decides where bytes go: both sides must agree on it."""
        blob = json.dumps(asdict(self), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    def describe(self) -> dict[str, object]:
        return {
            "model": self.model,
            "kv_cache_dtype": self.kv_cache_dtype,
            "version": self.version,
            "num_layers": self.num_layers,
            "fingerprint": self.fingerprint,
        }


def senders_layers(layout: Layout, rank: int, num_senders: int) -> list[int]:
    """Layers TP rank `rank` sends when `num_senders` ranks share the work (round-robin by layer).

    MLA latent and indexer caches are full-size on every TP rank, so any rank can send any layer;
    spreading layers spreads the NIC load.
    """
    if not 0 <= rank < num_senders:
        raise ValueError(f"sender rank {rank} is outside 0..{num_senders - 1}")
    return [lid for lid in range(layout.num_layers) if lid % num_senders == rank]
