"""Handoff errors, typed by whose fault they are and what the peer is told.

FrameError: the bytes are not a frame (bad magic, oversized, truncated): the peer is broken.
VersionMismatch: a frame of another protocol version (answered with RejectReason.VERSION).
MessageError: a well-formed frame whose content is wrong (unknown kind, missing or mistyped field).
Rejected: the node refused a request for a stated reason (busy, too long, ...); nothing is broken.
AuthError: the peer could not prove it holds the shared secret.
SessionError: a frame after the handshake failed its session tag, or came without one (altered,
  injected, replayed or reordered): the connection ends.
"""

from __future__ import annotations

from enum import StrEnum


class RejectReason(StrEnum):
    """Why a node refuses a handshake or a request; sent on the wire as the value."""

    #: No free slot and no ticket: try another node or later.
    BUSY = "busy"
    #: num_tokens exceeds the node's max_seq_len.
    TOO_LONG = "too_long"
    #: Different protocol version.
    VERSION = "version_mismatch"
    #: Different layout (model, KV-cache dtype, layer count or layout version).
    LAYOUT = "layout_mismatch"
    #: The request id (and sender rank) is already being received.
    DUPLICATE = "duplicate"
    #: The ticket is unknown, expired or was cancelled.
    UNKNOWN_TICKET = "unknown_ticket"
    #: The peer failed the HMAC challenge.
    UNAUTHENTICATED = "not_authenticated"
    #: The message was malformed.
    BAD_REQUEST = "bad_request"
    #: The node is stopping.
    SHUTTING_DOWN = "shutting_down"
    #: Different compatibility generation (tilert_serve/compat.py: served model, weights revision,
    #: layout, protocol), or a sender of an older release that names none.
    COMPAT = "compat_mismatch"


class HandoffError(Exception):
    """Base of every handoff error."""


class FrameError(HandoffError):
    """Bytes that do not form a valid frame."""


class VersionMismatch(FrameError):
    """A frame of a protocol version this side does not speak; `version` is the peer's."""

    def __init__(self, version: int, message: str) -> None:
        super().__init__(message)
        self.version = version


class MessageError(HandoffError):
    """A frame whose kind or fields are invalid."""


class AuthError(HandoffError):
    """The peer does not hold the shared secret (or we do not)."""


class SessionError(AuthError):
    """A frame after the handshake that does not carry this session's tag for its place in the stream."""


class Rejected(HandoffError):
    """The node refused; `reason` says why, the message says what to do."""

    def __init__(self, reason: RejectReason, message: str) -> None:
        super().__init__(f"{reason.value}: {message}")
        self.reason = reason
        self.message = message
