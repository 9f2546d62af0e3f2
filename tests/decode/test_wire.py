"""A sender process writes a synthetic request's state for every layout through Mooncake and NIXL;
the node receives every byte exactly, and its conversion matches an independent float64 decoding."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from tests.decode import synthetic
from tests.decode.conftest import running_node
from tilert_serve import layouts, transfer

NUM_TOKENS = 130  # three indexer pages, the last one partial


def e4m3_to_f64(b: np.ndarray) -> np.ndarray:
    """fp8 e4m3fn bytes -> float64, from the format's definition (not torch)."""
    b = b.astype(np.int64)
    sign, exp, man = (b >> 7) & 1, (b >> 3) & 0xF, b & 7
    val = np.where(exp == 0, man / 8 * 2.0**-6, (1 + man / 8) * 2.0 ** (exp - 7))
    val = np.where((exp == 15) & (man == 7), np.nan, val)
    return np.where(sign == 1, -val, val)


def bf16_to_f64(b: np.ndarray) -> np.ndarray:
    return (b.view(np.uint16).astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def hadamard_f64(n: int) -> np.ndarray:
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h / math.sqrt(n)


def reference_layer(layout: layouts.Layout, planes: dict[str, torch.Tensor], n: int) -> dict[str, np.ndarray]:
    rows = planes["mla"].numpy().reshape(n, -1)
    if layout.kv_cache_dtype == "fp8_ds_mla":
        kv = (
            e4m3_to_f64(rows[:, :512]).reshape(n, 4, 128)
            * rows[:, 512:528].copy().view(np.float32)[..., None]
        )
        out = {"kv": kv.reshape(n, 512), "pe": bf16_to_f64(rows[:, 528:656].copy())}
    elif layout.kv_cache_dtype == "bfloat16":
        vals = bf16_to_f64(rows.copy())
        out = {"kv": vals[:, :512], "pe": vals[:, 512:]}
    else:
        vals = rows.copy().view(np.float32).astype(np.float64)
        out = {"kv": vals[:, :512], "pe": vals[:, 512:]}
    if "indexer" in planes:
        pages = planes["indexer"].numpy().reshape(-1, 8448)
        keys = e4m3_to_f64(pages[:, :8192]).reshape(-1, 128) * pages[:, 8192:].copy().view(
            np.float32
        ).reshape(-1, 1)
        out["ki"] = keys[:n] @ hadamard_f64(128)
    return out


@pytest.mark.parametrize("engine", transfer.ENGINES)
@pytest.mark.parametrize("case", list(synthetic.LAYOUT_CASES))
async def test_state_lands_exactly_and_converts(case, engine, secret_file):
    layout = synthetic.layout_for(case)
    shards = 2 if case.startswith("glm5") else 1  # sharded receive buffers, as on an 8-GPU node
    async with running_node(
        layout, secret_file, transfer_name=engine, slots=2, max_seq_len=160, shards=shards
    ) as n:
        # Occupy slot 0 so the state goes to slot 1: offsets inside the shared buffer are exercised.
        _, first = await n.admit("other")
        status, adm = await n.admit("req-1", prompt_tokens=NUM_TOKENS, max_tokens=6)
        assert status == 200 and adm["slot"] == 1
        result = json.loads((await n.send(case, NUM_TOKENS, 7, engine, adm["ticket"]))[len("RESULT ") :])
        assert result["ok"], result
        assert result["nbytes"] == layout.request_bytes(NUM_TOKENS)

        views = n.node.buffers.views(1)
        place = n.node.buffers.placement
        for lid in range(layout.num_layers):
            for plane, data in synthetic.layer_bytes(layout, lid, NUM_TOKENS, 7).items():
                shard, off = place.offset(plane, lid)
                got = views[shard][off : off + data.numel()]
                assert torch.equal(got, data), f"layer {lid} plane {plane}: bytes differ"
                end = off + layout.plane(plane).nbytes(160)
                assert not views[shard][off + data.numel() : end].any(), (
                    f"layer {lid} {plane}: bytes past the request"
                )
        assert not n.node.buffers.views(0)[0].any(), "slot 0 was written"

        status, events = await n.generate(adm["ticket"], first_token=100, max_tokens=4)
        assert status == 200
        assert [t for e in events[:-1] for t in e["token_ids"]] == [101, 102, 103, 104]
        assert events[-1]["done"] and events[-1]["finish_reason"] == "length"
        state = n.engine.started[-1]
        assert state.seq_len == NUM_TOKENS and state.last_prompt_token == 11
        assert len(state.layers) == layout.num_layers
        for lid in (0, layout.num_layers - 1):  # a main layer and the MTP layer
            want = reference_layer(layout, synthetic.layer_bytes(layout, lid, NUM_TOKENS, 7), NUM_TOKENS)
            got = state.layers[lid]
            for name, ref in want.items():
                tensor = getattr(got, name)
                assert tensor is not None and tensor.shape == ref.shape
                np.testing.assert_allclose(
                    tensor.double().numpy(),
                    ref,
                    rtol=0,
                    atol=2e-6 * np.abs(ref).max(),
                    err_msg=f"layer {lid} {name}",
                )
            if not layout.index_head_dim:
                assert got.ki is None
        _ = first
