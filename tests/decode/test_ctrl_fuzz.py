"""Fuzzed control-plane input: garbage, truncated and oversized frames, wrong magic or version, bad
fields before and after authentication. Each is refused or dropped, and the node keeps serving."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import struct
import threading
from collections.abc import Iterator

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.decode import synthetic
from tests.decode.conftest import SECRET, running_node
from tilert_serve import transfer
from tilert_serve.handoff import auth, framing, messages
from tilert_serve.handoff.sender import HandoffRequest, Sender
from tilert_serve.layouts import Placement

CASE = "mla-bf16"
LAYOUT = synthetic.layout_for(CASE)


@pytest.fixture(scope="module")
def node_in_thread(tmp_path_factory) -> Iterator[tuple[int, object]]:
    """A node running in its own thread and loop, so synchronous fuzz cases can hit it."""
    secret_file = tmp_path_factory.mktemp("fuzz") / "secret"
    secret_file.write_bytes(SECRET)
    started, stop = threading.Event(), threading.Event()
    holder: dict[str, object] = {}

    async def main() -> None:
        async with running_node(LAYOUT, secret_file, slots=1, ticket_ttl_s=2, handoff_timeout_s=2) as n:
            holder["node"] = n
            started.set()
            while not stop.is_set():
                await asyncio.sleep(0.05)

    thread = threading.Thread(target=lambda: asyncio.run(main()), daemon=True)
    thread.start()
    assert started.wait(30)
    n = holder["node"]
    yield n.ctrl_port, n  # type: ignore[attr-defined]
    stop.set()
    thread.join(10)


def _exchange(port: int, payloads: list[bytes], authenticate: bool) -> list[messages.Message]:
    """Send payloads after the challenge (and auth); collect what the node says until it closes."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    dec = framing.Decoder()
    got: list[messages.Message] = []
    with contextlib.closing(sock):
        challenge = framing.SyncChannel(sock).recv()
        assert isinstance(challenge, messages.Challenge)
        if authenticate:
            nonce = auth.new_nonce()
            sock.sendall(framing.encode(messages.Auth(mac=auth.sender_mac(SECRET, challenge.nonce, nonce),
                                                      nonce=nonce, sender="fuzz")))
            got.append(framing.SyncChannel(sock).recv())
        with contextlib.suppress(OSError):
            for p in payloads:
                sock.sendall(p)
            sock.shutdown(socket.SHUT_WR)
        while True:
            try:
                data = sock.recv(65536)
            except (TimeoutError, OSError):
                break
            if not data:
                break
            got += dec.feed(data)
    return got


def _assert_refused(replies: list[messages.Message]) -> None:
    for msg in replies:
        assert isinstance(msg, (messages.Hello, messages.Error, messages.Reject, messages.Accept,
                                messages.Ack)), msg
    for msg in replies:
        if isinstance(msg, (messages.Error, messages.Reject)):
            assert msg.message  # a reason a person can read


def _good_handoff(port: int) -> None:
    staging = Placement(LAYOUT, max_tokens=16)
    buf = torch.zeros(staging.total_nbytes(), dtype=torch.uint8)
    synthetic.fill(staging, [buf], 16, 3)
    mover = transfer.create("mooncake", host="127.0.0.1", protocol="tcp", role="fuzz-sender")
    mover.register(buf.data_ptr(), buf.numel())
    sender = Sender(name="good", secret=SECRET, engine=mover, staging=staging, staging_addrs=[buf.data_ptr()])
    result = sender.send("127.0.0.1", port, HandoffRequest(request_id="good", num_tokens=16, last_prompt_token=1))
    assert result.ok, result


header = struct.Struct(">2sBBI")
frames = st.one_of(
    st.binary(max_size=64),
    st.builds(lambda k, body: header.pack(b"TP", 1, k, len(body)) + body, st.integers(0, 255), st.binary(max_size=64)),
    st.builds(lambda v, k, n: header.pack(b"TP", v, k, n), st.integers(0, 255), st.integers(0, 255),
              st.integers(0, 2**32 - 1)),
    st.builds(lambda k, obj: header.pack(b"TP", 1, k, len(obj)) + obj, st.sampled_from(sorted(messages.KINDS)),
              st.dictionaries(st.sampled_from(["request_id", "ticket", "num_tokens", "last_prompt_token",
                                               "layout_fingerprint", "sender_rank", "num_senders", "generation",
                                               "ok", "nbytes", "mac", "nonce"]),
                              st.one_of(st.integers(-5, 2**40), st.text(max_size=8), st.booleans(), st.none()),
                              max_size=8).map(lambda d: json.dumps(d).encode())),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(payloads=st.lists(frames, min_size=1, max_size=3), authenticate=st.booleans())
def test_fuzzed_frames_are_refused_and_the_node_survives(node_in_thread, payloads, authenticate):
    port, _ = node_in_thread
    _assert_refused(_exchange(port, payloads, authenticate))


def test_good_handoff_after_the_fuzzing(node_in_thread):
    port, n = node_in_thread
    _exchange(port, [b"\x00" * 3], authenticate=False)  # one more broken peer first
    _good_handoff(port)
    assert n.node.metrics.render().count(b"tilert_decode_ctrl_errors_total") >= 1  # type: ignore[attr-defined]
