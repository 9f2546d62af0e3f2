"""A writer on the data plane against the prefill's staging: the worker's registered staging region is
writable by any peer of its transfer engine (no secret needed), so what the sender hashes must be
the private copy the gather wrote, never the registered region. A real TileRTWorker (CPU caches)
hands a request to a real decode node over Mooncake TCP while an attacker's Mooncake engine writes
junk into the registered region after the gather: the node refuses the state (its check of what it
received fails) instead of decoding what the attacker wrote. Without the attacker the same flow
decodes the gathered state."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from tests.decode.attacker import DataPlaneWriter
from tests.decode.conftest import SECRET, running_node
from tilert_serve.layouts import convert
from tilert_serve.pd_vllm.config import ConnectorConfig
from tilert_serve.pd_vllm.extract import gather
from tilert_serve.pd_vllm.metadata import Destination, SendJob
from tilert_serve.pd_vllm.worker import TileRTWorker

NUM_TOKENS = 20


@pytest.fixture
def secret_file(tmp_path):
    path = tmp_path / "secret"
    path.write_bytes(SECRET)
    return path


def _worker(secret_file, layerwise: bool) -> TileRTWorker:
    cfg = ConnectorConfig.from_extra_config(
        {
            "tilert_model": "mla",
            "tilert_max_seq_len": 64,
            "tilert_local_host": "127.0.0.1",
            "tilert_secret_path": str(secret_file),
            "tilert_layerwise": layerwise,
            "tilert_timeout_s": 10.0,
        }
    )
    w = TileRTWorker(cfg, rank=0, world_size=1, group_of={}, block_size_of={0: 16}, num_hidden_layers=2)
    g = torch.Generator().manual_seed(3)
    w.register(
        {f"model.layers.{i}.self_attn.attn": torch.randn(8, 1, 16, 576, generator=g) for i in range(3)}
    )
    return w


@pytest.fixture(scope="module")
def attacker() -> Iterator[DataPlaneWriter]:
    writer = DataPlaneWriter(role="staging-attacker")
    yield writer
    writer.close()


def _overwrite_staging(attacker: DataPlaneWriter, w: TileRTWorker) -> None:
    """Junk over the whole registered staging buffer, written over Mooncake as any peer can."""
    assert w.pool is not None and w._mover is not None
    attacker.write(w._mover.peer_info(), [(w.pool.buffer.data_ptr(), w.pool.buffer.numel())])


def _run_job(w: TileRTWorker, job: SendJob, layerwise: bool) -> None:
    """One vLLM step of the prompt: layer-wise, the forward's layers as they finish; then wait_for_save."""
    if layerwise:
        w.begin([job])
        for i in range(2):
            w.layer_saved(f"model.layers.{i}.self_attn.attn")
    w.expect([job])
    w.step([job])


def _expected_state(w: TileRTWorker, job: SendJob) -> list[torch.Tensor]:
    assert w.pool is not None
    out = torch.zeros_like(w.pool.buffer)
    gather(w.caches, job.block_ids, job.num_tokens, w.pool.placement, [out])
    state = convert.to_injected_state([out], w.pool.placement, NUM_TOKENS, 3, torch.float32)
    return [t for layer in state.layers for t in (layer.kv, layer.pe)]


@pytest.mark.parametrize("layerwise", [False, True], ids=["whole", "layerwise"])
@pytest.mark.parametrize("attacked", [False, True], ids=["clean", "attacked"])
async def test_a_write_into_staging_after_the_gather_is_refused_by_the_node(
    secret_file, attacker, layerwise, attacked, monkeypatch
):
    w = _worker(secret_file, layerwise)
    try:
        assert w.layout is not None and w.pool is not None
        async with running_node(w.layout, secret_file, slots=1, max_seq_len=64) as n:
            _, adm = await n.admit("v")
            job = SendJob(
                req_id="v",
                dest=Destination("127.0.0.1", n.ctrl_port, adm["ticket"]),
                num_tokens=NUM_TOKENS,
                last_prompt_token=3,
                prompt_token_ids=list(range(NUM_TOKENS)),
                block_ids=([1, 2],),
            )
            publish = w.pool.publish
            published: list[list[int]] = []

            def publish_then_attack(index: int, layers: list[int], num_tokens: int, start: int = 0) -> None:
                # Each batch the gather put in staging, overwritten before the sender hashes and writes it.
                publish(index, layers, num_tokens, start)
                published.append(layers)
                if attacked:
                    _overwrite_staging(attacker, w)

            monkeypatch.setattr(w.pool, "publish", publish_then_attack)
            _run_job(w, job, layerwise)
            status, events = await n.generate(adm["ticket"], max_tokens=2)
            assert published == ([[0], [1], [2]] if layerwise else [[0, 1, 2]])
            if attacked:
                assert status == 502 and "digest differs" in events[0]["error"]["message"], events
                assert n.engine.started == []  # never injected
            else:
                assert status == 200, events
                got = [t for layer in n.engine.started[0].layers for t in (layer.kv, layer.pe)]
                assert all(torch.equal(a, b) for a, b in zip(got, _expected_state(w, job), strict=True))
    finally:
        w.shutdown()


async def test_a_write_into_staging_before_the_send_is_refused_by_the_node(secret_file, attacker):
    """The attack as it was found: the registered region overwritten between the gather and the
    sender's hash (which a digest of the registered region would have vouched for)."""
    w = _worker(secret_file, layerwise=False)
    try:
        assert w.layout is not None
        async with running_node(w.layout, secret_file, slots=1, max_seq_len=64) as n:
            _, adm = await n.admit("v")
            for sender in w._senders:
                real = sender.send

                def send(host, port, req, error=None, layers=None, real=real):  # type: ignore[no-untyped-def]
                    _overwrite_staging(attacker, w)
                    return real(host, port, req, error=error, layers=layers)

                sender.send = send  # type: ignore[method-assign]
            job = SendJob(
                req_id="v",
                dest=Destination("127.0.0.1", n.ctrl_port, adm["ticket"]),
                num_tokens=NUM_TOKENS,
                last_prompt_token=3,
                prompt_token_ids=list(range(NUM_TOKENS)),
                block_ids=([1, 2],),
            )
            _run_job(w, job, layerwise=False)
            status, events = await n.generate(adm["ticket"], max_tokens=2)
            assert status == 502 and "digest differs" in events[0]["error"]["message"], events
            assert n.engine.started == []
    finally:
        w.shutdown()
