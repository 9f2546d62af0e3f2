"""TileRTConnector, worker side (runs in each vLLM worker process, one per TP rank).

In `wait_for_save` (after the target model and the MTP drafter have written the step's KV) each
claimed request that finished its prompt this step is gathered from the paged caches into a staging
region's private twin, copied from there into the pre-registered region (StagingPool: the digest is
taken over the copy no peer can write), and handed to a background sender thread that does the
handshake, the one-sided writes and done. The forward pass never waits on the network.

Block contract: delay the free until the copy is done. request_finished returns delay_free=True for
every request with a send job; the worker reports the id in get_finished once its rows are in
staging (or the job was given up), which frees the blocks. Blocks are held for the gather only,
never for the network. When every staging region is busy, the job waits (its blocks stay valid)
and is gathered in a later step's wait_for_save, which vLLM calls every step, empty ones included,
while has_pending_push_work keeps the engine stepping; after tilert_timeout_s it is given up and
the node told at once. With TP > 1 every rank gathers and reports its own layers, so the default
get_finished_count (all ranks) is right. On CUDA the gather is enqueued on the current stream
before the blocks can be reused, and the sender waits on an event before writing.

Jobs and threads. Each claimed request of a rank is one record in a JobTable (jobs.py, whose docstring
draws its states: ANNOUNCED, CHUNKING, ENDED, DUE, WAITING, STAGING, COPIED). vLLM's step thread is the
table's only caller, from begin (bind_connector_metadata), layer_saved (save_kv_layer), step
(wait_for_save) and finished (get_finished); no lock. What a job shares with a sender thread is its
handoff (`_Work`): the sender thread owns the rest of it, giving the staging region back
(StagingPool, locked) once the step thread has closed the job's LayerFeed (locked: claim/pause on the
step thread against abandon on the sender thread), and recording stats (locked) and the pending count.

Sender threads: one per staging region plus one, each with its own Sender (sharing the transfer
engine), taking jobs oldest first. A job holds its region until its handoff ends, so every staged
job has a thread of its own: a slow or dead node, or a layer-wise job waiting on the forward, never
holds up another request's handoff; the extra thread carries give-up notices (no region) while
every region is sending.

Layer-wise handoff (tilert_layerwise, config.py). vLLM binds the step's metadata before the forward
(bind_connector_metadata): a job whose prompt completes in this step takes its staging region there
and goes to the sender thread at once, which shakes hands with the node while the forward runs.
After each main attention layer vLLM calls save_kv_layer (model_executor/layers/attention/
kv_transfer_utils.py, for MLA layers too); that layer's planes (its MLA cache and its DSA indexer
cache, which the layer's indexer wrote before its attention) are gathered into staging, an event is
recorded on CUDA, and the sender writes the layer and tells the node (LayersDone). The MTP layer is
written by the drafter after the target forward, and vLLM calls wait_for_save after the drafter
when speculative decoding is on (gpu_model_runner: defer_kv_connector_finalize); so the MTP layers
(ids >= num_hidden_layers), and any layer save_kv_layer did not report (micro-batched steps, whose
layers are reported once per micro-batch, are not used layer-wise), are gathered in wait_for_save,
which then closes the job's feed and only then reports its blocks copied: the block contract holds.

Chunk-wise handoff (chunked prefill, layer-wise on). A request whose prompt spans several steps has a
job in each step before its last too (SendJob.upto: the tokens computed by the end of that step). The
first such step that finds a staging region (leaving one free, so a prompt completing in a step never
waits behind a long prompt still being computed) begins the handoff there, and every later step stages
and sends, layer by layer, the tokens from where the last step stopped (`Job.staged`; a page split
by the chunk boundary is gathered and sent again, whole); the node hears of a layer (LayersDone, with
the digest of all its tokens) only in the prompt's last step, and so converts only finished layers of
finished chunks. A job that finds no region before its last step gathers everything then, as above.
Between steps the region is untouched: blocks are never held for a chunk (its rows are in staging
when wait_for_save returns), and a handoff that ends early (the node gone, a timeout, the request
aborted or preempted too long) gives its region back at once (LayerFeed.abandon) and its last step
has nothing left to send.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import queue
import re
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch

from tilert_serve import dataplane, layouts, transfer
from tilert_serve.compat import Compat
from tilert_serve.handoff import auth, digest
from tilert_serve.handoff.sender import HandoffRequest, HandoffResult, LayerSourceFailed, Sender, Staged
from tilert_serve.layouts import Layout, Placement, write_ranges
from tilert_serve.pd_vllm.config import ConnectorConfig
from tilert_serve.pd_vllm.extract import Gatherer, PagedCache, check_cache
from tilert_serve.pd_vllm.jobs import Job, JobState, JobTable, StepWork
from tilert_serve.pd_vllm.logs import get_logger
from tilert_serve.pd_vllm.metadata import SendJob
from tilert_serve.pd_vllm.pending import PendingSends
from tilert_serve.pd_vllm.stats import TileRTStats

log = get_logger(__name__)
_LAYER_ID = re.compile(r"layers\.(\d+)\.")
_DTYPE_NAMES = {
    torch.float32: "float32",
    torch.bfloat16: "bfloat16",
    torch.float16: "float16",
    torch.uint8: "fp8_ds_mla",
}


def classify(
    kv_caches: dict[str, torch.Tensor],
    tilert_model: str,
    group_of: dict[str, int],
    block_size_of: dict[int, int],
    num_hidden_layers: int,
) -> tuple[Layout, list[PagedCache]]:
    """The layout the registered caches imply, and each cache's (layer, plane)."""
    caches: list[PagedCache] = []
    for name, tensor in kv_caches.items():
        m = _LAYER_ID.search(name)
        if m is None:
            raise ValueError(f"KV cache {name!r} has no layer number; TileRTConnector cannot place it")
        plane = "indexer" if ("indexer" in name or "index_k" in name) else "mla"
        group = group_of.get(name, 0)
        caches.append(PagedCache(name, int(m.group(1)), plane, tensor, block_size_of.get(group, 16), group))
    mla = sorted(c.layer for c in caches if c.plane == "mla")
    if mla != list(range(len(mla))):
        raise ValueError(f"MLA layers {mla} are not 0..{len(mla) - 1}; is this a DeepSeek-V3-style model?")
    dtype = _DTYPE_NAMES.get(next(c.tensor.dtype for c in caches if c.plane == "mla"))
    if dtype is None:
        raise ValueError(f"unsupported KV-cache dtype {caches[0].tensor.dtype}")
    mtp = len(mla) - num_hidden_layers
    if tilert_model == "mla":
        layout = layouts.get("mla", dtype, num_layers=len(mla), num_mtp_layers=max(mtp, 0))
    else:
        layout = layouts.get(tilert_model, dtype, num_layers=len(mla))
    for c in caches:
        check_cache(c, layout)
    return layout, sorted(caches, key=lambda c: (c.layer, c.plane))


class StagingPool:
    """`slots` staging regions of one rank's share of the layout, allocated and registered once.

    Each region has a private twin, never registered: the gather writes there, the sender hashes
    there, and `publish` copies what was gathered into the registered region the one-sided write
    reads. Registered memory is writable by any peer of the transfer engine, so a digest of it would
    vouch for whatever a peer wrote between the gather and the hash; a write into the registered
    region now makes the node's check of the bytes it received fail instead. The cost is the staging
    memory twice over and one device-local copy of each state.
    """

    def __init__(self, staging: Placement, rank: int, slots: int, device: torch.device) -> None:
        self.placement, self.rank = staging, rank
        self.region_nbytes = staging.shard_nbytes(rank)
        self.buffer = torch.zeros(slots * self.region_nbytes, dtype=torch.uint8, device=device)
        self.private = torch.zeros_like(self.buffer)
        self._free = list(range(slots - 1, -1, -1))
        self._lock = threading.Lock()  # guards _free: the forward thread takes, the sender thread gives back

    def acquire(self, keep: int = 0) -> int | None:
        """A free region, if more than `keep` are free."""
        with self._lock:
            return self._free.pop() if len(self._free) > keep else None

    def release(self, index: int) -> None:
        with self._lock:
            self._free.append(index)

    @property
    def free(self) -> int:
        with self._lock:
            return len(self._free)

    def region(self, index: int) -> list[torch.Tensor | None]:
        """The registered region, per staging shard; only this rank's shard exists here."""
        return self._shards(self.buffer, index)

    def gather_region(self, index: int) -> list[torch.Tensor | None]:
        """The region's private twin, per staging shard: where the gather writes and the digest reads."""
        return self._shards(self.private, index)

    def publish(self, index: int, layers: list[int], num_tokens: int, start: int = 0) -> None:
        """Copy tokens `start` to `num_tokens` of `layers` from the private twin into the registered
        region (queued on the current stream on a GPU, like the gather before it)."""
        src, dst = self.gather_region(index)[self.rank], self.region(index)[self.rank]
        assert src is not None and dst is not None
        for r in write_ranges(self.placement, self.placement, layers, num_tokens, start):
            dst[r.src : r.src + r.nbytes].copy_(src[r.src : r.src + r.nbytes])

    def addrs(self, index: int) -> list[int]:
        out = [0] * self.placement.shards
        out[self.rank] = self.buffer.data_ptr() + index * self.region_nbytes
        return out

    def _shards(self, buffer: torch.Tensor, index: int) -> list[torch.Tensor | None]:
        out: list[torch.Tensor | None] = [None] * self.placement.shards
        out[self.rank] = buffer[index * self.region_nbytes : (index + 1) * self.region_nbytes]
        return out


class LayerFeed:
    """The layers of one request staged so far: the step thread puts, the sender thread takes (a
    handoff.sender.LayerSource). `closed` is set once the step thread will touch the staging region
    no more (every layer staged, given up, or the handoff ended between steps of a chunked prefill):
    only then may the region be scrubbed and reused."""

    def __init__(self) -> None:
        self._items: queue.Queue[tuple[Staged, torch.Event | None] | str | None] = queue.Queue()
        self.closed = threading.Event()
        self._lock = threading.Lock()  # orders claim/pause (step thread) against abandon (sender thread)
        self._in_step = True  # a feed is made by the step that first stages into it
        self._ended = False

    def claim(self) -> bool:
        """Step thread, a chunked prefill's later step: may this step stage into the region? False
        once the handoff has ended (the region is then no longer this job's)."""
        with self._lock:
            self._in_step = not self._ended
            return self._in_step

    def pause(self) -> None:
        """Step thread: done with the region until the request's next step."""
        with self._lock:
            self._in_step = False
            if self._ended:
                self.closed.set()

    def abandon(self) -> None:
        """Sender thread: the handoff has ended; the region is free once no step stages into it."""
        with self._lock:
            self._ended = True
            if not self._in_step:
                self.closed.set()

    def put(self, staged: Staged, event: torch.Event | None) -> None:
        self._items.put((staged, event))

    def finish(self) -> None:
        self._items.put(None)
        self.closed.set()

    def fail(self, error: str) -> None:
        self._items.put(error)
        self.closed.set()

    def next_layers(self, timeout: float) -> Staged | None:
        try:
            item = self._items.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"the prefill staged no further layer in {timeout:.1f} s") from None
        if item is None:
            return None
        if isinstance(item, str):
            raise LayerSourceFailed(item)
        staged, event = item
        if event is not None:
            event.synchronize()
        return staged


@dataclass
class _Work:
    """A handoff given to the sender threads (queued once, read there; the step thread adds to
    `extract_s` and feeds `feed` while the job stages)."""

    job: SendJob
    staging_index: int | None
    event: torch.Event | None
    extract_s: float
    error: str | None = None
    #: Layer-wise: the layers as they are staged (None: everything was staged before the work was queued).
    feed: LayerFeed | None = None


_STOP = object()


@functools.cache
def _layer_id(cache_name: str) -> int | None:
    """The layer number in a KV cache's name (None: none), looked up once per name."""
    m = _LAYER_ID.search(cache_name)
    return int(m.group(1)) if m else None


class TileRTWorker:
    def __init__(
        self,
        config: ConnectorConfig,
        *,
        rank: int,
        world_size: int,
        group_of: dict[str, int],
        block_size_of: dict[int, int],
        num_hidden_layers: int,
        compat: Compat | None = None,
    ) -> None:
        self.config = config
        #: The generation the scheduler advertises (generation.py); None: the unnamed one of the caches'
        #: layout (tests without vLLM).
        self.compat = compat
        self.rank, self.world_size = rank, world_size
        self.group_of, self.block_size_of = group_of, block_size_of
        self.num_hidden_layers = num_hidden_layers
        #: The signing secret, re-read before each handoff when its file changed (rotation).
        self.keyring = auth.FileKeyring(config.secret_path)
        self.layout: Layout | None = None
        self.caches: list[PagedCache] = []
        self.pool: StagingPool | None = None
        self.stats = TileRTStats()
        #: Handoffs queued or in flight, for `tilert-pd wait-idle` (pending.py): a prefill pod's preStop
        #: hook waits for them, so no state is left unsent when vLLM exits.
        self.pending = PendingSends(config.pending_dir)
        self._stats_lock = threading.Lock()  # guards stats: the sender thread records, the step thread takes
        #: Jobs waiting for the sender thread: _Work items, or _STOP.
        self._queue: queue.Queue[Any] = queue.Queue()
        #: Every send job of this rank, by request (jobs.py: its states and transitions). Only vLLM's
        #: step thread touches it: begin, layer_saved, step, finished.
        self.jobs: JobTable[_Work] = JobTable()
        self._threads: list[threading.Thread] = []
        self._senders: list[Sender] = []
        self._mover: transfer.TransferEngine | None = None

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        layout, caches = classify(
            kv_caches, self.config.tilert_model, self.group_of, self.block_size_of, self.num_hidden_layers
        )
        if self.compat is None:
            self.compat = Compat("", "", layout.fingerprint)
        elif self.compat.layout != layout.fingerprint:
            # The router pairs this prefill by the scheduler's generation; handoffs carrying another would
            # all be refused by the nodes it pairs it with. Say so now, not per request.
            raise ValueError(
                f"TileRTConnector: the registered KV caches have layout {layout.describe()}, not the one "
                "derived from vLLM's config (tilert_serve/pd_vllm/generation.py): check "
                "--kv-cache-dtype, --dtype and --speculative-config against tilert_model "
                f"{self.config.tilert_model!r}"
            )
        mine = set(layouts.senders_layers(layout, self.rank, self.world_size))
        self.layout, self.caches = layout, [c for c in caches if c.layer in mine]
        staging = Placement(layout, max_tokens=self.config.max_seq_len, shards=self.world_size)
        device = caches[0].tensor.device
        self.pool = StagingPool(staging, self.rank, self.config.staging_requests, device)
        self.gather = Gatherer(self.caches, staging, self.rank)
        self._mine = sorted(self.gather.layers)
        if self.config.handoff_digest:
            digest.warm_up(device)  # at load, not in the first handoff
        where = self._data_plane()
        assert where.address is not None
        self._mover = transfer.create(
            self.config.transfer,
            host=where.address,
            protocol=self.config.protocol,
            role=f"prefill-{self.rank}",
            interface=where.interface,
        )
        self._mover.register(
            self.pool.buffer.data_ptr(),
            self.pool.buffer.numel(),
            "cpu" if device.type == "cpu" else f"cuda:{device.index or 0}",
        )
        for i in range(self.config.staging_requests + 1):
            sender = Sender(
                name=f"prefill-rank{self.rank}",
                secret=self.keyring,
                engine=self._mover,
                staging=staging,
                staging_addrs=[0] * self.world_size,
                timeout_s=self.config.timeout_s,
                send_digest=self.config.handoff_digest,
                compat=self.compat.fingerprint,
            )
            thread = threading.Thread(
                target=self._run, args=(sender,), name=f"tilert-sender-{i}", daemon=True
            )
            thread.start()
            self._senders.append(sender)
            self._threads.append(thread)
        log.info(
            "TileRTConnector rank %d/%d: layout %s, %d layers here, staging %d x %.1f MB (%s), %s/%s",
            self.rank,
            self.world_size,
            layout.describe(),
            len(mine),
            self.config.staging_requests,
            self.pool.region_nbytes / 1e6,
            device,
            self.config.transfer,
            self.config.protocol,
        )

    def _data_plane(self) -> dataplane.DataPlane:
        """Where this worker's transfer engine runs: its Multus address when the handoff has networks of
        its own (as the decode node finds its own; vLLM then fails to start with the reason if Multus
        never reports it), else the configured local host."""
        return dataplane.find(
            self.config.data_plane_networks,
            self.config.network_status_file,
            os.environ.get("POD_NAMESPACE", ""),
            self.config.local_host,
            timeout_s=120.0,
        )

    def begin(self, jobs: list[SendJob]) -> None:
        """Called when vLLM binds the step's metadata, before the forward. With tilert_layerwise, a
        chunk-wise handoff begun in an earlier step goes on with this step's tokens, and any other
        job that finds a staging region (and no older job waiting for one) goes to the sender thread
        now, which connects while the forward runs. A failed gather or send never raises here
        (only a bug does: jobs.IllegalTransition)."""
        self.expect(jobs)
        if self.pool is None or not jobs:
            return
        blocked = self.jobs.any_waiting()  # older jobs take staging first: they wait in step()
        for send in jobs:
            last = send.upto is None
            job = self.jobs.arrive(send.req_id, last=last, prompt=send.prompt_token_ids)
            if job.step is not None:
                continue  # the metadata was bound again in this step: the job is under way already
            if job.state is JobState.CHUNKING:
                self._go_on(job, send)
            elif job.state is JobState.ENDED:
                if last:  # its handoff ended in an earlier step: nothing left to send
                    self.jobs.handoff_over(job, last=True)
            elif (
                job.state in (JobState.ANNOUNCED, JobState.DUE)  # not begun yet
                and send.dest.wants_layerwise(self.config.layerwise)
                and not blocked
            ):
                blocked = not self._start(job, send) and last

    def _start(self, job: Job[_Work], send: SendJob) -> bool:
        """Begin `job`'s layer-wise handoff in this step, if staging has a region for it (a chunk, one
        that leaves another free)."""
        assert self.pool is not None
        prompt = send.prompt_token_ids or job.prompt
        if not prompt:
            return False
        index = self.pool.acquire(keep=0 if send.upto is None else 1)
        if index is None:
            return False
        work = _Work(dataclasses.replace(send, prompt_token_ids=prompt), index, None, 0.0, feed=LayerFeed())
        self.jobs.start(job, work, StepWork(set(self._mine), send.upto, send.block_ids))
        self._queue_work(work)
        return True

    def _go_on(self, job: Job[_Work], send: SendJob) -> None:
        """This step's chunk (or the prompt's rest) of a chunk-wise handoff begun earlier."""
        assert job.handoff is not None and job.handoff.feed is not None
        if send.upto is not None and send.upto <= job.staged:
            return  # recomputing tokens already staged (the request was preempted and resumed)
        if job.handoff.feed.claim():
            self.jobs.go_on(job, StepWork(set(self._mine), send.upto, send.block_ids))
        else:  # the handoff ended between steps (and said why): the region is no longer this job's
            self.jobs.handoff_over(job, last=send.upto is None)

    @property
    def staging_layers(self) -> bool:
        """This step has layer-wise jobs whose layers save_kv_layer stages."""
        return bool(self.jobs.stepping)

    def layer_saved(self, layer_name: str) -> None:
        """save_kv_layer: the forward finished main layer `layer_name`; stage it for this step's
        layer-wise jobs. The MTP layers wait for wait_for_save (the drafter writes them). A failed gather
        never raises here."""
        if not self.jobs.stepping:
            return
        layer = _layer_id(layer_name)
        if layer is None or layer >= self.num_hidden_layers:
            return
        for job in self.jobs.stepping:
            assert job.step is not None
            if layer in job.step.pending and not job.step.failed:
                self._stage(job, [layer])

    def _stage(self, job: Job[_Work], layers: list[int]) -> None:
        """Gather `layers` of this step's tokens into the job's staging region and hand them to its
        feed; a failure marks the step failed and tells the sender. The only writer of a step's progress
        (`pending`, `failed`)."""
        work, step = job.handoff, job.step
        assert self.pool is not None and work is not None and step is not None
        assert work.staging_index is not None and work.feed is not None
        end = work.job.num_tokens if step.upto is None else step.upto
        t0 = time.perf_counter()
        try:
            region = self.pool.gather_region(work.staging_index)
            for layer in layers:
                self.gather(step.block_ids, end, region, layer=layer, start=job.staged)  # type: ignore[arg-type]
            self.pool.publish(
                work.staging_index, [lid for lid in layers if lid in self.gather.layers], end, job.staged
            )
            event = None
            if self.pool.buffer.is_cuda:
                event = torch.Event(device=self.pool.buffer.device)
                event.record()
        except Exception as exc:  # a bug here must not take the forward pass down
            log.exception("gathering layers %s of request %s into staging failed", layers, job.req_id)
            step.failed = True
            work.feed.fail(f"gather failed: {exc}")
            return
        finally:
            work.extract_s += time.perf_counter() - t0
        step.pending.difference_update(layers)
        work.feed.put(Staged(layers, job.staged, step.upto), event)

    def _finish_staging(self) -> None:
        """wait_for_save: stage what save_kv_layer did not (the MTP layers, after the drafter); a job
        in its prompt's last step then closes its feed and counts its blocks as copied, a chunk leaves
        the region until the request's next step."""
        for job in self.jobs.end_step():
            work, step = job.handoff, job.step
            assert work is not None and work.feed is not None and step is not None
            if not step.failed and step.pending:
                self._stage(job, sorted(step.pending))
            if step.upto is None:
                if not step.failed:
                    work.feed.finish()
                self.jobs.copied(job)
            elif step.failed:  # the feed told the sender, which gives the region back
                self.jobs.handoff_over(job, last=False)
            else:
                self.jobs.pause(job)
                work.feed.pause()

    def step(self, jobs: list[SendJob]) -> None:
        """Called from every wait_for_save: finish this step's layer-wise jobs, then gather what staging
        has room for, oldest first. A failed gather never raises here."""
        self._finish_staging()
        now = time.monotonic()
        for send in jobs:
            job = self.jobs.get(send.req_id)
            if send.upto is None and (job is None or job.state in (JobState.DUE, JobState.ANNOUNCED)):
                self.jobs.wait(send, now)  # not begun layer-wise in begin()
        assert self.pool is not None
        for job in self.jobs.waiting():
            assert job.send is not None
            send = job.send
            index = self.pool.acquire()
            if index is None:
                # Staging is busy: the oldest waits (blocks held), unless it has waited too long.
                if now - job.since > self.config.timeout_s:
                    self._give_up(
                        job,
                        f"prefill staging stayed full for {self.config.timeout_s:.0f} s "
                        f"({self.config.staging_requests} regions); raise tilert_staging_requests",
                    )
                    continue
                return
            t0 = time.perf_counter()
            try:
                self.gather(send.block_ids, send.num_tokens, self.pool.gather_region(index))  # type: ignore[arg-type]
                self.pool.publish(index, self._mine, send.num_tokens)
                event = None
                if self.pool.buffer.is_cuda:
                    event = torch.Event(device=self.pool.buffer.device)
                    event.record()
            except Exception as exc:  # a bug here must not take the forward pass down
                log.exception("gathering request %s into staging failed", send.req_id)
                self.pool.release(index)
                self._give_up(job, f"gather failed: {exc}")
                continue
            self.jobs.copied(job)
            self._queue_work(_Work(send, index, event, time.perf_counter() - t0))

    def _give_up(self, job: Job[_Work], error: str) -> None:
        """The blocks are no longer needed; the node hears at once that the state will not come."""
        assert job.send is not None
        send = job.send
        self.jobs.copied(job)
        self._queue_work(_Work(send, None, None, 0.0, error))

    def _queue_work(self, work: _Work) -> None:
        """Give a handoff to the sender threads, counted as pending until it ends (pending.py)."""
        self.pending.add(1)
        self._queue.put(work)

    def finished(self, finished_req_ids: set[str]) -> set[str] | None:
        """Ids whose blocks vLLM may free: copied out (or given up) and reported finished by vLLM."""
        ready, aborted = self.jobs.finish(finished_req_ids)
        for work in aborted:  # ended before its prompt was computed
            assert work.feed is not None
            work.feed.fail("the request ended before its prefill did")
        return ready or None

    def expect(self, jobs: list[SendJob]) -> None:
        """Jobs whose blocks the worker will report (a chunk's are never held)."""
        for send in jobs:
            if send.upto is None:
                self.jobs.arrive(send.req_id, last=True)

    def _run(self, sender: Sender) -> None:
        while True:
            work = self._queue.get()
            if work is _STOP:
                return
            try:
                result = self._send(sender, work)
            except Exception as exc:  # keep the thread alive for the next request
                log.exception("handoff of %s crashed", work.job.req_id)
                result = HandoffResult(False, "internal", str(exc))
            finally:
                if work.feed is not None:
                    work.feed.abandon()
                if work.feed is not None and not work.feed.closed.wait(self.config.timeout_s):
                    # The step thread may still gather into the region: never hand it to another request.
                    log.error(
                        "request %s: its layers were never all staged; staging region %s is retired",
                        work.job.req_id,
                        work.staging_index,
                    )
                elif work.staging_index is not None:
                    assert self.pool is not None
                    self._scrub(work)
                    self.pool.release(work.staging_index)
            with self._stats_lock:
                self.stats.record(
                    "ok" if result.ok else (result.reason or "failed"),
                    result.nbytes,
                    work.extract_s,
                    result.handshake_s + result.write_s + result.ack_s,
                    layers_sent=result.layers_sent,
                    layers_early=result.layers_early,
                    ack_s=result.ack_s,
                    write_s=result.busy_s,
                    chunk_bytes=result.chunk_bytes,
                )
            self.pending.add(-1)
            if not result.ok:
                log.warning(
                    "handoff of %s to %s:%d failed: %s: %s",
                    work.job.req_id,
                    work.job.dest.host,
                    work.job.dest.ctrl_port,
                    result.reason,
                    result.message,
                )

    def _send(self, sender: Sender, work: _Work) -> HandoffResult:
        job = work.job
        req = HandoffRequest(
            request_id=job.req_id,
            num_tokens=job.num_tokens,
            last_prompt_token=job.last_prompt_token,
            ticket=job.dest.ticket,
            prompt_token_ids=job.prompt_token_ids,
            rank=self.rank,
            num_senders=self.world_size,
        )
        if work.staging_index is None:
            return sender.send(job.dest.host, job.dest.ctrl_port, req, error=work.error or "not staged")
        if work.event is not None:
            work.event.synchronize()
        assert self.pool is not None
        sender.staging_addrs = self.pool.addrs(work.staging_index)
        sender.staging_buffers = self.pool.gather_region(work.staging_index)  # hashed there, not in staging
        return sender.send(job.dest.host, job.dest.ctrl_port, req, layers=work.feed)

    def _scrub(self, work: _Work) -> None:
        """Zero what the gather wrote into the staging region once it is sent (or given up): registered
        memory is readable on the data plane, and a later request must not find this one's state there.
        On a GPU the sender thread waits for the memset, so the next gather cannot be overtaken by it."""
        assert self.pool is not None and work.staging_index is not None
        region = self.pool.region(work.staging_index)[self.rank]
        assert region is not None
        for _shard, off, n in digest.sender_ranges(
            self.pool.placement, self.rank, self.world_size, work.job.num_tokens
        ):
            region[off : off + n].zero_()
        if region.is_cuda:
            torch.cuda.current_stream(region.device).synchronize()

    def take_stats(self) -> TileRTStats | None:
        with self._stats_lock:
            if self.stats.is_empty():
                return None
            stats, self.stats = self.stats, TileRTStats()
        return stats

    def shutdown(self) -> None:
        # vLLM shuts the connector down after its engine drained (--shutdown-timeout) or aborted: the
        # handoffs still queued or being written finish first (each bounded by tilert_timeout_s, all by
        # the pod's grace period), since a node whose sender vanishes fails the request.
        if self.pending.count:
            log.info(
                "TileRTConnector: finishing %d handoff(s) still to send before exiting", self.pending.count
            )
        for _ in self._threads:
            self._queue.put(_STOP)
        for thread in self._threads:
            thread.join(timeout=self.config.timeout_s)
        self._threads = []
        self.pending.close()
        if self._mover is not None and self.pool is not None:
            self._mover.unregister(self.pool.buffer.data_ptr())
            self._mover.close()
            self._mover = None
