"""decode/pipeline.py's `take` on a GPU node's buffers: the received bytes are copied into the slot's
snapshot (a device-local copy queued on the converter thread's stream), the copy is hashed on the
GPU, and the conversion reads the copy; a write into the receive buffer after the copy (a NIC's
write needs no stream, a tensor write stands for it here) changes neither the check nor the state.
GLM-5's fp8 layout over two shards on one GPU (the Triton conversion path), one sender rank per
shard's layers as a TP=2 prefill sends them."""

from __future__ import annotations

import pytest
import torch

from tests.decode import synthetic
from tilert_serve.decode import pipeline
from tilert_serve.decode.buffers import ReceiveBuffers
from tilert_serve.handoff import digest
from tilert_serve.layouts import Placement, convert

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs CUDA: the snapshot and its check run there"
    ),
]

NUM_TOKENS = 300


def test_the_snapshot_is_what_is_checked_and_converted_on_a_gpu() -> None:
    layout = synthetic.layout_for("glm5-fp8")
    digest.warm_up("cuda:0")  # as the node's start does: the kernels compiled before any handoff
    buffers = ReceiveBuffers(layout, max_seq_len=512, slots=2, shards=2, devices=["cuda:0", "cuda:0"])
    # What the senders wrote, laid out as the node's slot 1, and each rank's digest of it (on the host).
    host = [torch.zeros_like(v, device="cpu") for v in buffers.views(1)]
    synthetic.fill(buffers.placement, host, NUM_TOKENS, 3)
    for view, data in zip(buffers.views(1), host, strict=True):
        view.copy_(data)
    wrote = {
        rank: digest.of_ranges(host, digest.receiver_ranges(buffers.placement, rank, 2, NUM_TOKENS), "blake3")
        for rank in range(2)
    }

    def take(*args):  # type: ignore[no-untyped-def]
        return pipeline.take(buffers, True, *args)  # what the node's converter thread runs

    copy = buffers.snapshot

    def copy_then_tamper(slot: int, ranges) -> None:  # type: ignore[no-untyped-def]
        copy(slot, ranges)
        views = buffers.views(slot)
        for shard, off, n in ranges:  # the bytes just copied, before they are hashed: must change nothing
            views[shard][off : off + n].fill_(0x41)

    buffers.snapshot = copy_then_tamper  # type: ignore[method-assign]
    layers = {rank: list(range(rank, layout.num_layers, 2)) for rank in range(2)}
    for rank in range(2):
        assert take(1, rank, 2, NUM_TOKENS, layers[rank], wrote[rank]) is None
    torch.cuda.synchronize()
    # The receive region was overwritten where the senders wrote.
    assert all(
        buffers.views(1)[shard][off : off + n].eq(0x41).all()
        for rank in range(2)
        for shard, off, n in digest.receiver_ranges(buffers.placement, rank, 2, NUM_TOKENS)
    )

    got = convert.to_injected_state(
        buffers.snapshot_views(1), buffers.placement, NUM_TOKENS, 11, torch.bfloat16
    )
    want = convert.to_injected_state(
        [h.cuda() for h in host], buffers.placement, NUM_TOKENS, 11, torch.bfloat16
    )
    for a, b in zip(got.layers, want.layers, strict=True):
        assert torch.equal(a.kv, b.kv) and torch.equal(a.pe, b.pe)
        assert a.ki is not None and b.ki is not None and torch.equal(a.ki, b.ki)
    assert not buffers.snapshot_views(0)[0].any()  # the other slot's snapshot untouched

    # Tampered before the copy: the check of the copy fails.
    buffers.snapshot = copy  # type: ignore[method-assign]
    assert take(1, 0, 2, NUM_TOKENS, layers[0], wrote[0]) is not None


def test_staging_placement_and_receive_placement_agree() -> None:
    """The digest a prefill sends over its staging ranges is the one the node computes over its
    receive ranges (same bytes, same order), on the GPU as on the host."""
    layout = synthetic.layout_for("glm5-fp8")
    staging = Placement(layout, max_tokens=NUM_TOKENS, shards=2)
    bufs = [torch.zeros(staging.shard_nbytes(s), dtype=torch.uint8) for s in range(2)]
    synthetic.fill(staging, bufs, NUM_TOKENS, 5)
    for rank in range(2):
        ranges = digest.sender_ranges(staging, rank, 2, NUM_TOKENS)
        assert digest.of_ranges([b.cuda() for b in bufs], ranges, "blake3") == digest.of_ranges(
            bufs, ranges, "blake3"
        )
