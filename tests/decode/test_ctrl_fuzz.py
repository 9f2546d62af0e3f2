"""Fuzzed control-plane input with a real oracle, at three depths of the handshake:

- before authentication: garbage, truncated, oversized and other-version frames, and Auth messages
  whose fields are long enough (64 hex digits) to reach the HMAC check;
- after authentication: sealed frames of every kind with plausible fields (so they reach the message
  logic), and unsealed or altered frames (which must fail the session check);
- after a valid Request (the node's own layout fingerprint): fuzzed Done messages, or fuzzed
  LayersDone frames then a Done, then the router's generate call on the ticket, which must stream or
  fail with a reason.

The oracle: every frame we send is answered with a reasoned Error or Reject (a non-empty message) or
processed (Hello, Accept, Ack); an empty reply is a failure, except where our first frame was itself an
Error (the peer's last word) or we sent nothing. After every example the node must still answer a new
connection with a Challenge, and its catch-all internal-error path must never have run.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import struct
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.decode import handshake, synthetic
from tests.decode.conftest import SECRET, RunningNode, running_node
from tilert_serve import transfer
from tilert_serve.handoff import digest, framing, messages
from tilert_serve.handoff.errors import HandoffError
from tilert_serve.handoff.sender import HandoffRequest, Sender
from tilert_serve.layouts import Placement

CASE = "mla-bf16"
LAYOUT = synthetic.layout_for(CASE)
MAX_SEQ_LEN = 64
HEADER = struct.Struct(">2sBBI")
PROCESSED = (messages.Hello, messages.Accept, messages.Ack)


class NodeThread:
    """A node in its own thread and loop, so synchronous fuzz cases can hit it."""

    def __init__(self, n: RunningNode, loop: asyncio.AbstractEventLoop) -> None:
        self.n, self.loop = n, loop

    @property
    def port(self) -> int:
        return self.n.ctrl_port

    def internal_errors(self) -> float:
        for line in self.n.node.metrics.render().decode().splitlines():
            if line.startswith('tilert_decode_ctrl_errors_total{reason="internal"}'):
                return float(line.split()[-1])
        return 0.0

    def http(self, path: str, body: dict[str, Any]) -> tuple[int, list[Any]]:
        req = urllib.request.Request(
            self.n.url + path, data=json.dumps(body).encode(), headers={"content-type": "application/json"}
        )
        try:
            with urllib.request.urlopen(req, timeout=20) as r:
                text = r.read().decode()
                if r.headers.get("content-type", "").startswith("text/event-stream"):
                    return r.status, [
                        json.loads(ln[6:]) for ln in text.splitlines() if ln.startswith("data: ")
                    ]
                return r.status, [json.loads(text)]
        except urllib.error.HTTPError as exc:
            return exc.code, [json.loads(exc.read().decode())]

    def wait_free(self, timeout: float = 5.0) -> None:
        deadline = time.monotonic() + timeout
        while self.n.node.slots.free == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert self.n.node.slots.free > 0, [s.state for s in self.n.node.slots.slots]

    def check_alive(self) -> None:
        """A new connection still gets a Challenge, and no connection ever hit the internal-error path."""
        with contextlib.closing(socket.create_connection(("127.0.0.1", self.port), timeout=5)) as sock:
            assert isinstance(framing.SyncChannel(sock).recv(), messages.Challenge)
        assert self.n.node.failed is None
        assert self.internal_errors() == 0


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeThread]:
    secret_file = tmp_path_factory.mktemp("fuzz") / "secret"
    secret_file.write_bytes(SECRET)
    started, stop = threading.Event(), threading.Event()
    holder: dict[str, NodeThread] = {}

    async def main() -> None:
        async with running_node(
            LAYOUT,
            secret_file,
            slots=2,
            max_seq_len=MAX_SEQ_LEN,
            ticket_ttl_s=3,
            handoff_timeout_s=2,
            quarantine_s=0.2,
        ) as n:
            holder["node"] = NodeThread(n, asyncio.get_running_loop())
            started.set()
            while not stop.is_set():
                await asyncio.sleep(0.05)

    thread = threading.Thread(target=lambda: asyncio.run(main()), daemon=True)
    thread.start()
    assert started.wait(30)
    yield holder["node"]
    stop.set()
    thread.join(10)


class Conn:
    """A raw client connection that can take the handshake as far as asked."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=5)
        self.chan = framing.SyncChannel(self.sock)
        challenge = self.chan.recv()
        assert isinstance(challenge, messages.Challenge)
        self.challenge = challenge
        #: The node's view of our session, to decode what we send (for the oracle).
        self.mirror: framing.Session | None = None

    def authenticate(self) -> messages.Hello:
        done = handshake.authenticate(self.chan, SECRET, "fuzz", self.challenge)
        self.mirror = framing.Session.of_node(SECRET, self.challenge.nonce, done.nonce)
        assert isinstance(done.reply, messages.Hello), done.reply
        return done.reply

    def request(self, ticket: str | None, num_tokens: int) -> messages.Accept:
        self.chan.send(
            messages.Request(
                request_id="fuzz-req",
                ticket=ticket,
                num_tokens=num_tokens,
                last_prompt_token=1,
                layout_fingerprint=LAYOUT.fingerprint,
                compat=synthetic.unnamed_compat(LAYOUT.fingerprint),
            )
        )
        accept = self.chan.recv()
        assert isinstance(accept, messages.Accept), accept
        return accept

    def finish(self, payload: bytes) -> list[messages.Message]:
        """Send `payload`, half-close, and collect what the node says until it closes."""
        with contextlib.closing(self.sock):
            with contextlib.suppress(OSError):
                self.sock.sendall(payload)
                self.sock.shutdown(socket.SHUT_WR)
            data = b""
            while True:
                try:
                    chunk = self.sock.recv(65536)
                except (TimeoutError, OSError):
                    break
                if not chunk:
                    break
                data += chunk
        return _replies(data, self.chan.session)


def _replies(data: bytes, session: framing.Session | None) -> list[messages.Message]:
    """The node's frames, whatever their version (a version mismatch is answered in the peer's)."""
    out = []
    while data:
        assert len(data) >= HEADER.size, data
        header, (magic, _, _, length) = data[: HEADER.size], HEADER.unpack(data[: HEADER.size])
        assert magic == b"TP" and len(data) >= HEADER.size + length, data
        out.append(framing.open_frame(header, data[HEADER.size : HEADER.size + length], session)[0])
        data = data[HEADER.size + length :]
    return out


def _answer_required(payload: bytes, mirror: framing.Session | None, max_body: int) -> bool:
    """False when we sent nothing, or our first frame is a well-formed Error (the peer's last word)."""
    if not payload:
        return False
    try:
        first = framing.Decoder(mirror, max_body).feed(payload)
    except HandoffError:
        return True
    return not (first and isinstance(first[0], messages.Error))


def _assert_answered(replies: list[messages.Message], required: bool) -> None:
    for msg in replies:
        assert isinstance(msg, (*PROCESSED, messages.Error, messages.Reject)), msg
        if isinstance(msg, (messages.Error, messages.Reject)):
            assert msg.message, msg  # a reason a person can read
    if required:
        assert replies, "the node closed without a word"


# -- strategies ---------------------------------------------------------------------------------

hex64 = st.text(alphabet="0123456789abcdef", min_size=64, max_size=64)
texts = st.one_of(st.text(max_size=300), hex64, st.sampled_from(["\ud800", "a" * 5000, ""]))
ints = st.one_of(st.integers(-5, 2**40), st.integers(2**63, 2**70), st.sampled_from([0, 1, MAX_SEQ_LEN]))
scalars = st.one_of(ints, texts, st.booleans(), st.none(), st.floats(allow_nan=True))
values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=8,
)
FIELDS = [
    "request_id",
    "ticket",
    "num_tokens",
    "last_prompt_token",
    "layout_fingerprint",
    "sender_rank",
    "num_senders",
    "generation",
    "ok",
    "nbytes",
    "mac",
    "nonce",
    "sender",
    "digest",
    "writes_started",
    "prompt_token_ids",
    "reason",
    "message",
    "status",
    "error",
    "layers",
]
bodies = st.dictionaries(st.sampled_from(FIELDS), values, max_size=10)


def _raw(kind: int, body: bytes, version: int = 2) -> bytes:
    return HEADER.pack(b"TP", version, kind, len(body)) + body


raw_frames = st.one_of(
    st.binary(max_size=64),
    st.builds(_raw, st.integers(0, 255), st.binary(max_size=64)),
    st.builds(
        lambda v, k, n: HEADER.pack(b"TP", v, k, n),
        st.integers(0, 255),
        st.integers(0, 255),
        st.integers(0, 2**32 - 1),
    ),
    st.builds(lambda k, d: _raw(k, json.dumps(d).encode()), st.sampled_from(sorted(messages.KINDS)), bodies),
    st.builds(lambda d: _raw(messages.Auth.KIND, json.dumps(d).encode(), 1), bodies),  # an older version
    st.just(_raw(messages.Auth.KIND, b"[" * 3000 + b"]" * 3000)),
    st.just(_raw(messages.Auth.KIND, b'{"mac": "\\ud800", "nonce": 1, "sender": "x"}')),
    st.just(_raw(messages.Auth.KIND, b'{"nonce": ' + b"7" * 4000 + b"}")),
)
auths = st.builds(
    lambda mac, nonce, sender, extra: _raw(
        messages.Auth.KIND, json.dumps({"mac": mac, "nonce": nonce, "sender": sender, **extra}).encode()
    ),
    hex64,
    hex64,
    texts,
    bodies,
)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(payloads=st.lists(st.one_of(raw_frames, auths), min_size=1, max_size=3))
def test_unauthenticated_frames_get_a_reason(node, payloads):
    conn = Conn(node.port)
    payload = b"".join(payloads)
    _assert_answered(conn.finish(payload), _answer_required(payload, None, framing.PREAUTH_MAX_BODY))
    node.check_alive()


def _sealed(session: framing.Session, kind: int, body: bytes) -> bytes:
    frame = HEADER.pack(b"TP", 2, kind | framing.SEALED, len(body) + framing.TAG_SIZE) + body
    return frame + session.seal(frame)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    frames=st.lists(
        st.one_of(
            st.tuples(st.just("sealed"), st.sampled_from(sorted(messages.KINDS)), bodies),
            st.tuples(st.just("sealed-bytes"), st.integers(0, 127), st.binary(max_size=64)),
            st.tuples(st.just("raw"), raw_frames, st.none()),
            st.tuples(st.just("altered"), st.sampled_from(sorted(messages.KINDS)), bodies),
        ),
        min_size=1,
        max_size=3,
    )
)
def test_authenticated_frames_get_a_reason(node, frames):
    node.wait_free()
    conn = Conn(node.port)
    conn.authenticate()
    session = conn.chan.session
    assert session is not None
    payload = b""
    for how, a, b in frames:
        if how == "sealed":
            payload += _sealed(session, a, json.dumps(b).encode())
        elif how == "sealed-bytes":
            payload += _sealed(session, a, b)
        elif how == "altered":
            frame = _sealed(session, a, json.dumps(b).encode())
            payload += frame[:-1] + bytes([frame[-1] ^ 1])
        else:
            payload += a
    replies = conn.finish(payload)
    _assert_answered(replies, _answer_required(payload, conn.mirror, framing.MAX_BODY))
    node.check_alive()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    num_tokens=st.integers(1, MAX_SEQ_LEN),
    same_generation=st.booleans(),
    ok=st.booleans(),
    nbytes=st.integers(0, 2**40),
    digest_kind=st.sampled_from(["zeros", "random", "none", "bad-alg"]),
    writes_started=st.booleans(),
    extra=bodies.filter(lambda d: "\\ud800" not in json.dumps(d)),
)
def test_requests_reach_accept_done_and_generation(
    node, num_tokens, same_generation, ok, nbytes, digest_kind, writes_started, extra
):
    node.wait_free()
    status, (adm,) = node.http("/v1/admit", {"request_id": "fuzz-req"})
    assert status == 200, adm
    conn = Conn(node.port)
    conn.authenticate()
    accept = conn.request(adm["ticket"], num_tokens)
    slot = node.n.node.slots.slots[accept.slot]
    ranges = digest.receiver_ranges(node.n.node.buffers.placement, 0, 1, num_tokens)
    written = {
        "zeros": digest.of_ranges(node.n.node.buffers.views(accept.slot), ranges, "blake2b"),
        "random": "blake2b:" + "0" * 64,
        "none": None,
        "bad-alg": "md5:00",
    }[digest_kind]
    body = {
        **{k: v for k, v in extra.items() if k not in messages.Done.model_fields},
        "request_id": "fuzz-req",
        "generation": accept.generation if same_generation else accept.generation + 1,
        "ok": ok,
        "nbytes": nbytes,
        "digest": written,
        "writes_started": writes_started,
    }
    assert conn.chan.session is not None
    payload = _sealed(conn.chan.session, messages.Done.KIND, json.dumps(body).encode())
    replies = conn.finish(payload)
    _assert_answered(replies, True)
    if same_generation:
        assert isinstance(replies[-1], messages.Ack)
        assert replies[-1].status == ("complete" if ok else "failed")
    status, events = node.http("/v1/generate", {"ticket": adm["ticket"], "first_token": 5, "max_tokens": 2})
    if ok and same_generation and digest_kind == "zeros":
        assert status == 200 and events[-1]["done"], events
    else:
        assert status in (502, 504) and events[0]["error"]["message"], (status, events)
    assert slot.state.value in ("free", "quarantined")
    node.check_alive()


layer_lists = st.one_of(st.lists(st.integers(-2, LAYOUT.num_layers + 1), max_size=4), values)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    num_tokens=st.integers(1, MAX_SEQ_LEN),
    frames=st.lists(
        st.tuples(
            layer_lists,
            st.sampled_from([0, 0, 1]),
            st.sampled_from(["zeros", "random", "bad-alg", 7]),
            st.sampled_from(["fuzz-req", "other"]),
        ),
        min_size=1,
        max_size=3,
    ),
)
def test_layers_done_frames_are_validated(node, num_tokens, frames):
    node.wait_free()
    status, (adm,) = node.http("/v1/admit", {"request_id": "fuzz-req"})
    assert status == 200, adm
    conn = Conn(node.port)
    assert conn.authenticate().layerwise
    accept = conn.request(adm["ticket"], num_tokens)
    slot = node.n.node.slots.slots[accept.slot]
    views, place = node.n.node.buffers.views(accept.slot), node.n.node.buffers.placement
    assert conn.chan.session is not None
    payload = b""
    for layers, generation_offset, digest_kind, request_id in frames:
        valid = isinstance(layers, list) and all(
            isinstance(x, int) and 0 <= x < LAYOUT.num_layers for x in layers
        )
        written: object = digest_kind
        if digest_kind == "zeros":
            written = (
                digest.of_ranges(views, digest.receiver_ranges(place, 0, 1, num_tokens, layers), "blake2b")
                if valid and layers
                else "blake2b:" + "0" * 64
            )
        elif digest_kind == "random":
            written = "blake2b:" + "0" * 64
        elif digest_kind == "bad-alg":
            written = "md5:00"
        body = {
            "request_id": request_id,
            "generation": accept.generation + generation_offset,
            "layers": layers,
            "nbytes": 0,
            "digest": written,
        }
        payload += _sealed(conn.chan.session, messages.LayersDone.KIND, json.dumps(body).encode())
    done = {
        "request_id": "fuzz-req",
        "generation": accept.generation,
        "ok": True,
        "nbytes": 0,
        "digest": digest.of_ranges(views, digest.receiver_ranges(place, 0, 1, num_tokens), "blake2b"),
    }
    payload += _sealed(conn.chan.session, messages.Done.KIND, json.dumps(done).encode())
    _assert_answered(conn.finish(payload), True)
    status, events = node.http("/v1/generate", {"ticket": adm["ticket"], "first_token": 5, "max_tokens": 2})
    assert (status == 200 and events[-1]["done"]) or (
        status in (502, 504) and events[0]["error"]["message"]
    ), (status, events)
    assert slot.state.value in ("free", "quarantined")
    node.check_alive()


def test_a_good_handoff_after_the_fuzzing(node):
    node.wait_free()
    conn = Conn(node.port)
    _assert_answered(conn.finish(b"\x00" * 3), True)  # one more broken peer first
    staging = Placement(LAYOUT, max_tokens=16)
    buf = torch.zeros(staging.total_nbytes(), dtype=torch.uint8)
    synthetic.fill(staging, [buf], 16, 3)
    mover = transfer.create("mooncake", host="127.0.0.1", protocol="tcp", role="fuzz-sender")
    mover.register(buf.data_ptr(), buf.numel())
    sender = Sender(name="good", secret=SECRET, engine=mover, staging=staging, staging_buffers=[buf])
    status, (adm,) = node.http("/v1/admit", {"request_id": "good"})
    assert status == 200
    result = sender.send(
        "127.0.0.1",
        node.port,
        HandoffRequest(request_id="good", num_tokens=16, last_prompt_token=1, ticket=adm["ticket"]),
    )
    assert result.ok, result
    status, events = node.http("/v1/generate", {"ticket": adm["ticket"], "first_token": 5, "max_tokens": 2})
    assert status == 200 and events[-1]["finish_reason"] == "length"
    node.check_alive()
