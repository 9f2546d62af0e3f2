"""The node's control-plane server: one handoff per connection (see handoff/messages.py).

Between Accept and Done a layer-wise sender may send LayersDone frames (Hello says `layerwise`): each
must name this handoff's request and generation and layers of this sender rank not reported before;
anything else is a protocol error like any other. The node queues each reported layer's digest check
and conversion (node.layers_arrived) while the rest are still being written.

Before the handshake completes a connection is unauthenticated: at most MAX_PREAUTH of them are
held at once (more are told busy and closed), each frame is at most framing.PREAUTH_MAX_BODY bytes,
and the Auth must come within HANDSHAKE_TIMEOUT_S. After it every frame is sealed with the session
keys (framing.Session). Anything wrong, in any phase (a malformed or oversized frame, another
protocol version, a failed MAC or session tag, an unexpected message, a timeout), is answered with
an Error or Reject that names the reason, and the connection is closed; a slot it was given is failed
through the slot table (quarantined on release if its write may still land). The server goes on
serving every other connection.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tilert_serve.decode.slots import DuplicateSender, NodeFull, Slot, UnknownTicket
from tilert_serve.handoff import auth, messages
from tilert_serve.handoff.errors import FrameError, MessageError, RejectReason, SessionError, VersionMismatch
from tilert_serve.handoff.framing import HEADER, PREAUTH_MAX_BODY, Session, read_frame, write_message
from tilert_serve.layouts import senders_layers

if TYPE_CHECKING:
    from tilert_serve.decode.node import DecodeNode

log = logging.getLogger(__name__)

#: Seconds a sender gets for each handshake message; the writes themselves get the slot's deadline.
HANDSHAKE_TIMEOUT_S = 10.0
#: Unauthenticated connections held at once. Each holds at most the stream reader's buffer
#: (READ_LIMIT, twice that before the transport pauses) for HANDSHAKE_TIMEOUT_S.
MAX_PREAUTH = 64
#: asyncio's stream buffer limit for control connections.
READ_LIMIT = 64 * 1024


@dataclass
class _Conn:
    """What one connection holds so far; a slot accepted but not yet reported done is failed on error."""

    session: Session | None = None
    slot: Slot | None = None
    generation: int = 0
    rank: int = 0
    request_id: str = ""
    authenticated: bool = False


class _PeerError(Exception):
    """The sender sent an Error: it gives up on this connection, saying why."""


class _Refuse(Exception):
    def __init__(self, reason: RejectReason, message: str) -> None:
        super().__init__(message)
        self.reason, self.message = reason, message


class ControlServer:
    """Counts unauthenticated connections; `handle` serves one connection."""

    def __init__(self, node: DecodeNode) -> None:
        self.node = node
        self.preauth = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        node = self.node
        peer = writer.get_extra_info("peername")
        conn = _Conn()
        if self.preauth >= MAX_PREAUTH:
            node.metrics.ctrl_errors.labels("preauth_limit").inc()
            await _try_send(writer, messages.Error(reason=RejectReason.BUSY,
                                                   message=f"{MAX_PREAUTH} unauthenticated control connections are "
                                                           "open already; retry"), None)
            writer.close()
            return
        self.preauth += 1
        try:
            await _handoff(node, reader, writer, conn, self)
        except _Refuse as exc:
            node.recorder.ctrl_error(exc.reason.value, exc.message)
            log.info("handoff from %s refused: %s: %s", peer, exc.reason.value, exc.message)
            await _try_send(writer, messages.Reject(request_id=conn.request_id, reason=exc.reason,
                                                    message=exc.message), conn.session)
        except VersionMismatch as exc:
            node.recorder.ctrl_error(RejectReason.VERSION.value, str(exc))
            log.info("handoff from %s: %s", peer, exc)
            # In the peer's version: Error's body is the same in every version, so an older peer reads why.
            await _try_send(writer, messages.Error(reason=RejectReason.VERSION, message=str(exc)), None,
                            version=exc.version)
            _lost(node, conn, f"sender speaks another protocol version: {exc}")
        except SessionError as exc:
            node.recorder.ctrl_error(RejectReason.UNAUTHENTICATED.value, f"session check failed: {exc}")
            log.warning("handoff from %s: session check failed: %s", peer, exc)
            await _try_send(writer, messages.Error(reason=RejectReason.UNAUTHENTICATED, message=str(exc)),
                            conn.session)
            _lost(node, conn, f"the control connection failed its session check: {exc}")
        except (FrameError, MessageError) as exc:
            node.recorder.ctrl_error("bad_request", f"protocol error: {exc}")
            log.warning("handoff from %s: protocol error: %s", peer, exc)
            await _try_send(writer, messages.Error(reason=RejectReason.BAD_REQUEST, message=str(exc)), conn.session)
            _lost(node, conn, f"sender broke the protocol: {exc}")
        except _PeerError as exc:
            node.recorder.ctrl_error("peer_error", str(exc))
            log.info("handoff from %s: the sender gave up: %s", peer, exc)
            _lost(node, conn, str(exc))
        except (asyncio.IncompleteReadError, ConnectionError, TimeoutError) as exc:
            node.recorder.ctrl_error("disconnected", f"sender disconnected or timed out ({type(exc).__name__})")
            if isinstance(exc, TimeoutError):
                await _try_send(writer, messages.Error(reason=RejectReason.BAD_REQUEST,
                                                       message="timed out waiting for the next message"),
                                conn.session)
            # Any part of a frame started (a header, or a body even of zero bytes read after its
            # header) is answered; a peer that closes between frames is not.
            elif isinstance(exc, asyncio.IncompleteReadError) and (exc.partial or exc.expected != HEADER.size):
                await _try_send(writer, messages.Error(
                    reason=RejectReason.BAD_REQUEST,
                    message=f"the connection ended {len(exc.partial)} bytes into a {exc.expected}-byte frame part"),
                    conn.session)
            _lost(node, conn, f"sender disconnected or timed out before reporting done ({type(exc).__name__})")
        except Exception:  # the server must outlive any one connection
            node.recorder.ctrl_error("internal", "internal error in the control plane")
            log.exception("handoff from %s: internal error", peer)
            _lost(node, conn, "internal error in the decode node's control plane; see its log")
        finally:
            if not conn.authenticated:
                self.preauth -= 1
            writer.close()


def _lost(node: DecodeNode, conn: _Conn, error: str) -> None:
    if conn.slot is not None:
        node.slots.writer_lost(conn.slot, conn.generation, conn.rank, error)


async def _try_send(writer: asyncio.StreamWriter, msg: messages.Message, session: Session | None,
                    version: int | None = None) -> None:
    try:
        if version is None:
            await asyncio.wait_for(write_message(writer, msg, session), HANDSHAKE_TIMEOUT_S)
        else:
            await asyncio.wait_for(write_message(writer, msg, session, version), HANDSHAKE_TIMEOUT_S)
    except (ConnectionError, TimeoutError, FrameError):
        pass


async def _read(reader: asyncio.StreamReader, conn: _Conn, kind: type[messages.Message] | tuple[type[messages.Message], ...],
                timeout: float, max_body: int | None = None) -> messages.Message:
    if max_body is None:
        msg, _ = await asyncio.wait_for(read_frame(reader, conn.session), timeout)
    else:
        msg, _ = await asyncio.wait_for(read_frame(reader, conn.session, max_body), timeout)
    if isinstance(msg, messages.Error):
        raise _PeerError(f"the sender reported {msg.reason.value}: {msg.message}"[:1000])
    if not isinstance(msg, kind):
        names = " or ".join(k.__name__ for k in kind) if isinstance(kind, tuple) else kind.__name__
        raise MessageError(f"expected {names}, got {type(msg).__name__}")
    return msg


def _check_auth(node: DecodeNode, nonce: str, a: messages.Auth) -> bytes | None:
    """The accepted secret the sender's MAC was made with (every candidate is tried, in constant time
    each), or None."""
    found = None
    for secret in node.keyring.accepted():
        if auth.verify(auth.sender_mac(secret, nonce, a.nonce), a.mac) and found is None:
            found = secret
    return found


async def _handoff(node: DecodeNode, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                   conn: _Conn, server: ControlServer) -> None:
    nonce = auth.new_nonce()
    await write_message(writer, messages.Challenge(nonce=nonce, node=node.config.name))
    a = await _read(reader, conn, messages.Auth, HANDSHAKE_TIMEOUT_S, PREAUTH_MAX_BODY)
    assert isinstance(a, messages.Auth)
    secret = _check_auth(node, nonce, a)
    if secret is None:
        raise _Refuse(RejectReason.UNAUTHENTICATED,
                      "HMAC does not verify: the sender's handoff secret differs from this node's")
    conn.session = Session.of_node(secret, nonce, a.nonce)
    conn.authenticated = True
    server.preauth -= 1
    if node.stopping:
        raise _Refuse(RejectReason.SHUTTING_DOWN, "the node is stopping; send to another node")
    await write_message(writer, node.hello(auth.node_mac(secret, nonce, a.nonce)), conn.session)
    req = await _read(reader, conn, messages.Request, HANDSHAKE_TIMEOUT_S)
    assert isinstance(req, messages.Request)
    conn.request_id = req.request_id
    refused = _refusal(node, req)
    if refused is not None:
        # An authenticated sender's request for this ticket that can never be served: the request
        # fails now, naming why, instead of when its ticket expires.
        if req.ticket is not None and (slot := node.slots.find(req.ticket)) is not None:
            node.slots.fail(slot, f"the prefill's state was refused: {refused.reason.value}: {refused.message}")
        raise refused
    try:
        slot = node.slots.accept(ticket=req.ticket, request_id=req.request_id, rank=req.sender_rank,
                                 num_senders=req.num_senders, num_tokens=req.num_tokens,
                                 last_prompt_token=req.last_prompt_token, prompt_token_ids=req.prompt_token_ids)
    except NodeFull as exc:
        raise _Refuse(RejectReason.BUSY, f"{exc}; admit through the router or retry") from exc
    except UnknownTicket as exc:
        raise _Refuse(RejectReason.UNKNOWN_TICKET, str(exc)) from exc
    except DuplicateSender as exc:
        raise _Refuse(RejectReason.DUPLICATE, str(exc)) from exc
    conn.slot, conn.generation, conn.rank = slot, slot.generation, req.sender_rank
    await _receive(node, reader, writer, conn, req, slot)


def _refusal(node: DecodeNode, req: messages.Request) -> _Refuse | None:
    """Why this node can never take `req`'s state, or None."""
    if req.layout_fingerprint != node.layout.fingerprint:
        return _Refuse(RejectReason.LAYOUT, f"this node runs layout {node.layout.describe()}")
    if req.num_tokens > node.config.max_seq_len:
        return _Refuse(RejectReason.TOO_LONG, f"{req.num_tokens} tokens exceed this node's max_seq_len "
                                              f"{node.config.max_seq_len}")
    if not 0 <= req.sender_rank < req.num_senders:
        return _Refuse(RejectReason.BAD_REQUEST, f"sender_rank {req.sender_rank} not in 0..{req.num_senders - 1}")
    if req.num_senders > node.layout.num_layers:
        return _Refuse(RejectReason.BAD_REQUEST, f"num_senders {req.num_senders} exceeds the layout's "
                                                 f"{node.layout.num_layers} layers")
    return None


def _check_handoff(msg: messages.LayersDone | messages.Done, req: messages.Request, generation: int) -> None:
    """A LayersDone or Done must name the request and slot generation this connection was accepted for."""
    if msg.generation != generation or msg.request_id != req.request_id:
        raise MessageError(f"{type(msg).__name__} names request {msg.request_id!r} generation {msg.generation}, the "
                           f"slot was accepted for {req.request_id!r} generation {generation}")


def _check_layers(msg: messages.LayersDone, req: messages.Request, generation: int, mine: set[int],
                  reported: set[int]) -> None:
    """A LayersDone must name this handoff, and layers this sender rank holds, each once."""
    _check_handoff(msg, req, generation)
    if len(set(msg.layers)) != len(msg.layers):
        raise MessageError(f"LayersDone names a layer twice: {msg.layers}")
    foreign = sorted(set(msg.layers) - mine)
    if foreign:
        raise MessageError(f"LayersDone names layers {foreign}, which sender rank {req.sender_rank} of "
                           f"{req.num_senders} does not send (its layers: {sorted(mine)})")
    again = sorted(set(msg.layers) & reported)
    if again:
        raise MessageError(f"LayersDone reports layers {again} again")


async def _receive(node: DecodeNode, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, conn: _Conn,
                   req: messages.Request, slot: Slot) -> None:
    generation = conn.generation
    await write_message(writer, messages.Accept(request_id=req.request_id, slot=slot.index, generation=generation,
                                                regions=node.buffers.regions(slot.index),
                                                max_tokens=node.config.max_seq_len), conn.session)
    deadline = slot.deadline
    mine = set(senders_layers(node.layout, req.sender_rank, req.num_senders))
    reported: set[int] = set()
    while True:
        frame = await _read(reader, conn, (messages.LayersDone, messages.Done),
                            max(0.0, deadline - node.slots.clock()))
        if isinstance(frame, messages.Done):
            done = frame
            break
        assert isinstance(frame, messages.LayersDone)
        _check_layers(frame, req, generation, mine, reported)
        reported.update(frame.layers)
        node.layers_arrived(slot, generation, req.sender_rank, frame.layers, frame.nbytes, frame.digest)
    _check_handoff(done, req, generation)
    conn.slot = None  # reported: a later disconnect no longer fails the slot
    complete = node.slots.done(slot, generation, req.sender_rank, ok=done.ok, nbytes=done.nbytes, error=done.error,
                               digest=done.digest, writes_started=done.writes_started, write_s=done.write_s)
    status: messages.AckStatus
    if not done.ok:
        status, msg = "failed", slot.error or done.error or ""
    elif slot.generation != generation or slot.request_id != req.request_id:
        status, msg = "failed", "the request was cancelled or expired before its state arrived"
    else:
        status, msg = ("complete" if complete else "waiting_for_ranks"), ""
    await write_message(writer, messages.Ack(request_id=req.request_id, status=status, message=msg), conn.session)
