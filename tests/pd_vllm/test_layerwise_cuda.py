"""The CUDA side of the layer-wise handoff, on a GPU, with GLM-5's real cache geometry.

Prefill side: TileRTWorker (begin -> layer_saved per layer -> step) over CUDA paged caches, the
"forward" writing each layer's cache on the GPU just before save_kv_layer reports it, the GPU held
back by a sleep kernel so the host runs ahead of it. The sender thread (Sender.send stood in for: no
network, no transfer engine) takes each layer as the feed hands it over, after its CUDA event, and
hashes that layer's staging bytes on the GPU (handoff/digest.py: pinned host copies on a side
stream); each digest must equal the digest of the reference bytes (extract.gather's index_select on
the CPU over the same caches). The same over a chunked prefill of three steps (SendJob.upto): each
step's tokens staged layer by layer, the blocks a chunk ends inside staged again with the next chunk.
Node side: each layer lands in a CUDA receive buffer (a copy on
another stream standing in for the NIC's write, finished before its LayersDone), and a converter
thread per slot checks the layer's digest and converts it (convert.to_layer_state on the thread's
stream, as decode/pipeline.py's HandoffPipeline._convert_layers does); the layers must equal the whole-state conversion
bit for bit.

vLLM is not needed for this: when it is not installed (the GPU machine), the three vLLM names the
connector's modules import at load time (its logger, KVConnectorMetadata, the connector-stats base
classes) are stood in for by minimal stand-ins before the worker is imported; pydantic (the
connector's config) travels as wheels (bench/gpu.sh).
"""

from __future__ import annotations

import queue
import random
import sys
import threading
import time
import types
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

import pytest
import torch

from tilert_serve import layouts
from tilert_serve.handoff import digest
from tilert_serve.layouts import convert
from tilert_serve.pd_vllm.extract import Gatherer, PagedCache, gather

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the layer-wise CUDA path"),
]

BLOCK = 64
NUM_TOKENS = 1000  # 16 blocks, the last one partial; 16 indexer pages
NUM_BLOCKS = 40
ALGO = "blake2b"  # always there (blake3 may not be on the GPU machine)


def _stand_in_vllm() -> None:
    """Minimal stand-ins for the vLLM names imported at load time by pd_vllm's logs, metadata, stats."""
    try:
        import vllm  # noqa: F401

        return
    except ImportError:
        pass
    import logging

    def module(name: str, **attrs: Any) -> None:
        m = types.ModuleType(name)
        m.__dict__.update(attrs)
        sys.modules[name] = m

    @dataclass
    class KVConnectorStats:
        data: dict[str, Any] = field(default_factory=dict)

    class KVConnectorPromMetrics:
        def __init__(self, *args: Any) -> None:
            pass

    base = "vllm.distributed.kv_transfer.kv_connector.v1"
    for name in (
        "vllm",
        "vllm.distributed",
        "vllm.distributed.kv_transfer",
        "vllm.distributed.kv_transfer.kv_connector",
        base,
    ):
        module(name)
    module("vllm.logger", _VllmLogger=logging.Logger, init_logger=logging.getLogger)
    module(f"{base}.base", KVConnectorMetadata=type("KVConnectorMetadata", (), {}))
    module(
        f"{base}.metrics",
        KVConnectorStats=KVConnectorStats,
        KVConnectorPromMetrics=KVConnectorPromMetrics,
        PromMetric=object,
        PromMetricT=object,
    )


def glm5_caches(device: str, seed: int) -> tuple[layouts.Layout, list[torch.Tensor], list[torch.Tensor]]:
    """Per layer, GLM-5's MLA cache (blocks of 64 rows of 656 B) and indexer cache (one 8,448 B page a
    block), holding what vLLM writes (convert.py's mirror functions of random engine tensors), a
    different scale per layer so mixed-up layers cannot match."""
    layout = layouts.get("glm5", "fp8_ds_mla")
    gen = torch.Generator().manual_seed(seed)
    rows = NUM_BLOCKS * BLOCK
    mla, idx = [], []
    for lid in range(layout.num_layers):
        kv = torch.randn(rows, 512, generator=gen) * (1 + lid % 5)
        pe = torch.randn(rows, 64, generator=gen)
        keys = torch.randn(rows, 128, generator=gen)
        mla.append(convert.kv_pe_to_mla_rows(kv, pe, layout).view(NUM_BLOCKS, BLOCK, 656).to(device))
        idx.append(convert.keys_to_indexer_pages(keys).view(NUM_BLOCKS, BLOCK, 132).to(device))
    return layout, mla, idx


def reference_staging(
    layout: layouts.Layout,
    mla: list[torch.Tensor],
    idx: list[torch.Tensor],
    ids: list[int],
    staging: layouts.Placement,
) -> torch.Tensor:
    """What staging must hold: the CPU path's index_select gather of the same caches."""
    caches = [
        PagedCache(f"l{i}.{p}", i, p, t.cpu(), BLOCK, 0)
        for i in range(layout.num_layers)
        for p, t in (("mla", mla[i]), ("indexer", idx[i]))
    ]
    out = torch.zeros(staging.total_nbytes(), dtype=torch.uint8)
    gather(caches, (ids,), NUM_TOKENS, staging, [out])
    return out


def layer_digest(
    buffers: list[torch.Tensor], staging: layouts.Placement, layers: list[int], tokens: int = NUM_TOKENS
) -> str:
    return digest.of_ranges(buffers, digest.sender_ranges(staging, 0, 1, tokens, layers), ALGO)


def forward_writes(cache: torch.Tensor, truth: torch.Tensor, ids: list[int], upto: int, page: bool) -> None:
    """The forward writes `cache` (blocks of BLOCK rows) up to token `upto`: before the prompt's end, the
    rows of later tokens hold garbage, and so does an indexer `page` holding any (it is complete only
    once the next chunk has run)."""
    cache.copy_(truth)
    if upto < NUM_TOKENS:
        tokens = torch.arange(upto // BLOCK * BLOCK if page else upto, len(ids) * BLOCK)
        blocks = torch.tensor(ids, dtype=torch.int64)[tokens // BLOCK]
        cache[blocks.to(cache.device), (tokens % BLOCK).to(cache.device)] = 0x5A


@pytest.mark.parametrize("ends", [(NUM_TOKENS,), (300, 700, NUM_TOKENS)], ids=["one step", "three chunks"])
def test_worker_stages_layer_by_layer_on_cuda_and_each_layers_digest_is_the_references(
    tmp_path, monkeypatch, ends
):
    # "three chunks": a chunked prefill, every step's tokens staged as its layers finish (300 and 700
    # end inside a block, so its rows and the indexer page are staged again with the next chunk).
    pytest.importorskip(
        "pydantic", reason="the connector's config needs pydantic (bench/gpu.sh carries its wheels)"
    )
    _stand_in_vllm()
    from tilert_serve import transfer
    from tilert_serve.handoff.sender import HandoffResult, Sender
    from tilert_serve.pd_vllm.config import ConnectorConfig
    from tilert_serve.pd_vllm.metadata import Destination, SendJob
    from tilert_serve.pd_vllm.worker import TileRTWorker

    layout, truth_mla, truth_idx = glm5_caches("cuda", seed=1)
    main = layout.num_main_layers
    # vLLM's caches before the forward: garbage, overwritten layer by layer by the "forward" below.
    kv_caches: dict[str, torch.Tensor] = {}
    for lid in range(layout.num_layers):
        kv_caches[f"model.layers.{lid}.self_attn.attn"] = torch.full_like(truth_mla[lid], 0x5A)
        kv_caches[f"model.layers.{lid}.self_attn.indexer.k_cache"] = torch.full_like(truth_idx[lid], 0x5A)

    class NoMover:
        name = "none"

        def register(self, *args: Any) -> None:
            pass

        def unregister(self, *args: Any) -> None:
            pass

        def close(self) -> None:
            pass

    monkeypatch.setattr(transfer, "create", lambda *a, **k: NoMover())
    seen: list[
        tuple[list[int], int | None, str, str]
    ] = []  # (layers, upto, digest of GPU staging, of its host copy)

    def send(
        self: Sender, host: str, port: int, req: Any, error: str | None = None, layers: Any = None
    ) -> Any:
        assert layers is not None, "a layer-wise job must be sent layer-wise"
        assert w.pool is not None
        buffers = [w.pool.buffer]  # one staging region: the pool's whole buffer
        while (staged := layers.next_layers(30.0)) is not None:  # waits on the batch's CUDA event
            # A chunk's tokens up to its last whole block are final (the next step stages that block again).
            tokens = NUM_TOKENS if staged.upto is None else staged.upto // BLOCK * BLOCK
            on_gpu = layer_digest(buffers, staging, staged.layers, tokens)
            on_host = layer_digest([buffers[0].cpu()], staging, staged.layers, tokens)
            seen.append((staged.layers, staged.upto, on_gpu, on_host))
        return HandoffResult(True, nbytes=1, layers_sent=len(seen))

    monkeypatch.setattr(Sender, "send", send)
    secret = tmp_path / "secret"
    secret.write_text("0123456789abcdef0123456789abcdef")
    cfg = ConnectorConfig.from_extra_config(
        {
            "tilert_model": "glm5",
            "tilert_max_seq_len": 1024,
            "tilert_local_host": "127.0.0.1",
            "tilert_secret_path": str(secret),
            "tilert_staging_requests": 2,
            "tilert_timeout_s": 30.0,
        }
    )
    w = TileRTWorker(cfg, rank=0, world_size=1, group_of={}, block_size_of={0: BLOCK}, num_hidden_layers=main)
    w.register(kv_caches)
    try:
        assert w.pool is not None and w.pool.buffer.is_cuda
        staging = w.pool.placement
        ids = random.Random(3).sample(range(NUM_BLOCKS), -(-NUM_TOKENS // BLOCK))
        want = reference_staging(layout, truth_mla, truth_idx, ids, staging)
        job = SendJob(
            req_id="a",
            dest=Destination("127.0.0.1", 9, None),
            num_tokens=NUM_TOKENS,
            last_prompt_token=5,
            prompt_token_ids=list(range(NUM_TOKENS)),
            block_ids=(ids,),
        )
        for upto in ends:
            step = job if upto == NUM_TOKENS else replace(job, upto=upto)
            w.begin([step])
            for lid in range(layout.num_layers):
                # The forward writes layer lid's caches on the GPU (behind a sleep: the host runs ahead),
                # then reports the layer; the MTP layer is written by the drafter, before wait_for_save.
                torch.cuda._sleep(2_000_000)
                forward_writes(
                    kv_caches[f"model.layers.{lid}.self_attn.attn"], truth_mla[lid], ids, upto, False
                )
                forward_writes(
                    kv_caches[f"model.layers.{lid}.self_attn.indexer.k_cache"],
                    truth_idx[lid],
                    ids,
                    upto,
                    True,
                )
                if lid < main:
                    w.layer_saved(f"model.layers.{lid}.self_attn.attn")
            w.step([step])
        deadline = time.monotonic() + 60
        while w.pool.free != 2:
            assert time.monotonic() < deadline, "the job never finished"
            time.sleep(0.01)
        every = [[lid] for lid in range(layout.num_layers)]
        assert [(b, u) for b, u, _, _ in seen] == [(b, u) for u in [*ends[:-1], None] for b in every]
        for batch, upto, on_gpu, on_host in seen:
            # A complete layer: every chunk's tokens, a page split by a chunk staged again, whole.
            tokens = NUM_TOKENS if upto is None else upto // BLOCK * BLOCK
            assert on_gpu == on_host == layer_digest([want], staging, batch, tokens), (
                f"layer {batch}, {upto}: differs"
            )
        assert w.finished({"a"}) == {"a"}
        assert not w.pool.buffer.any()  # scrubbed once sent
    finally:
        w.shutdown()


def test_gpu_staging_lands_and_converts_layer_by_layer_on_a_converter_thread():
    layout, mla, idx = glm5_caches("cuda", seed=2)
    staging = layouts.Placement(layout, max_tokens=1024)
    caches = [
        PagedCache(f"l{i}.{p}", i, p, t, BLOCK, 0)
        for i in range(layout.num_layers)
        for p, t in (("mla", mla[i]), ("indexer", idx[i]))
    ]
    g = Gatherer(caches, staging, 0)
    assert g._fused is not None, "on CUDA the Gatherer must take the Triton kernels"
    ids = random.Random(4).sample(range(NUM_BLOCKS), -(-NUM_TOKENS // BLOCK))
    want = reference_staging(layout, mla, idx, ids, staging)
    region = torch.zeros(staging.total_nbytes(), dtype=torch.uint8, device="cuda")
    received = torch.full_like(region, 0xA5)  # the node's slot; bytes the request does not own stay poison
    nic = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    landed: queue.Queue[tuple[int, str] | None] = queue.Queue()

    def sender() -> None:
        """Prefill's sender thread: wait for the layer's event, write it, then say LayersDone (digest)."""
        while (item := staged.get()) is not None:
            lid, event = item
            event.synchronize()
            d = layer_digest([region], staging, [lid])
            with torch.cuda.stream(nic):
                for _, off, n in digest.sender_ranges(staging, 0, 1, NUM_TOKENS, [lid]):
                    received[off : off + n].copy_(region[off : off + n])
            nic.synchronize()  # the write completed before its LayersDone goes out
            landed.put((lid, d))
        landed.put(None)

    staged: queue.Queue[tuple[int, torch.cuda.Event] | None] = queue.Queue()
    converted: dict[int, Any] = {}

    def convert_layer(lid: int, layer_digest_: str) -> None:
        """decode/pipeline.py's HandoffPipeline._convert_layers: check the layer's digest, then convert it on this thread."""
        ranges = digest.receiver_ranges(staging, 0, 1, NUM_TOKENS, [lid])
        digest.check(layer_digest_, [received], ranges)
        converted[lid] = convert.to_layer_state([received], staging, lid, NUM_TOKENS, torch.bfloat16)

    send_thread = threading.Thread(target=sender)
    send_thread.start()
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="convert-0") as converter:
        futures = []
        for lid in range(layout.num_layers):  # the forward: layer by layer, the host ahead of the GPU
            torch.cuda._sleep(1_000_000)
            assert g(([*ids],), NUM_TOKENS, [region], layer=lid) == layout.layer_bytes(NUM_TOKENS)
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record()
            staged.put((lid, event))
        staged.put(None)
        while (item := landed.get(timeout=60)) is not None:
            futures.append(converter.submit(convert_layer, *item))
        for f in futures:
            f.result()
    send_thread.join()
    assert torch.equal(region.cpu(), want), "GPU staging differs from the CPU gather"
    whole = convert.to_injected_state([received], staging, NUM_TOKENS, 5, torch.bfloat16)
    assert sorted(converted) == list(range(layout.num_layers))
    for lid in range(layout.num_layers):
        got, ref = converted[lid], whole.layers[lid]
        assert got.kv.is_cuda and got.kv.dtype == torch.bfloat16
        assert torch.equal(got.kv, ref.kv) and torch.equal(got.pe, ref.pe) and torch.equal(got.ki, ref.ki), (
            lid
        )
    # The converted state is what the CPU path makes of the reference bytes.
    cpu = convert.to_injected_state([want], staging, NUM_TOKENS, 5, torch.float32)
    for lid in (0, 40, layout.num_layers - 1):
        got, ref = converted[lid], cpu.layers[lid]
        err = float((got.kv.double().cpu() - ref.kv.double()).norm() / ref.kv.double().norm())
        assert err < 1e-2, (lid, err)
