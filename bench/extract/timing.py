"""Kernel-only timing for the extraction and conversion benchmarks: a CUDA graph of the call, replayed.

`median_ms` (bench/common.py) times a call as a caller sees it: the host's Python and launch overhead
count whenever the GPU waits for them, which at 8k tokens (~0.3 ms of bytes) is a visible share. A
graph replay runs the same kernels with the host out of the way: the device time alone. Reporting both
says which of the two a gap comes from.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch


def graph_ms(fn: Callable[[], object], reps: int = 50, warmup: int = 5) -> float:
    """Median device time of `fn`'s GPU work, captured once into a CUDA graph and replayed."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # capture needs the kernels compiled and allocator warmed first
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(warmup):
        graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    del graph
    return statistics.median(times)
