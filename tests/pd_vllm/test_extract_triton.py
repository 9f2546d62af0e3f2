"""The CUDA extraction (pd_vllm/extract_triton.py, through Gatherer) against the CPU gather
(one index_select per layer and plane), byte for byte; and the per-layer gather (layer-wise handoff)
against the whole request's, on the CPU and on CUDA.

The staging region is poisoned first: every byte the request owns must be overwritten with the
reference's bytes, and every other byte must keep the poison (nothing written past the request or
into another layer). Token counts straddle the 64-token blocks. Timing lives in bench/extract.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable

import pytest
import torch

from tilert_serve import layouts
from tilert_serve.pd_vllm.extract import Gatherer, PagedCache, gather


def gpu(test: Callable[..., None]) -> Callable[..., None]:
    """The Triton kernels run only on a GPU; the per-layer CPU test beside them runs everywhere."""
    needs = pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs CUDA: the Triton kernels run only on a GPU"
    )
    return pytest.mark.gpu(needs(test))  # type: ignore[no-any-return]


BLOCK = 64  # fp8_ds_mla indexer pages cover 64 tokens, so vLLM runs the prefill with 64-token blocks
POISON = 0xA5


def caches_for(
    layout: layouts.Layout, layers: list[int], num_blocks: int, seed: int, device: str = "cuda"
) -> list[PagedCache]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for lid in layers:
        for plane in layout.planes:
            # Per block: 64 MLA rows, or one indexer page of the same bytes a [64, 132] view holds.
            per_token = plane.unit_bytes if plane.unit_tokens == 1 else plane.unit_bytes // BLOCK
            t = torch.randint(0, 256, (num_blocks, BLOCK, per_token), dtype=torch.uint8, generator=gen)
            out.append(PagedCache(f"l{lid}.{plane.name}", lid, plane.name, t.to(device), BLOCK, 0))
    return out


def owned(place: layouts.Placement, layers: list[int], n: int) -> list[tuple[int, int, int]]:
    """(shard, start, end) of every byte range the request's layers own in staging."""
    out = []
    for lid in layers:
        for plane in place.layout.planes:
            shard, off = place.offset(plane.name, lid)
            out.append((shard, off, off + plane.nbytes(n)))
    return out


def check(
    place: layouts.Placement, caches: list[PagedCache], shard: int, n: int, num_blocks: int, seed: int
) -> None:
    ids = (random.Random(seed).sample(range(num_blocks), (n + BLOCK - 1) // BLOCK),)
    cpu = [PagedCache(c.name, c.layer, c.plane, c.tensor.cpu(), c.block_size, c.group) for c in caches]
    want = [torch.zeros(place.shard_nbytes(s), dtype=torch.uint8) for s in range(place.shards)]
    expected_bytes = gather(cpu, ids, n, place, want)
    got = [
        torch.full((place.shard_nbytes(s),), POISON, dtype=torch.uint8, device="cuda")
        for s in range(place.shards)
    ]
    fused = Gatherer(caches, place, shard)
    assert fused._fused is not None, "on CUDA the Gatherer must take the Triton kernels"
    assert fused(ids, n, got) == expected_bytes
    torch.cuda.synchronize()
    back = [g.cpu() for g in got]
    untouched = [torch.ones(place.shard_nbytes(s), dtype=torch.bool) for s in range(place.shards)]
    for s, start, end in owned(place, sorted({c.layer for c in caches}), n):
        assert torch.equal(back[s][start:end], want[s][start:end]), (
            f"shard {s} bytes {start}..{end} differ ({n} tokens)"
        )
        untouched[s][start:end] = False
    for s in range(place.shards):
        stray = (back[s][untouched[s]] != POISON).nonzero()
        assert stray.numel() == 0, (
            f"shard {s}: {stray.numel()} bytes written outside the request ({n} tokens)"
        )


@gpu
@pytest.mark.parametrize("n", [1, 63, 64, 65, 1000, 4096])
def test_glm5_fused_gather_equals_index_select(n: int) -> None:
    layout = layouts.get("glm5", "fp8_ds_mla")
    place = layouts.Placement(layout, max_tokens=4096)
    num_blocks = 4096 // BLOCK * 5 // 4
    caches = caches_for(layout, list(range(layout.num_layers)), num_blocks, seed=n)
    check(place, caches, 0, n, num_blocks, seed=n)


@gpu
def test_a_ranks_share_of_layers_lands_on_its_own_shard() -> None:
    # Two staging shards; this rank holds the odd layers, which the placement puts on shard 1.
    layout = layouts.get("glm5", "fp8_ds_mla")
    place = layouts.Placement(layout, max_tokens=512, shards=2)
    layers = [lid for lid in range(layout.num_layers) if place.shard_of(lid) == 1]
    caches = caches_for(layout, layers, 16, seed=7)
    check(place, caches, 1, 300, 16, seed=7)


@gpu
def test_deepseek_v3_2_fused_gather_equals_index_select() -> None:
    layout = layouts.get("deepseek_v3_2", "fp8_ds_mla")
    place = layouts.Placement(layout, max_tokens=1024)
    caches = caches_for(layout, list(range(layout.num_layers)), 20, seed=9)
    check(place, caches, 0, 777, 20, seed=9)


def per_layer_equals_whole(device: str, shards: int, shard: int, n: int, seed: int) -> None:
    """Gathering layer by layer writes exactly the whole request's bytes; layers the rank lacks write 0."""
    layout = layouts.get("glm5", "fp8_ds_mla")
    place = layouts.Placement(layout, max_tokens=512, shards=shards)
    mine = [lid for lid in range(layout.num_layers) if place.shard_of(lid) == shard]
    caches = caches_for(layout, mine, 12, seed=seed, device=device)
    ids = (random.Random(seed).sample(range(12), (n + BLOCK - 1) // BLOCK),)
    g = Gatherer(caches, place, shard)
    assert g.layers == frozenset(mine)
    whole = [
        torch.full((place.shard_nbytes(s),), POISON, dtype=torch.uint8, device=device) for s in range(shards)
    ]
    parts = [w.clone() for w in whole]
    total = g(ids, n, whole)
    by_layer = [g(ids, n, parts, layer=lid) for lid in range(layout.num_layers)]
    assert sum(by_layer) == total == len(mine) * layout.layer_bytes(n)
    assert all(b == 0 for lid, b in enumerate(by_layer) if lid not in mine)
    assert all(torch.equal(a.cpu(), b.cpu()) for a, b in zip(whole, parts, strict=True))
    # One layer alone touches only its own planes' bytes.
    lone = [torch.full_like(w, POISON) for w in whole]
    lid = mine[len(mine) // 2]
    g(ids, n, lone, layer=lid)
    back = lone[shard].cpu()
    for plane in layout.planes:
        _, off = place.offset(plane.name, lid)
        end = off + plane.nbytes(n)
        assert torch.equal(back[off:end], parts[shard][off:end].cpu())
        back[off:end] = POISON
    assert bool((back == POISON).all()), "a single-layer gather wrote outside its layer"


def chunk_by_chunk_equals_whole(device: str, bounds: list[int], seed: int, by_layer: bool) -> None:
    """A chunked prefill: each step gathers its chunk's tokens (`start` = the chunk's first) while the
    cache holds nothing valid past the chunk yet (poisoned here), and the chunks together leave exactly
    the whole request's bytes in staging, a page split by a chunk boundary included (it is copied
    again, whole, with the next chunk)."""
    layout = layouts.get("glm5", "fp8_ds_mla")
    place = layouts.Placement(layout, max_tokens=512, shards=2)
    shard, n = 1, bounds[-1]
    mine = [lid for lid in range(layout.num_layers) if place.shard_of(lid) == shard]
    caches = caches_for(layout, mine, 12, seed=seed, device=device)
    ids = (random.Random(seed).sample(range(12), (n + BLOCK - 1) // BLOCK),)
    g = Gatherer(caches, place, shard)
    whole = [torch.full((place.shard_nbytes(s),), POISON, dtype=torch.uint8, device=device) for s in range(2)]
    g(ids, n, whole)
    final = [c.tensor.clone() for c in caches]
    staged = [torch.full_like(w, POISON) for w in whole]
    for lo, hi in itertools.pairwise(bounds):
        for c, full in zip(caches, final, strict=True):  # tokens the forward has not reached yet
            c.tensor.copy_(full)
            for t in range(hi, n):
                c.tensor[ids[0][t // BLOCK], t % BLOCK] = 0x5A
        if by_layer:
            for lid in mine:
                g(ids, hi, staged, layer=lid, start=lo)
        else:
            g(ids, hi, staged, start=lo)
    assert all(torch.equal(a.cpu(), b.cpu()) for a, b in zip(whole, staged, strict=True)), bounds


#: Chunk boundaries: vLLM's chunks of 9/63/63/29 tokens (docs/reference/vllm-connector.md,
#: "Chunked prefill"), block-aligned chunks, and a chunk inside one page.
CHUNKINGS = [[0, 9, 72, 135, 164], [0, 64, 128, 200], [0, 3, 5, 70]]


@pytest.mark.parametrize("bounds", CHUNKINGS)
@pytest.mark.parametrize("by_layer", [True, False])
def test_gathering_chunk_by_chunk_equals_the_whole_request_on_cpu(bounds: list[int], by_layer: bool) -> None:
    chunk_by_chunk_equals_whole("cpu", bounds, seed=len(bounds), by_layer=by_layer)


@gpu
@pytest.mark.parametrize("bounds", CHUNKINGS)
@pytest.mark.parametrize("by_layer", [True, False])
def test_gathering_chunk_by_chunk_equals_the_whole_request_on_cuda(bounds: list[int], by_layer: bool) -> None:
    chunk_by_chunk_equals_whole("cuda", bounds, seed=len(bounds), by_layer=by_layer)


@pytest.mark.parametrize(("shards", "shard", "n"), [(1, 0, 130), (2, 1, 64), (3, 2, 1)])
def test_gathering_layer_by_layer_equals_the_whole_request_on_cpu(shards: int, shard: int, n: int) -> None:
    per_layer_equals_whole("cpu", shards, shard, n, seed=n)


@gpu
@pytest.mark.parametrize(("shards", "shard", "n"), [(1, 0, 130), (2, 1, 64), (3, 2, 500)])
def test_gathering_layer_by_layer_equals_the_whole_request_on_cuda(shards: int, shard: int, n: int) -> None:
    per_layer_equals_whole("cuda", shards, shard, n, seed=n)


@gpu
@pytest.mark.parametrize(("shards", "shard", "n"), [(1, 0, 1), (2, 1, 65), (3, 2, 500)])
def test_the_general_kernel_writes_what_the_planes_kernel_writes(
    shards: int, shard: int, n: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Every layout here takes _gather_planes_kernel; _gather_kernel (the segment table's geometry)
    # stays for any other: both must gather the same bytes, whole and layer by layer.
    from tilert_serve.pd_vllm import extract_triton

    monkeypatch.setattr(extract_triton, "PLANES_KERNEL", False)
    per_layer_equals_whole("cuda", shards, shard, n, seed=n + 100)


@gpu
def test_the_direct_launch_writes_what_tritons_own_launch_writes(monkeypatch: pytest.MonkeyPatch) -> None:
    # The compiled kernel's launcher (convert_triton.Launcher) against JITFunction's call, byte for byte,
    # over token counts whose specialisations differ (1, a multiple of 16, neither).
    from tilert_serve.layouts import convert_triton
    from tilert_serve.pd_vllm import extract_triton

    layout = layouts.get("glm5", "fp8_ds_mla")
    place = layouts.Placement(layout, max_tokens=512)
    caches = caches_for(layout, list(range(layout.num_layers)), 12, seed=11)
    g = Gatherer(caches, place, 0)
    for n in (1, 64, 300, 64, 1, 300):
        ids = (random.Random(n).sample(range(12), (n + BLOCK - 1) // BLOCK),)
        out = {}
        for direct in (False, True):
            monkeypatch.setattr(convert_triton, "DIRECT_LAUNCH", direct)
            whole = torch.full((place.total_nbytes(),), POISON, dtype=torch.uint8, device="cuda")
            parts = whole.clone()
            g(ids, n, [whole])
            for lid in range(layout.num_layers):
                g(ids, n, [parts], layer=lid)
            out[direct] = (whole.cpu(), parts.cpu())
        assert torch.equal(out[True][0], out[False][0]) and torch.equal(out[True][1], out[False][1]), n
    assert g._fused is not None and g._fused._planes is not None, "GLM-5 takes the planes kernel"
    launcher = extract_triton._GATHER_PLANES
    assert launcher.direct and launcher._compiled, (
        "the launcher refused the call: Triton's own path ran instead"
    )
