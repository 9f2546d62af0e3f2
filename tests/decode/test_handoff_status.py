"""The node's record of the data plane (HandoffReady): the last handoff it decoded from, with
bytes, seconds, bandwidth and transport; the last data-plane failure with the wire's reason; on the
authenticated /v1/status and as metrics without request ids."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket

from tests.decode import synthetic
from tests.decode.conftest import converter_held, running_node
from tilert_serve.decode.record import link_seconds
from tilert_serve.decode.slots import Slot
from tilert_serve.handoff import auth, framing, messages
from tilert_serve.handoff.errors import RejectReason

CASE = "mla-f32"
LAYOUT = synthetic.layout_for(CASE)
INJECTED = "peer-text-check-the-firewall"


def test_link_seconds_are_the_slowest_ranks_writes_and_never_include_the_forward():
    slot = Slot(0, t_accept=10.0, t_ready=12.5)
    slot.write_s = {0: 0.2, 1: 0.5}
    assert link_seconds(slot, layerwise=True) == 0.5  # ranks write side by side
    slot.write_s = {0: 0.2, 1: None}  # a sender too old to say
    assert link_seconds(slot, layerwise=False) == 2.5  # Accept to the last Done
    # Layer-wise, that span holds the prefill's forward: no bandwidth is claimed from it.
    assert link_seconds(slot, layerwise=True) is None


async def _status(n) -> dict:  # type: ignore[no-untyped-def]
    async with n.session.get(f"{n.url}/v1/status") as r:
        assert r.status == 200
        return (await r.json())["handoff"]


async def _handoff_and_decode(n, request_id: str, secret_file=None) -> tuple[str, int, list]:  # type: ignore[no-untyped-def]
    _, adm = await n.admit(request_id)
    line = await n.send(
        CASE,
        20,
        1,
        "mooncake",
        adm["ticket"],
        request_id=request_id,
        **({"secret_file": secret_file} if secret_file else {}),
    )
    status, events = await n.generate(adm["ticket"], max_tokens=1)
    return line, status, events


async def test_success_then_failures_with_their_reasons(secret_file, tmp_path):
    async with running_node(LAYOUT, secret_file, slots=1, ticket_ttl_s=20) as n:
        h = await _status(n)
        assert h["last_success"] is None and h["last_failure"] is None
        assert h["transport"] == {"engine": "mooncake", "protocol": "tcp"}

        line, status, events = await _handoff_and_decode(n, "good")
        assert json.loads(line[7:])["ok"] and status == 200 and events[-1]["done"]
        h = await _status(n)
        ok = h["last_success"]
        assert ok is not None and h["successes"] == 1 and h["last_failure"] is None
        assert ok["bytes"] > 0
        # Measured over the sender's write calls (Done.write_s), not the whole Accept-to-Done span.
        assert ok["seconds"] > 0 and ok["age_s"] >= 0
        assert ok["bandwidth_bytes_per_s"] == ok["bytes"] / n.node.handoff.ok_seconds

        # A prefill with another secret: refused as not authenticated, which anyone could cause, so it is
        # no failure of the node's yet; the router's generate then times out (the node's own fact), and
        # that failure says how many control connections failed authentication since.
        n.node.slots.ticket_ttl_s = 3.0
        wrong = tmp_path / "wrong"
        wrong.write_text("not-the-secret-0123456789")
        _, adm = await n.admit("bad-secret")
        waiting = asyncio.create_task(n.generate(adm["ticket"], max_tokens=1))
        line = await n.send(
            CASE, 20, 1, "mooncake", adm["ticket"], request_id="bad-secret", secret_file=wrong
        )
        assert json.loads(line[7:])["reason"] == "not_authenticated"
        assert (await _status(n))["last_failure"] is None
        status, events = await waiting
        assert status == 504, events
        h = await _status(n)
        assert h["last_failure"]["reason"] == "timeout", h
        assert h["last_failure"]["failed_authentication"] == 1
        assert "control connections: 1 failed authentication" in h["last_failure"]["message"]
        assert h["unauthenticated"] == {"not_authenticated": 1}
        assert h["last_failure"]["age_s"] <= h["last_success"]["age_s"]

        # A prefill with another layout.
        r = json.loads((await n.send("mla-bf16", 20, 1, "mooncake", None))[7:])
        assert r["reason"] == "layout_mismatch"
        h = await _status(n)
        assert h["last_failure"]["reason"] == "layout_mismatch", h

        # Busy, unknown tickets and too-long requests are not the data plane's failures.
        r = json.loads((await n.send(CASE, 20, 1, "mooncake", "no-such-ticket"))[7:])
        assert r["reason"] == "unknown_ticket"
        assert (await _status(n))["last_failure"]["reason"] == "layout_mismatch"

        # A state that never comes: timeout.
        n.node.slots.ticket_ttl_s = 0.5
        _, adm = await n.admit("never")
        status, _ = await n.generate(adm["ticket"])
        assert status == 504
        assert (await _status(n))["last_failure"]["reason"] == "timeout"

        # Recovery: a good handoff again is the latest event.
        await asyncio.sleep(0.05)
        n.node.slots.ticket_ttl_s = 20
        line, status, _ = await _handoff_and_decode(n, "good-again")
        assert status == 200
        h = await _status(n)
        assert h["successes"] == 2 and h["last_success"]["age_s"] < h["last_failure"]["age_s"]

        async with n.session.get(f"{n.url}/metrics") as resp:
            text = await resp.text()
        assert 'tilert_decode_handoff_failures_total{reason="not_authenticated"}' not in text
        assert 'tilert_decode_handoff_failures_total{reason="timeout"} 2.0' in text
        assert 'tilert_decode_ctrl_unauthenticated_total{reason="not_authenticated"} 1.0' in text
        assert 'tilert_decode_handoff_failures_total{reason="layout_mismatch"} 1.0' in text
        assert "tilert_decode_last_handoff_success_timestamp_seconds" in text
        assert "good" not in text and "bad-secret" not in text  # no request ids in metrics


async def test_digest_mismatch_is_recorded(secret_file):
    async with running_node(LAYOUT, secret_file, slots=1) as n:
        _, adm = await n.admit("torn")
        with converter_held(n.node):  # checked after the bytes change, as if /generate came first
            line = await n.send(CASE, 20, 1, "mooncake", adm["ticket"], request_id="torn")
            assert json.loads(line[7:])["ok"]
            n.node.buffers.views(0)[0][:64] += 1  # the bytes differ from what the sender hashed
        status, _ = await n.generate(adm["ticket"], max_tokens=1)
        assert status == 502
        h = await _status(n)
        assert h["last_failure"]["reason"] == "digest_mismatch" and h["last_success"] is None


async def test_unauthenticated_noise_flips_no_status(secret_file):
    """Anyone reaching the ctrl port: a connect+close, a wrong-MAC Auth, an unsealed Error with its own
    text, a frame of another protocol version. None is the data plane's failure: /v1/status's last failure stays unset and the operator's
    HandoffReady (from this very payload) stays True; each is counted by how it ended."""
    from tilert_operator import observe
    from tilert_operator import status as op_status
    from tilert_serve.router.config import TileRTNode

    async with running_node(LAYOUT, secret_file, slots=1) as n:
        line, status, _ = await _handoff_and_decode(n, "good")
        assert status == 200, line

        def noise() -> None:
            with contextlib.closing(socket.create_connection(("127.0.0.1", n.ctrl_port), timeout=10)):
                pass
            with contextlib.closing(socket.create_connection(("127.0.0.1", n.ctrl_port), timeout=10)) as sock:
                chan = framing.SyncChannel(sock)
                challenge = chan.recv()
                assert isinstance(challenge, messages.Challenge)
                nonce = auth.new_nonce()
                chan.send(
                    messages.Auth(
                        mac=auth.sender_mac(b"w" * 32, challenge.nonce, nonce), nonce=nonce, sender="x"
                    )
                )
                assert isinstance(chan.recv(), messages.Reject)
            with contextlib.closing(socket.create_connection(("127.0.0.1", n.ctrl_port), timeout=10)) as sock:
                chan = framing.SyncChannel(sock)
                chan.recv()
                chan.send(messages.Error(reason=RejectReason.LAYOUT, message=INJECTED))
                with contextlib.suppress(OSError):
                    sock.recv(1)
            with contextlib.closing(socket.create_connection(("127.0.0.1", n.ctrl_port), timeout=10)) as sock:
                framing.SyncChannel(sock).recv()
                sock.sendall(
                    framing.encode(
                        messages.Auth(mac="a" * 64, nonce=auth.new_nonce(), sender="old"), version=1
                    )
                )
                with contextlib.suppress(OSError):
                    sock.recv(4096)

        await asyncio.to_thread(noise)

        async def counted() -> dict:
            for _ in range(500):
                h = await _status(n)
                if h["last_failure"] is not None or sum(h.get("unauthenticated", {}).values()) >= 4:
                    return h
                await asyncio.sleep(0.01)
            raise AssertionError(f"the node did not count the noise: {h}")

        h = await counted()
        assert h["last_failure"] is None and h["failures"] == 0, h
        assert h["unauthenticated"] == {
            "disconnected": 1,
            "not_authenticated": 1,
            "peer_error": 1,
            "version_mismatch": 1,
        }
        assert (h["recent_failed_authentication"], h["recent_version_mismatches"]) == (1, 1)
        async with n.session.get(f"{n.url}/v1/status") as r:
            body = await r.json()
        assert INJECTED not in json.dumps(body)
        report = observe.NodeReport.from_status("node-0", body)
        node = TileRTNode(name="node-0", http_url=n.url, ctrl_host="127.0.0.1", ctrl_port=n.ctrl_port)
        c = op_status.handoff_ready(1, [node], [report])
        assert (c["status"], c["reason"]) == ("True", "HandoffOK"), c
        text = n.node.metrics.render().decode()
        assert 'tilert_decode_ctrl_unauthenticated_total{reason="not_authenticated"} 1.0' in text
        assert "tilert_decode_handoff_failures_total{" not in text
