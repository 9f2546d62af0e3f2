"""Frames: an 8-byte header (magic, protocol version, kind, body length), a JSON body, and after the
handshake a 32-byte session tag.

The codec is pure (bytes <-> messages, incremental decoding, no I/O); `read_message` and
`write_message` (asyncio) and `SyncChannel` (blocking sockets, for the sender thread inside vLLM)
are the thin I/O layers on top.

Sealed frames. Once both sides hold the session keys (auth.session_keys), every frame is sealed: the
kind byte carries SEALED (0x80), the length counts the body plus the tag, and the tag is
HMAC-SHA256(direction key, 8-byte big-endian sequence number || header || body). The sequence number
is implicit (each side counts the frames of each direction from 0), so a dropped, replayed or
reordered frame fails its tag like an altered one. Once the session is established (the node: the
sender's Auth verified; the sender: the first sealed frame from the node, the Hello, opened) every
frame must be sealed, an Error or Reject included: an unsealed one can only come from someone on the
path, and its words must not end the handoff. Before that, the sender takes an unsealed Error or
Reject (the node could not seal it: the sender's secret differs, or the frame is too old), and such a
refusal ends the connection.

Protocol versions. A version changes when a message changes incompatibly.
  1: Challenge/Auth/Hello/Request/Accept|Reject/Done/Ack, HMAC-SHA256 mutual authentication.
  2: frames after the handshake sealed with per-connection keys (above); Done carries `digest` and
     `writes_started`; a frame of another version is answered with Error(version_mismatch), encoded
     in the peer's version (Error's body is the same in every version); the first frames (before the
     handshake completes) are limited to PREAUTH_MAX_BODY bytes.
     Within 2: Request and Hello carry `compat`, the compatibility fingerprint (tilert_serve/compat.py).
     No new version for it: the field is optional on the wire, so a sender of the release before reads
     the node's refusal (Reject compat_mismatch, naming the release to run) instead of a version error,
     while a node of that release ignores it and checks the layout alone, as it always did.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import socket
import struct
from typing import Any, Final

from tilert_serve import defaults, keepalive
from tilert_serve.handoff import auth, messages
from tilert_serve.handoff.errors import FrameError, MessageError, SessionError, VersionMismatch

PROTOCOL_VERSION: Final = defaults.HANDOFF_PROTOCOL_VERSION
MAGIC: Final = b"TP"
HEADER: Final = struct.Struct(">2sBBI")
#: Largest body accepted: a Request with the prompt ids of a 200k-token prompt is ~1.5 MB of JSON.
MAX_BODY: Final = 4 * 1024 * 1024
#: Largest body before the handshake completes (a Challenge or Auth is ~250 bytes): an unauthenticated
#: peer can make us buffer no more than this.
PREAUTH_MAX_BODY: Final = 4096
#: Kind-byte flag of a frame that carries a session tag.
SEALED: Final = 0x80
TAG_SIZE: Final = 32
_UNSEALED_OK: Final = frozenset({messages.Error.KIND, messages.Reject.KIND})


class Session:
    """One connection's frame keys and sequence numbers (see the module docstring)."""

    def __init__(self, send_key: bytes, recv_key: bytes, established: bool = False) -> None:
        self._send_key, self._recv_key = send_key, recv_key
        #: The peer proved it holds these keys: from now on an unsealed frame is refused, whatever its kind.
        self.established = established
        #: Frames sealed and opened so far: the next frame's sequence number in each direction.
        self.sent = 0
        self.received = 0

    @classmethod
    def of_node(cls, secret: bytes, node_nonce: str, sender_nonce: str) -> Session:
        to_node, to_sender = auth.session_keys(secret, node_nonce, sender_nonce)
        # The node derives the keys only after the sender's Auth verified: the peer is proven.
        return cls(send_key=to_sender, recv_key=to_node, established=True)

    @classmethod
    def of_sender(cls, secret: bytes, node_nonce: str, sender_nonce: str) -> Session:
        to_node, to_sender = auth.session_keys(secret, node_nonce, sender_nonce)
        return cls(send_key=to_node, recv_key=to_sender)

    @staticmethod
    def _tag(key: bytes, seq: int, frame: bytes) -> bytes:
        return hmac.new(key, seq.to_bytes(8, "big") + frame, hashlib.sha256).digest()

    def seal(self, frame: bytes) -> bytes:
        tag = self._tag(self._send_key, self.sent, frame)
        self.sent += 1
        return tag

    def open(self, frame: bytes, tag: bytes, kind: int) -> None:
        seq = self.received
        self.received += 1
        if not hmac.compare_digest(self._tag(self._recv_key, seq, frame), tag):
            name = getattr(messages.KINDS.get(kind), "__name__", f"kind 0x{kind:02x}")
            raise SessionError(
                f"{name} frame #{seq} of this session does not verify: it was altered, injected, "
                "replayed or reordered on the way (or the peer lost the session)"
            )
        self.established = True


def encode(msg: messages.Message, session: Session | None = None, version: int = PROTOCOL_VERSION) -> bytes:
    body = json.dumps(msg.model_dump(mode="json"), separators=(",", ":")).encode()
    if len(body) > MAX_BODY:
        raise FrameError(f"{type(msg).__name__} body is {len(body)} bytes, over the {MAX_BODY}-byte limit")
    if session is None:
        return HEADER.pack(MAGIC, version, msg.KIND, len(body)) + body
    frame = HEADER.pack(MAGIC, version, msg.KIND | SEALED, len(body) + TAG_SIZE) + body
    return frame + session.seal(frame)


def parse_header(header: bytes, max_body: int = MAX_BODY) -> tuple[int, int, int]:
    """(version, kind byte, payload length) of an 8-byte header; rejects what cannot be a frame, and a
    length over `max_body` (plus the tag of a sealed frame) before its payload is read."""
    if len(header) != HEADER.size:
        raise FrameError(f"frame header must be {HEADER.size} bytes, got {len(header)}")
    magic, version, kind, length = HEADER.unpack(header)
    if magic != MAGIC:
        raise FrameError(
            f"bad magic {magic!r} (expected {MAGIC!r}): the peer does not speak the handoff protocol"
        )
    if version != PROTOCOL_VERSION:
        raise VersionMismatch(
            version,
            f"protocol version {version} is not supported (this side speaks "
            f"{PROTOCOL_VERSION}); run the same tilert-pd release on prefill and decode",
        )
    limit = max_body + (TAG_SIZE if kind & SEALED else 0)
    if length > limit:
        raise FrameError(
            f"kind 0x{kind:02x} frame announces {length} body bytes, over the {limit}-byte limit"
        )
    return version, kind, length


def open_frame(header: bytes, payload: bytes, session: Session | None) -> tuple[messages.Message, bool]:
    """The message of a whole frame (header already checked by parse_header) and whether it was sealed."""
    kind_byte = header[3]
    kind, sealed = kind_byte & ~SEALED, bool(kind_byte & SEALED)
    if sealed:
        if session is None:
            raise FrameError(f"kind 0x{kind:02x} frame is sealed, but the handshake has not finished")
        if len(payload) < TAG_SIZE:
            raise FrameError(
                f"sealed kind 0x{kind:02x} frame has {len(payload)} bytes, less than its {TAG_SIZE}-byte tag"
            )
        body, tag = payload[:-TAG_SIZE], payload[-TAG_SIZE:]
        session.open(header + body, tag, kind)
        return parse_body(kind, body), True
    if session is not None and (session.established or kind not in _UNSEALED_OK):
        name = getattr(messages.KINDS.get(kind), "__name__", f"kind 0x{kind:02x}")
        raise SessionError(
            f"{name} frame without a session tag after the handshake (injected on the way, or the "
            "peer lost the session)"
        )
    return parse_body(kind, payload), False


def parse_body(kind: int, body: bytes) -> messages.Message:
    if kind not in messages.KINDS:
        raise MessageError(f"unknown message kind 0x{kind:02x}; known kinds: {sorted(messages.KINDS)}")
    try:
        data = json.loads(body.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise MessageError(f"kind 0x{kind:02x} body is not UTF-8: {exc.reason} at byte {exc.start}") from exc
    except RecursionError as exc:
        raise MessageError(f"kind 0x{kind:02x} body nests too deeply") from exc
    except ValueError as exc:  # JSONDecodeError, and integers past Python's digit limit
        raise MessageError(f"kind 0x{kind:02x} body is not JSON we take: {str(exc)[:200]}") from exc
    if not isinstance(data, dict):
        raise MessageError(f"kind 0x{kind:02x} body must be a JSON object, got {type(data).__name__}")
    if b"\\u" in body:
        _no_lone_surrogates(kind, data)
    return messages.from_body(kind, data)


def _no_lone_surrogates(kind: int, data: Any) -> None:
    """JSON escapes can spell lone surrogates (\\ud800), which are no text: refuse them here rather
    than fail later when the string is encoded (a MAC, a log line)."""
    stack = [data]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError as exc:
                raise MessageError(
                    f"kind 0x{kind:02x} body has a string with a lone surrogate "
                    f"(\\u{ord(item[exc.start]):04x})"
                ) from exc


class Decoder:
    """Incremental decoder: feed bytes as they arrive, take whole messages out.

    A partial header or body stays buffered; a bad header raises at once, before its body arrives,
    so an oversized length never makes us buffer it. Set `session` once the handshake is done.
    """

    def __init__(self, session: Session | None = None, max_body: int = MAX_BODY) -> None:
        self.session = session
        self.max_body = max_body
        self._buf = bytearray()
        self._pending: bytes | None = None  # a parsed header whose payload has not all arrived

    def feed(self, data: bytes) -> list[messages.Message]:
        self._buf += data
        out: list[messages.Message] = []
        while True:
            if self._pending is None:
                if len(self._buf) < HEADER.size:
                    return out
                header = bytes(self._buf[: HEADER.size])
                parse_header(header, self.max_body)
                del self._buf[: HEADER.size]
                self._pending = header
            length = HEADER.unpack(self._pending)[3]
            if len(self._buf) < length:
                return out
            payload = bytes(self._buf[:length])
            del self._buf[:length]
            header, self._pending = self._pending, None
            out.append(open_frame(header, payload, self.session)[0])


async def read_frame(
    reader: asyncio.StreamReader, session: Session | None = None, max_body: int = MAX_BODY
) -> tuple[messages.Message, bool]:
    """Read one message and whether it was sealed; IncompleteReadError if the peer closed."""
    header = await reader.readexactly(HEADER.size)
    length = parse_header(header, max_body)[2]
    return open_frame(header, await reader.readexactly(length), session)


async def read_message(
    reader: asyncio.StreamReader, session: Session | None = None, max_body: int = MAX_BODY
) -> messages.Message:
    return (await read_frame(reader, session, max_body))[0]


async def write_message(
    writer: asyncio.StreamWriter,
    msg: messages.Message,
    session: Session | None = None,
    version: int = PROTOCOL_VERSION,
) -> None:
    writer.write(encode(msg, session, version))
    await writer.drain()


#: Longest a connect to a decode node may take. A live node's kernel answers the handshake at once
#: (accepting needs no help from the process); an address that stays silent belongs to a pod that is
#: gone without a reset (deleted with its network, its machine lost), and every second waited there
#: holds one of the prefill's staging regions that other requests' handoffs need.
CONNECT_TIMEOUT_S: Final = 3.0


class SyncChannel:
    """Blocking framed messages over a socket (the sender runs in a background thread). Set `session`
    once the handshake is done: later frames are sealed and checked."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.session: Session | None = None

    @classmethod
    def connect(
        cls, host: str, port: int, timeout: float, connect_timeout: float = CONNECT_TIMEOUT_S
    ) -> SyncChannel:
        """`timeout`: the longest wait for one message. `connect_timeout` and the keepalive
        (tilert_serve/keepalive.py) are shorter: they tell a peer that is gone from one that is slow."""
        sock = socket.create_connection((host, port), timeout=min(connect_timeout, timeout))
        sock.settimeout(timeout)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        keepalive.detect_silent_peer(sock)
        return cls(sock)

    def _recv_exactly(self, n: int) -> bytes:
        chunks = bytearray()
        while len(chunks) < n:
            chunk = self.sock.recv(n - len(chunks))
            if not chunk:
                raise ConnectionError(f"peer closed the connection after {len(chunks)} of {n} bytes")
            chunks += chunk
        return bytes(chunks)

    def send(self, msg: messages.Message, version: int = PROTOCOL_VERSION) -> None:
        self.sock.sendall(encode(msg, self.session, version))

    def recv_frame(self, max_body: int = MAX_BODY) -> tuple[messages.Message, bool]:
        header = self._recv_exactly(HEADER.size)
        length = parse_header(header, max_body)[2]
        return open_frame(header, self._recv_exactly(length), self.session)

    def recv(self, max_body: int = MAX_BODY) -> messages.Message:
        return self.recv_frame(max_body)[0]

    def close(self) -> None:
        self.sock.close()
