"""The decode node: receive buffers, gated slots, the control-plane server, and the decode of each
admitted request (convert -> inject -> decode with MTP -> stop rules -> text).

Threads: the event loop owns the slot table, the control plane and HTTP; engine work (inject,
decode steps) runs in a pool with one worker per slot and reports back through the loop. What lands
in a slot becomes the engine's state in the handoff pipeline (pipeline.py), on the slot's converter
thread, ahead of /generate; /generate waits only for what is still queued, injects and decodes.

Each stateful part has one owner of its transitions: the slot table (slots.py) of every slot's, the
pipeline of each slot generation's build, the recorder (record.py) of the data-plane record, and this
node of its own phase:

    STARTING -> READY (start: engine loaded, buffers registered, control port open)
    STARTING -> FAILED (start_failed)
    any -> STOPPING -> STOPPED (stop)

The servers see the node through narrow interfaces: the control server through `ctrl.ControlNode`,
the HTTP API through `http.NodeAPI`; neither reaches into the node's parts.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from collections.abc import AsyncGenerator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import torch

from tilert_serve import defaults
from tilert_serve.compat import Compat
from tilert_serve.decode import ctrl, pipeline
from tilert_serve.decode.buffers import ReceiveBuffers
from tilert_serve.decode.detokenize import detokenizer
from tilert_serve.decode.engines.base import DecodeEngine, InvalidRequest, Sampling
from tilert_serve.decode.metrics import NodeMetrics
from tilert_serve.decode.pipeline import HandoffFailed, HandoffPipeline, StateRefused
from tilert_serve.decode.record import GenerateStamps, Recorder
from tilert_serve.decode.slots import NodeFull, Slot, SlotState, SlotTable
from tilert_serve.decode.stopping import cut
from tilert_serve.handoff import auth, digest, messages
from tilert_serve.layouts import Layout
from tilert_serve.transfer import TransferEngine

__all__ = [
    "Admission",
    "DecodeNode",
    "GenerateParams",
    "HandoffFailed",
    "NodeConfig",
    "NodePhase",
    "StateRefused",
]

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
    #: Filled on the way when the call is traced (record.GenerateStamps); None = not traced.
    stamps: GenerateStamps | None = None


#: Slot states with a request between its admission and the end of its stream.
_ACTIVE = frozenset({SlotState.RESERVED, SlotState.RECEIVING, SlotState.READY, SlotState.DECODING})


class NodePhase(StrEnum):
    STARTING = "starting"
    READY = "ready"
    FAILED = "failed"
    STOPPING = "stopping"
    STOPPED = "stopped"


@dataclass(frozen=True)
class Admission:
    """A reserved slot, as /v1/admit answers it."""

    ticket: str
    slot: int
    expires_in_s: float
    ctrl_host: str
    ctrl_port: int


class NotReady(Exception):
    """The node does not take admissions yet (its engine is loading) or any more (stopping)."""


class TooLong(Exception):
    """The request would not fit this node's max_seq_len."""


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
        #: What a sender's Request is checked against (decode/ctrl.py).
        self.terms = ctrl.Terms(config.name, config.max_seq_len, layout, self.compat)
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
        self.pipeline = HandoffPipeline(
            layout=layout,
            buffers=self.buffers,
            metrics=self.metrics,
            engine_layers=engine.num_layers,
            engine_dtype=getattr(engine, "dtype", torch.float32),
            verify_digest=config.verify_digest,
            clock=clock,
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
        self._waiters = [_Waiters() for _ in range(config.slots)]
        self._pool = ThreadPoolExecutor(max_workers=config.slots, thread_name_prefix="decode")
        self._server: asyncio.Server | None = None
        self._reaper: asyncio.Task[None] | None = None
        self.ctrl_port = config.ctrl_port
        self._phase = NodePhase.STARTING
        #: Why start failed, if it did (reported by /health and /ready; kept through the stop).
        self._failure: str | None = None
        #: Why every request was ended before it finished (the drain's time ran out), for the streams
        #: cut by it to say so; None while the node serves.
        self._ended: str | None = None

    # -- phase (this node is the only writer) ----------------------------------------------------

    @property
    def phase(self) -> NodePhase:
        return self._phase

    @property
    def ready(self) -> bool:
        return self._phase is NodePhase.READY

    @property
    def stopping(self) -> bool:
        return self._phase in (NodePhase.STOPPING, NodePhase.STOPPED)

    @property
    def failed(self) -> str | None:
        """Why start failed, or None."""
        return self._failure

    @property
    def ended(self) -> str | None:
        """Why every request was ended early (the drain's time ran out), or None."""
        return self._ended

    async def start(self) -> None:
        """STARTING -> READY: load the engine, register the buffers, open the control port."""
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
        if self._phase is NodePhase.STARTING:  # not if stopped meanwhile
            self._phase = NodePhase.READY
        log.info(
            "decode node %s ready: %d slots, layout %s, ctrl %s:%d, %.1f MB receive buffers (and as much again of snapshots)",
            self.config.name,
            self.config.slots,
            self.layout.describe(),
            self.config.advertise_host,
            self.ctrl_port,
            self.buffers.nbytes / 1e6,
        )

    def start_failed(self, why: str) -> None:
        """STARTING -> FAILED: /health and /ready report `why` from now on."""
        self._failure = why
        if self._phase is NodePhase.STARTING:
            self._phase = NodePhase.FAILED
        log.error("decode node %s could not start: %s", self.config.name, why)

    async def stop(self) -> None:
        """-> STOPPING -> STOPPED: streams end at their next step, then every part is closed."""
        self._phase = NodePhase.STOPPING
        for w in self._waiters:
            w.cancel.set()
        if self._reaper:
            self._reaper.cancel()
        if self._server:
            self._server.close()
            await self._server.wait_closed()
        self._pool.shutdown(wait=True, cancel_futures=True)
        self.pipeline.close()
        self.buffers.unregister()
        self.transfer.close()
        self._phase = NodePhase.STOPPED

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
        self.pipeline.slot_changed(slot, event)
        if event == "complete":
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

    # -- what the control server uses (ctrl.ControlNode) -----------------------------------------

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

    def regions(self, index: int) -> list[messages.Region]:
        """Slot `index`'s receive regions, as Accept hands them to a sender."""
        return self.buffers.regions(index)

    def layers_arrived(
        self, slot: Slot, generation: int, rank: int, layers: list[int], layer_digest: str
    ) -> None:
        self.pipeline.layers_arrived(slot, generation, rank, layers, layer_digest)

    # -- what the HTTP API uses (http.NodeAPI) ---------------------------------------------------

    def admit(self, request_id: str, need: int) -> Admission:
        """Reserve a slot for a request of `need` tokens (prompt and output): NotReady, TooLong or
        slots.NodeFull when it cannot be (each counted)."""
        if not self.ready:
            raise NotReady("the decode node is still starting; retry on another node")
        if need > self.config.max_seq_len:
            self.metrics.admissions.labels("too_long").inc()
            raise TooLong(
                f"prompt_tokens + max_tokens = {need} exceeds this node's max_seq_len "
                f"{self.config.max_seq_len}; send it to the native pool"
            )
        try:
            slot = self.slots.admit(request_id)
        except NodeFull:
            self.metrics.admissions.labels("full").inc()
            raise
        self.metrics.admissions.labels("admitted").inc()
        assert slot.ticket is not None
        return Admission(
            ticket=slot.ticket,
            slot=slot.index,
            expires_in_s=self.config.ticket_ttl_s,
            ctrl_host=self.config.advertise_host,
            ctrl_port=self.ctrl_port,
        )

    def claim(self, ticket: str) -> Slot:
        """The slot a generate call takes (UnknownTicket, AlreadyClaimed)."""
        return self.slots.claim(ticket)

    def cancel_ticket(self, ticket: str) -> bool:
        """End the request holding `ticket`; False when no live slot holds it."""
        slot = self.slots.find(ticket)
        if slot is None:
            return False
        self.cancel(slot)
        return True

    def render_metrics(self) -> bytes:
        return self.metrics.render()

    def status(self, with_request_ids: bool) -> dict[str, Any]:
        """GET /v1/status's body; request ids only when `with_request_ids`."""
        return {
            "name": self.config.name,
            "ready": self.ready,
            # The compatibility generation (tilert_serve/compat.py): a prefill's handoff is taken only
            # from a sender of this one; the router routes here only while it is the configured one.
            "compat": self.compat.fingerprint,
            "model": {"name": self.compat.model, "revision": self.compat.revision},
            "failed": self.failed,
            "layout": self.layout.describe(),
            "engine": self.engine.name,
            "transfer": self.transfer.name,
            "max_seq_len": self.config.max_seq_len,
            "slots": [
                {
                    "index": s.index,
                    "state": s.state.value,
                    **({"request_id": s.request_id} if with_request_ids else {}),
                }
                for s in self.slots.slots
            ],
            "ctrl": {"host": self.config.advertise_host, "port": self.ctrl_port},
            # The data plane's record: the last handoff decoded from, the last failure and its reason, the
            # transport and its measured bandwidth (the operator's HandoffReady reads it).
            "handoff": self.handoff.as_dict(),
        }

    # -- requests --------------------------------------------------------------------------------

    @property
    def idle(self) -> bool:
        """No request between its admission and the end of its stream (the drain waits for this)."""
        return not any(s.state in _ACTIVE for s in self.slots.slots)

    def end_all(self, why: str) -> None:
        """End every request on the node now (the drain's time is up): a stream stops at its next step
        and ends with an error event saying `why`; a ticket not streaming yet fails with `why`."""
        self._ended = why
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
            build, final = self.pipeline.handed_over(slot)
            try:
                state = final.result()
                t1 = time.perf_counter()
                seq = self.engine.start(state)
                t2 = time.perf_counter()
            finally:
                self.pipeline.let_go(build)
            del state, final  # not kept through the decode
            # The engine holds its own copy now: neither the converted state nor the receive region
            # need keep the request's KV (the region is readable on the data plane) while it decodes.
            self.buffers.scrub(slot.index)
            timings = pipeline.timings(build, slot, t0, t1, t_found)
            self.metrics.digest_seconds.observe(timings["digest_ms"] / 1e3)
            self.metrics.convert_seconds.observe(timings["convert_ms"] / 1e3)
            self.metrics.inject_seconds.observe(t2 - t1)
            put(("timing", timings | {"inject_ms": (t2 - t1) * 1e3, "_decode_start": t2}))
            stamps = p.stamps
            if stamps is not None:
                # Read by the HTTP handler once the stream has ended (after the queue's hand-over).
                stamps.found, stamps.assembled, stamps.injected = t0, t1, t2
                with build.lock:
                    stamps.work = list(build.spans)
            try:
                for step in seq.decode(p.first_token, p.sampling, p.max_tokens):
                    if cancel.is_set():
                        break
                    if stamps is not None and not stamps.first_step:
                        stamps.first_step = time.perf_counter()
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
