"""Layer-wise handoff (LayersDone): a sender process gives its layers one at a time, the node checks and
converts each as it lands; the state decoded is the whole-state flow's, an older node still gets the
whole state, a wrong layer digest is refused before injection, a sender dying or giving up between
layers fails the slot (quarantined while its writes may land), a cancel drops what was converted, and
every malformed LayersDone is a protocol error answered with a reason."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import sys

import pytest
import torch

from tests.decode import handshake, synthetic
from tests.decode.conftest import (
    HERE,
    SECRET,
    SENDER_ENV,
    RunningNode,
    converter_held,
    running_node,
    two_rank_staging,
)
from tilert_serve.handoff import digest, framing, messages
from tilert_serve.handoff.sender import HandoffRequest, Sender, Staged
from tilert_serve.layouts import Placement, convert, write_ranges

NUM_TOKENS = 70  # two indexer pages, the last one partial


def whole_state(case: str, num_tokens: int, seed: int) -> list[tuple[torch.Tensor, ...]]:
    """The engine state the whole-state flow makes of the sender's synthetic bytes."""
    layout = synthetic.layout_for(case)
    staging = Placement(layout, max_tokens=num_tokens)
    buf = torch.zeros(staging.total_nbytes(), dtype=torch.uint8)
    synthetic.fill(staging, [buf], num_tokens, seed)
    state = convert.to_injected_state([buf], staging, num_tokens, 11, torch.float32)
    return [(s.kv, s.pe, s.ki) if s.ki is not None else (s.kv, s.pe) for s in state.layers]


def assert_same_state(n: RunningNode, case: str, seed: int) -> None:
    got = n.engine.started[-1]
    want = whole_state(case, NUM_TOKENS, seed)
    assert got.seq_len == NUM_TOKENS and len(got.layers) == len(want)
    for lid, (layer, ref) in enumerate(zip(got.layers, want, strict=True)):
        mine = (layer.kv, layer.pe, layer.ki) if layer.ki is not None else (layer.kv, layer.pe)
        assert all(torch.equal(a, b) for a, b in zip(mine, ref, strict=True)), f"layer {lid} differs"


def converted_bytes(n: RunningNode) -> float | None:
    return n.node.metrics.registry.get_sample_value("tilert_decode_converted_state_bytes")


async def wait_for(predicate, timeout: float = 20.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        assert loop.time() < deadline, "condition not reached"
        await asyncio.sleep(0.02)


@contextlib.asynccontextmanager
async def handed_over(case: str, secret_file, seed: int, flag: str):
    """A node of `case`'s layout (GLM-5's on two shards) and the result of one sender process's
    handoff of NUM_TOKENS tokens to it, with sender_proc's `flag`: (node, admission, result)."""
    shards = 2 if case.startswith("glm5") else 1
    async with running_node(
        synthetic.layout_for(case), secret_file, slots=1, max_seq_len=128, shards=shards
    ) as n:
        _, adm = await n.admit("r")
        line = await n.send(case, NUM_TOKENS, seed, "mooncake", adm["ticket"], flag, request_id="r")
        yield n, adm, json.loads(line[7:])


@pytest.mark.parametrize("case", ["glm5-fp8", "mla-f32"])
async def test_layerwise_state_is_the_whole_states(case, secret_file):
    layout = synthetic.layout_for(case)
    async with handed_over(case, secret_file, 5, "--layerwise") as (n, adm, result):
        assert result["ok"], result
        assert result["layers_sent"] == layout.num_layers and result["layers_early"] == layout.num_layers - 1
        assert result["nbytes"] == layout.request_bytes(NUM_TOKENS)
        # Converted ahead of /generate, and counted: the whole engine state waits in the node's memory.
        state_bytes = sum(
            t.numel() * t.element_size() for layer in whole_state(case, NUM_TOKENS, 5) for t in layer
        )
        await wait_for(lambda: converted_bytes(n) == state_bytes)
        status, events = await n.generate(adm["ticket"], max_tokens=2)
        assert status == 200 and events[-1]["finish_reason"] == "length"
        assert converted_bytes(n) == 0  # let go once injected, not kept through the decode
        timings = events[-1]["timings"]
        assert timings["layerwise"] == 1.0 and timings["layers_layerwise"] == layout.num_layers
        assert timings["layers_early"] == layout.num_layers - 1
        assert set(timings) >= {
            "wire_wait_ms",
            "digest_ms",
            "convert_ms",
            "inject_ms",
            "decode_ms",
            "tpot_ms",
            "hidden_digest_ms",
            "hidden_convert_ms",
            "last_layer_to_ready_ms",
            "ready_to_generate_ms",
        }
        assert_same_state(n, case, 5)
        assert b"tilert_decode_layers_received_total %d.0" % layout.num_layers in n.node.metrics.render()
        assert n.node.slots.free == 1 and not n.node.buffers.views(0)[0].any()


@pytest.mark.parametrize("case", ["glm5-fp8", "mla-f32"])
async def test_a_chunked_prefills_state_is_the_whole_states(case, secret_file):
    """A prompt computed in chunks of 9, 31 and 30 tokens: each chunk's tokens are written as they are
    staged, the node hears of a layer only with the last chunk, and decodes the whole-state flow's
    state. The indexer page the first two chunks end inside holds garbage until the next chunk: it
    must come again, whole (sender_proc's ChunkByChunk), or the layer digests would not match."""
    layout = synthetic.layout_for(case)
    async with handed_over(case, secret_file, 7, "--chunks=9,40") as (n, adm, result):
        assert result["ok"], result
        assert result["layers_sent"] == layout.num_layers
        staging, every = Placement(layout, max_tokens=NUM_TOKENS), list(range(layout.num_layers))
        early = [
            r.nbytes for lo, hi in ((0, 9), (9, 40)) for r in write_ranges(staging, staging, every, hi, lo)
        ]
        assert result["chunk_bytes"] == sum(early)
        status, events = await n.generate(adm["ticket"], max_tokens=2)
        assert status == 200 and events[-1]["finish_reason"] == "length"
        assert events[-1]["timings"]["layers_layerwise"] == layout.num_layers
        assert_same_state(n, case, 7)


async def test_a_node_without_layerwise_gets_the_whole_state(secret_file, monkeypatch):
    case = "mla-bf16"
    async with running_node(synthetic.layout_for(case), secret_file, slots=1) as n:
        hello = n.node.hello
        monkeypatch.setattr(n.node, "hello", lambda mac: hello(mac).model_copy(update={"layerwise": False}))
        _, adm = await n.admit("old")
        result = json.loads(
            (await n.send(case, NUM_TOKENS, 2, "mooncake", adm["ticket"], "--layerwise", request_id="old"))[
                7:
            ]
        )
        assert result["ok"] and result["layers_sent"] == 0, result
        status, events = await n.generate(adm["ticket"], max_tokens=2)
        assert status == 200 and events[-1]["timings"]["layerwise"] == 0.0
        assert_same_state(n, case, 2)


async def test_a_wrong_layer_digest_is_refused_before_injection(secret_file):
    case = "mla-f32"
    layout = synthetic.layout_for(case)
    async with running_node(layout, secret_file, slots=1) as n:
        _, adm = await n.admit("torn")
        with converter_held(n.node):  # the layer is checked after its bytes change
            result = json.loads(
                (
                    await n.send(
                        case, NUM_TOKENS, 1, "mooncake", adm["ticket"], "--layerwise", request_id="torn"
                    )
                )[7:]
            )
            assert result["ok"], result
            shard, off = n.node.buffers.placement.offset("mla", 1)
            n.node.buffers.views(0)[shard][off : off + 8] += 1
        status, events = await n.generate(adm["ticket"])
        assert status == 502 and "layers [1]" in events[0]["error"]["message"]
        assert "digest differs" in events[0]["error"]["message"]
        assert n.engine.started == []
        assert n.node.handoff.fail_reason == "digest_mismatch"
        assert n.node.slots.free == 1 and not n.node.buffers.views(0)[0].any()


async def test_a_sender_dying_between_layers_fails_and_quarantines_the_slot(secret_file):
    case = "mla-f32"
    async with running_node(synthetic.layout_for(case), secret_file, slots=1, quarantine_s=0.5) as n:
        _, adm = await n.admit("doomed")
        line = await n.send(
            case,
            NUM_TOKENS,
            1,
            "mooncake",
            adm["ticket"],
            "--layerwise",
            "--die-after-layers=1",
            request_id="doomed",
        )
        assert line.startswith("ACCEPTED and dying"), line
        status, events = await n.generate(adm["ticket"])
        assert status == 502 and "disconnected" in events[0]["error"]["message"]
        assert n.engine.started == []
        slot = n.node.slots.slots[0]
        assert slot.state.value == "quarantined" and n.node.pipeline.build(0) is None
        await wait_for(lambda: slot.state.value == "free")
        assert not n.node.buffers.views(0)[0].any()


@pytest.mark.parametrize(
    ("flag", "why"),
    [("--give-up-after-layers=2", "gave up"), ("--stall-after-layers=2", "staged no further layer")],
)
async def test_a_prefill_giving_up_between_layers_frees_the_slot_without_quarantine(secret_file, flag, why):
    # Given up, or stalled past the sender's wait for a batch (a step): the node hears at once, not
    # at its handoff deadline.
    case = "mla-f32"
    async with running_node(synthetic.layout_for(case), secret_file, slots=1) as n:
        _, adm = await n.admit("given-up")
        result = json.loads(
            (
                await n.send(
                    case, NUM_TOKENS, 1, "mooncake", adm["ticket"], "--layerwise", flag, request_id="given-up"
                )
            )[7:]
        )
        assert not result["ok"] and result["reason"] == "prefill_failed", result
        status, events = await n.generate(adm["ticket"])
        assert status == 502 and why in events[0]["error"]["message"]
        assert n.node.slots.free == 1 and n.node.pipeline.build(0) is None
        assert b"tilert_decode_quarantined_slots_total 0.0" in n.node.metrics.render()


async def test_cancel_between_layers_drops_what_was_converted(secret_file):
    case = "mla-f32"
    layout = synthetic.layout_for(case)
    async with running_node(layout, secret_file, slots=1) as n:
        _, adm = await n.admit("cancelled")
        args = [
            sys.executable,
            str(HERE / "sender_proc.py"),
            case,
            str(NUM_TOKENS),
            "1",
            "mooncake",
            "127.0.0.1",
            str(n.ctrl_port),
            str(n.secret_file),
            "cancelled",
            adm["ticket"],
            "--layerwise",
            "--hold-after-layers=2",
        ]
        proc = await asyncio.create_subprocess_exec(
            *args, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, env=SENDER_ENV
        )
        assert proc.stdout is not None and proc.stdin is not None
        while (line := await asyncio.wait_for(proc.stdout.readline(), 60)) != b"HELD\n":
            assert line, "the sender ended before holding"
        prepared = n.node.pipeline.build(0)
        assert prepared is not None
        await wait_for(lambda: len(prepared.layers) == 2)  # two layers checked and converted already
        assert converted_bytes(n) == prepared.held_bytes > 0
        async with n.session.post(f"{n.url}/v1/cancel", json={"ticket": adm["ticket"]}) as r:
            assert (await r.json()) == {"cancelled": True}
        slot = n.node.slots.slots[0]
        assert slot.state.value == "quarantined"  # the sender may still write
        assert n.node.pipeline.build(0) is None and prepared.dropped and not prepared.layers
        assert converted_bytes(n) == 0
        proc.stdin.write(b"go\n")
        await proc.stdin.drain()
        out, _ = await asyncio.wait_for(proc.communicate(), 60)
        result = json.loads(next(ln for ln in out.decode().splitlines() if ln.startswith("RESULT "))[7:])
        assert not result["ok"] and "cancelled" in result["message"], result
        # Its Done said every write returned: the quarantine ends at once, the slot scrubbed.
        await wait_for(lambda: slot.state.value == "free")
        assert not n.node.buffers.views(0)[0].any() and n.engine.started == []


class RawSender:
    """A control connection driven frame by frame, up to Accept (for protocol violations)."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        self.chan = framing.SyncChannel(self.sock)

    def accept(
        self, layout_fingerprint: str, ticket: str, rank: int = 0, senders: int = 1
    ) -> messages.Accept:
        assert handshake.hello(self.chan, SECRET, "raw").layerwise
        self.chan.send(
            messages.Request(
                request_id="raw",
                ticket=ticket,
                num_tokens=NUM_TOKENS,
                last_prompt_token=1,
                layout_fingerprint=layout_fingerprint,
                compat=synthetic.unnamed_compat(layout_fingerprint),
                sender_rank=rank,
                num_senders=senders,
            )
        )
        accept = self.chan.recv()
        assert isinstance(accept, messages.Accept), accept
        return accept

    def send_all(self, frames: list[messages.Message]) -> list[messages.Message]:
        with contextlib.closing(self.sock):
            for frame in frames:
                self.chan.send(frame)
            replies: list[messages.Message] = []
            with contextlib.suppress(OSError, framing.FrameError, EOFError, ConnectionError):
                while True:
                    replies.append(self.chan.recv())
            return replies


def _layers(
    accept: messages.Accept, layers: list[int], *, generation: int | None = None, request_id: str = "raw"
) -> messages.LayersDone:
    return messages.LayersDone(
        request_id=request_id,
        layers=layers,
        nbytes=0,
        digest="blake2b:" + "0" * 64,
        generation=accept.generation if generation is None else generation,
    )


VIOLATIONS = {
    "a layer twice in one frame": (1, lambda a: [_layers(a, [0, 0])], "twice"),
    "a layer again": (1, lambda a: [_layers(a, [0]), _layers(a, [1]), _layers(a, [0])], "again"),
    "another rank's layer": (2, lambda a: [_layers(a, [1])], "does not send"),
    "a layer past the layout": (1, lambda a: [_layers(a, [3])], "does not send"),
    "another generation": (1, lambda a: [_layers(a, [0], generation=a.generation + 1)], "generation"),
    "another request": (1, lambda a: [_layers(a, [0], request_id="other")], "request"),
}


@pytest.mark.parametrize("name", list(VIOLATIONS))
async def test_malformed_layers_done_is_a_protocol_error(name, secret_file):
    senders, frames, words = VIOLATIONS[name]
    layout = synthetic.layout_for("mla-f32")
    async with running_node(layout, secret_file, slots=1, quarantine_s=0.2) as n:
        _, adm = await n.admit("raw")

        def drive() -> list[messages.Message]:
            raw = RawSender(n.ctrl_port)
            accept = raw.accept(layout.fingerprint, adm["ticket"], rank=0, senders=senders)
            return raw.send_all(frames(accept))

        replies = await asyncio.to_thread(drive)
        assert replies and isinstance(replies[-1], messages.Error), replies
        assert replies[-1].reason.value == "bad_request" and words in replies[-1].message, replies[-1]
        status, events = await n.generate(adm["ticket"])
        assert status == 502 and "broke the protocol" in events[0]["error"]["message"]
        assert n.engine.started == [] and n.node.pipeline.build(0) is None
        await wait_for(lambda: n.node.slots.free == 1)
        # The node goes on serving: a good layer-wise handoff after it.
        _, adm = await n.admit("good")
        result = json.loads(
            (
                await n.send(
                    "mla-f32", NUM_TOKENS, 3, "mooncake", adm["ticket"], "--layerwise", request_id="good"
                )
            )[7:]
        )
        assert result["ok"], result
        assert (await n.generate(adm["ticket"], max_tokens=2))[0] == 200


async def test_layers_done_digests_cover_what_the_sender_wrote(secret_file):
    """The node's per-layer ranges are the sender's: a raw LayersDone with the right digest of layer 0
    and a Done covering the rest decodes."""
    case = "mla-f32"
    layout = synthetic.layout_for(case)
    async with running_node(layout, secret_file, slots=1) as n:
        _, adm = await n.admit("raw")

        def drive() -> list[messages.Message]:
            raw = RawSender(n.ctrl_port)
            accept = raw.accept(layout.fingerprint, adm["ticket"])
            # Write the synthetic state straight into the slot (as the data plane would).
            views = n.node.buffers.views(accept.slot)
            synthetic.fill(n.node.buffers.placement, views, NUM_TOKENS, 4)
            place = n.node.buffers.placement
            first = digest.of_ranges(views, digest.receiver_ranges(place, 0, 1, NUM_TOKENS, [0]), "blake2b")
            rest = digest.of_ranges(views, digest.receiver_ranges(place, 0, 1, NUM_TOKENS, [1, 2]), "blake2b")
            return raw.send_all(
                [
                    messages.LayersDone(
                        request_id="raw", generation=accept.generation, layers=[0], nbytes=1, digest=first
                    ),
                    messages.Done(
                        request_id="raw", generation=accept.generation, ok=True, nbytes=2, digest=rest
                    ),
                ]
            )

        replies = await asyncio.to_thread(drive)
        assert isinstance(replies[-1], messages.Ack) and replies[-1].status == "complete", replies
        status, events = await n.generate(adm["ticket"], max_tokens=2)
        assert status == 200, events
        assert_same_state(n, case, 4)


async def test_a_sender_without_digests_sends_the_whole_state(secret_file):
    """Layer-wise needs per-layer digests: a sender with digests off waits for every layer and sends
    the whole state, which a node with --handoff-digest off decodes."""
    case = "mla-f32"
    async with running_node(synthetic.layout_for(case), secret_file, slots=1, verify_digest=False) as n:
        _, adm = await n.admit("plain")
        result = json.loads(
            (
                await n.send(
                    case,
                    NUM_TOKENS,
                    6,
                    "mooncake",
                    adm["ticket"],
                    "--layerwise",
                    "--no-digest",
                    request_id="plain",
                )
            )[7:]
        )
        assert result["ok"] and result["layers_sent"] == 0, result
        status, events = await n.generate(adm["ticket"], max_tokens=2)
        assert status == 200 and events[-1]["timings"]["layerwise"] == 0.0
        assert_same_state(n, case, 6)


class AllAtOnce:
    """A LayerSource giving each of `layers` in its own batch."""

    def __init__(self, layers: list[int]) -> None:
        self.left = list(layers)

    def next_layers(self, timeout: float) -> Staged | None:
        return Staged([self.left.pop(0)]) if self.left else None


async def test_two_sender_ranks_layer_by_layer(secret_file):
    """TP=2: each rank reports only its own layers; the node assembles both ranks' layers."""
    from tilert_serve import layouts

    case = "glm5-fp8"
    layout = synthetic.layout_for(case)
    with two_rank_staging(layout, NUM_TOKENS, 8, "tp-layerwise") as (staging, bufs, mover):
        async with running_node(layout, secret_file, slots=1, max_seq_len=128, shards=2) as n:
            _, adm = await n.admit("tp")
            for rank in range(2):
                sender = Sender(
                    name=f"rank{rank}", secret=SECRET, engine=mover, staging=staging, staging_buffers=bufs
                )
                req = HandoffRequest(
                    request_id="tp",
                    num_tokens=NUM_TOKENS,
                    last_prompt_token=11,
                    ticket=adm["ticket"],
                    rank=rank,
                    num_senders=2,
                )
                source = AllAtOnce(layouts.senders_layers(layout, rank, 2))
                result = await asyncio.to_thread(sender.send, "127.0.0.1", n.ctrl_port, req, None, source)
                assert result.ok and result.layers_sent == len(layouts.senders_layers(layout, rank, 2)), (
                    result
                )
            status, events = await n.generate(adm["ticket"], max_tokens=2)
            assert status == 200 and events[-1]["timings"]["layers_layerwise"] == layout.num_layers
            assert_same_state(n, case, 8)
