"""decode/pipeline.py's `settle` on a GPU: the converter thread's spans end when the conversion's kernels
have run, not when they were queued.

The stream is held back by a sleep kernel first, so the conversion is still queued when its call
returns (what a span without `settle` would end on); `settle` must then wait for it. Once on the
test's thread, once on a converter thread (as the node converts: a ThreadPoolExecutor, that thread's
current stream) over a placement of two shards on one GPU and a CPU tensor among the views.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from tilert_serve import layouts
from tilert_serve.decode.pipeline import settle
from tilert_serve.layouts import convert

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: settle waits on CUDA streams"),
]

#: ~50 ms of a sleep kernel on an H200 (1.98 GHz): far longer than the host takes to queue the conversion.
HOLD_CYCLES = 100_000_000


def regions_of(place: layouts.Placement) -> list[torch.Tensor]:
    """Received bytes (random: only when the kernels run matters here, not what they compute)."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    return [
        torch.randint(0, 256, (place.shard_nbytes(s),), dtype=torch.uint8, device="cuda", generator=gen)
        for s in range(place.shards)
    ]


def test_settle_waits_for_the_conversion_queued_behind_the_stream() -> None:
    place = layouts.Placement(layouts.get("glm5", "fp8_ds_mla"), max_tokens=8192)
    regions = regions_of(place)
    for lid in range(3):  # compiled (layers 0, 1, 2 specialise differently) before the stream is held:
        convert.to_layer_state(regions, place, lid, 8192, torch.bfloat16)  # loading a module waits for it
    torch.cuda.synchronize()
    torch.cuda._sleep(HOLD_CYCLES)
    for lid in range(3):
        convert.to_layer_state(regions, place, lid, 8192, torch.bfloat16)
    converted = torch.cuda.Event()
    converted.record()
    assert not converted.query(), "the conversion ran before its call returned: nothing here tests settle"
    t0 = time.perf_counter()
    settle(regions)
    waited = time.perf_counter() - t0
    assert converted.query() and torch.cuda.current_stream().query()
    assert waited > 0.005, f"settle returned after {waited * 1e3:.2f} ms with the stream held"


def test_settle_on_a_converter_thread_over_several_shards_and_a_cpu_view() -> None:
    place = layouts.Placement(layouts.get("glm5", "fp8_ds_mla"), max_tokens=1024, shards=2)
    regions = regions_of(place)
    convert.to_injected_state(regions, place, 1000, 0, torch.bfloat16)
    torch.cuda.synchronize()

    def convert_and_settle() -> tuple[bool, bool]:
        torch.cuda._sleep(HOLD_CYCLES)
        convert.to_injected_state(regions, place, 1000, 0, torch.bfloat16)
        converted = torch.cuda.Event()
        converted.record()
        queued = not converted.query()
        settle([*regions, torch.zeros(4)])  # the CPU tensor is no stream to wait on; both shards one device
        return queued, converted.query()

    with ThreadPoolExecutor(1) as converter:
        queued, done = converter.submit(convert_and_settle).result(timeout=60)
    assert queued, "the conversion ran before its call returned: nothing here tests settle"
    assert done
