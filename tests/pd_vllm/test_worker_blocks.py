"""The worker's block contract: a job's blocks are released (reported in get_finished) only after
its rows are in staging and vLLM has finished the request; a full staging pool makes jobs wait, not
fail, until they have waited tilert_timeout_s. The sender runs for real against a closed port."""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest
import torch

from tilert_serve.local.runner import free_port
from tilert_serve.pd_vllm.config import ConnectorConfig
from tilert_serve.pd_vllm.metadata import Destination, SendJob
from tilert_serve.pd_vllm.worker import TileRTWorker


def _worker(tmp_path, timeout_s: float, staging: int = 1) -> TileRTWorker:
    """A rank of a 2-layer MLA model with MTP (3 caches) and `staging` staging regions."""
    secret = tmp_path / "secret"
    secret.write_text("0123456789abcdef0123456789abcdef")
    cfg = ConnectorConfig.from_extra_config(
        {
            "tilert_model": "mla",
            "tilert_max_seq_len": 64,
            "tilert_local_host": "127.0.0.1",
            "tilert_secret_path": str(secret),
            "tilert_staging_requests": staging,
            "tilert_timeout_s": timeout_s,
        }
    )
    assert cfg.layerwise  # the default
    w = TileRTWorker(cfg, rank=0, world_size=1, group_of={}, block_size_of={0: 16}, num_hidden_layers=2)
    w.register({f"model.layers.{i}.self_attn.attn": torch.randn(8, 1, 16, 576) for i in range(3)})
    return w


@pytest.fixture
def worker(tmp_path):
    w = _worker(tmp_path, 0.5)
    yield w
    w.shutdown()


def stand_in(worker: TileRTWorker, send):
    """Every sender thread's Sender.send replaced by `send` (the threads look it up per job)."""
    for sender in worker._senders:
        sender.send = send
    return send


def job(req_id: str, port: int) -> SendJob:
    return SendJob(
        req_id=req_id,
        dest=Destination("127.0.0.1", port, None),
        num_tokens=20,
        last_prompt_token=3,
        prompt_token_ids=list(range(20)),
        block_ids=([1, 2],),
    )


def _until(cond, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_blocks_are_released_after_the_copy_and_the_finish(worker):
    port = free_port()
    a, b = job("a", port), job("b", port)
    worker.expect([a, b])
    worker.step([a, b])  # one staging region: a is copied, b waits with its blocks held
    assert worker.finished(set()) is None  # vLLM has not finished them yet
    assert worker.finished({"a", "b"}) == {"a"}
    _until(lambda: worker.pool.free == 1)  # the sender failed (closed port) and gave staging back
    worker.step([])  # an empty step: b now gets the region
    assert worker.finished(set()) == {"b"}
    assert worker.finished({"a", "b"}) is None  # each id is reported once
    _until(lambda: worker.pool.free == 1)
    stats = worker.take_stats()
    assert stats is not None and stats.data["handoffs"] == {"unreachable": 2}


def test_a_job_that_waits_too_long_is_given_up_and_released(worker):
    port = free_port()
    a, b = job("a", port), job("b", port)
    worker.pool.acquire()  # staging is busy with something that never returns
    worker.expect([a, b])
    worker.step([a, b])
    assert worker.finished({"a", "b"}) is None
    time.sleep(0.6)
    worker.step([])
    assert worker.finished(set()) == {"a", "b"}
    # Both are still announced to their node (here unreachable), so its slot would free at once.
    _until(lambda: worker.stats.data["handoffs"].get("unreachable", 0) == 2)


def test_unknown_ids_are_never_reported(worker):
    assert worker.finished({"not-ours"}) is None


def test_staging_is_zeroed_once_its_state_is_sent(worker):
    """Registered staging is readable on the data plane: what a request left there is zeroed as soon
    as its handoff ends, before the region serves another request."""
    from tilert_serve.handoff.sender import HandoffResult

    seen: list[torch.Tensor] = []

    def send(host, port, req, error=None, layers=None):
        seen.append(worker.pool.buffer.clone())
        return HandoffResult(False, "unreachable", "test")

    stand_in(worker, send)
    a = job("a", free_port())
    worker.expect([a])
    worker.step([a])
    _until(lambda: worker.pool.free == 1)
    assert seen and seen[0].any()  # the gathered state was there while it was sent
    assert not worker.pool.buffer.any()


class HungNode:
    """Stands in for Sender.send: request `hung`'s node never answers (until released); the others
    are recorded as sent, with the error of a give-up notice."""

    def __init__(self, hung: str) -> None:
        self.hung, self.release, self.sent = hung, threading.Event(), []

    def __call__(self, host, port, req, error=None, layers=None):
        from tilert_serve.handoff.sender import HandoffResult

        if req.request_id == self.hung:
            self.release.wait(30)
        self.sent.append((req.request_id, error))
        return HandoffResult(True, nbytes=1)


def test_a_hung_node_holds_up_no_other_request(tmp_path):
    """Each staged job has a sender thread of its own: while one node never answers, the next
    request's state goes out and its blocks are freed."""
    w = _worker(tmp_path, 5.0, staging=2)
    node = stand_in(w, HungNode("a"))
    try:
        a, b = job("a", free_port()), job("b", free_port())
        w.expect([a, b])
        w.step([a])
        w.step([b])
        _until(lambda: node.sent == [("b", None)])
        assert w.finished({"a", "b"}) == {"a", "b"}  # both were copied out; a's handoff still hangs
        # b's sender gives its region back after its send returns (after node.sent): wait for that.
        _until(lambda: w.pool.free == 1)  # a holds its region, b gave its back
        assert node.sent == [("b", None)]
    finally:
        node.release.set()
        w.shutdown()
    assert node.sent == [("b", None), ("a", None)]


def test_a_give_up_notice_goes_out_while_every_region_is_sending(tmp_path):
    """The thread beyond the regions carries the notice of a job that waited too long for staging,
    so its node frees the slot at once although the only region is stuck in a hung handoff."""
    w = _worker(tmp_path, 0.5)
    node = stand_in(w, HungNode("a"))
    try:
        a, b = job("a", free_port()), job("b", free_port())
        w.expect([a, b])
        w.step([a, b])  # a takes the region and hangs; b waits with its blocks held
        time.sleep(0.6)
        w.step([])  # b has waited past tilert_timeout_s: given up
        _until(lambda: len(node.sent) == 1)
        assert node.sent[0][0] == "b" and "staging stayed full" in node.sent[0][1]
        assert w.finished({"a", "b"}) == {"a", "b"}
    finally:
        node.release.set()
        w.shutdown()


# -- layer-wise (tilert_layerwise) ------------------------------------------------------------------


class FeedRecorder:
    """Stands in for Sender.send: takes the layers as the worker stages them, copying staging each time."""

    def __init__(self, worker: TileRTWorker) -> None:
        self.worker = worker
        self.batches: list[list[int]] = []
        #: (start, upto) of each batch: the tokens it holds.
        self.ranges: list[tuple[int, int | None]] = []
        self.snapshots: list[torch.Tensor] = []
        self.errors: list[str] = []
        self.whole: list[str] = []

    def __call__(self, host, port, req, error=None, layers=None):
        from tilert_serve.handoff.sender import HandoffResult, LayerSourceFailed

        if layers is None:
            self.whole.append(req.request_id)
            return HandoffResult(True, nbytes=1)
        try:
            while (staged := layers.next_layers(10.0)) is not None:
                self.batches.append(staged.layers)
                self.ranges.append((staged.start, staged.upto))
                self.snapshots.append(self.worker.pool.buffer.clone())
        except LayerSourceFailed as exc:
            self.errors.append(str(exc))
            return HandoffResult(False, "prefill_failed", str(exc))
        return HandoffResult(True, nbytes=1, layers_sent=len(self.batches))


@pytest.fixture
def layerwise_worker(tmp_path):
    w = _worker(tmp_path, 5.0)
    w.recorder = stand_in(w, FeedRecorder(w))
    yield w
    w.shutdown()


def _whole_gather(worker: TileRTWorker, j: SendJob) -> torch.Tensor:
    from tilert_serve.pd_vllm.extract import gather

    out = torch.zeros_like(worker.pool.buffer)
    gather(worker.caches, j.block_ids, j.num_tokens, worker.pool.placement, [out])
    return out


def test_layers_are_staged_as_the_forward_reports_them_and_mtp_at_wait_for_save(layerwise_worker):
    w, rec = layerwise_worker, layerwise_worker.recorder
    a = job("a", free_port())
    w.begin([a])  # bind_connector_metadata, before the forward
    assert w.pool.free == 0  # the region is taken, the sender already connecting
    w.layer_saved("model.layers.0.self_attn.attn")
    w.layer_saved("model.layers.0.self_attn.attn")  # reported again (another hook): staged once
    w.layer_saved("model.layers.2.self_attn.attn")  # the MTP layer: not before the drafter
    w.layer_saved("model.layers.1.self_attn.attn")
    _until(lambda: len(rec.batches) == 2)
    assert rec.batches == [[0], [1]]
    assert w.finished({"a"}) is None  # not every layer is staged: the blocks stay
    w.expect([a])
    w.step([a])  # wait_for_save, after the drafter
    _until(lambda: w.pool.free == 1)
    assert rec.batches == [[0], [1], [2]] and rec.whole == []
    assert torch.equal(rec.snapshots[-1], _whole_gather(w, a))  # the same bytes as the whole gather
    assert w.finished(set()) == {"a"}
    assert not w.pool.buffer.any()  # scrubbed after the send


def test_a_failed_layer_gather_gives_the_job_up_and_frees_its_blocks(layerwise_worker, monkeypatch):
    w, rec = layerwise_worker, layerwise_worker.recorder
    a = job("a", free_port())
    w.begin([a])
    w.layer_saved("model.layers.0.self_attn.attn")

    def broken(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(w, "gather", broken)
    w.layer_saved("model.layers.1.self_attn.attn")
    w.step([a])
    _until(lambda: w.pool.free == 1)
    assert rec.batches == [[0]] and rec.errors == ["gather failed: boom"]
    assert w.finished({"a"}) == {"a"}


def test_a_job_without_free_staging_waits_for_the_whole_state_path(layerwise_worker):
    w, rec = layerwise_worker, layerwise_worker.recorder
    a, b = job("a", free_port()), job("b", free_port())
    w.begin([a, b])  # one region: a goes layer-wise, b waits
    for i in range(2):
        w.layer_saved(f"model.layers.{i}.self_attn.attn")
    w.step([a, b])
    _until(lambda: w.pool.free == 1)
    w.step([])  # b gets the region, gathered whole
    _until(lambda: rec.whole == ["b"])
    assert rec.batches == [[0], [1], [2]]
    assert w.finished({"a", "b"}) == {"a", "b"}


def test_layerwise_off_gathers_everything_at_wait_for_save(tmp_path):
    secret = tmp_path / "secret"
    secret.write_text("0123456789abcdef0123456789abcdef")
    cfg = ConnectorConfig.from_extra_config(
        {
            "tilert_model": "mla",
            "tilert_max_seq_len": 64,
            "tilert_local_host": "127.0.0.1",
            "tilert_secret_path": str(secret),
            "tilert_layerwise": False,
        }
    )
    w = TileRTWorker(cfg, rank=0, world_size=1, group_of={}, block_size_of={0: 16}, num_hidden_layers=2)
    w.register({f"model.layers.{i}.self_attn.attn": torch.randn(8, 1, 16, 576) for i in range(3)})
    rec = stand_in(w, FeedRecorder(w))
    try:
        a = job("a", free_port())
        w.begin([a])
        w.layer_saved("model.layers.0.self_attn.attn")
        w.step([a])
        _until(lambda: rec.whole == ["a"])
        assert rec.batches == []
    finally:
        w.shutdown()


# -- chunk-wise (a chunked prefill, layer-wise) -----------------------------------------------------


def chunk(j: SendJob, upto: int, blocks: list[int], first: bool) -> SendJob:
    """`j`'s job in a step of its chunked prefill before the last: `upto` tokens computed by its end."""
    return dataclasses.replace(
        j, upto=upto, block_ids=(blocks,), prompt_token_ids=j.prompt_token_ids if first else []
    )


def forward(w: TileRTWorker, jobs: list[SendJob]) -> None:
    """One vLLM step: the metadata bound, the forward's two main layers, wait_for_save."""
    w.begin(jobs)
    for i in range(2):
        w.layer_saved(f"model.layers.{i}.self_attn.attn")
    w.step(jobs)


@pytest.fixture
def chunk_worker(tmp_path):
    w = _worker(tmp_path, 5.0, staging=2)
    w.recorder = stand_in(w, FeedRecorder(w))
    yield w
    w.shutdown()


def test_a_chunked_prompt_is_sent_chunk_by_chunk_and_completed_in_its_last_step(chunk_worker):
    w, rec = chunk_worker, chunk_worker.recorder
    a = job("a", free_port())  # 20 tokens in blocks 1 and 2 (16 tokens a block)
    forward(w, [chunk(a, 7, [1], first=True)])
    _until(lambda: len(rec.batches) == 3)
    assert rec.batches == [[0], [1], [2]] and rec.ranges == [(0, 7)] * 3  # the MTP layer's at wait_for_save
    assert w.pool.free == 1  # the region stays with the request between its steps
    assert w.finished(set()) is None  # no block is held for a chunk
    whole, staged = _whole_gather(w, a), rec.snapshots[-1]
    row = w.layout.plane("mla").unit_bytes
    for lid in range(3):
        _, off = w.pool.placement.offset("mla", lid)
        assert torch.equal(staged[off : off + 7 * row], whole[off : off + 7 * row])
        assert not staged[off + 7 * row : off + 20 * row].any()  # not computed yet, so not staged
    forward(w, [chunk(a, 7, [3], first=False)])  # preempted and resumed: recomputes what is staged already
    forward(w, [a])  # the last step: the rest of every layer, which the node now hears of
    _until(lambda: w.pool.free == 2)
    assert rec.batches == [[0], [1], [2]] * 2 and rec.ranges == [(0, 7)] * 3 + [(7, None)] * 3
    assert torch.equal(rec.snapshots[-1], whole)
    assert w.finished({"a"}) == {"a"}
    assert not w.pool.buffer.any()  # scrubbed after the send


def test_a_chunk_leaves_a_region_for_prompts_that_complete(chunk_worker):
    w, rec = chunk_worker, chunk_worker.recorder
    w.pool.acquire()  # another request's handoff holds one of the two regions
    a = job("a", free_port())
    forward(w, [chunk(a, 7, [1], first=True)])
    assert w.pool.free == 1  # not taken by a prompt still being computed
    forward(w, [a])  # its last step takes it: every token of every layer
    _until(lambda: len(rec.batches) == 3)
    assert rec.ranges == [(0, None)] * 3
    assert w.finished({"a"}) == {"a"}


def test_a_request_aborted_mid_prompt_gives_its_handoff_up(chunk_worker):
    w, rec = chunk_worker, chunk_worker.recorder
    forward(w, [chunk(job("a", free_port()), 7, [1], first=True)])
    _until(lambda: len(rec.batches) == 3)
    assert w.finished({"a"}) is None  # none of its blocks was held
    _until(lambda: rec.errors == ["the request ended before its prefill did"])
    _until(lambda: w.pool.free == 2)


def test_a_handoff_that_ends_between_steps_frees_its_region_and_its_last_step_sends_nothing(tmp_path):
    from tilert_serve.handoff.sender import HandoffResult

    w = _worker(tmp_path, 5.0, staging=2)
    calls = []

    def node_gone(host, port, req, error=None, layers=None):
        calls.append(req.request_id)
        for _ in range(3):
            layers.next_layers(10.0)
        return HandoffResult(False, "unreachable", "connection to decode node lost")

    stand_in(w, node_gone)
    try:
        a = job("a", free_port())
        forward(w, [chunk(a, 7, [1], first=True)])
        _until(lambda: w.pool.free == 2)  # given back between the request's steps
        forward(w, [chunk(a, 14, [1], first=False)])
        assert w.pool.free == 2  # nothing staged into a region that is no longer its own
        forward(w, [a])
        assert w.finished({"a"}) == {"a"}  # its blocks free at once: nothing is left to send
        assert calls == ["a"]  # and no second handshake on a used ticket
        stats = w.take_stats()
        assert stats is not None and stats.data["handoffs"] == {"unreachable": 1}
    finally:
        w.shutdown()


def test_a_step_whose_hooks_run_twice_starts_and_sends_each_job_once(chunk_worker):
    """Each job's record says how far it got, so metadata bound (or saved) again in one step neither
    takes a second staging region nor queues a second handoff under the same ticket."""
    w, rec = chunk_worker, chunk_worker.recorder
    a, b = (
        job("a", free_port()),
        dataclasses.replace(job("b", free_port()), dest=Destination("127.0.0.1", 1, None, False)),
    )
    w.begin([a, b])
    w.begin([a, b])
    assert w.pool.free == 1  # a took one region, once; b (whole state) waits for wait_for_save
    for i in range(2):
        w.layer_saved(f"model.layers.{i}.self_attn.attn")
    w.step([a, b])
    w.step([a, b])
    _until(lambda: w.pool.free == 2)
    assert rec.batches == [[0], [1], [2]] and rec.whole == ["b"]
    assert w.finished({"a", "b"}) == {"a", "b"}


def test_a_chunk_step_whose_metadata_is_bound_twice_stages_it_once(chunk_worker):
    w, rec = chunk_worker, chunk_worker.recorder
    a = job("a", free_port())
    forward(w, [chunk(a, 7, [1], first=True)])
    second = chunk(a, 14, [1], first=False)
    w.begin([second])
    forward(w, [second])
    forward(w, [a])
    _until(lambda: w.pool.free == 2)
    assert rec.ranges == [(0, 7)] * 3 + [(7, 14)] * 3 + [(14, None)] * 3
    assert w.finished({"a"}) == {"a"}
