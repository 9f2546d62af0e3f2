"""Server-sent events: an incremental decoder for upstream streams and the encoders the router writes.

The decoder does no I/O: feed it bytes as they arrive, get back whole events; a partial event waits
in the buffer for the next feed. Events are split on a blank line (`\\n\\n`, also `\\r\\n\\r\\n`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

DONE = b"data: [DONE]\n\n"


@dataclass(frozen=True, slots=True)
class Event:
    #: The `event:` field; "message" when absent, as the SSE spec says.
    event: str
    data: str
    #: The event's bytes as received, blank line included: what a pass-through relay writes on.
    raw: bytes


class Decoder:
    def __init__(self, max_event_bytes: int = 16 * 1024 * 1024) -> None:
        self._buf = b""
        self._max = max_event_bytes

    def feed(self, chunk: bytes) -> list[Event]:
        buf = self._buf + chunk if self._buf else chunk
        if b"\r\n" in buf:
            buf = buf.replace(b"\r\n", b"\n")
        events: list[Event] = []
        start = 0
        while True:
            end = buf.find(b"\n\n", start)
            if end < 0:
                break
            raw = buf[start : end + 2]
            start = end + 2
            if raw.startswith(b"data: ") and raw.find(b"\n", 6) == len(raw) - 2:
                # The common case, one data line: no line splitting needed.
                events.append(Event("message", raw[6:-2].decode("utf-8", errors="replace"), raw))
                continue
            ev = _parse(raw)
            if ev is not None:
                events.append(ev)
        self._buf = buf[start:]
        if len(self._buf) > self._max:
            raise ValueError(f"SSE event larger than {self._max} bytes")
        return events


def _parse(raw: bytes) -> Event | None:
    event = "message"
    data: list[str] = []
    for line in raw.decode("utf-8", errors="replace").split("\n"):
        if not line or line.startswith(":"):
            continue
        name, _, value = line.partition(":")
        if value.startswith(" "):
            value = value[1:]
        if name == "data":
            data.append(value)
        elif name == "event":
            event = value
    if not data and event == "message":
        return None  # comment or keep-alive only
    return Event(event=event, data="\n".join(data), raw=raw)


def data(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def error(message: str, type: str = "upstream_error", code: str | None = None) -> bytes:
    """The stream's last event but [DONE] when it fails after the first byte, as vLLM's OpenAI server
    ends a stream that failed (`data: {"error": {...}}`, no `event:` line, then `data: [DONE]`), so a
    client that handles vLLM's handles ours; OpenAI's Python client raises APIError on it. `code` is
    the failure's kind, a string as in the router's other errors (vLLM puts an HTTP status there)."""
    body = {"error": {"message": message, "type": type, "param": None, "code": code}}
    return data(body)
