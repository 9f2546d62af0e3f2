"""Frames and messages: exact bytes, every bound, the session seal, and the errors a broken peer gets."""

import asyncio
import json
import os
import socket
import time

import pytest

from tilert_serve.handoff import auth, framing, messages
from tilert_serve.handoff.errors import (
    AuthError,
    FrameError,
    MessageError,
    RejectReason,
    SessionError,
    VersionMismatch,
)

DONE = messages.Done(request_id="r1", generation=3, ok=True, nbytes=42)
DONE_BODY = (
    b'{"request_id":"r1","generation":3,"ok":true,"nbytes":42,"error":null,"digest":null,'
    b'"writes_started":true,"write_s":null}'
)
DONE_BYTES = b"TP\x02\x07\x00\x00\x00\x78" + DONE_BODY
#: The same Done sealed as frame #0 with the key b"k" * 32: kind | 0x80, length + 32, HMAC-SHA256 tag.
DONE_SEALED = (
    b"TP\x02\x87\x00\x00\x00\x98"
    + DONE_BODY
    + bytes.fromhex("8a280ed5fa6fd9b99bc9e099502548c5997624262a7cfed101bc8ce8055704c2")
)
#: A Done as senders wrote it before Done.write_s (an optional field of the same version): still read.
OLDER_DONE_BODY = b'{"request_id":"r1","generation":3,"ok":true,"nbytes":42,"error":null,"digest":null,"writes_started":true}'
HEX64 = "ab" * 32


def test_golden_bytes_both_ways():
    assert framing.encode(DONE) == DONE_BYTES
    assert framing.Decoder().feed(DONE_BYTES) == [DONE]
    assert framing.encode(DONE, framing.Session(b"k" * 32, b"x" * 32)) == DONE_SEALED
    assert framing.Decoder(framing.Session(b"x" * 32, b"k" * 32)).feed(DONE_SEALED) == [DONE]
    assert framing.Decoder().feed(b"TP\x02\x07\x00\x00\x00\x69" + OLDER_DONE_BODY) == [DONE]


def _pair() -> tuple[framing.Session, framing.Session]:
    secret, n1, n2 = b"s" * 32, auth.new_nonce(), auth.new_nonce()
    return framing.Session.of_node(secret, n1, n2), framing.Session.of_sender(secret, n1, n2)


def test_session_frames_verify_in_order_both_ways():
    node, sender = _pair()
    to_node = framing.Decoder(node)
    to_sender = framing.Decoder(sender)
    for i in range(3):
        assert to_node.feed(framing.encode(DONE, sender)) == [DONE]
        ack = messages.Ack(request_id=str(i), status="complete")
        assert to_sender.feed(framing.encode(ack, node)) == [ack]


def test_altered_replayed_reordered_reflected_and_unsealed_frames_fail():
    node, sender = _pair()
    first, second = framing.encode(DONE, sender), framing.encode(DONE, sender)
    altered = first.replace(b'"nbytes":42', b'"nbytes":43')
    with pytest.raises(SessionError, match="Done frame #0 of this session does not verify"):
        framing.Decoder(_pair()[0]).feed(first)  # another session's keys
    dec = framing.Decoder(node)
    with pytest.raises(SessionError):
        dec.feed(altered)
    node, sender = _pair()
    first, second = framing.encode(DONE, sender), framing.encode(DONE, sender)
    with pytest.raises(SessionError, match="#0"):  # reordered: #1 read where #0 belongs
        framing.Decoder(node).feed(second)
    node2, sender2 = _pair()
    dec = framing.Decoder(node2)
    one = framing.encode(DONE, sender2)
    assert dec.feed(one) == [DONE]
    with pytest.raises(SessionError, match="#1"):  # replayed
        dec.feed(one)
    node3, sender3 = _pair()
    with pytest.raises(SessionError):  # reflected: the node's own frame back to it
        framing.Decoder(node3).feed(framing.encode(DONE, node3))
    with pytest.raises(SessionError, match="Done frame without a session tag after the handshake"):
        framing.Decoder(node3).feed(framing.encode(DONE))
    # Before the node's first sealed frame, a node that cannot seal (the sender's secret differs) may
    # still say why it refuses (and the connection ends there)...
    err = messages.Error(reason=RejectReason.UNAUTHENTICATED, message="no")
    node4, sender4 = _pair()
    assert framing.Decoder(sender4).feed(framing.encode(err)) == [err]
    # ...but once the session is established (the node: at once; the sender: after the Hello opened)
    # an unsealed Error can only be injected on the way.
    with pytest.raises(SessionError, match="Error frame without a session tag"):
        framing.Decoder(node3).feed(framing.encode(err))
    to_sender = framing.Decoder(sender4)
    assert to_sender.feed(framing.encode(DONE, node4)) == [DONE]
    with pytest.raises(SessionError, match="Error frame without a session tag"):
        to_sender.feed(framing.encode(err))
    with pytest.raises(FrameError, match="sealed, but the handshake has not finished"):
        framing.Decoder().feed(framing.encode(DONE, sender3))


def test_session_keys_differ_per_direction_nonce_and_secret():
    a = auth.session_keys(b"s" * 32, "aa" * 32, "bb" * 32)
    assert a[0] != a[1]
    assert auth.session_keys(b"s" * 32, "aa" * 32, "cc" * 32) != a
    assert auth.session_keys(b"t" * 32, "aa" * 32, "bb" * 32) != a
    assert auth.session_keys(b"s" * 32, "aa" * 32, "bb" * 32) == a


def test_every_kind_round_trips():
    samples = [
        messages.Challenge(nonce="a" * 64, node="n0"),
        messages.Auth(mac=HEX64, nonce="b" * 64, sender="prefill-0"),
        messages.Hello(
            mac=HEX64,
            node="n0",
            layout=messages.LayoutInfo(
                model="glm5", kv_cache_dtype="fp8_ds_mla", version=1, num_layers=79, fingerprint="f"
            ),
            max_seq_len=100,
            slots_total=1,
            slots_free=1,
            transfer="mooncake",
            peer={"session_id": "127.0.0.1:15000"},
        ),
        messages.Request(
            request_id="r",
            ticket="t",
            num_tokens=5,
            last_prompt_token=9,
            prompt_token_ids=[1, 2],
            layout_fingerprint="f",
        ),
        messages.Accept(
            request_id="r",
            slot=0,
            generation=1,
            regions=[messages.Region(shard=0, addr=1, nbytes=2)],
            max_tokens=100,
        ),
        messages.Reject(request_id="r", reason=RejectReason.BUSY, message="all 1 slots busy"),
        DONE,
        messages.Ack(request_id="r", status="complete"),
        messages.Error(reason=RejectReason.BAD_REQUEST, message="x"),
        messages.LayersDone(
            request_id="r", generation=1, layers=[0, 2], nbytes=10, digest="blake3:" + "0" * 64
        ),
    ]
    stream = b"".join(framing.encode(m) for m in samples)
    assert framing.Decoder().feed(stream) == samples
    assert {type(m).KIND for m in samples} == set(messages.KINDS)


def test_decoder_is_incremental_byte_by_byte():
    dec = framing.Decoder()
    out = []
    for i in range(len(DONE_BYTES) * 2):
        out += dec.feed((DONE_BYTES * 2)[i : i + 1])
    assert out == [DONE, DONE]


@pytest.mark.parametrize(
    ("data", "error", "match"),
    [
        (b"XX\x02\x07\x00\x00\x00\x01{", FrameError, "bad magic"),
        (b"TP\x01\x07\x00\x00\x00\x01{", VersionMismatch, "protocol version 1 is not supported"),
        (b"TP\x02\x07\x7f\xff\xff\xff", FrameError, "over the 4194304-byte limit"),
        (b"TP\x02\x63\x00\x00\x00\x02{}", MessageError, "unknown message kind 0x63"),
        (b"TP\x02\x07\x00\x00\x00\x02[]", MessageError, "must be a JSON object"),
        (b"TP\x02\x07\x00\x00\x00\x03{x}", MessageError, "not JSON"),
        (
            b'TP\x02\x07\x00\x00\x00\x1c{"request_id":"r","ok":true}',
            MessageError,
            "generation: Field required",
        ),
    ],
)
def test_bad_frames_name_the_problem(data, error, match):
    with pytest.raises(error, match=match):
        framing.Decoder().feed(data)


def test_oversized_header_rejected_before_its_body_arrives():
    with pytest.raises(FrameError):
        framing.Decoder().feed(b"TP\x02\x04\x10\x00\x00\x00")  # 256 MiB announced, nothing sent
    with pytest.raises(FrameError, match="over the 4096-byte limit"):
        framing.Decoder(max_body=framing.PREAUTH_MAX_BODY).feed(b"TP\x02\x02\x00\x00\x10\x01")


def _frame(kind: int, body: bytes) -> bytes:
    return framing.HEADER.pack(b"TP", 2, kind, len(body)) + body


@pytest.mark.parametrize(
    ("body", "match"),
    [
        (b'{"mac": "\\ud800", "nonce": "x", "sender": "s"}', "lone surrogate"),
        (b'{"sender": ["\\udfff"]}', "lone surrogate"),
        (b"[" * 100_000 + b"]" * 100_000, "nests too deeply"),
        (b'{"nonce": ' + b"9" * 5000 + b"}", "not JSON we take"),
        (b'{"mac": 5, "nonce": null, "sender": {}}', "invalid Auth"),
        (b'{"mac": "' + b"a" * 63 + b'", "nonce": "' + b"0" * 64 + b'", "sender": "s"}', "mac"),
        (b"\xff\xfe", "not UTF-8"),
    ],
)
def test_hostile_bodies_are_message_errors(body, match):
    with pytest.raises(MessageError, match=match):
        framing.Decoder().feed(_frame(messages.Auth.KIND, body))


def test_surrogate_pairs_are_text():
    msg = framing.Decoder().feed(
        _frame(messages.Error.KIND, b'{"reason": "busy", "message": "\\ud83d\\ude00"}')
    )
    assert msg[0].message == "\U0001f600"  # type: ignore[attr-defined]


def test_field_constraints_are_enforced():
    body = json.dumps({"request_id": "r", "num_tokens": 0, "last_prompt_token": 1, "layout_fingerprint": "f"})
    with pytest.raises(MessageError, match="num_tokens: Input should be greater than or equal to 1"):
        messages.from_body(messages.Request.KIND, json.loads(body))


def test_unknown_fields_from_a_newer_peer_are_ignored():
    data = DONE.model_dump() | {"added_in_a_later_release": 1}
    assert messages.from_body(messages.Done.KIND, data) == DONE


def test_sync_and_async_channels_interoperate():
    async def main() -> None:
        async def serve(reader, writer):
            msg = await framing.read_message(reader)
            await framing.write_message(writer, messages.Ack(request_id=msg.request_id, status="complete"))
            writer.close()

        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]

        def client() -> messages.Message:
            chan = framing.SyncChannel.connect("127.0.0.1", port, timeout=5)
            chan.send(DONE)
            reply = chan.recv()
            with pytest.raises(ConnectionError, match="peer closed"):
                chan.recv()
            chan.close()
            return reply

        reply = await asyncio.to_thread(client)
        server.close()
        assert reply == messages.Ack(request_id="r1", status="complete")

    asyncio.run(main())


def test_macs_bind_both_nonces_and_roles():
    s, n1, n2 = b"k" * 32, auth.new_nonce(), auth.new_nonce()
    assert auth.verify(auth.sender_mac(s, n1, n2), auth.sender_mac(s, n1, n2))
    assert not auth.verify(auth.sender_mac(s, n1, n2), auth.sender_mac(s, n2, n1))
    assert not auth.verify(auth.sender_mac(s, n1, n2), auth.node_mac(s, n1, n2))
    assert not auth.verify(auth.sender_mac(s, n1, n2), auth.sender_mac(b"x" * 32, n1, n2))


def test_digest_algorithm_is_one_both_sides_have():
    from tilert_serve.handoff import digest

    assert digest.preferred(["blake2b"]) == "blake2b"
    assert digest.preferred(None) == digest.available()[0]
    assert digest.preferred(["sha3"]) == "blake2b"  # hashlib's, always there


def test_file_keyring_follows_rotation(tmp_path):
    d = tmp_path / "handoff"
    d.mkdir()
    (d / "secret").write_text("old-secret-0123456789\n")
    ring = auth.FileKeyring(d / "secret")
    assert ring.signing() == b"old-secret-0123456789" and ring.accepted() == (b"old-secret-0123456789",)
    # Rotation as the kubelet does it: the files change together (a new inode each).
    (d / "secret.new").write_text("new-secret-0123456789\n")
    os.replace(d / "secret.new", d / "secret")
    (d / "accept").write_text("old-secret-0123456789\n\nshort\n")
    time.sleep(0.01)
    assert ring.signing() == b"new-secret-0123456789"
    assert ring.accepted() == (b"new-secret-0123456789", b"old-secret-0123456789")
    (d / "accept").write_text("")
    assert ring.accepted() == (b"new-secret-0123456789",)
    # A briefly missing secret keeps the last good one.
    os.remove(d / "secret")
    assert ring.signing() == b"new-secret-0123456789"


def test_secret_loading_errors_say_what_to_do(tmp_path):
    with pytest.raises(AuthError, match="mount the PDCluster's handoff Secret"):
        auth.load_secret(tmp_path / "missing")
    (tmp_path / "short").write_text("abc\n")
    with pytest.raises(AuthError, match="at least 16"):
        auth.load_secret(tmp_path / "short")
    (tmp_path / "ok").write_text("0123456789abcdef0123\n")
    assert auth.load_secret(tmp_path / "ok") == b"0123456789abcdef0123"


def test_socket_pair_smoke():
    a, b = socket.socketpair()
    framing.SyncChannel(a).send(DONE)
    assert framing.SyncChannel(b).recv() == DONE
    a.close()
    b.close()
