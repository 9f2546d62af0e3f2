"""The per-slot handoff pipeline: what lands in a slot's receive region becomes the engine's state.

Conversion runs ahead of /generate, on one converter thread per slot (FIFO, so a slot's tasks run in
the order they were queued): each layer a layer-wise sender reports done (LayersDone) is taken and
converted as it lands, and once every rank reported done (the slot is READY) the rest is taken (Done's
digests) and converted and the engine state assembled. Taking bytes means: copy them out of the
receive region (which any data-plane peer can still write) into the slot's snapshot, which no peer
can write, check the copy against the sender's digest, and convert only from the copy (`take`). A
state whose digest is wrong or missing is refused (StateRefused) when the decode asks for it, before
anything is injected.

What is built belongs to one generation of a slot (a `Build`). Its lifecycle, and who moves it:

    (none) -> building      the event loop, on the slot's first LayersDone or at READY (`_build_for`)
    building -> final queued the event loop, as the slot table reports READY (`slot_changed`)
    layers converted        the slot's converter thread only (`_convert_layers`, `_assemble`)
    -> handed over          the decode thread (`handed_over`), which injects it and lets it go
    -> dropped              the event loop, on the slot's failure, release, quarantine or reuse
                            (`slot_changed`); a converter task of a dropped build does nothing

The converted tensors are counted in the converted_bytes gauge from conversion until they are let go
(injected, or the build dropped), so memory held for a slot that will never decode shows.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from tilert_serve.decode.buffers import ReceiveBuffers
from tilert_serve.decode.metrics import NodeMetrics
from tilert_serve.decode.slots import Slot, SlotState
from tilert_serve.handoff import digest
from tilert_serve.layouts import Layout, convert, senders_layers
from tilert_serve.layouts.state import InjectedState, LayerState


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
class Build:
    """One slot generation's state as the converter thread builds it (see the module docstring)."""

    generation: int
    #: Converted layers (engine layers only), by layer id.
    layers: dict[int, LayerState] = field(default_factory=dict)
    #: Layers taken (copied into the snapshot and, digests on, checked there) by LayersDone, per sender rank.
    taken: dict[int, set[int]] = field(default_factory=dict)
    #: Why the state is refused (a layer's digest differs); raised when the decode asks, before injection.
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


def state_bytes(layers: Iterable[LayerState]) -> int:
    return sum(
        t.numel() * t.element_size()
        for layer in layers
        for t in (layer.kv, layer.pe, layer.ki)
        if t is not None
    )


def settle(views: list[torch.Tensor]) -> None:
    """Wait for the conversion's kernels on a GPU (they run after the call returns), so a converter
    span ends when the layers are converted, not when they were queued: convert_ms and
    hidden_convert_ms tell the device's time. The converter thread waits, not the decode."""
    for device in {v.device for v in views if v.is_cuda}:
        torch.cuda.current_stream(device).synchronize()


def overlap(spans: list[tuple[str, float, float]], kind: str, lo: float, hi: float) -> float:
    """Seconds of `kind` spans inside [lo, hi]."""
    return sum(max(0.0, min(end, hi) - max(start, lo)) for k, start, end in spans if k == kind)


def take(
    buffers: ReceiveBuffers,
    verify: bool,
    index: int,
    rank: int,
    num_senders: int,
    num_tokens: int,
    layers: list[int],
    expected: str | None,
) -> str | None:
    """Copy what sender `rank` wrote of `layers` out of slot `index`'s receive region into its
    snapshot, then (`verify`) check the copy against `expected`: why it differs, or None. Snapshot
    first, then check, then convert from the snapshot: the receive region stays writable by any
    data-plane peer, so the bytes checked must be the bytes used (decode/buffers.py)."""
    ranges = digest.receiver_ranges(buffers.placement, rank, num_senders, num_tokens, layers)
    buffers.snapshot(index, ranges)
    if not verify:
        return None
    try:
        digest.check(expected or "", buffers.snapshot_views(index), ranges)
    except digest.DigestError as exc:
        return str(exc)
    return None


def timings(build: Build, slot: Slot, t0: float, t1: float, t_found: float) -> dict[str, float]:
    """The pipeline's part of a stream's timings: /generate found the state at `t0` (perf_counter;
    `t_found` on the slot clock) and had it at `t1`. digest_ms and convert_ms are the part of the
    converter's work on the critical path (after `t0`); the hidden_* ones, the work done before."""
    with build.lock:
        spans = list(build.spans)
    digest_s = overlap(spans, "digest", t0, t1)
    return {
        "digest_ms": digest_s * 1e3,
        "convert_ms": max(0.0, (t1 - t0) - digest_s) * 1e3,
        "hidden_digest_ms": overlap(spans, "digest", float("-inf"), t0) * 1e3,
        "hidden_convert_ms": overlap(spans, "convert", float("-inf"), t0) * 1e3,
        "layerwise": 1.0 if build.layers_reported else 0.0,
        "layers_layerwise": float(build.layers_reported),
        "layers_early": float(build.layers_reported - build.last_frame_layers),
        "last_layer_to_ready_ms": (
            (slot.t_ready - build.t_last_layer) * 1e3 if build.t_last_layer is not None else 0.0
        ),
        "ready_to_generate_ms": max(0.0, t_found - slot.t_ready) * 1e3,
    }


def _facts(slot: Slot) -> tuple[int, int, int, int, dict[int, str | None]]:
    """What `_assemble` needs of a slot, read now on the event loop (the slot changes after)."""
    return slot.index, slot.ranks_expected, slot.num_tokens, slot.last_prompt_token, dict(slot.digests)


class HandoffPipeline:
    """Each slot's converter thread and the build of its current generation (one owner per transition:
    see the module docstring)."""

    def __init__(
        self,
        *,
        layout: Layout,
        buffers: ReceiveBuffers,
        metrics: NodeMetrics,
        engine_layers: int,
        engine_dtype: torch.dtype,
        verify_digest: bool,
        clock: Callable[[], float],
    ) -> None:
        self.layout = layout
        self.buffers = buffers
        self.metrics = metrics
        self.engine_layers = engine_layers
        self.engine_dtype = engine_dtype
        self.verify_digest = verify_digest
        self.clock = clock
        self._converters = [
            ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"convert-{i}") for i in range(buffers.slots)
        ]
        self._builds: list[Build | None] = [None] * buffers.slots

    # -- queries -------------------------------------------------------------------------------

    def build(self, index: int) -> Build | None:
        """Slot `index`'s current build, if any (for tests and diagnostics)."""
        return self._builds[index]

    def converter(self, index: int) -> ThreadPoolExecutor:
        """Slot `index`'s converter thread (FIFO)."""
        return self._converters[index]

    # -- event loop: slot events and LayersDone ------------------------------------------------

    def slot_changed(self, slot: Slot, event: str) -> None:
        """The slot table's transition `event` (node.py forwards every one): drop the build of a
        generation that ended; queue the final assembly when the slot is READY."""
        build = self._builds[slot.index]
        if build is not None and (
            build.generation != slot.generation or event in ("failed", "released", "quarantined")
        ):
            self._drop(slot.index)
        if event == "complete":
            build = self._build_for(slot)
            build.final = self._converters[slot.index].submit(self._assemble, build, *_facts(slot))

    def layers_arrived(
        self, slot: Slot, generation: int, rank: int, layers: list[int], layer_digest: str
    ) -> None:
        """A sender rank reported `layers` written (ctrl.py checked they are its own, once each): queue
        their digest check and conversion. Ignored unless the slot is still receiving this generation."""
        if slot.generation != generation or slot.state is not SlotState.RECEIVING:
            return
        build = self._build_for(slot)
        build.layers_reported += len(layers)
        build.last_frame_layers = len(layers)
        build.t_last_layer = self.clock()
        self.metrics.layers_received.inc(len(layers))
        self._converters[slot.index].submit(
            self._convert_layers,
            build,
            slot.index,
            rank,
            slot.ranks_expected,
            slot.num_tokens,
            list(layers),
            layer_digest,
        )

    def close(self) -> None:
        """Drop every build and stop the converter threads (after the decodes stopped)."""
        for i, converter in enumerate(self._converters):
            self._drop(i)
            converter.shutdown(wait=True, cancel_futures=True)

    def _build_for(self, slot: Slot) -> Build:
        build = self._builds[slot.index]
        if build is None or build.generation != slot.generation:
            self._drop(slot.index)
            build = self._builds[slot.index] = Build(slot.generation)
        return build

    def _drop(self, index: int) -> None:
        """Forget what was converted for the slot's generation; its queued tasks then do nothing."""
        build, self._builds[index] = self._builds[index], None
        if build is not None:
            with build.lock:
                build.dropped = True
            self.let_go(build)

    # -- decode thread -------------------------------------------------------------------------

    def handed_over(self, slot: Slot) -> tuple[Build, Future[InjectedState]]:
        """The READY slot's build (for its timings) and its state's future. Not queued at READY (which
        the slot table never allows): assembled here, on the caller's thread."""
        build = self._builds[slot.index]
        final = build.final if build is not None and build.generation == slot.generation else None
        if build is not None and final is not None:
            return build, final
        build, final = Build(slot.generation), Future()
        try:
            final.set_result(self._assemble(build, *_facts(slot)))
        except Exception as exc:
            final.set_exception(exc)
        return build, final

    def let_go(self, build: Build) -> None:
        """Drop the generation's converted tensors: once injected the engine holds its own copy, and a
        failed or released slot needs none. Without this they would live until the slot's next use."""
        with build.lock:
            build.layers.clear()
            build.final = None
            nbytes, build.held_bytes = build.held_bytes, 0
        self.metrics.converted_bytes.dec(nbytes)

    # -- converter thread ----------------------------------------------------------------------

    def _hold(self, build: Build, nbytes: int) -> None:
        """Count `nbytes` more of converted state for this generation (caller holds build.lock)."""
        build.held_bytes += nbytes
        self.metrics.converted_bytes.inc(nbytes)

    def _convert_layers(
        self,
        build: Build,
        index: int,
        rank: int,
        num_senders: int,
        num_tokens: int,
        layers: list[int],
        layer_digest: str,
    ) -> None:
        """Take these layers (snapshot and check), then convert them (engine layers only) from the
        snapshot."""
        if build.dropped or build.refused is not None:
            return
        snap = self.buffers.snapshot_views(index)
        t0 = time.perf_counter()
        problem = take(
            self.buffers, self.verify_digest, index, rank, num_senders, num_tokens, layers, layer_digest
        )
        if problem is not None:
            build.refused = f"sender rank {rank}, layers {layers}: {problem}"
            return
        t1 = time.perf_counter()
        converted = {
            lid: convert.to_layer_state(snap, self.buffers.placement, lid, num_tokens, self.engine_dtype)
            for lid in layers
            if lid < self.engine_layers
        }
        settle(snap)
        t2 = time.perf_counter()
        with build.lock:
            if build.dropped:
                return
            build.layers.update(converted)
            self._hold(build, state_bytes(converted.values()))
            build.taken.setdefault(rank, set()).update(layers)
            build.spans += [("digest", t0, t1), ("convert", t1, t2)]

    def _assemble(
        self,
        build: Build,
        index: int,
        num_senders: int,
        num_tokens: int,
        last_prompt_token: int,
        digests: dict[int, str | None],
    ) -> InjectedState:
        """StateRefused unless every rank's bytes are covered by a digest that matches (per layer, or
        Done's over the rest); else the engine's state, converted from the snapshot."""
        if build.refused is not None:
            raise StateRefused(build.refused)
        snap = self.buffers.snapshot_views(index)
        placement = self.buffers.placement
        t0 = time.perf_counter()
        self._take_rest(build, index, num_senders, num_tokens, digests)
        t1 = time.perf_counter()
        if not build.layers:
            state = convert.to_injected_state(
                snap, placement, num_tokens, last_prompt_token, self.engine_dtype
            )
            layers = state.layers[: self.engine_layers]
        else:
            layers = [
                build.layers.get(lid)
                or convert.to_layer_state(snap, placement, lid, num_tokens, self.engine_dtype)
                for lid in range(self.engine_layers)
            ]
        settle(snap)
        t2 = time.perf_counter()
        with build.lock:
            build.spans += [("digest", t0, t1), ("convert", t1, t2)]
            if not build.dropped:  # the layers converted ahead are counted already
                self._hold(build, state_bytes(layers) - build.held_bytes)
        return InjectedState(layers=layers, seq_len=num_tokens, last_prompt_token=last_prompt_token)

    def _take_rest(
        self,
        build: Build,
        index: int,
        num_senders: int,
        num_tokens: int,
        digests: dict[int, str | None],
    ) -> None:
        """Take every rank's layers no LayersDone covered (Done's digest covers them); StateRefused
        when one is not covered or differs."""
        rest = {
            rank: sorted(set(senders_layers(self.layout, rank, num_senders)) - build.taken.get(rank, set()))
            for rank in range(num_senders)
        }
        missing = [rank for rank, layers in rest.items() if layers and digests.get(rank) is None]
        if missing and self.verify_digest:
            raise StateRefused(
                f"sender ranks {missing} sent no digest of their state and this node checks digests; "
                "turn tilert_handoff_digest on in the prefill's connector (or the node's "
                "--handoff-digest off)"
            )

        def take_rank(rank: int) -> str | None:
            if not rest[rank]:
                return None
            problem = take(
                self.buffers,
                self.verify_digest,
                index,
                rank,
                num_senders,
                num_tokens,
                rest[rank],
                digests.get(rank),
            )
            return None if problem is None else f"sender rank {rank}: {problem}"

        # One thread per rank: with TP senders each rank's bytes sit on its own GPU shard, whose copies
        # and hashing then run side by side (the hashing releases the GIL).
        if num_senders == 1:
            errors = [take_rank(0)]
        else:
            with ThreadPoolExecutor(max_workers=min(num_senders, 8), thread_name_prefix="digest") as pool:
                errors = list(pool.map(take_rank, range(num_senders)))
        problems = [e for e in errors if e]
        if problems:
            raise StateRefused("; ".join(problems))
