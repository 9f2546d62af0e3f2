"""Per-model state layouts: sizes, placement in buffers, and conversion to the engine's tensors."""

from tilert_serve.layouts.base import Layout, Plane, senders_layers
from tilert_serve.layouts.placement import Placement, Range, write_ranges
from tilert_serve.layouts.registry import for_hf_config, get

__all__ = ["Layout", "Placement", "Plane", "Range", "for_hf_config", "get", "senders_layers", "write_ranges"]
