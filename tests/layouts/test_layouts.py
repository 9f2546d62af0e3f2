"""Layout sizes, placement and conversions (docs/reference/kv-layouts.md, "Sizes", for the sizes)."""

import itertools

import pytest
import torch

from tilert_serve import layouts
from tilert_serve.layouts import convert

GB = 1e9


@pytest.mark.parametrize(
    ("model", "dtype", "per_token"),
    [
        ("glm5", "fp8_ds_mla", 62_252),
        ("deepseek_v3_2", "fp8_ds_mla", 48_856),
        ("glm5", "bfloat16", 101_436),
        ("deepseek_v3_2", "bfloat16", 79_608),
    ],
)
def test_bytes_per_token_match_the_reference_table(model, dtype, per_token):
    assert layouts.get(model, dtype).bytes_per_token() == per_token


@pytest.mark.parametrize(
    ("model", "tokens", "gb"),
    [
        ("glm5", 8 * 1024, 0.510),
        ("glm5", 32 * 1024, 2.040),
        ("glm5", 128 * 1024, 8.159),
        ("deepseek_v3_2", 8 * 1024, 0.400),
        ("deepseek_v3_2", 128 * 1024, 6.404),
    ],
)
def test_request_bytes_match_the_handoff_table(model, tokens, gb):
    assert round(layouts.get(model, "fp8").request_bytes(tokens) / GB, 3) == gb


def test_indexer_pages_round_up():
    layout = layouts.get("glm5", "fp8_ds_mla")
    assert layout.layer_bytes(1) == 656 + 8448
    assert layout.layer_bytes(64) == 64 * 656 + 8448
    assert layout.layer_bytes(65) == 65 * 656 + 2 * 8448


def test_glm5_receive_buffer_shards_like_tilert():
    place = layouts.Placement(layouts.get("glm5", "fp8"), max_tokens=202_752, shards=8)
    assert round(place.total_nbytes() / GB, 1) == 12.6
    assert round(place.shard_nbytes(0) / GB, 1) == 1.6
    assert place.shard_of(9) == 1


def test_mla_layout_follows_the_checkpoint():
    layout = layouts.for_hf_config(
        "mla",
        {"kv_lora_rank": 512, "qk_rope_head_dim": 64, "num_hidden_layers": 2, "num_nextn_predict_layers": 1},
        "float32",
    )
    assert (layout.num_layers, layout.num_mtp_layers, layout.planes[0].unit_bytes) == (3, 1, 576 * 4)
    assert layout.index_head_dim == 0


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: layouts.get("llama", "bf16"), "unknown tilert model 'llama'"),
        (lambda: layouts.get("glm5", "float32"), "does not support KV-cache dtype 'float32'"),
        (lambda: layouts.get("glm5", "fp8", num_layers=60), "glm5 has 79 layers"),
        (lambda: layouts.get("mla", "float32"), "needs num_layers"),
        (
            lambda: layouts.for_hf_config(
                "mla", {"kv_lora_rank": 256, "qk_rope_head_dim": 64, "num_hidden_layers": 2}, "float32"
            ),
            "kv_lora_rank=256",
        ),
    ],
)
def test_bad_layout_requests_name_the_problem(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_placement_blocks_never_overlap_and_fit_their_shard():
    layout = layouts.get("deepseek_v3_2", "fp8")
    place = layouts.Placement(layout, max_tokens=200, shards=3)
    spans: dict[int, list[tuple[int, int]]] = {}
    for lid in range(layout.num_layers):
        for plane in layout.planes:
            shard, off = place.offset(plane.name, lid)
            spans.setdefault(shard, []).append((off, off + plane.nbytes(200)))
    for shard, blocks in spans.items():
        blocks.sort()
        assert blocks[0][0] == 0 and blocks[-1][1] == place.shard_nbytes(shard)
        assert all(a[1] == b[0] for a, b in itertools.pairwise(blocks))


def test_senders_split_layers_round_robin():
    layout = layouts.get("glm5", "fp8")
    split = [layouts.senders_layers(layout, r, 8) for r in range(8)]
    assert sorted(itertools.chain.from_iterable(split)) == list(range(79))
    assert split[1][:3] == [1, 9, 17]
    with pytest.raises(ValueError, match="rank 8"):
        layouts.senders_layers(layout, 8, 8)


def test_write_ranges_move_exactly_the_request():
    layout = layouts.for_hf_config(
        "mla",
        {"kv_lora_rank": 512, "qk_rope_head_dim": 64, "num_hidden_layers": 3, "num_nextn_predict_layers": 1},
        "bfloat16",
    )
    src = layouts.Placement(layout, max_tokens=32)
    dst = layouts.Placement(layout, max_tokens=64, shards=2)
    src_buf = [torch.randint(0, 255, (src.total_nbytes(),), dtype=torch.uint8)]
    dst_buf = [torch.zeros(dst.shard_nbytes(s), dtype=torch.uint8) for s in range(2)]
    ranges = layouts.write_ranges(src, dst, list(range(layout.num_layers)), num_tokens=20)
    assert sum(r.nbytes for r in ranges) == layout.request_bytes(20)
    for r in ranges:
        dst_buf[r.dst_shard][r.dst : r.dst + r.nbytes] = src_buf[r.src_shard][r.src : r.src + r.nbytes]
    for lid in range(layout.num_layers):
        (_, s), (d_shard, d) = src.offset("mla", lid), dst.offset("mla", lid)
        n = layout.plane("mla").nbytes(20)
        assert torch.equal(src_buf[0][s : s + n], dst_buf[d_shard][d : d + n])
    with pytest.raises(ValueError, match="exceed the buffer's capacity"):
        layouts.write_ranges(src, dst, [0], num_tokens=33)


def test_hadamard_is_orthonormal():
    h = convert.hadamard_matrix(128)
    assert torch.allclose(h @ h.T, torch.eye(128), atol=1e-6)
    with pytest.raises(ValueError, match="power of two"):
        convert.hadamard_matrix(96)


@pytest.mark.parametrize("dtype", ["fp8_ds_mla", "bfloat16"])
def test_received_bytes_convert_back_to_the_state(dtype):
    torch.manual_seed(0)
    layout = layouts.get("glm5", dtype)
    n = 70  # two indexer pages, the second one partial
    place = layouts.Placement(layout, max_tokens=128, shards=2)
    region = [torch.zeros(place.shard_nbytes(s), dtype=torch.uint8) for s in range(2)]
    kv, pe, keys = torch.randn(n, 512), torch.randn(n, 64), torch.randn(n, 128)
    rows = convert.kv_pe_to_mla_rows(kv, pe, layout).flatten()
    pages = convert.keys_to_indexer_pages(keys).flatten()
    for lid in (0, 5, 78):
        shard, off = place.offset("mla", lid)
        region[shard][off : off + rows.numel()] = rows
        shard, off = place.offset("indexer", lid)
        region[shard][off : off + pages.numel()] = pages
    state = convert.to_injected_state(region, place, n, last_prompt_token=7, out_dtype=torch.float32)
    assert state.seq_len == n and len(state.layers) == 79 and state.last_prompt_token == 7
    got = state.layers[78]
    # fp8 e4m3 keeps 3 mantissa bits: relative error up to 2^-4 per element before scaling.
    tol = 0.07 if dtype == "fp8_ds_mla" else 0.01
    assert torch.allclose(got.kv, kv, atol=tol * kv.abs().max().item())
    assert torch.allclose(got.pe, pe.bfloat16().float())
    rotated = keys @ convert.hadamard_matrix(128)
    assert got.ki is not None and got.ki.shape == (n, 128)
    assert torch.allclose(got.ki, rotated, atol=0.07 * rotated.abs().max().item())
    assert torch.count_nonzero(state.layers[1].kv) == 0  # untouched layers stay empty


@pytest.mark.parametrize(
    ("model", "dtype", "shards"), [("glm5", "fp8_ds_mla", 2), ("glm5", "bfloat16", 1), ("mla", "float32", 3)]
)
def test_a_layer_converts_to_exactly_its_part_of_the_whole_state(model, dtype, shards):
    # The node converts each layer as it lands (layer-wise handoff): the result must be the layer the
    # whole-state conversion would give, bit for bit, on every shard.
    gen = torch.Generator().manual_seed(11)
    layout = layouts.get(model, dtype, num_layers=4 if model == "mla" else None)
    n = 70
    place = layouts.Placement(layout, max_tokens=128, shards=shards)
    region = [torch.zeros(place.shard_nbytes(s), dtype=torch.uint8) for s in range(shards)]
    for lid in range(layout.num_layers):
        rows = convert.kv_pe_to_mla_rows(
            torch.randn(n, 512, generator=gen) * (1 + lid % 3), torch.randn(n, 64, generator=gen), layout
        ).flatten()
        shard, off = place.offset("mla", lid)
        region[shard][off : off + rows.numel()] = rows
        if layout.index_head_dim:
            pages = convert.keys_to_indexer_pages(torch.randn(n, 128, generator=gen)).flatten()
            shard, off = place.offset("indexer", lid)
            region[shard][off : off + pages.numel()] = pages
    whole = convert.to_injected_state(region, place, n, last_prompt_token=3, out_dtype=torch.bfloat16)
    for lid in range(layout.num_layers):
        one = convert.to_layer_state(region, place, lid, n, torch.bfloat16)
        want = whole.layers[lid]
        assert torch.equal(one.kv, want.kv) and torch.equal(one.pe, want.pe), lid
        assert (one.ki is None) == (want.ki is None) == (not layout.index_head_dim)
        assert one.ki is None or torch.equal(one.ki, want.ki)
    with pytest.raises(ValueError, match="exceed the slot's capacity"):
        convert.to_layer_state(region, place, 0, 129, torch.bfloat16)
