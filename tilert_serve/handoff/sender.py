"""The sending side of a handoff: one blocking call per request and sender rank.

Used by TileRTConnector's background sender thread (never by the forward pass) and by tests and
benchmarks. The state must already sit in a registered staging buffer laid out by `staging`
(a Placement of the same layout). Remote failures are returned as a result, not raised: the caller
turns them into metrics and kv_transfer_params and goes on serving.

After the handshake every frame is sealed with the connection's session keys (framing.Session): a
relay that rewrites the node's Hello (its transfer peer) or Accept (the regions to write) is caught
before a byte is written, and the result says so (reason not_authenticated).

Layer-wise handoff: given a `LayerSource` (the layers the prefill's forward has staged so far), the
sender shakes hands at once, then writes each batch of layers as it is staged and sends a LayersDone
with those layers' digest, so the node verifies and converts them while later layers are still being
computed; the final Done then covers nothing more. A chunked prefill's source also gives the chunks
before the last (`Staged.upto`): their token ranges are written as they are staged, with no frame,
and the last chunk's batches complete the layers (LayersDone, digest over every token). A node whose
Hello does not say `layerwise` (an older node), or a sender without digests, gets the whole-state flow: every
layer is waited for, written, and covered by Done's digest.
"""

from __future__ import annotations

import errno
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from tilert_serve.compat import Compat
from tilert_serve.handoff import auth, digest, messages
from tilert_serve.handoff.errors import FrameError, MessageError, RejectReason, SessionError, VersionMismatch
from tilert_serve.handoff.framing import PREAUTH_MAX_BODY, Session, SyncChannel
from tilert_serve.layouts import Placement, senders_layers, write_ranges
from tilert_serve.transfer import TransferEngine, TransferError, WriteOp


@dataclass(frozen=True)
class HandoffRequest:
    request_id: str
    num_tokens: int
    last_prompt_token: int
    ticket: str | None = None
    prompt_token_ids: list[int] = field(default_factory=list)
    rank: int = 0
    num_senders: int = 1


class _WriteFailed(Exception):
    """A transfer engine write failed; the node has been told (Done not ok)."""


class LayerSourceFailed(Exception):
    """The prefill gave up on the request between layers; the message says why."""


@dataclass(frozen=True)
class Staged:
    """A batch of layers whose tokens `start` to `upto` are in staging. `upto` None: every token from
    `start` to the request's end, so these layers are complete (checked and converted once written);
    else a chunk of a chunked prefill whose later chunks are still to be computed (a paged plane's
    page holding `upto` is partial and comes again, whole, with the next chunk)."""

    layers: list[int]
    start: int = 0
    upto: int | None = None


class LayerSource(Protocol):
    """The layers of one request staged so far, in the order the forward staged them."""

    def next_layers(self, timeout: float) -> Staged | None:
        """The next batch of this rank's layers staged (waiting up to `timeout` seconds; TimeoutError
        after), or None when every layer is complete. Raises LayerSourceFailed when the prefill gave up."""
        ...


@dataclass
class HandoffResult:
    ok: bool
    #: A RejectReason value, "unreachable", "timeout", "transfer_failed" or "protocol"; None when ok.
    reason: str | None = None
    message: str = ""
    nbytes: int = 0
    #: Seconds: connect+handshake, writes (layer-wise: Accept to the last layer's write, waits for the
    #: forward included), done->ack (from the end of the last write).
    handshake_s: float = 0.0
    write_s: float = 0.0
    ack_s: float = 0.0
    #: Layer-wise: layers sent in LayersDone frames, and how many of them before the last batch
    #: (those the node could convert while the prefill still computed).
    layers_sent: int = 0
    layers_early: int = 0
    #: Chunked prefill: bytes written while the prompt's later chunks were still to be computed.
    chunk_bytes: int = 0
    #: Seconds inside the transfer engine's write calls alone (what the link's bandwidth is measured
    #: over; write_s includes the waits for the forward when layer-wise).
    busy_s: float = 0.0


class Sender:
    """`secret`: bytes, or a Keyring (auth.FileKeyring re-reads a rotated secret before each handoff).
    `staging_buffers`: the staging shards as uint8 tensors (this rank's, others None), for the digest:
    in a prefill, the private twin of the registered region that `staging_addrs` point at (registered
    memory can be written by any data-plane peer, so it is never what is hashed; see
    pd_vllm/worker.py StagingPool). `staging_addrs` defaults to their addresses. `send_digest`: put a digest of the written bytes in
    Done (the node refuses a state without one unless it runs with digests off). `compat`: this
    prefill's compatibility fingerprint (tilert_serve/compat.py), sent in every Request; a node of
    another generation refuses it (compat_mismatch) before anything is written. None: the unnamed
    generation of the staging layout (no served model name, no revision), which a node started
    without --served-model-name and --model-revision runs (tests, benchmarks, hand-run nodes)."""

    def __init__(
        self,
        *,
        name: str,
        secret: bytes | auth.Keyring,
        engine: TransferEngine,
        staging: Placement,
        staging_addrs: list[int] | None = None,
        staging_buffers: Sequence[torch.Tensor | None] | None = None,
        timeout_s: float = 30.0,
        send_digest: bool = True,
        compat: str | None = None,
    ) -> None:
        self.name = name
        self.compat = compat if compat is not None else Compat("", "", staging.layout.fingerprint).fingerprint
        self.keyring = auth.keyring(secret)
        self.engine = engine
        self.staging = staging
        self.staging_buffers = staging_buffers
        self.staging_addrs = (
            staging_addrs
            if staging_addrs is not None
            else [0 if b is None else b.data_ptr() for b in (staging_buffers or [])]
        )
        self.timeout_s = timeout_s
        self.send_digest = send_digest
        # Peer handle per node engine identity: connecting (NIXL metadata load) is done once per node.
        self._peers: dict[str, str] = {}

    def send(
        self,
        host: str,
        port: int,
        req: HandoffRequest,
        error: str | None = None,
        layers: LayerSource | None = None,
    ) -> HandoffResult:
        """Hand the request's staged state to the node. With `error`, write nothing and tell the node
        at once that this request's state will not come (so its slot frees now, not at the deadline).
        With `layers`, the state is still being staged: shake hands now and send layers as they come."""
        t0 = time.monotonic()
        try:
            chan = SyncChannel.connect(host, port, timeout=self.timeout_s)
        except OSError as exc:
            return HandoffResult(False, "unreachable", f"cannot reach decode node {host}:{port}: {exc}")
        try:
            return self._send(chan, req, t0, error, layers)
        except TimeoutError as exc:
            if exc.errno == errno.ETIMEDOUT:  # keepalive.py's verdict, not our message timeout
                return HandoffResult(
                    False,
                    "unreachable",
                    f"decode node {host}:{port} went silent (no answer to keepalive probes): it is gone",
                )
            return HandoffResult(
                False, "timeout", f"decode node {host}:{port} did not answer in {self.timeout_s} s"
            )
        except (OSError, ConnectionError) as exc:
            return HandoffResult(False, "unreachable", f"connection to decode node {host}:{port} lost: {exc}")
        except SessionError as exc:
            try:  # the node learns why (sealed: our keys are good, the frames we got were not)
                chan.send(
                    messages.Error(
                        reason=RejectReason.UNAUTHENTICATED,
                        message=f"the node's frames failed the sender's session check: {exc}",
                    )
                )
            except OSError:
                pass
            return HandoffResult(
                False,
                RejectReason.UNAUTHENTICATED.value,
                f"control connection to {host}:{port} failed its session check: {exc}; nothing more was sent",
            )
        except VersionMismatch as exc:
            try:
                chan.send(messages.Error(reason=RejectReason.VERSION, message=str(exc)), version=exc.version)
            except OSError:
                pass
            return HandoffResult(False, RejectReason.VERSION.value, f"decode node {host}:{port}: {exc}")
        except (FrameError, MessageError) as exc:
            return HandoffResult(
                False, "protocol", f"decode node {host}:{port} sent an invalid message: {exc}"
            )
        finally:
            chan.close()

    def _expect(self, chan: SyncChannel, kind: type[messages.Message]) -> messages.Message:
        msg, sealed = chan.recv_frame()
        if isinstance(msg, kind) or isinstance(msg, (messages.Reject, messages.Error)):
            if not sealed and chan.session is not None and not isinstance(msg, kind):
                # A refusal the node could not seal: it is not in our session (wrong secret), or a relay.
                return messages.Error(reason=msg.reason, message=f"(unsealed) {msg.message}")  # type: ignore[attr-defined]
            return msg
        raise MessageError(f"expected {kind.__name__}, got {type(msg).__name__}")

    def _send(
        self, chan: SyncChannel, req: HandoffRequest, t0: float, error: str | None, source: LayerSource | None
    ) -> HandoffResult:
        challenge, _ = chan.recv_frame(PREAUTH_MAX_BODY)
        if not isinstance(challenge, messages.Challenge):
            return _refused(challenge)
        nonce = auth.new_nonce()
        secret = self.keyring.signing()
        chan.send(
            messages.Auth(mac=auth.sender_mac(secret, challenge.nonce, nonce), nonce=nonce, sender=self.name)
        )
        chan.session = Session.of_sender(secret, challenge.nonce, nonce)
        hello = self._expect(chan, messages.Hello)
        if not isinstance(hello, messages.Hello):
            return _refused(hello)
        if not auth.verify(auth.node_mac(secret, challenge.nonce, nonce), hello.mac):
            chan.send(
                messages.Error(reason=RejectReason.UNAUTHENTICATED, message="node proof does not verify")
            )
            return HandoffResult(
                False,
                RejectReason.UNAUTHENTICATED.value,
                f"decode node {hello.node} does not hold the handoff secret; state not sent",
            )
        layout = self.staging.layout
        request = messages.Request(
            request_id=req.request_id,
            ticket=req.ticket,
            num_tokens=req.num_tokens,
            last_prompt_token=req.last_prompt_token,
            prompt_token_ids=req.prompt_token_ids,
            layout_fingerprint=layout.fingerprint,
            sender_rank=req.rank,
            num_senders=req.num_senders,
            compat=self.compat,
        )
        if hello.layout.fingerprint != layout.fingerprint:
            msg = (
                f"node {hello.node} runs layout {hello.layout.model}/{hello.layout.kv_cache_dtype} "
                f"v{hello.layout.version} ({hello.layout.num_layers} layers), this prefill "
                f"{layout.model}/{layout.kv_cache_dtype} v{layout.version} ({layout.num_layers} layers)"
            )
            # The request still goes: the node refuses it and fails its ticket at once, so the client
            # hears why now, not when the ticket expires.
            chan.send(request)
            self._expect(chan, messages.Accept)
            return HandoffResult(False, RejectReason.LAYOUT.value, msg)
        key = f"{hello.transfer}:{hello.peer.get('session_id') or hello.peer.get('agent')}"
        if key not in self._peers:
            self._peers[key] = self.engine.connect(hello.peer)
        chan.send(request)
        accept = self._expect(chan, messages.Accept)
        if not isinstance(accept, messages.Accept):
            return _refused(accept)
        t1 = time.monotonic()
        if error is not None:
            return self._abandon(chan, req, accept, error, t1 - t0, wrote=False)
        dst = Placement(layout, max_tokens=accept.max_tokens, shards=len(accept.regions))
        layerwise = (
            source is not None and hello.layerwise and self.send_digest and self.staging_buffers is not None
        )
        if source is not None and not layerwise:
            # The node (or our digest setting) takes the whole state at once: wait for every layer.
            try:
                while source.next_layers(self.timeout_s) is not None:
                    pass
            except (LayerSourceFailed, TimeoutError) as exc:
                return self._abandon(chan, req, accept, str(exc), t1 - t0, wrote=False)
        h = _Handoff(chan, req, accept, key, dst)
        if layerwise:
            assert source is not None
            return self._send_layers(h, source, hello.digests, t0, t1)
        # Hashed before the write: staging does not change while it is being sent.
        written = self._digest(req, hello.digests)
        try:
            nbytes, busy_s = self._write(h, senders_layers(layout, req.rank, req.num_senders))
        except _WriteFailed as exc:
            return HandoffResult(False, "transfer_failed", str(exc), handshake_s=t1 - t0)
        return self._finish(h, nbytes, written, busy_s, (t0, t1, time.monotonic()))

    def _hash_and_write(
        self, h: _Handoff, layers: list[int], buffers: list[torch.Tensor], algorithm: str, start: int = 0
    ) -> tuple[str, int, float]:
        """The digest of `layers`' staged bytes, every token (hashed before the write: staging does not
        change while it is sent), then the write of tokens `start` on (earlier chunks went before):
        (digest, bytes, seconds)."""
        hashed = digest.of_ranges(
            buffers,
            digest.sender_ranges(self.staging, h.req.rank, h.req.num_senders, h.req.num_tokens, layers),
            algorithm,
        )
        return (hashed, *self._write(h, layers, start))

    def _write(
        self, h: _Handoff, layers: list[int], start: int = 0, upto: int | None = None
    ) -> tuple[int, float]:
        """Write this rank's ranges of `layers`, tokens `start` to `upto` (None: the request's end), into
        the node's slot: (bytes, seconds the write call took). On a transfer error the node's handle is
        forgotten (it may have restarted with new buffers), the node told, and _WriteFailed raised."""
        end = h.req.num_tokens if upto is None else upto
        ops = [
            WriteOp(
                self.staging_addrs[r.src_shard] + r.src, h.accept.regions[r.dst_shard].addr + r.dst, r.nbytes
            )
            for r in write_ranges(self.staging, h.dst, layers, end, start)
        ]
        t = time.monotonic()
        try:
            self.engine.write(self._peers[h.key], ops)
        except TransferError as exc:
            self._peers.pop(h.key, None)
            h.chan.send(
                messages.Done(
                    request_id=h.req.request_id,
                    generation=h.accept.generation,
                    ok=False,
                    nbytes=0,
                    error=str(exc),
                )
            )
            raise _WriteFailed(str(exc)) from exc
        return sum(o.nbytes for o in ops), time.monotonic() - t

    def _abandon(
        self,
        chan: SyncChannel,
        req: HandoffRequest,
        accept: messages.Accept,
        error: str,
        handshake_s: float,
        wrote: bool,
    ) -> HandoffResult:
        """The prefill gave up (before the first write, or between layers): every write call made has
        returned, so no byte of ours can still land (writes_started False lets the node free the slot without quarantine)."""
        chan.send(
            messages.Done(
                request_id=req.request_id,
                generation=accept.generation,
                ok=False,
                nbytes=0,
                error=error,
                writes_started=False,
            )
        )
        self._expect(chan, messages.Ack)
        return HandoffResult(
            False,
            "prefill_failed",
            error + (" (after some layers)" if wrote else ""),
            handshake_s=handshake_s,
        )

    def _send_layers(
        self, h: _Handoff, source: LayerSource, theirs: list[str], t0: float, t1: float
    ) -> HandoffResult:
        mine = set(senders_layers(self.staging.layout, h.req.rank, h.req.num_senders))
        sent: set[int] = set()
        nbytes = last_batch = chunk_bytes = 0
        busy_s = 0.0
        algorithm = digest.preferred(theirs)
        assert self.staging_buffers is not None
        buffers = [b if b is not None else torch.empty(0, dtype=torch.uint8) for b in self.staging_buffers]
        while True:
            # Each batch may take as long as one step of the prefill (a chunked prompt spans many);
            # the node's handoff deadline bounds the whole.
            try:
                staged = source.next_layers(self.timeout_s)
            except (LayerSourceFailed, TimeoutError) as exc:
                return self._abandon(
                    h.chan, h.req, h.accept, str(exc), t1 - t0, wrote=bool(sent) or chunk_bytes > 0
                )
            if staged is None:
                break
            layers = [lid for lid in staged.layers if lid in mine and lid not in sent]
            if not layers:
                continue
            try:
                if staged.upto is None:
                    written, n, seconds = self._hash_and_write(h, layers, buffers, algorithm, staged.start)
                else:
                    written, (n, seconds) = None, self._write(h, layers, staged.start, staged.upto)
            except _WriteFailed as exc:
                return HandoffResult(False, "transfer_failed", str(exc), handshake_s=t1 - t0)
            busy_s += seconds
            nbytes += n
            if written is None:  # a chunk of layers still being computed: written, nothing said
                chunk_bytes += n
                continue
            h.chan.send(
                messages.LayersDone(
                    request_id=h.req.request_id,
                    generation=h.accept.generation,
                    layers=layers,
                    nbytes=n,
                    digest=written,
                )
            )
            sent.update(layers)
            last_batch = len(layers)
        t2 = time.monotonic()
        missing = sorted(mine - sent)
        if missing:
            # Layers the source never gave: written now and covered by Done's digest.
            try:
                rest, n, seconds = self._hash_and_write(h, missing, buffers, algorithm)
            except _WriteFailed as exc:
                return HandoffResult(False, "transfer_failed", str(exc), handshake_s=t1 - t0)
            nbytes += n
            busy_s += seconds
            t2 = time.monotonic()
        result = self._finish(h, nbytes, rest if missing else None, busy_s, (t0, t1, t2))
        result.layers_sent = len(sent)
        result.layers_early = len(sent) - last_batch
        result.chunk_bytes = chunk_bytes
        return result

    def _finish(
        self,
        h: _Handoff,
        nbytes: int,
        written: str | None,
        busy_s: float,
        times: tuple[float, float, float],
    ) -> HandoffResult:
        """Every write made: Done (with the digest of what was written, if any) and the node's Ack.
        `times`: when the handshake started and ended and the writes ended (monotonic s)."""
        t0, t1, t2 = times
        h.chan.send(
            messages.Done(
                request_id=h.req.request_id,
                generation=h.accept.generation,
                ok=True,
                nbytes=nbytes,
                digest=written,
                write_s=busy_s,
            )
        )
        ack = self._expect(h.chan, messages.Ack)
        t3 = time.monotonic()
        if not isinstance(ack, messages.Ack) or ack.status == "failed":
            detail = ack.message if isinstance(ack, (messages.Ack, messages.Reject, messages.Error)) else ""
            result = HandoffResult(
                False, "protocol", f"node did not take the state: {detail}", nbytes, t1 - t0, t2 - t1, t3 - t2
            )
        else:
            result = HandoffResult(True, None, "", nbytes, t1 - t0, t2 - t1, t3 - t2)
        result.busy_s = busy_s
        return result

    def _digest(self, req: HandoffRequest, theirs: list[str]) -> str | None:
        if not self.send_digest or self.staging_buffers is None:
            return None
        buffers = [b if b is not None else torch.empty(0, dtype=torch.uint8) for b in self.staging_buffers]
        return digest.of_ranges(
            buffers,
            digest.sender_ranges(self.staging, req.rank, req.num_senders, req.num_tokens),
            digest.preferred(theirs),
        )


@dataclass(frozen=True)
class _Handoff:
    """One handoff the node has accepted, as the writes and the closing messages need it: the channel,
    the request, the node's Accept (slot generation and regions), the key of the node's transfer
    handle, and where the state goes in the node's buffers."""

    chan: SyncChannel
    req: HandoffRequest
    accept: messages.Accept
    key: str
    dst: Placement


def _refused(msg: messages.Message) -> HandoffResult:
    if isinstance(msg, (messages.Reject, messages.Error)):
        return HandoffResult(False, msg.reason.value, msg.message)
    return HandoffResult(False, "protocol", f"unexpected {type(msg).__name__}")
