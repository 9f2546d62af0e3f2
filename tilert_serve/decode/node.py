"""The decode node: receive buffers, gated slots, the control-plane server, and the decode of each
admitted request (convert -> inject -> decode with MTP -> stop rules -> text).

Threads: the event loop owns the slot table, the control plane and HTTP; engine work (inject,
decode steps) runs in a pool with one worker per slot and reports back through the loop.

Conversion runs ahead of /generate, on one converter thread per slot (FIFO, so a slot's tasks run in
the order they were queued): each layer a layer-wise sender reports done (LayersDone) is taken and
converted as it lands, and once every rank reported done (READY) the rest is taken (Done's digests)
and converted and the engine state assembled. Taking bytes means: copy them out of the receive
region (which any data-plane peer can still write) into the slot's snapshot, which no peer can
write, check the copy against the sender's digest, and convert only from the copy (`_take`).
/generate then waits only for what is still queued, injects and decodes. A state whose digest is
wrong or missing is refused there, before anything is injected. Converted tensors belong to one generation of a slot: the slot's
failure, release or quarantine drops them (a task of a dropped generation does nothing).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from collections.abc import AsyncGenerator, Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from tilert_serve import defaults
from tilert_serve.compat import Compat
from tilert_serve.decode import ctrl
from tilert_serve.decode.buffers import ReceiveBuffers
from tilert_serve.decode.detokenize import detokenizer
from tilert_serve.decode.engines.base import DecodeEngine, InvalidRequest, Sampling
from tilert_serve.decode.metrics import NodeMetrics
from tilert_serve.decode.record import Recorder
from tilert_serve.decode.slots import Slot, SlotState, SlotTable
from tilert_serve.decode.stopping import cut
from tilert_serve.handoff import auth, digest, messages
from tilert_serve.layouts import Layout, convert, senders_layers
from tilert_serve.layouts.state import InjectedState, LayerState
from tilert_serve.transfer import TransferEngine

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class NodeConfig:
    name: str
    max_seq_len: int
    slots: int = 1
    #: The HTTP API's listen address (the pod network: the router and the kubelet's probes).
    host: str = "0.0.0.0"
    #: The data-plane address (tilert_serve.dataplane): the control port listens there and only there,
    #: and senders (Hello) and the router (admit) are told it.
    advertise_host: str = "127.0.0.1"
    ctrl_port: int = defaults.DECODE_CTRL_PORT
    http_port: int = defaults.DECODE_HTTP_PORT
    shards: int = 1
    devices: tuple[str, ...] = ("cpu",)
    ticket_ttl_s: float = defaults.TICKET_TTL_S
    #: From a sender's Accept to its Done.
    handoff_timeout_s: float = 60.0
    #: Longest silence between two engine steps before the stream is failed.
    step_timeout_s: float = 120.0
    #: How long a released slot whose writer may still be writing stays out of use (decode/slots.py).
    quarantine_s: float = defaults.WRITE_QUARANTINE_S
    #: Check each sender rank's digest of what it wrote before converting (handoff/digest.py); off,
    #: a state without digests is taken as it is.
    verify_digest: bool = True
    #: The served model name and weights revision: with the layout, the node's compatibility
    #: generation (tilert_serve/compat.py), which a sender's Request must name.
    model_name: str = ""
    model_revision: str = ""


@dataclass(frozen=True)
class GenerateParams:
    first_token: int
    max_tokens: int
    sampling: Sampling = field(default_factory=Sampling)
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False


class HandoffFailed(Exception):
    """The state did not arrive: the sender failed, vanished, or the deadline passed."""

    def __init__(self, message: str, timeout: bool) -> None:
        super().__init__(message)
        self.timeout = timeout


class StateRefused(HandoffFailed):
    """The state arrived but is not what its senders wrote (digest mismatch, or no digest)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, timeout=False)


@dataclass
class _Prepared:
    """One slot generation's state as the converter thread builds it (see the module docstring)."""

    generation: int
    #: Converted layers (engine layers only), by layer id.
    layers: dict[int, LayerState] = field(default_factory=dict)
    #: Layers taken (copied into the snapshot and, digests on, checked there) by LayersDone, per sender rank.
    taken: dict[int, set[int]] = field(default_factory=dict)
    #: Why the state is refused (a layer's digest differs); raised at /generate, before injection.
    refused: str | None = None
    #: The assembled state (or StateRefused), queued when the slot became READY.
    final: Future[InjectedState] | None = None
    dropped: bool = False
    #: Layers reported in LayersDone frames, the size of the last such frame, and when it came (slot clock).
    layers_reported: int = 0
    last_frame_layers: int = 0
    t_last_layer: float | None = None
    #: (kind "digest"|"convert", perf_counter start, end) of every converter task's work.
    spans: list[tuple[str, float, float]] = field(default_factory=list)
    #: Bytes of converted tensors this generation holds (counted in the converted_bytes gauge).
    held_bytes: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)


def _state_bytes(layers: Iterable[LayerState]) -> int:
    return sum(
        t.numel() * t.element_size()
        for layer in layers
        for t in (layer.kv, layer.pe, layer.ki)
        if t is not None
    )


def _settle(views: list[torch.Tensor]) -> None:
    """Wait for the conversion's kernels on a GPU (they run after the call returns), so a converter
    span ends when the layers are converted, not when they were queued: convert_ms and
    hidden_convert_ms tell the device's time. The converter thread waits, not the decode."""
    for device in {v.device for v in views if v.is_cuda}:
        torch.cuda.current_stream(device).synchronize()


def _overlap(spans: list[tuple[str, float, float]], kind: str, lo: float, hi: float) -> float:
    return sum(max(0.0, min(end, hi) - max(start, lo)) for k, start, end in spans if k == kind)


@dataclass
class _Waiters:
    event: asyncio.Event = field(default_factory=asyncio.Event)
    cancel: threading.Event = field(default_factory=threading.Event)


class DecodeNode:
    def __init__(
        self,
        config: NodeConfig,
        *,
        layout: Layout,
        engine: DecodeEngine,
        transfer: TransferEngine,
        secret: bytes | auth.Keyring,
        tokenizer: Any = None,
        eos_token_ids: frozenset[int] = frozenset(),
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        # An engine decoding without MTP takes the main layers only; the MTP layer's state still arrives.
        if engine.num_layers not in (layout.num_layers, layout.num_main_layers):
            raise ValueError(
                f"engine {engine.name} takes {engine.num_layers} layers, layout {layout.model} has "
                f"{layout.num_layers}: the checkpoint and --tilert-model disagree"
            )
        if config.slots > engine.max_sequences:
            raise ValueError(
                f"--slots {config.slots} exceeds what engine {engine.name} holds at once "
                f"({engine.max_sequences}); use --slots {engine.max_sequences}"
            )
        if config.max_seq_len > engine.max_seq_len:
            raise ValueError(f"--max-seq-len {config.max_seq_len} exceeds the engine's {engine.max_seq_len}")
        self.config = config
        self.layout = layout
        #: This node's compatibility generation: advertised in /v1/status, /ready and Hello; a
        #: sender's Request must name the same fingerprint (decode/ctrl.py).
        self.compat = Compat(config.model_name, config.model_revision, layout.fingerprint)
        self.engine = engine
        self.transfer = transfer
        #: The accepted handoff secrets (a FileKeyring follows a rotated Secret without a restart).
        self.keyring = auth.keyring(secret)
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.metrics = NodeMetrics(config.slots)
        self.recorder = Recorder(transfer, self.metrics, clock)
        #: The data plane's record (/v1/status); written through `recorder` only.
        self.handoff = self.recorder.record
        self.buffers = ReceiveBuffers(
            layout,
            max_seq_len=config.max_seq_len,
            slots=config.slots,
            shards=config.shards,
            devices=list(config.devices),
        )
        self.slots = SlotTable(
            config.slots,
            ticket_ttl_s=config.ticket_ttl_s,
            handoff_timeout_s=config.handoff_timeout_s,
            quarantine_s=config.quarantine_s,
            clock=clock,
            scrub=self.buffers.scrub,
            on_change=self._slot_changed,
        )
        self.ctrl = ctrl.ControlServer(self)
        self.engine_dtype: torch.dtype = getattr(engine, "dtype", torch.float32)
        self._waiters = [_Waiters() for _ in range(config.slots)]
        self._pool = ThreadPoolExecutor(max_workers=config.slots, thread_name_prefix="decode")
        #: One converter thread per slot, and what it builds for the slot's current generation.
        self._converters = [
            ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"convert-{i}") for i in range(config.slots)
        ]
        self._prepared: list[_Prepared | None] = [None] * config.slots
        self._server: asyncio.Server | None = None
        self._reaper: asyncio.Task[None] | None = None
        self.ctrl_port = config.ctrl_port
        self.ready = False
        self.stopping = False
        #: Why every request was ended before it finished (the drain's time ran out), for the streams
        #: cut by it to say so; None while the node serves.
        self.ended: str | None = None
        #: Why start failed, if it did (reported by /health and /ready).
        self.failed: str | None = None

    # -- lifecycle -------------------------------------------------------------------------------

    async def start(self) -> None:
        """Load the engine, register the buffers, open the control port. /ready turns true after."""
        await asyncio.to_thread(self.engine.load)
        if self.config.verify_digest:
            for device in sorted(set(self.config.devices)):
                await asyncio.to_thread(digest.warm_up, device)
        self.buffers.register(self.transfer)
        self._server = await asyncio.start_server(
            self.ctrl.handle, self.config.advertise_host, self.config.ctrl_port, limit=ctrl.READ_LIMIT
        )
        self.ctrl_port = self._server.sockets[0].getsockname()[1]
        self._reaper = asyncio.create_task(self._reap(), name="slot-reaper")
        self.ready = True
        log.info(
            "decode node %s ready: %d slots, layout %s, ctrl %s:%d, %.1f MB receive buffers (and as much again of snapshots)",
            self.config.name,
            self.config.slots,
            self.layout.describe(),
            self.config.advertise_host,
            self.ctrl_port,
            self.buffers.nbytes / 1e6,
        )

    async def stop(self) -> None:
        self.stopping, self.ready = True, False
        for w in self._waiters:
            w.cancel.set()
        if self._reaper:
            self._reaper.cancel()
        if self._server:
            self._server.close()
            await self._server.wait_closed()
        self._pool.shutdown(wait=True, cancel_futures=True)
        for i, converter in enumerate(self._converters):
            self._drop(i)
            converter.shutdown(wait=True, cancel_futures=True)
        self.buffers.unregister()
        self.transfer.close()

    async def _reap(self) -> None:
        while True:
            await asyncio.sleep(0.1)
            for freed in self.slots.expire():
                self.metrics.expired.labels(freed.state.value).inc()
                log.info(
                    "slot %d: deadline passed in state %s (request %s)",
                    freed.index,
                    freed.state.value,
                    freed.request_id,
                )

    # -- slot events (the slot table calls this on every transition) ----------------------------

    def _slot_changed(self, slot: Slot, event: str) -> None:
        self.metrics.slots_busy.set(self.slots.busy)
        prepared = self._prepared[slot.index]
        if prepared is not None and (
            prepared.generation != slot.generation or event in ("failed", "released", "quarantined")
        ):
            self._drop(slot.index)
        if event == "complete":
            self._queue_final(slot)
            self.metrics.handoffs.labels("complete").inc()
            self.metrics.handoff_bytes.inc(slot.nbytes)
            self.metrics.handoff_seconds.observe(slot.t_ready - slot.t_accept)
        elif event == "failed":
            self.metrics.handoffs.labels("failed").inc()
            # A rank's failed write (its Done said so); the control plane's own failures were recorded
            # by the recorder (ctrl_error) with their reason already.
            if (slot.error or "").startswith("sender rank"):
                self.recorder.failure("transfer_failed", slot.error or "")
        elif event == "quarantined":
            self.metrics.quarantined.inc()
            log.info(
                "slot %d quarantined: sender ranks %s may still be writing",
                slot.index,
                sorted(slot.in_flight),
            )
        waiters = self._waiters[slot.index]
        waiters.event.set()
        waiters.event = asyncio.Event()

    # -- conversion ahead of /generate -----------------------------------------------------------

    def _drop(self, index: int) -> None:
        """Forget what was converted for the slot's generation; its queued tasks then do nothing."""
        prepared, self._prepared[index] = self._prepared[index], None
        if prepared is not None:
            with prepared.lock:
                prepared.dropped = True
            self._let_go(prepared)

    def _hold(self, prepared: _Prepared, nbytes: int) -> None:
        """Count `nbytes` more of converted state for this generation (caller holds prepared.lock)."""
        prepared.held_bytes += nbytes
        self.metrics.converted_bytes.inc(nbytes)

    def _let_go(self, prepared: _Prepared) -> None:
        """Drop the generation's converted tensors: once injected the engine holds its own copy, and a
        failed or released slot needs none. Without this they would live until the slot's next use."""
        with prepared.lock:
            prepared.layers.clear()
            prepared.final = None
            nbytes, prepared.held_bytes = prepared.held_bytes, 0
        self.metrics.converted_bytes.dec(nbytes)

    def _prepared_for(self, slot: Slot) -> _Prepared:
        prepared = self._prepared[slot.index]
        if prepared is None or prepared.generation != slot.generation:
            self._drop(slot.index)
            prepared = self._prepared[slot.index] = _Prepared(slot.generation)
        return prepared

    def layers_arrived(
        self, slot: Slot, generation: int, rank: int, layers: list[int], nbytes: int, layer_digest: str
    ) -> None:
        """A sender rank reported `layers` written (ctrl.py checked they are its own, once each): queue
        their digest check and conversion. Ignored unless the slot is still receiving this generation."""
        if slot.generation != generation or slot.state is not SlotState.RECEIVING:
            return
        prepared = self._prepared_for(slot)
        prepared.layers_reported += len(layers)
        prepared.last_frame_layers = len(layers)
        prepared.t_last_layer = self.slots.clock()
        self.metrics.layers_received.inc(len(layers))
        self._converters[slot.index].submit(
            self._convert_layers,
            prepared,
            slot.index,
            rank,
            slot.ranks_expected,
            slot.num_tokens,
            list(layers),
            layer_digest,
        )

    def _convert_layers(
        self,
        prepared: _Prepared,
        index: int,
        rank: int,
        num_senders: int,
        num_tokens: int,
        layers: list[int],
        layer_digest: str,
    ) -> None:
        """Converter thread: take these layers (snapshot and check), then convert them (engine layers
        only) from the snapshot."""
        if prepared.dropped or prepared.refused is not None:
            return
        snap = self.buffers.snapshot_views(index)
        t0 = time.perf_counter()
        problem = self._take(index, rank, num_senders, num_tokens, layers, layer_digest)
        if problem is not None:
            prepared.refused = f"sender rank {rank}, layers {layers}: {problem}"
            return
        t1 = time.perf_counter()
        converted = {
            lid: convert.to_layer_state(snap, self.buffers.placement, lid, num_tokens, self.engine_dtype)
            for lid in layers
            if lid < self.engine.num_layers
        }
        _settle(snap)
        t2 = time.perf_counter()
        with prepared.lock:
            if prepared.dropped:
                return
            prepared.layers.update(converted)
            self._hold(prepared, _state_bytes(converted.values()))
            prepared.taken.setdefault(rank, set()).update(layers)
            prepared.spans += [("digest", t0, t1), ("convert", t1, t2)]

    def _queue_final(self, slot: Slot) -> None:
        """The slot is READY: queue the check of what no LayersDone covered and the assembly."""
        prepared = self._prepared_for(slot)
        prepared.final = self._converters[slot.index].submit(
            self._assemble,
            prepared,
            slot.index,
            slot.ranks_expected,
            slot.num_tokens,
            slot.last_prompt_token,
            dict(slot.digests),
        )

    def _assemble(
        self,
        prepared: _Prepared,
        index: int,
        num_senders: int,
        num_tokens: int,
        last_prompt_token: int,
        digests: dict[int, str | None],
    ) -> InjectedState:
        """Converter thread: StateRefused unless every rank's bytes are covered by a digest that matches
        (per layer, or Done's over the rest); else the engine's state, converted from the snapshot."""
        if prepared.refused is not None:
            raise StateRefused(prepared.refused)
        snap = self.buffers.snapshot_views(index)
        placement = self.buffers.placement
        t0 = time.perf_counter()
        self._take_rest(prepared, index, num_senders, num_tokens, digests)
        t1 = time.perf_counter()
        if not prepared.layers:
            state = convert.to_injected_state(
                snap, placement, num_tokens, last_prompt_token, self.engine_dtype
            )
            layers = state.layers[: self.engine.num_layers]
        else:
            layers = [
                prepared.layers.get(lid)
                or convert.to_layer_state(snap, placement, lid, num_tokens, self.engine_dtype)
                for lid in range(self.engine.num_layers)
            ]
        _settle(snap)
        t2 = time.perf_counter()
        with prepared.lock:
            prepared.spans += [("digest", t0, t1), ("convert", t1, t2)]
            if not prepared.dropped:  # the layers converted ahead are counted already
                self._hold(prepared, _state_bytes(layers) - prepared.held_bytes)
        return InjectedState(layers=layers, seq_len=num_tokens, last_prompt_token=last_prompt_token)

    def _take(
        self,
        index: int,
        rank: int,
        num_senders: int,
        num_tokens: int,
        layers: list[int],
        expected: str | None,
    ) -> str | None:
        """Copy what sender `rank` wrote of `layers` out of the slot's receive region into its snapshot,
        then (digests on) check the copy against `expected`: why it differs, or None. Snapshot first,
        then check, then convert from the snapshot: the receive region stays writable by any data-plane
        peer, so the bytes checked must be the bytes used (decode/buffers.py)."""
        ranges = digest.receiver_ranges(self.buffers.placement, rank, num_senders, num_tokens, layers)
        self.buffers.snapshot(index, ranges)
        if not self.config.verify_digest:
            return None
        try:
            digest.check(expected or "", self.buffers.snapshot_views(index), ranges)
        except digest.DigestError as exc:
            return str(exc)
        return None

    def _take_rest(
        self,
        prepared: _Prepared,
        index: int,
        num_senders: int,
        num_tokens: int,
        digests: dict[int, str | None],
    ) -> None:
        """Take every rank's layers no LayersDone covered (Done's digest covers them); StateRefused
        when one is not covered or differs."""
        rest = {
            rank: sorted(
                set(senders_layers(self.layout, rank, num_senders)) - prepared.taken.get(rank, set())
            )
            for rank in range(num_senders)
        }
        missing = [rank for rank, layers in rest.items() if layers and digests.get(rank) is None]
        if missing and self.config.verify_digest:
            raise StateRefused(
                f"sender ranks {missing} sent no digest of their state and this node checks digests; "
                "turn tilert_handoff_digest on in the prefill's connector (or the node's "
                "--handoff-digest off)"
            )

        def take(rank: int) -> str | None:
            if not rest[rank]:
                return None
            problem = self._take(index, rank, num_senders, num_tokens, rest[rank], digests.get(rank))
            return None if problem is None else f"sender rank {rank}: {problem}"

        # One thread per rank: with TP senders each rank's bytes sit on its own GPU shard, whose copies
        # and hashing then run side by side (the hashing releases the GIL).
        if num_senders == 1:
            errors = [take(0)]
        else:
            with ThreadPoolExecutor(max_workers=min(num_senders, 8), thread_name_prefix="digest") as pool:
                errors = list(pool.map(take, range(num_senders)))
        problems = [e for e in errors if e]
        if problems:
            raise StateRefused("; ".join(problems))

    def hello(self, mac: str) -> messages.Hello:
        return messages.Hello(
            mac=mac,
            node=self.config.name,
            layout=messages.LayoutInfo(**self.layout.describe()),  # type: ignore[arg-type]
            max_seq_len=self.config.max_seq_len,
            slots_total=self.config.slots,
            slots_free=self.slots.free,
            transfer=self.transfer.name,
            peer=self.transfer.peer_info(),
            digests=digest.available(),
            layerwise=True,
            compat=self.compat.fingerprint,
        )

    def end_all(self, why: str) -> None:
        """End every request on the node now (the drain's time is up): a stream stops at its next step
        and ends with an error event saying `why`; a ticket not streaming yet fails with `why`."""
        self.ended = why
        for slot in self.slots.slots:
            if slot.state is SlotState.DECODING:
                self._waiters[slot.index].cancel.set()
            else:
                self.slots.fail(slot, why)

    def cancel(self, slot: Slot) -> None:
        """End a slot's request; a running decode stops at its next step and releases the slot itself,
        a generate call waiting for the state is told it was cancelled."""
        if slot.state is SlotState.DECODING:
            self._waiters[slot.index].cancel.set()
        else:
            self.slots.release(slot)

    # -- generate --------------------------------------------------------------------------------

    async def wait_for_state(self, slot: Slot) -> None:
        """Wait until the slot's state has landed; HandoffFailed if it will not."""
        generation, deadline, t_admit = slot.generation, slot.deadline, slot.t_admit

        def timed_out() -> HandoffFailed:
            message = (
                f"the prefill's state did not arrive within {self.slots.clock() - t_admit:.1f} s of admission"
            )
            # A more specific failure since the admission (a sender refused as not authenticated, a
            # layout mismatch) is why: keep it as the node's last failure.
            h = self.handoff
            if h.fail_at is None or h.fail_at < t_admit:
                self.recorder.failure("timeout", message, since=t_admit)
            return HandoffFailed(message, True)

        while slot.state in (SlotState.RESERVED, SlotState.RECEIVING) and slot.generation == generation:
            deadline = slot.deadline  # an Accept moves it to the handoff's own deadline
            remaining = deadline - self.slots.clock()
            try:
                await asyncio.wait_for(self._waiters[slot.index].event.wait(), max(remaining, 0.0) + 0.05)
            except TimeoutError:
                pass
            if self.slots.clock() >= slot.deadline and slot.state in (
                SlotState.RESERVED,
                SlotState.RECEIVING,
            ):
                self.slots.release(slot)
                raise timed_out()
        if slot.generation != generation or slot.state in (SlotState.FREE, SlotState.QUARANTINED):
            # The table's expiry may have freed the slot first (the same deadline, whichever looked
            # first): that is the same timeout, not a cancel.
            if self.slots.clock() >= deadline:
                raise timed_out()
            raise HandoffFailed("the ticket was cancelled or expired while waiting for the state", True)
        if slot.state is SlotState.FAILED:
            error = slot.error or "handoff failed"
            self.slots.release(slot)
            raise HandoffFailed(error, False)

    async def decode(self, slot: Slot, p: GenerateParams) -> AsyncGenerator[dict[str, Any], None]:
        """Stream a READY slot's decode as events; always frees the slot at the end."""
        # The sequence cannot grow past the engine's positions: a longer ask ends as "length" there.
        p = dataclasses.replace(
            p, max_tokens=max(0, min(p.max_tokens, self.config.max_seq_len - slot.num_tokens - 1))
        )
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        cancel = self._waiters[slot.index].cancel
        cancel.clear()
        self.slots.start_decoding(slot)
        stop_ids = set(p.stop_token_ids) | (set() if p.ignore_eos else set(self.eos_token_ids))

        def put(item: tuple[str, Any]) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, item)

        work = loop.run_in_executor(self._pool, self._decode_thread, slot, p, cancel, put)
        detok = (
            detokenizer(self.tokenizer, slot.prompt_token_ids, p.first_token)
            if self.tokenizer is not None
            else None
        )
        produced = drafted = accepted = 0
        timings: dict[str, float] = {"wire_wait_ms": (slot.t_ready - slot.t_accept) * 1e3}
        finish: str | None = None
        injected = recorded = False
        try:
            while finish is None:
                kind, value = await asyncio.wait_for(queue.get(), self.config.step_timeout_s)
                if kind == "timing":
                    timings.update(value)
                    injected = True
                elif kind == "step":
                    if not recorded:
                        # The node decoded from the handoff: the data plane works end to end.
                        recorded = True
                        self.recorder.success(slot, bool(timings.get("layerwise")))
                    drafted, accepted = drafted + value.drafted, accepted + value.accepted
                    tokens, finish = cut(value.token_ids, produced, p.max_tokens, stop_ids)
                    produced += len(tokens)
                    if tokens:
                        yield {"token_ids": tokens, "text": detok.push(tokens) if detok else ""}
                elif kind == "error":
                    # A request whose own parameters cannot be decoded says nothing of the node or the
                    # data plane: recorded, any client could turn every node's status false.
                    if isinstance(value, StateRefused):
                        # Our own words only: the refusal's text can quote what a sender named (its
                        # digest algorithm), and the record reaches the operator's conditions.
                        self.recorder.failure(
                            "digest_mismatch",
                            "a state was refused: its bytes are not what its "
                            "sender hashed (torn, or written by another data-plane peer)",
                        )
                    elif not isinstance(value, InvalidRequest):
                        self.recorder.failure("decode_failed", f"{type(value).__name__}: {value}")
                    raise value
                elif kind == "end":
                    finish = "cancelled" if cancel.is_set() else "length"
                    if injected and not recorded and p.max_tokens == 0:
                        recorded = True  # nothing to decode was asked: converted and injected is all there is
                        self.recorder.success(slot, bool(timings.get("layerwise")))
            decode_s = timings.pop("_decode_start", None)
            decode_ms = (time.perf_counter() - decode_s) * 1e3 if decode_s else 0.0
            timings.update(
                decode_ms=decode_ms,
                tpot_ms=decode_ms / produced if produced else 0.0,
                mtp_acceptance=accepted / drafted if drafted else 0.0,
            )
            self.metrics.requests.labels(finish).inc()
            self.metrics.mtp_drafted.inc(drafted)
            self.metrics.mtp_accepted.inc(accepted)
            if produced:
                self.metrics.tpot_seconds.observe(decode_ms / produced / 1e3)
            yield {
                "done": True,
                "finish_reason": finish,
                "num_tokens": produced,
                "mtp": {"drafted": drafted, "accepted": accepted},
                "timings": timings,
            }
        finally:
            cancel.set()
            try:
                await asyncio.shield(work)
            except Exception:  # already reported through the queue
                pass
            self.slots.release(slot)

    def _decode_thread(
        self, slot: Slot, p: GenerateParams, cancel: threading.Event, put: Callable[[tuple[str, Any]], None]
    ) -> None:
        try:
            t0 = time.perf_counter()
            t_found = self.slots.clock()
            prepared = self._prepared[slot.index]
            final = (
                prepared.final if prepared is not None and prepared.generation == slot.generation else None
            )
            if prepared is None or final is None:
                # Not queued at READY (cannot happen through the slot table): build it here.
                prepared = _Prepared(slot.generation)
                final = Future()
                try:
                    final.set_result(
                        self._assemble(
                            prepared,
                            slot.index,
                            slot.ranks_expected,
                            slot.num_tokens,
                            slot.last_prompt_token,
                            dict(slot.digests),
                        )
                    )
                except Exception as exc:
                    final.set_exception(exc)
            try:
                state = final.result()
                t1 = time.perf_counter()
                seq = self.engine.start(state)
                t2 = time.perf_counter()
            finally:
                self._let_go(prepared)
            del state, final  # not kept through the decode
            # The engine holds its own copy now: neither the converted state nor the receive region
            # need keep the request's KV (the region is readable on the data plane) while it decodes.
            self.buffers.scrub(slot.index)
            with prepared.lock:
                spans = list(prepared.spans)
            # On the critical path: the part of the converter's work after /generate found the state.
            digest_s = _overlap(spans, "digest", t0, t1)
            convert_s = max(0.0, (t1 - t0) - digest_s)
            self.metrics.digest_seconds.observe(digest_s)
            self.metrics.convert_seconds.observe(convert_s)
            self.metrics.inject_seconds.observe(t2 - t1)
            put(
                (
                    "timing",
                    {
                        "digest_ms": digest_s * 1e3,
                        "convert_ms": convert_s * 1e3,
                        "inject_ms": (t2 - t1) * 1e3,
                        # Hidden: the converter's work done before /generate found the state.
                        "hidden_digest_ms": _overlap(spans, "digest", float("-inf"), t0) * 1e3,
                        "hidden_convert_ms": _overlap(spans, "convert", float("-inf"), t0) * 1e3,
                        "layerwise": 1.0 if prepared.layers_reported else 0.0,
                        "layers_layerwise": float(prepared.layers_reported),
                        "layers_early": float(prepared.layers_reported - prepared.last_frame_layers),
                        "last_layer_to_ready_ms": (
                            (slot.t_ready - prepared.t_last_layer) * 1e3
                            if prepared.t_last_layer is not None
                            else 0.0
                        ),
                        "ready_to_generate_ms": max(0.0, t_found - slot.t_ready) * 1e3,
                        "_decode_start": t2,
                    },
                )
            )
            try:
                for step in seq.decode(p.first_token, p.sampling, p.max_tokens):
                    if cancel.is_set():
                        break
                    put(("step", step))
            finally:
                seq.close()
            put(("end", None))
        except StateRefused as exc:
            log.warning("slot %d (request %s): %s", slot.index, slot.request_id, exc)
            self.metrics.handoffs.labels("refused").inc()
            put(("error", exc))
        except InvalidRequest as exc:
            log.info("slot %d (request %s): %s", slot.index, slot.request_id, exc)
            put(("error", exc))
        except Exception as exc:
            log.exception("decode of slot %d failed", slot.index)
            put(("error", exc))
