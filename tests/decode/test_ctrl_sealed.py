"""Issue 22: after the handshake every frame is sealed, an Error included. An on-path relay (no secret)
that injects an unsealed Error must not end a handoff with its own words, on either side, and its
text must land in no record the operator reads."""

from __future__ import annotations

import asyncio
import contextlib
import socket

from tests.decode import handshake, synthetic
from tests.decode.conftest import SECRET, running_node
from tests.decode.test_attacks import NUM_TOKENS, _send, _sender, relay
from tilert_serve.handoff import framing, messages
from tilert_serve.handoff.errors import RejectReason

CASE = "mla-f32"
LAYOUT = synthetic.layout_for(CASE)
INJECTED = "relay-says-check-your-firewall"


def _handshake(port: int) -> tuple[socket.socket, framing.SyncChannel]:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    chan = framing.SyncChannel(sock)
    handshake.hello(chan, SECRET, "s")
    return sock, chan


def _request(chan: framing.SyncChannel, request_id: str, ticket: str) -> None:
    chan.send(
        messages.Request(
            request_id=request_id,
            ticket=ticket,
            num_tokens=NUM_TOKENS,
            last_prompt_token=1,
            layout_fingerprint=LAYOUT.fingerprint,
            compat=synthetic.unnamed_compat(LAYOUT.fingerprint),
        )
    )


async def test_an_unsealed_error_after_the_handshake_is_a_session_failure_at_the_node(secret_file):
    async with running_node(LAYOUT, secret_file, slots=1) as n:
        _, adm = await n.admit("r")

        def inject() -> list[messages.Message]:
            sock, chan = _handshake(n.ctrl_port)
            with contextlib.closing(sock):
                _request(chan, "r", adm["ticket"])
                assert isinstance(chan.recv(), messages.Accept)
                # What a relay can put on the wire: an Error without the session's tag.
                sock.sendall(
                    framing.encode(messages.Error(reason=RejectReason.BAD_REQUEST, message=INJECTED))
                )
                got = []
                with contextlib.suppress(ConnectionError, OSError):
                    got.append(chan.recv())
                return got

        got = await asyncio.to_thread(inject)
        assert got and isinstance(got[0], messages.Error) and got[0].reason == "not_authenticated", got
        async with n.session.get(f"{n.url}/v1/status") as r:
            text = await r.text()
        assert INJECTED not in text
        assert b'tilert_decode_ctrl_errors_total{reason="peer_error"}' not in n.node.metrics.render()


async def test_an_unsealed_error_after_the_hello_does_not_end_the_senders_handoff_in_its_words(secret_file):
    async with running_node(LAYOUT, secret_file, slots=1) as n:

        def swap_accept(frame: bytes) -> bytes:
            if frame[3] & 0x7F != messages.Accept.KIND:
                return frame
            return framing.encode(messages.Error(reason=RejectReason.BUSY, message=INJECTED))

        sender, _ = _sender()
        async with relay(n.ctrl_port, to_sender=swap_accept) as port:
            result = await _send(sender, port, None)
        assert (result.ok, result.reason) == (False, "not_authenticated"), result
        assert INJECTED not in result.message


async def test_a_handoff_that_fails_before_its_accept_went_out_leaves_no_quarantine(secret_file, monkeypatch):
    """Issue 22: the slot was taken for the sender, but the Accept (the regions) never went out: no
    write can land, so the failed slot is freed at once, not held for the quarantine's bound."""
    async with running_node(LAYOUT, secret_file, slots=1, quarantine_s=600) as n:

        def broken(index: int) -> list:
            raise RuntimeError("regions unavailable")

        monkeypatch.setattr(n.node.buffers, "regions", broken)
        _, adm = await n.admit("r")

        def request() -> list[messages.Message]:
            sock, chan = _handshake(n.ctrl_port)
            with contextlib.closing(sock):
                _request(chan, "r", adm["ticket"])
                got = []
                with contextlib.suppress(ConnectionError, OSError):
                    got.append(chan.recv())
                return got

        got = await asyncio.to_thread(request)
        assert not any(isinstance(m, messages.Accept) for m in got), got
        status, _ = await n.generate(adm["ticket"])
        assert status == 502
        assert n.node.slots.slots[0].state.value == "free"
        assert (await n.admit("next"))[0] == 200


async def test_an_authenticated_senders_words_stay_out_of_the_record(secret_file):
    """Even an authenticated sender's text (a failed write's reason, its Error's message) reaches only the
    request's error and the log: the record the operator quotes holds the node's words and the reason."""
    async with running_node(LAYOUT, secret_file, slots=1) as n:
        for how in ("done", "error"):
            _, adm = await n.admit(how)

            def fail(how: str = how, ticket: str = adm["ticket"]) -> None:
                sock, chan = _handshake(n.ctrl_port)
                with contextlib.closing(sock):
                    _request(chan, how, ticket)
                    accept = chan.recv()
                    assert isinstance(accept, messages.Accept)
                    if how == "done":
                        chan.send(
                            messages.Done(
                                request_id=how,
                                generation=accept.generation,
                                ok=False,
                                nbytes=0,
                                error=INJECTED,
                                writes_started=False,
                            )
                        )
                        chan.recv()
                    else:
                        chan.send(messages.Error(reason=RejectReason.LAYOUT, message=INJECTED))

            await asyncio.to_thread(fail)
            status, events = await n.generate(adm["ticket"])
            assert status == 502 and INJECTED in events[0]["error"]["message"]  # the request's own error
            async with n.session.get(f"{n.url}/v1/status") as r:
                h = (await r.json())["handoff"]
            assert h["last_failure"] is not None and INJECTED not in h["last_failure"]["message"], h
            assert h["last_failure"]["reason"] == ("transfer_failed" if how == "done" else "layout_mismatch")
