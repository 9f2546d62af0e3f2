"""The node's control-plane server: one handoff per connection (see handoff/messages.py).

Between Accept and Done a layer-wise sender may send LayersDone frames (Hello says `layerwise`): each
must name this handoff's request and generation and layers of this sender rank not reported before;
anything else is a protocol error like any other. The node queues each reported layer's digest check
and conversion (the node's handoff pipeline, decode/pipeline.py) while the rest are still being written.

The server sees the node only through `ControlNode`: the slot table (the owner of every slot
transition), the recorder (the owner of the data-plane record), the terms a Request is checked
against, the handshake's Hello and secrets, the slots' regions and where reported layers go.

Before the handshake completes a connection is unauthenticated. Anyone who reaches the port can open
such connections and hold them, so they are admitted by a gate (`PreauthGate`) built so that a real
prefill is never starved by them: a sender answers the Challenge within a round trip, so each gets
AUTH_TIMEOUT_S for its Auth; each frame is at most framing.PREAUTH_MAX_BODY bytes; one source address
(an IPv6 /64) holds at most MAX_PREAUTH_PER_SOURCE, and a newcomer past that evicts its own source's
oldest; at MAX_PREAUTH in all, a newcomer evicts the oldest connection of the worst source (most held,
plus a decaying count of its connections that ended unauthenticated), or is itself told busy when its
own source is the worst. A crowd of idle connections thus churns among its own sources, while a
sender that authenticates in a round trip is never the one evicted or refused.

After the handshake every frame is sealed with the session keys (framing.Session). Anything wrong, in
any phase (a malformed or oversized frame, another protocol version, a failed MAC or session tag, an
unexpected message, a timeout), is answered with an Error or Reject that names the reason, and the
connection is closed; a slot it was given is failed through the slot table (quarantined on release if
its write may still land). The server goes on serving every other connection. What an
unauthenticated connection did is counted apart (record.py) and never becomes the node's data-plane
failure; what is recorded is the node's own words, never the peer's text.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from tilert_serve.compat import Compat
from tilert_serve.decode.record import Recorder
from tilert_serve.decode.slots import DuplicateSender, NodeFull, Slot, SlotTable, UnknownTicket
from tilert_serve.handoff import auth, messages
from tilert_serve.handoff.errors import FrameError, MessageError, RejectReason, SessionError, VersionMismatch
from tilert_serve.handoff.framing import HEADER, PREAUTH_MAX_BODY, Session, encode, read_frame, write_message
from tilert_serve.layouts import Layout, senders_layers

log = logging.getLogger(__name__)

#: Seconds an authenticated sender gets for each handshake message; the writes themselves get the
#: slot's deadline.
HANDSHAKE_TIMEOUT_S = 10.0
#: Seconds from accepting a connection to its Auth: a real sender answers the Challenge within a round
#: trip and one HMAC; an idle connection is closed after this.
AUTH_TIMEOUT_S = 3.0
#: Unauthenticated connections held at once. Each holds at most the stream reader's buffer
#: (READ_LIMIT, twice that before the transport pauses) for AUTH_TIMEOUT_S.
MAX_PREAUTH = 64
#: Unauthenticated connections held at once from one source address (an IPv6 /64): a TP=8 prefill
#: opening one connection per rank for two requests at once fits.
MAX_PREAUTH_PER_SOURCE = 16
#: Half-life of a source's count of connections that ended unauthenticated (evicted, timed out,
#: refused, failed the MAC).
STRIKE_HALF_LIFE_S = 60.0
#: Sources whose strikes are remembered; past it the least suspicious are forgotten.
MAX_SOURCES = 4096
#: asyncio's stream buffer limit for control connections.
READ_LIMIT = 64 * 1024
#: Connections that end before authenticating are anyone's to cause: each is logged at debug only,
#: and their counts by reason at most once per this many seconds (the metric counts every one).
UNAUTHENTICATED_LOG_INTERVAL_S = 60.0


def source_of(peername: object) -> str:
    """The address a connection is counted under: the IPv4 address, or the IPv6 /64 (one host's
    addresses are a whole /64)."""
    host = peername[0] if isinstance(peername, tuple) and peername else peername
    try:
        addr = ipaddress.ip_address(str(host).split("%", 1)[0])
    except ValueError:
        return str(host)
    if isinstance(addr, ipaddress.IPv6Address):
        if addr.ipv4_mapped is not None:
            return str(addr.ipv4_mapped)
        return str(ipaddress.IPv6Network((addr, 64), strict=False))
    return str(addr)


@dataclass(eq=False)
class Preauth:
    """One unauthenticated connection's place in the gate."""

    source: str
    opened: float
    #: Cancelled to evict the connection.
    task: asyncio.Task[None] | None
    evicted: bool = False


@dataclass
class PreauthGate:
    """Which unauthenticated connections are held; the one owner of their admission, eviction and
    release (see the module docstring). Plain data on an injected clock; the event loop is its only
    caller."""

    limit: int = MAX_PREAUTH
    per_source: int = MAX_PREAUTH_PER_SOURCE
    clock: Callable[[], float] = time.monotonic
    #: Held connections per source, oldest first.
    held: dict[str, list[Preauth]] = field(default_factory=dict)
    #: Per source: (strikes, clock when last updated); decays with STRIKE_HALF_LIFE_S.
    strikes: dict[str, tuple[float, float]] = field(default_factory=dict)

    @property
    def count(self) -> int:
        return sum(len(v) for v in self.held.values())

    def _strikes(self, source: str, now: float) -> float:
        value, at = self.strikes.get(source, (0.0, now))
        return value * math.pow(0.5, (now - at) / STRIKE_HALF_LIFE_S)

    def strike(self, source: str) -> None:
        now = self.clock()
        self.strikes[source] = (self._strikes(source, now) + 1.0, now)
        if len(self.strikes) > MAX_SOURCES:
            keep = sorted(self.strikes, key=lambda s: self._strikes(s, now), reverse=True)[: MAX_SOURCES // 2]
            self.strikes = {s: self.strikes[s] for s in keep}

    def admit(self, source: str, task: asyncio.Task[None] | None) -> tuple[Preauth | None, Preauth | None]:
        """(the newcomer's place, or None: refuse it as busy; the connection to evict, or None)."""
        now = self.clock()
        mine = self.held.get(source, [])
        worst = None
        if len(mine) >= self.per_source:
            worst = source
        elif self.count >= self.limit:

            def badness(s: str) -> tuple[float, float]:
                held = self.held.get(s, [])
                # Ties go to the source whose oldest connection is the oldest.
                return len(held) + (s == source) + self._strikes(s, now), -(held[0].opened if held else now)

            worst = max({*self.held, source}, key=badness)
        victim = None
        if worst == source:
            # The newcomer's own source is the worst: a clean one (a prefill's burst of ranks) trades its
            # oldest for it; one whose connections have been ending unauthenticated is refused, cheaply,
            # instead of churning.
            if not mine or self._strikes(source, now) >= 0.5:
                self.strike(source)
                return None, None
            victim = mine[0]
        elif worst is not None:
            victim = self.held[worst][0]
        if victim is not None:
            self.evict(victim)
        entry = Preauth(source, now, task)
        self.held.setdefault(source, []).append(entry)
        return entry, victim

    def evict(self, entry: Preauth) -> None:
        """Take `entry` out and mark it evicted (its owner cancels its task)."""
        entry.evicted = True
        self.release(entry, authenticated=False)

    def release(self, entry: Preauth, *, authenticated: bool) -> None:
        """The connection authenticated or ended; idempotent."""
        mine = self.held.get(entry.source)
        if mine is None or entry not in mine:
            return
        mine.remove(entry)
        if not mine:
            del self.held[entry.source]
        if not authenticated:
            self.strike(entry.source)


@dataclass
class _Conn:
    """What one connection holds so far; a slot accepted but not yet reported done is failed on error."""

    session: Session | None = None
    slot: Slot | None = None
    generation: int = 0
    rank: int = 0
    request_id: str = ""
    authenticated: bool = False
    place: Preauth | None = None


class _PeerError(Exception):
    """The sender sent an Error: it gives up on this connection, saying why (a RejectReason)."""

    def __init__(self, reason: RejectReason, said: str) -> None:
        super().__init__(f"the sender gave up, reporting {reason.value}")
        #: The sender's own words (sealed: an authenticated sender's): for the request's error only.
        self.reason, self.said = reason, said[:500]


class _Refuse(Exception):
    def __init__(self, reason: RejectReason, message: str) -> None:
        super().__init__(message)
        self.reason, self.message = reason, message


@dataclass(frozen=True)
class Terms:
    """What a sender's Request is checked against: the node's name, its longest sequence, the layout
    it receives and its compatibility generation."""

    node: str
    max_seq_len: int
    layout: Layout
    compat: Compat


class ControlNode(Protocol):
    """What the control server uses of the decode node (node.py implements it)."""

    @property
    def terms(self) -> Terms: ...

    @property
    def slots(self) -> SlotTable: ...

    @property
    def recorder(self) -> Recorder: ...

    @property
    def keyring(self) -> auth.Keyring: ...

    @property
    def stopping(self) -> bool: ...

    def hello(self, mac: str) -> messages.Hello: ...

    def regions(self, index: int) -> list[messages.Region]: ...

    def layers_arrived(
        self, slot: Slot, generation: int, rank: int, layers: list[int], layer_digest: str
    ) -> None: ...


class ControlServer:
    """Admits unauthenticated connections through its gate; `handle` serves one connection."""

    def __init__(self, node: ControlNode) -> None:
        self.node = node
        self.gate = PreauthGate(limit=MAX_PREAUTH, per_source=MAX_PREAUTH_PER_SOURCE, clock=node.slots.clock)
        self._summed_at = -math.inf
        self._summed: dict[str, int] = {}

    def _log(self, conn: _Conn, level: int, msg: str, *args: object) -> None:
        """Log a connection's end: as is when it authenticated; else at debug, plus the counts of such
        endings at most once per UNAUTHENTICATED_LOG_INTERVAL_S (so a crowd cannot flood the log)."""
        if conn.authenticated:
            log.log(level, msg, *args)
            return
        log.debug(msg, *args)
        now = self.node.slots.clock()
        if now - self._summed_at < UNAUTHENTICATED_LOG_INTERVAL_S:
            return
        counts = self.node.recorder.record.unauthenticated
        new = {k: n - self._summed.get(k, 0) for k, n in counts.items() if n > self._summed.get(k, 0)}
        since = "" if math.isinf(self._summed_at) else " since the last such line"
        self._summed_at, self._summed = now, dict(counts)
        log.info(
            "control connections that ended before authenticating%s: %s (each is logged at debug)",
            since,
            ", ".join(f"{n} {k}" for k, n in sorted(new.items())) or "none",
        )

    @property
    def preauth(self) -> int:
        """Unauthenticated connections held now."""
        return self.gate.count

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        node = self.node
        peer = writer.get_extra_info("peername")
        conn = _Conn()
        conn.place, victim = self.gate.admit(source_of(peer), asyncio.current_task())
        if victim is not None and victim.task is not None:
            victim.task.cancel()
        if conn.place is None:
            node.recorder.unauthenticated("refused_busy")
            self._log(
                conn, logging.DEBUG, "control connection from %s refused: its address holds too many", peer
            )
            _say_busy(writer, "too many unauthenticated control connections from this address")
            writer.close()
            return
        try:
            try:
                await _handoff(node, reader, writer, conn, self)
            finally:
                # Out of the gate before any answer is sent: a connection on its way out is never evicted.
                self.gate.release(conn.place, authenticated=conn.authenticated)
        except asyncio.CancelledError:
            if not conn.place.evicted or conn.authenticated:
                raise
            node.recorder.unauthenticated("evicted")
            self._log(conn, logging.DEBUG, "control connection from %s evicted before it authenticated", peer)
            _say_busy(writer, "evicted: too many unauthenticated control connections")
        except _Refuse as exc:
            node.recorder.ctrl_error(exc.reason.value, exc.message, authenticated=conn.authenticated)
            self._log(
                conn, logging.INFO, "handoff from %s refused: %s: %.300r", peer, exc.reason.value, exc.message
            )
            await _try_send(
                writer,
                messages.Reject(request_id=conn.request_id, reason=exc.reason, message=exc.message),
                conn.session,
            )
        except VersionMismatch as exc:
            node.recorder.ctrl_error(
                RejectReason.VERSION.value,
                f"the sender speaks protocol version {exc.version}",
                authenticated=conn.authenticated,
            )
            self._log(conn, logging.INFO, "handoff from %s: %s", peer, exc)
            # In the peer's version: Error's body is the same in every version, so an older peer reads why.
            # Sealed once the session is established: after it, an unsealed frame is refused as injected.
            await _try_send(
                writer,
                messages.Error(reason=RejectReason.VERSION, message=str(exc)),
                conn.session,
                version=exc.version,
            )
            _lost(node, conn, f"sender speaks another protocol version: {exc}")
        except SessionError as exc:
            node.recorder.ctrl_error(
                RejectReason.UNAUTHENTICATED.value,
                f"session check failed: {exc}",
                authenticated=conn.authenticated,
            )
            self._log(conn, logging.WARNING, "handoff from %s: session check failed: %s", peer, exc)
            await _try_send(
                writer, messages.Error(reason=RejectReason.UNAUTHENTICATED, message=str(exc)), conn.session
            )
            _lost(node, conn, f"the control connection failed its session check: {exc}")
        except (FrameError, MessageError) as exc:
            # The message may quote the peer (a field's value): the log has it, the record does not.
            node.recorder.ctrl_error(
                "bad_request",
                f"the sender broke the protocol ({type(exc).__name__}); see the node's log",
                authenticated=conn.authenticated,
            )
            self._log(conn, logging.WARNING, "handoff from %s: protocol error: %.500r", peer, str(exc))
            await _try_send(
                writer, messages.Error(reason=RejectReason.BAD_REQUEST, message=str(exc)), conn.session
            )
            _lost(node, conn, f"sender broke the protocol: {exc}")
        except _PeerError as exc:
            node.recorder.ctrl_error(
                "peer_error", str(exc), authenticated=conn.authenticated, peer_reason=exc.reason.value
            )
            self._log(conn, logging.INFO, "handoff from %s: %s: %.500r", peer, exc, exc.said)
            _lost(node, conn, f"the sender reported {exc.reason.value}: {exc.said}")
        except (asyncio.IncompleteReadError, ConnectionError, TimeoutError) as exc:
            reason = (
                "auth_timeout" if isinstance(exc, TimeoutError) and not conn.authenticated else "disconnected"
            )
            node.recorder.ctrl_error(
                reason,
                f"sender disconnected or timed out ({type(exc).__name__})",
                authenticated=conn.authenticated,
            )
            self._log(conn, logging.DEBUG, "handoff from %s: %s (%s)", peer, reason, type(exc).__name__)
            if isinstance(exc, TimeoutError):
                await _try_send(
                    writer,
                    messages.Error(
                        reason=RejectReason.BAD_REQUEST, message="timed out waiting for the next message"
                    ),
                    conn.session,
                )
            # Any part of a frame started (a header, or a body even of zero bytes read after its
            # header) is answered; a peer that closes between frames is not.
            elif isinstance(exc, asyncio.IncompleteReadError) and (
                exc.partial or exc.expected != HEADER.size
            ):
                await _try_send(
                    writer,
                    messages.Error(
                        reason=RejectReason.BAD_REQUEST,
                        message=f"the connection ended {len(exc.partial)} bytes into a {exc.expected}-byte frame part",
                    ),
                    conn.session,
                )
            _lost(
                node, conn, f"sender disconnected or timed out before reporting done ({type(exc).__name__})"
            )
        except Exception:  # the server must outlive any one connection
            node.recorder.ctrl_error(
                "internal",
                "internal error in the decode node's control plane; see its log",
                authenticated=conn.authenticated,
            )
            log.exception("handoff from %s: internal error", peer)
            _lost(node, conn, "internal error in the decode node's control plane; see its log")
        finally:
            writer.close()


def _say_busy(writer: asyncio.StreamWriter, why: str) -> None:
    """Tell an unauthenticated peer it was turned away, without waiting on it (it holds nothing of ours)."""
    try:
        writer.write(encode(messages.Error(reason=RejectReason.BUSY, message=f"{why}; retry")))
    except (ConnectionError, RuntimeError):
        pass


def _lost(node: ControlNode, conn: _Conn, error: str) -> None:
    if conn.slot is not None:
        node.slots.writer_lost(conn.slot, conn.generation, conn.rank, error)


async def _try_send(
    writer: asyncio.StreamWriter, msg: messages.Message, session: Session | None, version: int | None = None
) -> None:
    try:
        if version is None:
            await asyncio.wait_for(write_message(writer, msg, session), HANDSHAKE_TIMEOUT_S)
        else:
            await asyncio.wait_for(write_message(writer, msg, session, version), HANDSHAKE_TIMEOUT_S)
    except (ConnectionError, TimeoutError, FrameError):
        pass


async def _read(
    reader: asyncio.StreamReader,
    conn: _Conn,
    kind: type[messages.Message] | tuple[type[messages.Message], ...],
    timeout: float,
    max_body: int | None = None,
) -> messages.Message:
    if max_body is None:
        msg, _ = await asyncio.wait_for(read_frame(reader, conn.session), timeout)
    else:
        msg, _ = await asyncio.wait_for(read_frame(reader, conn.session, max_body), timeout)
    if isinstance(msg, messages.Error):
        # Its text is the peer's: the record gets only the reason (an enum).
        raise _PeerError(msg.reason, msg.message)
    if not isinstance(msg, kind):
        names = " or ".join(k.__name__ for k in kind) if isinstance(kind, tuple) else kind.__name__
        raise MessageError(f"expected {names}, got {type(msg).__name__}")
    return msg


def _check_auth(node: ControlNode, nonce: str, a: messages.Auth) -> bytes | None:
    """The accepted secret the sender's MAC was made with (every candidate is tried, in constant time
    each), or None."""
    found = None
    for secret in node.keyring.accepted():
        if auth.verify(auth.sender_mac(secret, nonce, a.nonce), a.mac) and found is None:
            found = secret
    return found


async def _handoff(
    node: ControlNode,
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    conn: _Conn,
    server: ControlServer,
) -> None:
    nonce = auth.new_nonce()
    async with asyncio.timeout(AUTH_TIMEOUT_S):
        await write_message(writer, messages.Challenge(nonce=nonce, node=node.terms.node))
        a = await _read(reader, conn, messages.Auth, AUTH_TIMEOUT_S, PREAUTH_MAX_BODY)
    assert isinstance(a, messages.Auth)
    secret = _check_auth(node, nonce, a)
    if secret is None:
        raise _Refuse(
            RejectReason.UNAUTHENTICATED,
            "HMAC does not verify: the sender's handoff secret differs from this node's",
        )
    conn.session = Session.of_node(secret, nonce, a.nonce)
    conn.authenticated = True
    if conn.place is not None:
        server.gate.release(conn.place, authenticated=True)
    if node.stopping:
        raise _Refuse(RejectReason.SHUTTING_DOWN, "the node is stopping; send to another node")
    await write_message(writer, node.hello(auth.node_mac(secret, nonce, a.nonce)), conn.session)
    req = await _read(reader, conn, messages.Request, HANDSHAKE_TIMEOUT_S)
    assert isinstance(req, messages.Request)
    conn.request_id = req.request_id
    refused = _refusal(node.terms, req)
    if refused is not None:
        # An authenticated sender's request for this ticket that can never be served: the request
        # fails now, naming why, instead of when its ticket expires.
        if req.ticket is not None and (slot := node.slots.find(req.ticket)) is not None:
            node.slots.fail(
                slot, f"the prefill's state was refused: {refused.reason.value}: {refused.message}"
            )
        raise refused
    try:
        slot = node.slots.accept(
            ticket=req.ticket,
            request_id=req.request_id,
            rank=req.sender_rank,
            num_senders=req.num_senders,
            num_tokens=req.num_tokens,
            last_prompt_token=req.last_prompt_token,
            prompt_token_ids=req.prompt_token_ids,
        )
    except NodeFull as exc:
        raise _Refuse(RejectReason.BUSY, f"{exc}; admit through the router or retry") from exc
    except UnknownTicket as exc:
        raise _Refuse(RejectReason.UNKNOWN_TICKET, str(exc)) from exc
    except DuplicateSender as exc:
        raise _Refuse(RejectReason.DUPLICATE, str(exc)) from exc
    conn.slot, conn.generation, conn.rank = slot, slot.generation, req.sender_rank
    await _receive(node, reader, writer, conn, req, slot)


def _refusal(terms: Terms, req: messages.Request) -> _Refuse | None:
    """Why this node can never take `req`'s state, or None."""
    if req.layout_fingerprint != terms.layout.fingerprint:
        return _Refuse(RejectReason.LAYOUT, f"this node runs layout {terms.layout.describe()}")
    mine = terms.compat.fingerprint
    if req.compat is None:
        return _Refuse(
            RejectReason.COMPAT,
            f"the sender named no compatibility generation (this node's is {mine}): it runs an older "
            "tilert-pd release; run the prefill and the decode nodes of the same release",
        )
    if req.compat != mine:
        c = terms.compat
        return _Refuse(
            RejectReason.COMPAT,
            f"the sender's compatibility generation is {req.compat}, this node's {mine} (served model "
            f"{c.model!r}, revision {c.revision!r}, layout {c.layout}, protocol {c.protocol}): check that "
            "the prefill's --served-model-name and model_revision equal the node's --served-model-name "
            "and --model-revision, and that both run the same tilert-pd release; the router pairs only "
            "equal generations",
        )
    if req.num_tokens > terms.max_seq_len:
        return _Refuse(
            RejectReason.TOO_LONG,
            f"{req.num_tokens} tokens exceed this node's max_seq_len {terms.max_seq_len}",
        )
    if not 0 <= req.sender_rank < req.num_senders:
        return _Refuse(
            RejectReason.BAD_REQUEST, f"sender_rank {req.sender_rank} not in 0..{req.num_senders - 1}"
        )
    if req.num_senders > terms.layout.num_layers:
        return _Refuse(
            RejectReason.BAD_REQUEST,
            f"num_senders {req.num_senders} exceeds the layout's {terms.layout.num_layers} layers",
        )
    return None


def _check_handoff(msg: messages.LayersDone | messages.Done, req: messages.Request, generation: int) -> None:
    """A LayersDone or Done must name the request and slot generation this connection was accepted for."""
    if msg.generation != generation or msg.request_id != req.request_id:
        raise MessageError(
            f"{type(msg).__name__} names request {msg.request_id!r} generation {msg.generation}, the "
            f"slot was accepted for {req.request_id!r} generation {generation}"
        )


def _check_layers(
    msg: messages.LayersDone, req: messages.Request, generation: int, mine: set[int], reported: set[int]
) -> None:
    """A LayersDone must name this handoff, and layers this sender rank holds, each once."""
    _check_handoff(msg, req, generation)
    if len(set(msg.layers)) != len(msg.layers):
        raise MessageError(f"LayersDone names a layer twice: {msg.layers}")
    foreign = sorted(set(msg.layers) - mine)
    if foreign:
        raise MessageError(
            f"LayersDone names layers {foreign}, which sender rank {req.sender_rank} of "
            f"{req.num_senders} does not send (its layers: {sorted(mine)})"
        )
    again = sorted(set(msg.layers) & reported)
    if again:
        raise MessageError(f"LayersDone reports layers {again} again")


async def _receive(
    node: ControlNode,
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    conn: _Conn,
    req: messages.Request,
    slot: Slot,
) -> None:
    generation = conn.generation
    accept = messages.Accept(
        request_id=req.request_id,
        slot=slot.index,
        generation=generation,
        regions=node.regions(slot.index),
        max_tokens=node.terms.max_seq_len,
    )
    if writer.transport.is_closing():
        raise ConnectionResetError("the sender's connection closed before its Accept went out")
    # From here the regions may reach the sender (even if the write below fails part-way).
    node.slots.regions_given(slot, generation, req.sender_rank)
    await write_message(writer, accept, conn.session)
    deadline = slot.deadline
    mine = set(senders_layers(node.terms.layout, req.sender_rank, req.num_senders))
    reported: set[int] = set()
    while True:
        frame = await _read(
            reader, conn, (messages.LayersDone, messages.Done), max(0.0, deadline - node.slots.clock())
        )
        if isinstance(frame, messages.Done):
            done = frame
            break
        assert isinstance(frame, messages.LayersDone)
        _check_layers(frame, req, generation, mine, reported)
        reported.update(frame.layers)
        node.layers_arrived(slot, generation, req.sender_rank, frame.layers, frame.digest)
    _check_handoff(done, req, generation)
    conn.slot = None  # reported: a later disconnect no longer fails the slot
    complete = node.slots.done(
        slot,
        generation,
        req.sender_rank,
        ok=done.ok,
        nbytes=done.nbytes,
        error=done.error,
        digest=done.digest,
        writes_started=done.writes_started,
        write_s=done.write_s,
    )
    status: messages.AckStatus
    if not done.ok:
        status, msg = "failed", slot.error or done.error or ""
    elif slot.generation != generation or slot.request_id != req.request_id:
        status, msg = "failed", "the request was cancelled or expired before its state arrived"
    else:
        status, msg = ("complete" if complete else "waiting_for_ranks"), ""
    await write_message(
        writer, messages.Ack(request_id=req.request_id, status=status, message=msg), conn.session
    )
