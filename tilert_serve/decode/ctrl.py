"""The node's control-plane server: one handoff per connection (see handoff/messages.py).

A malformed frame, a failed HMAC or a vanished sender ends that connection (and fails the slot it
had been given, so the slot is freed by the generate call or its deadline); the server goes on
serving every other connection.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tilert_serve.decode.slots import DuplicateSender, NodeFull, Slot, UnknownTicket
from tilert_serve.handoff import auth, messages
from tilert_serve.handoff.errors import FrameError, MessageError, RejectReason
from tilert_serve.handoff.framing import read_message, write_message

if TYPE_CHECKING:
    from tilert_serve.decode.node import DecodeNode

log = logging.getLogger(__name__)

#: Seconds a sender gets for each handshake message; the writes themselves get the slot's deadline.
HANDSHAKE_TIMEOUT_S = 10.0


@dataclass
class _Conn:
    """What one connection holds so far; a slot accepted but not yet reported done is failed on error."""

    slot: Slot | None = None
    generation: int = 0
    request_id: str = ""


class _Refuse(Exception):
    def __init__(self, reason: RejectReason, message: str) -> None:
        super().__init__(message)
        self.reason, self.message = reason, message


async def handle(node: DecodeNode, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    peer = writer.get_extra_info("peername")
    conn = _Conn()
    try:
        await _handoff(node, reader, writer, conn)
    except _Refuse as exc:
        node.metrics.ctrl_errors.labels(exc.reason.value).inc()
        log.info("handoff from %s refused: %s: %s", peer, exc.reason.value, exc.message)
        await _try_send(writer, messages.Reject(request_id=conn.request_id, reason=exc.reason, message=exc.message))
    except (FrameError, MessageError) as exc:
        node.metrics.ctrl_errors.labels("bad_request").inc()
        log.warning("handoff from %s: protocol error: %s", peer, exc)
        await _try_send(writer, messages.Error(reason=RejectReason.BAD_REQUEST, message=str(exc)))
        if conn.slot is not None:
            node.fail_slot(conn.slot, conn.generation, f"sender broke the protocol: {exc}")
    except (asyncio.IncompleteReadError, ConnectionError, TimeoutError) as exc:
        node.metrics.ctrl_errors.labels("disconnected").inc()
        if conn.slot is not None:
            node.fail_slot(conn.slot, conn.generation, f"sender disconnected or timed out before reporting done ({type(exc).__name__})")
    except Exception:  # the server must outlive any one connection
        log.exception("handoff from %s: internal error", peer)
        if conn.slot is not None:
            node.fail_slot(conn.slot, conn.generation, "internal error in the decode node's control plane; see its log")
    finally:
        writer.close()


async def _try_send(writer: asyncio.StreamWriter, msg: messages.Message) -> None:
    try:
        await asyncio.wait_for(write_message(writer, msg), HANDSHAKE_TIMEOUT_S)
    except (ConnectionError, TimeoutError):
        pass


async def _read(reader: asyncio.StreamReader, kind: type[messages.Message], timeout: float) -> messages.Message:
    msg = await asyncio.wait_for(read_message(reader), timeout)
    if isinstance(msg, messages.Error):
        raise ConnectionError(f"peer reported {msg.reason.value}: {msg.message}")
    if not isinstance(msg, kind):
        raise MessageError(f"expected {kind.__name__}, got {type(msg).__name__}")
    return msg


async def _handoff(node: DecodeNode, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                   conn: _Conn) -> None:
    nonce = auth.new_nonce()
    await write_message(writer, messages.Challenge(nonce=nonce, node=node.config.name))
    a = await _read(reader, messages.Auth, HANDSHAKE_TIMEOUT_S)
    assert isinstance(a, messages.Auth)
    if not auth.verify(auth.sender_mac(node.secret, nonce, a.nonce), a.mac):
        raise _Refuse(RejectReason.UNAUTHENTICATED,
                      "HMAC does not verify: the sender's handoff secret differs from this node's")
    if node.stopping:
        raise _Refuse(RejectReason.SHUTTING_DOWN, "the node is stopping; send to another node")
    await write_message(writer, node.hello(auth.node_mac(node.secret, nonce, a.nonce)))
    req = await _read(reader, messages.Request, HANDSHAKE_TIMEOUT_S)
    assert isinstance(req, messages.Request)
    conn.request_id = req.request_id
    if req.layout_fingerprint != node.layout.fingerprint:
        raise _Refuse(RejectReason.LAYOUT, f"this node runs layout {node.layout.describe()}")
    if req.num_tokens > node.config.max_seq_len:
        raise _Refuse(RejectReason.TOO_LONG, f"{req.num_tokens} tokens exceed this node's max_seq_len "
                                             f"{node.config.max_seq_len}")
    if not 0 <= req.sender_rank < req.num_senders:
        raise _Refuse(RejectReason.BAD_REQUEST, f"sender_rank {req.sender_rank} not in 0..{req.num_senders - 1}")
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
    conn.slot, conn.generation = slot, slot.generation
    node.slot_changed(slot)
    generation = slot.generation
    slot.writers += 1
    try:
        await _receive(node, reader, writer, conn, req, slot, generation)
    finally:
        slot.writers -= 1


async def _receive(node: DecodeNode, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, conn: _Conn,
                   req: messages.Request, slot: Slot, generation: int) -> None:
    await write_message(writer, messages.Accept(request_id=req.request_id, slot=slot.index, generation=generation,
                                                regions=node.buffers.regions(slot.index),
                                                max_tokens=node.config.max_seq_len))
    remaining = max(0.0, slot.deadline - node.slots.clock())
    done = await _read(reader, messages.Done, remaining)
    assert isinstance(done, messages.Done)
    if done.generation != generation:
        raise MessageError(f"Done carries generation {done.generation}, the slot was accepted as {generation}")
    conn.slot = None  # reported: a later disconnect no longer fails the slot
    complete = node.rank_done(slot, generation, req.sender_rank, done)
    status: messages.AckStatus
    if not done.ok:
        status, msg = "failed", slot.error or done.error or ""
    else:
        status, msg = ("complete" if complete else "waiting_for_ranks"), ""
    await write_message(writer, messages.Ack(request_id=req.request_id, status=status, message=msg))
