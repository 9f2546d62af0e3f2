"""The CUDA conversion (layouts/convert_triton.py) against the torch path in float32 on the CPU.

Received fp8_ds_mla bytes are built from random engine tensors with convert.py's mirror functions, so
the inputs are what vLLM's cache holds; token counts straddle the kernels' tiles (16 tokens per MLA
program, 64 per indexer page). Timing lives in bench/convert; this file is only correctness.
"""

from __future__ import annotations

import pytest
import torch

from tilert_serve import layouts
from tilert_serve.layouts import convert

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs CUDA: the Triton kernels run only on a GPU"
    ),
]

#: bf16 outputs of float32 math: the documented bound for bf16 results is 1e-3..1e-2 relative.
TOLERANCE = 1e-2


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double().cpu() - want.double().cpu()).norm() / want.double().cpu().norm())


def received(place: layouts.Placement, n: int, seed: int, device: torch.device) -> list[torch.Tensor]:
    """One slot's regions filled as vLLM would send them; bytes past `n` tokens are random too, so a
    kernel that reads beyond the request shows in its output."""
    gen = torch.Generator().manual_seed(seed)
    regions = [
        torch.randint(0, 256, (place.shard_nbytes(s),), dtype=torch.uint8, generator=gen)
        for s in range(place.shards)
    ]
    for lid in range(place.layout.num_layers):
        # A different scale per layer: a kernel that mixes layers up cannot match by accident.
        kv = torch.randn(n, 512, generator=gen) * (1 + lid % 5)
        pe = torch.randn(n, 64, generator=gen)
        keys = torch.randn(n, 128, generator=gen)
        rows = convert.kv_pe_to_mla_rows(kv, pe, place.layout).flatten()
        pages = convert.keys_to_indexer_pages(keys).flatten()
        shard, off = place.offset("mla", lid)
        regions[shard][off : off + rows.numel()] = rows
        shard, off = place.offset("indexer", lid)
        regions[shard][off : off + pages.numel()] = pages
    return [r.to(device) for r in regions]


def assert_matches_torch_path(regions: list[torch.Tensor], place: layouts.Placement, n: int) -> None:
    from tilert_serve.layouts import convert_triton

    got = convert_triton.to_injected_state(regions, place, n, 7)
    want = convert.to_injected_state([r.cpu() for r in regions], place, n, 7, torch.float32)
    assert (got.seq_len, got.last_prompt_token, len(got.layers)) == (n, 7, place.layout.num_layers)
    for lid, (g, w) in enumerate(zip(got.layers, want.layers, strict=True)):
        assert g.ki is not None and w.ki is not None
        for name, a, b in (("kv", g.kv, w.kv), ("pe", g.pe, w.pe), ("ki", g.ki, w.ki)):
            assert a.dtype == torch.bfloat16 and a.shape == b.shape, (lid, name, a.dtype, a.shape, b.shape)
            assert a.device == regions[place.shard_of(lid)].device
            assert torch.isfinite(a).all(), (lid, name)
            err = rel_err(a, b)
            assert err < TOLERANCE, f"layer {lid} {name}: relative error {err:.2e} at {n} tokens"


@pytest.mark.parametrize("n", [1, 15, 16, 17, 64, 65, 1000])
def test_glm5_conversion_matches_the_torch_path(n: int) -> None:
    place = layouts.Placement(layouts.get("glm5", "fp8_ds_mla"), max_tokens=1024)
    assert_matches_torch_path(received(place, n, seed=n, device=torch.device("cuda")), place, n)


def test_deepseek_v3_2_conversion_matches_the_torch_path() -> None:
    place = layouts.Placement(layouts.get("deepseek_v3_2", "fp8_ds_mla"), max_tokens=256)
    assert_matches_torch_path(received(place, 200, seed=1, device=torch.device("cuda")), place, 200)


def test_sharded_regions_convert_shard_by_shard() -> None:
    # Three shards on one GPU: the layer -> shard mapping and per-shard offsets are what is tested.
    place = layouts.Placement(layouts.get("glm5", "fp8_ds_mla"), max_tokens=512, shards=3)
    assert_matches_torch_path(received(place, 300, seed=3, device=torch.device("cuda")), place, 300)


def test_the_public_entry_point_takes_the_kernels_for_bf16_on_cuda() -> None:
    place = layouts.Placement(layouts.get("glm5", "fp8_ds_mla"), max_tokens=128)
    regions = received(place, 100, seed=4, device=torch.device("cuda"))
    got = convert.to_injected_state(regions, place, 100, 0, torch.bfloat16)
    want = convert.to_injected_state([r.cpu() for r in regions], place, 100, 0, torch.float32)
    assert got.layers[0].kv.is_cuda and got.layers[0].kv.dtype == torch.bfloat16
    assert max(rel_err(g.kv, w.kv) for g, w in zip(got.layers, want.layers, strict=True)) < TOLERANCE


def test_wrong_inputs_are_refused() -> None:
    from tilert_serve.layouts import convert_triton

    place = layouts.Placement(layouts.get("glm5", "fp8_ds_mla"), max_tokens=64, shards=2)
    regions = received(place, 10, seed=5, device=torch.device("cuda"))
    with pytest.raises(ValueError, match="1 regions for a placement of 2 shards"):
        convert_triton.to_injected_state(regions[:1], place, 10, 0)
    bf16 = layouts.Placement(layouts.get("glm5", "bfloat16"), max_tokens=64)
    with pytest.raises(ValueError, match="handles fp8_ds_mla, not bfloat16"):
        convert_triton.to_injected_state(
            [torch.zeros(bf16.total_nbytes(), dtype=torch.uint8, device="cuda")], bf16, 10, 0
        )


@pytest.mark.parametrize(("n", "shards"), [(1, 1), (65, 1), (300, 3)])
def test_a_layer_converts_bit_for_bit_as_in_the_whole_state(n: int, shards: int) -> None:
    # Layer-wise handoff converts each layer as it lands; it must equal that layer of the whole state.
    place = layouts.Placement(layouts.get("glm5", "fp8_ds_mla"), max_tokens=512, shards=shards)
    regions = received(place, n, seed=20 + n, device=torch.device("cuda"))
    whole = convert.to_injected_state(regions, place, n, 0, torch.bfloat16)
    for lid in range(place.layout.num_layers):
        one = convert.to_layer_state(regions, place, lid, n, torch.bfloat16)
        want = whole.layers[lid]
        assert one.kv.device == regions[place.shard_of(lid)].device
        assert one.ki is not None and want.ki is not None
        assert (
            torch.equal(one.kv, want.kv) and torch.equal(one.pe, want.pe) and torch.equal(one.ki, want.ki)
        ), lid


def test_pages_per_program_and_launch_shape_leave_the_bits_alone() -> None:
    # The whole state runs 4 indexer pages a program on large grids, a layer alone 1; one launch or two.
    from tilert_serve.layouts import convert_triton

    place = layouts.Placement(layouts.get("glm5", "fp8_ds_mla"), max_tokens=512)
    regions = received(place, 450, seed=31, device=torch.device("cuda"))
    want = convert_triton.to_injected_state(regions, place, 450, 0, pages=4)
    for pages, one_launch in ((1, True), (2, False)):
        convert_triton.ONE_LAUNCH = one_launch
        try:
            for lid in (0, 39, 78):
                got = convert_triton.to_layer_state(regions, place, lid, 450, pages=pages)
                w = want.layers[lid]
                assert w.ki is not None and got.ki is not None
                assert torch.equal(got.kv, w.kv) and torch.equal(got.pe, w.pe) and torch.equal(got.ki, w.ki)
        finally:
            convert_triton.ONE_LAUNCH = None


@pytest.mark.parametrize("n", [1, 17, 65, 1000])
def test_a_layers_tile_size_leaves_the_bits_alone(n: int) -> None:
    # A layer alone may run other MLA tiles and warps (LAYER_BLOCK_T, LAYER_WARPS) than the whole state.
    from tilert_serve.layouts import convert_triton

    place = layouts.Placement(layouts.get("glm5", "fp8_ds_mla"), max_tokens=1024)
    regions = received(place, n, seed=40 + n, device=torch.device("cuda"))
    whole = convert_triton.to_injected_state(regions, place, n, 0)
    for block_t, warps in ((16, 4), (32, 4), (64, 8)):
        for lid in (0, 40, 78):
            one = convert_triton.to_layer_state(regions, place, lid, n, block_t=block_t, num_warps=warps)
            w = whole.layers[lid]
            assert one.ki is not None and w.ki is not None
            assert torch.equal(one.kv, w.kv) and torch.equal(one.pe, w.pe) and torch.equal(one.ki, w.ki), (
                lid,
                block_t,
            )


def test_the_direct_launch_converts_what_tritons_own_launch_converts(monkeypatch) -> None:
    from tilert_serve.layouts import convert_triton

    place = layouts.Placement(layouts.get("glm5", "fp8_ds_mla"), max_tokens=512)
    for n in (1, 64, 300, 64, 1, 300):  # specialisations differ: 1, a multiple of 16, neither
        regions = received(place, n, seed=50 + n, device=torch.device("cuda"))
        got = {}
        for direct in (False, True):
            monkeypatch.setattr(convert_triton, "DIRECT_LAUNCH", direct)
            whole = convert_triton.to_injected_state(regions, place, n, 0)
            one = convert_triton.to_layer_state(regions, place, 7, n)
            got[direct] = [t.cpu() for s in (*whole.layers, one) for t in (s.kv, s.pe, s.ki) if t is not None]
        assert all(torch.equal(a, b) for a, b in zip(got[True], got[False], strict=True)), n
    launchers = (convert_triton._MLA_ROWS, convert_triton._INDEXER_PAGES, convert_triton._CONVERT)
    assert all(x.direct and x._compiled for x in launchers), "the launcher refused: Triton's own path ran"


@pytest.mark.parametrize("n", [1, 64, 65, 1000])
def test_the_pipelined_indexer_loop_leaves_the_bits_alone(n: int, monkeypatch) -> None:
    # The whole state's indexer launch runs its pages as a pipelined loop (IDX_STAGES); unrolled, the
    # same bits (and a layer alone, which runs the unrolled tile, equals the whole state's: above).
    from tilert_serve.layouts import convert_triton

    place = layouts.Placement(layouts.get("glm5", "fp8_ds_mla"), max_tokens=1024)
    regions = received(place, n, seed=60 + n, device=torch.device("cuda"))
    got = {}
    for stages in (0, 2):
        monkeypatch.setattr(convert_triton, "IDX_STAGES", stages)
        got[stages] = [
            s.ki.cpu()
            for s in convert_triton.to_injected_state(regions, place, n, 0).layers
            if s.ki is not None
        ]
    assert len(got[0]) == place.layout.num_layers
    assert all(torch.equal(a, b) for a, b in zip(got[0], got[2], strict=True))


@pytest.mark.parametrize("n", [1, 17, 65, 1000])
def test_a_layers_program_order_leaves_the_bits_alone(n: int, monkeypatch) -> None:
    # LAYER_ORDER: MLA programs first, indexer programs first, or interleaved (with block_t 64 and 2
    # pages a program, 1 token: one MLA program and one indexer program, mla_programs // idx_programs 1).
    from tilert_serve.layouts import convert_triton

    place = layouts.Placement(layouts.get("glm5", "fp8_ds_mla"), max_tokens=1024)
    regions = received(place, n, seed=50 + n, device=torch.device("cuda"))
    whole = convert_triton.to_injected_state(regions, place, n, 0)
    for order in (0, 1, 2):
        monkeypatch.setattr(convert_triton, "LAYER_ORDER", order)
        for block_t, warps, pages in ((32, 8, 1), (16, 4, 1), (64, 8, 2)):
            for lid in (0, 40, 78):
                one = convert_triton.to_layer_state(
                    regions, place, lid, n, block_t=block_t, num_warps=warps, pages=pages
                )
                w = whole.layers[lid]
                assert one.ki is not None and w.ki is not None
                assert (
                    torch.equal(one.kv, w.kv) and torch.equal(one.pe, w.pe) and torch.equal(one.ki, w.ki)
                ), (order, block_t, pages, lid)
