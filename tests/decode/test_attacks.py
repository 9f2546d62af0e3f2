"""The attacks docs/security.md lists that touch the control channel and the data plane, rerun against the node
and the sender: each is refused.

- a relay without the secret rewrites Hello.peer or Accept.regions: the sender stops before writing;
- a relay sends its own Request after the peer's Hello: the node ends the connection, no slot taken;
- another writer on the (unauthenticated) data plane overwrites a READY slot: the digest refuses it;
- a freed slot's old KV is read back over the data plane: it was scrubbed;
- malformed pre-auth frames get a reasoned Error, never the internal-error path;
- a crowd of unauthenticated connections: capped, each buffering at most a small frame;
- another protocol version: answered with version_mismatch, in that version.
(Slot reuse while a vanished sender's write may land: test_dispatch's quarantine test.)
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import struct
import time
from collections.abc import AsyncIterator, Callable

import pytest
import torch

from tests.decode import handshake, synthetic
from tests.decode.attacker import DataPlaneWriter
from tests.decode.conftest import SECRET, converter_held, running_node, two_rank_staging
from tilert_serve import transfer
from tilert_serve.decode import ctrl
from tilert_serve.handoff import auth, framing, messages
from tilert_serve.handoff.sender import HandoffRequest, HandoffResult, Sender
from tilert_serve.layouts import Placement

CASE = "mla-f32"
LAYOUT = synthetic.layout_for(CASE)
HEADER = struct.Struct(">2sBBI")
NUM_TOKENS = 20


def _sender(secret: bytes = SECRET) -> tuple[Sender, torch.Tensor]:
    staging = Placement(LAYOUT, max_tokens=NUM_TOKENS)
    buf = torch.zeros(staging.total_nbytes(), dtype=torch.uint8)
    synthetic.fill(staging, [buf], NUM_TOKENS, 5)
    mover = transfer.create("mooncake", host="127.0.0.1", protocol="tcp", role="attack-sender")
    mover.register(buf.data_ptr(), buf.numel())
    return Sender(
        name="victim", secret=secret, engine=mover, staging=staging, staging_buffers=[buf], timeout_s=10
    ), buf


async def _send(sender: Sender, port: int, ticket: str | None, request_id: str = "victim") -> HandoffResult:
    req = HandoffRequest(
        request_id=request_id,
        num_tokens=NUM_TOKENS,
        last_prompt_token=11,
        ticket=ticket,
        prompt_token_ids=list(range(NUM_TOKENS)),
    )
    return await asyncio.to_thread(sender.send, "127.0.0.1", port, req)


Transform = Callable[[bytes], bytes | None]


def _keep(frame: bytes) -> bytes | None:
    return frame


@contextlib.asynccontextmanager
async def relay(
    node_port: int, to_sender: Transform = _keep, to_node: Transform = _keep
) -> AsyncIterator[int]:
    """A man in the middle without the secret: forwards whole frames, each through a transform
    (None drops it)."""

    async def pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter, fn: Transform) -> None:
        try:
            while True:
                header = await src.readexactly(HEADER.size)
                frame = header + await src.readexactly(HEADER.unpack(header)[3])
                out = fn(frame)
                if out:
                    dst.write(out)
                    await dst.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            dst.close()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        node_r, node_w = await asyncio.open_connection("127.0.0.1", node_port)
        await asyncio.gather(pump(node_r, writer, to_sender), pump(reader, node_w, to_node))

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        server.close()


def _rewrite(kind: int, change: Callable[[dict], None]) -> Transform:
    """Rewrite the JSON body of sealed frames of `kind`, keeping their tag (the relay cannot make one)."""

    def fn(frame: bytes) -> bytes:
        if frame[3] & 0x7F != kind:
            return frame
        body, tag = frame[HEADER.size : -framing.TAG_SIZE], frame[-framing.TAG_SIZE :]
        data = json.loads(body)
        change(data)
        new = json.dumps(data, separators=(",", ":")).encode()
        return HEADER.pack(b"TP", frame[2], frame[3], len(new) + framing.TAG_SIZE) + new + tag

    return fn


async def test_relay_rewriting_hello_peer_is_caught_before_any_write(secret_file):
    async with running_node(LAYOUT, secret_file, slots=1) as n:

        def steal(hello: dict) -> None:
            hello["peer"]["session_id"] = "127.0.0.1:1"  # the relay's own transfer engine

        sender, _ = _sender()
        async with relay(n.ctrl_port, to_sender=_rewrite(messages.Hello.KIND, steal)) as port:
            result = await _send(sender, port, None)
        assert (result.ok, result.reason) == (False, "not_authenticated"), result
        assert "Hello frame #0 of this session does not verify" in result.message
        assert result.nbytes == 0 and n.node.slots.free == 1


async def test_relay_rewriting_accept_regions_is_caught_before_any_write(secret_file):
    async with running_node(LAYOUT, secret_file, slots=1, quarantine_s=0.3) as n:

        def redirect(accept: dict) -> None:
            accept["regions"][0]["addr"] += 4096

        sender, _ = _sender()
        _, adm = await n.admit("victim")
        async with relay(n.ctrl_port, to_sender=_rewrite(messages.Accept.KIND, redirect)) as port:
            result = await _send(sender, port, adm["ticket"])
        assert (result.ok, result.reason) == (False, "not_authenticated"), result
        assert "Accept frame #1" in result.message and result.nbytes == 0
        assert not n.node.buffers.views(0)[0].any()  # nothing was written anywhere in the node
        status, events = await n.generate(adm["ticket"])
        assert status == 502 and "session check" in events[0]["error"]["message"]


async def test_relay_sending_its_own_request_after_the_hello_is_refused(secret_file):
    async with running_node(LAYOUT, secret_file, slots=1) as n:
        own = framing.encode(
            messages.Request(
                request_id="relay",
                num_tokens=NUM_TOKENS,
                last_prompt_token=1,
                layout_fingerprint=LAYOUT.fingerprint,
                compat=synthetic.unnamed_compat(LAYOUT.fingerprint),
            )
        )
        # The relay cannot seal, so it sends its Request unsealed, or with the victim's tag.
        for forge in (
            lambda frame: own,
            lambda frame: (
                own[:3]
                + bytes([own[3] | 0x80])
                + struct.pack(">I", len(own) - 8 + 32)
                + own[8:]
                + frame[-32:]
            ),
        ):

            def swap(frame: bytes, forge: Transform = forge) -> bytes | None:
                return forge(frame) if frame[3] & 0x7F == messages.Request.KIND else frame

            sender, _ = _sender()
            async with relay(n.ctrl_port, to_node=swap) as port:
                result = await _send(sender, port, None)
            assert not result.ok and result.reason == "not_authenticated", result
            assert n.node.slots.free == 1 and n.node.slots.by_request("relay") is None
        assert b'tilert_decode_ctrl_errors_total{reason="not_authenticated"} 2.0' in n.node.metrics.render()


async def test_write_over_a_ready_slot_is_refused_by_the_digest(secret_file):
    async with running_node(LAYOUT, secret_file, slots=1) as n:
        _, adm = await n.admit("victim")
        # The node checks a state as soon as it lands; held here, the write below comes before the check.
        with converter_held(n.node):
            line = await n.send(CASE, NUM_TOKENS, 1, "mooncake", adm["ticket"], request_id="victim")
            assert json.loads(line[7:])["ok"], line
            # Another process on the data plane writes into the READY slot: no secret needed for that.
            attacker = DataPlaneWriter(junk_bytes=4096)
            attacker.write(n.node.transfer.peer_info(), [(n.node.buffers.regions(0)[0].addr + 100, 4096)])
            attacker.close()
        status, events = await n.generate(adm["ticket"])
        assert status == 502 and events[0]["error"]["type"] == "handoff_failed"
        assert "digest differs" in events[0]["error"]["message"]
        assert n.engine.started == []  # never injected, never decoded
        assert n.node.slots.free == 1 and not n.node.buffers.views(0)[0].any()


async def test_a_state_without_digest_is_refused_unless_digests_are_off(secret_file):
    async with running_node(LAYOUT, secret_file, slots=1) as n:
        _, adm = await n.admit("a")
        assert json.loads(
            (await n.send(CASE, NUM_TOKENS, 1, "mooncake", adm["ticket"], "--no-digest", request_id="a"))[7:]
        )["ok"]
        status, events = await n.generate(adm["ticket"])
        assert status == 502 and "sent no digest" in events[0]["error"]["message"]
    async with running_node(LAYOUT, secret_file, slots=1, verify_digest=False) as n:
        _, adm = await n.admit("a")
        assert json.loads(
            (await n.send(CASE, NUM_TOKENS, 1, "mooncake", adm["ticket"], "--no-digest", request_id="a"))[7:]
        )["ok"]
        assert (await n.generate(adm["ticket"], max_tokens=2))[0] == 200


async def test_a_freed_slot_reads_back_as_zeros(secret_file):
    async with running_node(LAYOUT, secret_file, slots=1) as n:
        _, adm = await n.admit("victim")
        assert json.loads(
            (await n.send(CASE, NUM_TOKENS, 1, "mooncake", adm["ticket"], request_id="victim"))[7:]
        )["ok"]
        region = n.node.buffers.regions(0)[0]
        assert n.node.buffers.views(0)[0].any()  # the state is there until it is injected
        status, _ = await n.generate(adm["ticket"], max_tokens=2)
        assert status == 200
        # Read the whole slot back over Mooncake, as any process on the data plane can.
        back = torch.full((region.nbytes,), 0xFF, dtype=torch.uint8)
        reader = transfer.create("mooncake", host="127.0.0.1", protocol="tcp", role="reader")
        reader.register(back.data_ptr(), back.numel())
        peer = reader.connect(n.node.transfer.peer_info())
        rc = reader._engine.batch_transfer_sync_read(peer, [back.data_ptr()], [region.addr], [region.nbytes])  # type: ignore[attr-defined]
        assert rc == 0
        assert not back.any()


async def test_two_generates_on_one_ticket(secret_file):
    async with running_node(LAYOUT, secret_file, slots=1) as n:
        _, adm = await n.admit("a")
        first = asyncio.create_task(n.generate(adm["ticket"], max_tokens=2))
        await asyncio.sleep(0.2)  # waiting for the state
        status, (body,) = await n.generate(adm["ticket"], max_tokens=2)
        assert status == 409 and body["error"]["type"] == "already_generating"
        assert json.loads((await n.send(CASE, NUM_TOKENS, 1, "mooncake", adm["ticket"], request_id="a"))[7:])[
            "ok"
        ]
        assert (await first)[0] == 200


def _exchange(port: int, payload: bytes) -> list[messages.Message]:
    with contextlib.closing(socket.create_connection(("127.0.0.1", port), timeout=10)) as sock:
        chan = framing.SyncChannel(sock)
        assert isinstance(chan.recv(), messages.Challenge)
        sock.sendall(payload)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    out = []
    while data:
        length = HEADER.unpack(data[:8])[3]
        out.append(framing.open_frame(data[:8], data[8 : 8 + length], None)[0])
        data = data[8 + length :]
    return out


@pytest.mark.parametrize(
    ("body", "why"),
    [
        (b'{"mac": "\\ud800", "nonce": "' + b"a" * 64 + b'", "sender": "x"}', "lone surrogate"),
        (
            b'{"mac": "' + b"z" * 64 + b'", "nonce": "' + b"a" * 64 + b'", "sender": "x"}',
            "mac: String should match",
        ),
        (
            b'{"mac": "' + b"a" * 64 + b'", "nonce": "' + b"a" * 64 + b'", "sender": "\\udc00"}',
            "lone surrogate",
        ),
        (b"[" * 100_000, "over the 4096-byte limit"),
        (b"[" * 2000 + b"]" * 2000, "nests too deeply"),
        (b'{"nonce": ' + b"1" * 5000 + b"}", "over the 4096-byte limit"),
        (b'{"nonce": ' + b"1" * 3000 + b"}", "invalid Auth message"),
        (b'{"mac": ["' + b"a" * 64 + b'"], "nonce": 5, "sender": null}', "invalid Auth message"),
    ],
)
async def test_malformed_preauth_frames_get_a_reason(secret_file, body, why):
    async with running_node(LAYOUT, secret_file, slots=1) as n:
        frame = HEADER.pack(b"TP", 2, messages.Auth.KIND, len(body)) + body
        (reply,) = await asyncio.to_thread(_exchange, n.ctrl_port, frame)
        assert isinstance(reply, messages.Error) and reply.reason == "bad_request" and why in reply.message, (
            reply
        )
        assert b'reason="internal"' not in n.node.metrics.render()


async def test_another_protocol_version_gets_version_mismatch_in_its_own_version(secret_file):
    async with running_node(LAYOUT, secret_file, slots=1) as n:
        nonce = auth.new_nonce()
        old = framing.encode(messages.Auth(mac="a" * 64, nonce=nonce, sender="old"), version=1)

        def exchange() -> bytes:
            with contextlib.closing(socket.create_connection(("127.0.0.1", n.ctrl_port), timeout=10)) as sock:
                framing.SyncChannel(sock).recv()
                sock.sendall(old)
                data = b""
                while chunk := sock.recv(65536):
                    data += chunk
                return data

        data = await asyncio.to_thread(exchange)
        assert data[:4] == b"TP\x01\x09"  # an Error, in version 1
        reply = json.loads(data[8:])
        assert (
            reply["reason"] == "version_mismatch"
            and "protocol version 1 is not supported" in reply["message"]
        )


async def test_a_sender_told_another_version_says_so(secret_file):
    async def old_node(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(framing.encode(messages.Challenge(nonce="a" * 64, node="old"), version=3))
        await writer.drain()
        got.append(await reader.read(4096))
        writer.close()

    got: list[bytes] = []
    server = await asyncio.start_server(old_node, "127.0.0.1", 0)
    sender, _ = _sender()
    result = await _send(sender, server.sockets[0].getsockname()[1], None)
    for _ in range(100):  # the old node's handler reads what the sender sent last
        if got:
            break
        await asyncio.sleep(0.02)
    server.close()
    assert (result.ok, result.reason) == (False, "version_mismatch"), result
    assert got and got[0][:4] == b"TP\x03\x09"  # told in the node's version


async def test_unauthenticated_connections_are_capped_and_hold_little(secret_file, monkeypatch):
    monkeypatch.setattr(ctrl, "MAX_PREAUTH", 8)
    async with running_node(LAYOUT, secret_file, slots=1) as n:

        def crowd() -> tuple[list[socket.socket], list[messages.Message], list[messages.Message]]:
            held = []
            for i in range(8):  # idle after the challenge, each with a partial 4 KiB frame
                s = socket.socket()
                s.settimeout(10)
                s.bind((f"127.0.0.{2 + i}", 0))  # one source each: only the global cap applies
                s.connect(("127.0.0.1", n.ctrl_port))
                framing.SyncChannel(s).recv()
                s.sendall(HEADER.pack(b"TP", 2, messages.Auth.KIND, 4096) + b"{" * 4000)
                held.append(s)
            # One more: it gets its Challenge, and the oldest idle one (the first) is told busy and closed,
            # so no more than the cap is ever held.
            with contextlib.closing(socket.create_connection(("127.0.0.1", n.ctrl_port), timeout=10)) as s:
                assert isinstance(framing.SyncChannel(s).recv(), messages.Challenge)
                over = framing.Decoder().feed(held[0].recv(65536))
            # 40 more, each announcing a 4 MiB body: refused on the header, before any of it is buffered.
            big = []
            for s in held[:4]:
                s.close()
            for _ in range(40):
                with contextlib.closing(
                    socket.create_connection(("127.0.0.1", n.ctrl_port), timeout=10)
                ) as s:
                    if not isinstance(framing.SyncChannel(s).recv(), messages.Challenge):
                        continue
                    s.sendall(HEADER.pack(b"TP", 2, messages.Auth.KIND, 4 << 20) + b"x" * 1000)
                    big += framing.Decoder().feed(s.recv(65536))
            return held[4:], over, big

        held, over, big = await asyncio.to_thread(crowd)
        assert [type(m) for m in over] == [messages.Error] and over[0].reason == "busy"  # type: ignore[attr-defined]
        assert big and all(
            isinstance(m, messages.Error) and "over the 4096-byte limit" in m.message for m in big
        )
        assert n.node.ctrl.preauth <= 8
        for s in held:
            s.close()
        for _ in range(500):  # the node notices the closes
            if n.node.ctrl.preauth == 0:
                break
            await asyncio.sleep(0.01)
        assert n.node.ctrl.preauth == 0
        sender, _ = _sender()
        _, adm = await n.admit("after")
        assert (await _send(sender, n.ctrl_port, adm["ticket"], "after")).ok


async def test_a_rotated_secret_is_taken_without_a_restart(secret_file, tmp_path):
    handoff = tmp_path / "handoff"
    handoff.mkdir()
    (handoff / "secret").write_bytes(SECRET)
    ring = auth.FileKeyring(handoff / "secret")
    async with running_node(LAYOUT, secret_file, slots=1, secret=ring) as n:
        new = b"rotated-secret-0123456789abcdef"
        # The operator renders the new secret and keeps the old one accepted: old and new senders pass.
        (handoff / "secret.tmp").write_bytes(new)
        (handoff / "secret.tmp").replace(handoff / "secret")
        (handoff / "accept").write_bytes(SECRET + b"\n")
        for secret in (SECRET, new):
            sender, _ = _sender(secret)
            _, adm = await n.admit("r")
            result = await _send(sender, n.ctrl_port, adm["ticket"], "r")
            assert result.ok, result
            assert (await n.generate(adm["ticket"], max_tokens=2))[0] == 200
        # The grace period ends: the old secret is refused.
        (handoff / "accept").write_bytes(b"")
        sender, _ = _sender(SECRET)
        result = await _send(sender, n.ctrl_port, None, "late")
        assert (result.ok, result.reason) == (False, "not_authenticated")


async def test_two_sender_ranks_each_digest_checked(secret_file):
    """TP=2 prefill: each rank's digest covers its own layers; a write over rank 1's layers names it."""
    with two_rank_staging(LAYOUT, NUM_TOKENS, 9, "tp-sender") as (staging, bufs, mover):
        async with running_node(LAYOUT, secret_file, slots=1) as n:
            for tamper in (False, True):
                _, adm = await n.admit("tp")
                # Tampered: the node's check (as the state lands) is held until after the write over it.
                with converter_held(n.node) if tamper else contextlib.nullcontext():
                    for rank in range(2):
                        sender = Sender(
                            name=f"rank{rank}",
                            secret=SECRET,
                            engine=mover,
                            staging=staging,
                            staging_buffers=bufs,
                        )
                        req = HandoffRequest(
                            request_id="tp",
                            num_tokens=NUM_TOKENS,
                            last_prompt_token=11,
                            ticket=adm["ticket"],
                            rank=rank,
                            num_senders=2,
                        )
                        assert (await asyncio.to_thread(sender.send, "127.0.0.1", n.ctrl_port, req)).ok
                    if tamper:
                        shard, off = n.node.buffers.placement.offset("mla", 1)  # layer 1: rank 1's
                        n.node.buffers.views(0)[shard][off] ^= 0xFF
                status, events = await n.generate(adm["ticket"], max_tokens=2)
                if tamper:
                    assert status == 502 and "sender rank 1:" in events[0]["error"]["message"]
                    assert "rank 0" not in events[0]["error"]["message"]
                else:
                    assert status == 200, events


async def test_done_after_the_deadline_leaves_the_slot_quarantined(secret_file):
    """A sender whose Done comes after the handoff deadline may still have been writing: the node
    has dropped it, and its slot is not reused until the quarantine ends."""
    async with running_node(LAYOUT, secret_file, slots=1, handoff_timeout_s=0.3, quarantine_s=1.0) as n:
        _, adm = await n.admit("slow")

        def slow_sender() -> list[messages.Message]:
            with contextlib.closing(socket.create_connection(("127.0.0.1", n.ctrl_port), timeout=10)) as sock:
                chan = framing.SyncChannel(sock)
                handshake.authenticate(chan, SECRET, "slow")
                chan.send(
                    messages.Request(
                        request_id="slow",
                        ticket=adm["ticket"],
                        num_tokens=NUM_TOKENS,
                        last_prompt_token=1,
                        layout_fingerprint=LAYOUT.fingerprint,
                        compat=synthetic.unnamed_compat(LAYOUT.fingerprint),
                    )
                )
                accept = chan.recv()
                assert isinstance(accept, messages.Accept)
                time.sleep(0.6)  # past the deadline
                got = [chan.recv()]  # the node gave up on us
                with contextlib.suppress(OSError):
                    chan.send(
                        messages.Done(request_id="slow", generation=accept.generation, ok=True, nbytes=1)
                    )
                return got

        (reply,) = await asyncio.to_thread(slow_sender)
        assert isinstance(reply, messages.Error) and "timed out" in reply.message
        status, events = await n.generate(adm["ticket"])
        assert status in (404, 502, 504), events  # the reaper or the control connection got there first
        assert n.node.slots.slots[0].state.value == "quarantined"
        assert n.node.slots.quarantine_status()["quarantined"][0]["ranks_in_flight"] == [0]
        assert (await n.admit("next"))[0] == 429
        for _ in range(1000):  # the quarantine's bound
            if n.node.slots.slots[0].state.value == "free":
                break
            await asyncio.sleep(0.01)
        assert (await n.admit("next"))[0] == 200
        # Back in use with its writer never confirmed done: reported, not silent.
        assert n.node.slots.unconfirmed_reuses == 1
        assert b'tilert_decode_expired_slots_total{state="quarantined"} 1.0' in n.node.metrics.render()
