"""Frames and messages: exact bytes, every bound, and the errors a broken peer gets."""

import asyncio
import json
import socket

import pytest

from tilert_serve.handoff import auth, framing, messages
from tilert_serve.handoff.errors import AuthError, FrameError, MessageError, RejectReason

DONE = messages.Done(request_id="r1", generation=3, ok=True, nbytes=42)
DONE_BYTES = (b"TP\x01\x07\x00\x00\x00\x45"
              b'{"request_id":"r1","generation":3,"ok":true,"nbytes":42,"error":null}')


def test_golden_bytes_both_ways():
    assert framing.encode(DONE) == DONE_BYTES
    assert framing.Decoder().feed(DONE_BYTES) == [DONE]


def test_every_kind_round_trips():
    samples = [
        messages.Challenge(nonce="a" * 64, node="n0"),
        messages.Auth(mac="m", nonce="b" * 64, sender="prefill-0"),
        messages.Hello(mac="m", node="n0", layout=messages.LayoutInfo(model="glm5", kv_cache_dtype="fp8_ds_mla",
                       version=1, num_layers=79, fingerprint="f"), max_seq_len=100, slots_total=1, slots_free=1,
                       transfer="mooncake", peer={"session_id": "127.0.0.1:15000"}),
        messages.Request(request_id="r", ticket="t", num_tokens=5, last_prompt_token=9, prompt_token_ids=[1, 2],
                         layout_fingerprint="f"),
        messages.Accept(request_id="r", slot=0, generation=1, regions=[messages.Region(shard=0, addr=1, nbytes=2)],
                        max_tokens=100),
        messages.Reject(request_id="r", reason=RejectReason.BUSY, message="all 1 slots busy"),
        DONE,
        messages.Ack(request_id="r", status="complete"),
        messages.Error(reason=RejectReason.BAD_REQUEST, message="x"),
    ]
    stream = b"".join(framing.encode(m) for m in samples)
    assert framing.Decoder().feed(stream) == samples
    assert {type(m).KIND for m in samples} == set(messages.KINDS)


def test_decoder_is_incremental_byte_by_byte():
    dec = framing.Decoder()
    out = []
    for i in range(len(DONE_BYTES) * 2):
        out += dec.feed((DONE_BYTES * 2)[i:i + 1])
    assert out == [DONE, DONE]


@pytest.mark.parametrize(
    ("data", "error", "match"),
    [(b"XX\x01\x07\x00\x00\x00\x01{", FrameError, "bad magic"),
     (b"TP\x02\x07\x00\x00\x00\x01{", FrameError, "protocol version 2 is not supported"),
     (b"TP\x01\x07\x7f\xff\xff\xff", FrameError, "over the 4194304-byte limit"),
     (b"TP\x01\x63\x00\x00\x00\x02{}", MessageError, "unknown message kind 0x63"),
     (b"TP\x01\x07\x00\x00\x00\x02[]", MessageError, "must be a JSON object"),
     (b"TP\x01\x07\x00\x00\x00\x03{x}", MessageError, "not JSON"),
     (b'TP\x01\x07\x00\x00\x00\x1c{"request_id":"r","ok":true}', MessageError, "generation: Field required")],
)
def test_bad_frames_name_the_problem(data, error, match):
    with pytest.raises(error, match=match):
        framing.Decoder().feed(data)


def test_oversized_header_rejected_before_its_body_arrives():
    with pytest.raises(FrameError):
        framing.Decoder().feed(b"TP\x01\x04\x10\x00\x00\x00")  # 256 MiB announced, nothing sent


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
