"""Frames: an 8-byte header (magic, protocol version, kind, body length) and a JSON body.

The codec is pure (bytes <-> messages, incremental decoding, no I/O); `read_message` and
`write_message` (asyncio) and `SyncChannel` (blocking sockets, for the sender thread inside vLLM)
are the thin I/O layers on top.

Protocol versions. A version changes when a message changes incompatibly.
  1: Challenge/Auth/Hello/Request/Accept|Reject/Done/Ack, HMAC-SHA256 mutual authentication.
"""

from __future__ import annotations

import asyncio
import json
import socket
import struct
from typing import Final

from tilert_serve.handoff import messages
from tilert_serve.handoff.errors import FrameError, MessageError

PROTOCOL_VERSION: Final = 1
MAGIC: Final = b"TP"
HEADER: Final = struct.Struct(">2sBBI")
#: Largest body accepted: a Request with the prompt ids of a 200k-token prompt is ~1.5 MB of JSON.
MAX_BODY: Final = 4 * 1024 * 1024


def encode(msg: messages.Message, version: int = PROTOCOL_VERSION) -> bytes:
    body = json.dumps(msg.model_dump(mode="json"), separators=(",", ":")).encode()
    if len(body) > MAX_BODY:
        raise FrameError(f"{type(msg).__name__} body is {len(body)} bytes, over the {MAX_BODY}-byte limit")
    return HEADER.pack(MAGIC, version, msg.KIND, len(body)) + body


def parse_header(header: bytes) -> tuple[int, int, int]:
    """(version, kind, body length) of an 8-byte header; rejects what cannot be a frame."""
    if len(header) != HEADER.size:
        raise FrameError(f"frame header must be {HEADER.size} bytes, got {len(header)}")
    magic, version, kind, length = HEADER.unpack(header)
    if magic != MAGIC:
        raise FrameError(f"bad magic {magic!r} (expected {MAGIC!r}): the peer does not speak the handoff protocol")
    if version != PROTOCOL_VERSION:
        raise FrameError(f"protocol version {version} is not supported (this side speaks {PROTOCOL_VERSION}); "
                         "run the same tilert-pd release on prefill and decode")
    if length > MAX_BODY:
        raise FrameError(f"kind 0x{kind:02x} frame announces {length} body bytes, over the {MAX_BODY}-byte limit")
    return version, kind, length


def parse_body(kind: int, body: bytes) -> messages.Message:
    try:
        data = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise MessageError(f"kind 0x{kind:02x} body is not JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise MessageError(f"kind 0x{kind:02x} body must be a JSON object, got {type(data).__name__}")
    return messages.from_body(kind, data)


class Decoder:
    """Incremental decoder: feed bytes as they arrive, take whole messages out.

    A partial header or body stays buffered; a bad header raises at once, before its body arrives,
    so an oversized length never makes us buffer it.
    """

    def __init__(self) -> None:
        self._buf = bytearray()
        self._pending: tuple[int, int] | None = None  # (kind, length) of a parsed header

    def feed(self, data: bytes) -> list[messages.Message]:
        self._buf += data
        out: list[messages.Message] = []
        while True:
            if self._pending is None:
                if len(self._buf) < HEADER.size:
                    return out
                _, kind, length = parse_header(bytes(self._buf[:HEADER.size]))
                del self._buf[:HEADER.size]
                self._pending = (kind, length)
            kind, length = self._pending
            if len(self._buf) < length:
                return out
            body = bytes(self._buf[:length])
            del self._buf[:length]
            self._pending = None
            out.append(parse_body(kind, body))


async def read_message(reader: asyncio.StreamReader) -> messages.Message:
    """Read one message; IncompleteReadError if the peer closed."""
    _, kind, length = parse_header(await reader.readexactly(HEADER.size))
    return parse_body(kind, await reader.readexactly(length))


async def write_message(writer: asyncio.StreamWriter, msg: messages.Message) -> None:
    writer.write(encode(msg))
    await writer.drain()


class SyncChannel:
    """Blocking framed messages over a socket (the sender runs in a background thread)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock

    @classmethod
    def connect(cls, host: str, port: int, timeout: float) -> SyncChannel:
        sock = socket.create_connection((host, port), timeout=timeout)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return cls(sock)

    def _recv_exactly(self, n: int) -> bytes:
        chunks = bytearray()
        while len(chunks) < n:
            chunk = self.sock.recv(n - len(chunks))
            if not chunk:
                raise ConnectionError(f"peer closed the connection after {len(chunks)} of {n} bytes")
            chunks += chunk
        return bytes(chunks)

    def send(self, msg: messages.Message) -> None:
        self.sock.sendall(encode(msg))

    def recv(self) -> messages.Message:
        _, kind, length = parse_header(self._recv_exactly(HEADER.size))
        return parse_body(kind, self._recv_exactly(length))

    def close(self) -> None:
        self.sock.close()
