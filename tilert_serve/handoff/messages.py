"""The handoff control-plane messages, one class per kind, each with its wire type byte.

A handoff, on one TCP connection from a prefill sender (one per TP rank) to a decode node:

    node   -> sender  Challenge   node nonce
    sender -> node    Auth        HMAC(secret, node nonce, sender nonce), sender nonce
    node   -> sender  Hello       node's proof, protocol and layout, transfer engine peer info
    sender -> node    Request     request id or ticket, token count, last prompt token, prompt ids,
                                  the sender's compatibility fingerprint
    node   -> sender  Accept      the slot's receive regions  | Reject (reason)
    (sender writes the bytes one-sidedly through the transfer engine)
    sender -> node    LayersDone  (layer-wise, only to a node whose Hello says `layerwise`): these
                                  layers' bytes are written, with their digest; repeated as layers land
    sender -> node    Done        ok or the write error; a digest of the bytes written and not covered
                                  by a LayersDone
    node   -> sender  Ack         the node has the state (or why not)

Every frame from Hello on is sealed with the connection's session keys (framing.Session).

Either side may send Error and close on a protocol violation. Fields added within a protocol
version must be optional; unknown fields from a newer peer are ignored, unknown kinds are errors.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tilert_serve import pydantic_errors
from tilert_serve.handoff.errors import MessageError, RejectReason


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)
    KIND: ClassVar[int]


#: A nonce: 32 to 128 hex digits (auth.new_nonce gives 64).
_NONCE = r"^[0-9a-f]{32,128}$"
#: An HMAC-SHA256 in hex.
_MAC = r"^[0-9a-f]{64}$"
#: A compatibility fingerprint (compat.Compat.fingerprint: 12 hex digits; room for a longer one). Hex
#: only, so the node may name a sender's fingerprint in its own refusal without quoting a peer's text.
_COMPAT = r"^[0-9a-f]{8,64}$"
#: Token ids are vocabulary indices: anything past this is no token.
_TOKEN_LIMIT = 1 << 31


class Challenge(Message):
    KIND: ClassVar[int] = 1
    nonce: str = Field(pattern=_NONCE)
    node: str = Field(max_length=256)


class Auth(Message):
    KIND: ClassVar[int] = 2
    mac: str = Field(pattern=_MAC)
    nonce: str = Field(pattern=_NONCE)
    sender: str = Field(max_length=256)


class Region(BaseModel):
    """A registered memory range of the node, in the transfer engine's address space."""

    model_config = ConfigDict(frozen=True)
    shard: int = Field(ge=0)
    addr: int = Field(ge=0)
    nbytes: int = Field(ge=0)


class LayoutInfo(BaseModel):
    model_config = ConfigDict(frozen=True, extra="ignore")
    model: str
    kv_cache_dtype: str
    version: int
    num_layers: int
    fingerprint: str


class Hello(Message):
    KIND: ClassVar[int] = 3
    #: HMAC(secret, sender nonce, node nonce): proves the node, so state never goes to an impostor.
    mac: str = Field(pattern=_MAC)
    node: str
    layout: LayoutInfo
    max_seq_len: int
    slots_total: int
    slots_free: int
    #: Transfer engine name and whatever its peers need to write to us (session id, NIXL metadata).
    transfer: str
    peer: dict[str, Any]
    #: Digest algorithms the node can check (handoff.digest), preferred first.
    digests: list[str] = ["blake2b"]
    #: The node takes LayersDone frames between Accept and Done (layer-wise handoff); an older node
    #: leaves it out and gets the whole state before Done.
    layerwise: bool = False
    #: The node's compatibility fingerprint (compat.Compat.fingerprint); None from an older node.
    compat: str | None = Field(default=None, pattern=_COMPAT)


class Request(Message):
    KIND: ClassVar[int] = 4
    request_id: str = Field(min_length=1, max_length=256)
    #: The router's admission ticket; None takes any free slot (ungated callers, tests).
    ticket: str | None = None
    num_tokens: int = Field(ge=1)
    last_prompt_token: int = Field(ge=0, lt=_TOKEN_LIMIT)
    #: The prompt's token ids, for detokenising the output in context; may be empty.
    prompt_token_ids: list[Annotated[int, Field(ge=0, lt=_TOKEN_LIMIT)]] = []
    layout_fingerprint: str
    sender_rank: int = Field(default=0, ge=0)
    num_senders: int = Field(default=1, ge=1)
    #: The sender's compatibility fingerprint (compat.Compat.fingerprint). Optional on the wire, as
    #: fields added within a protocol version are, so an older sender is refused by reason
    #: (compat_mismatch, naming the release) instead of failing to parse; the node requires it.
    compat: str | None = Field(default=None, pattern=_COMPAT)


class Accept(Message):
    KIND: ClassVar[int] = 5
    request_id: str
    slot: int
    #: Bumped every time the slot is reused, so a late Done from an earlier use is recognised.
    generation: int
    #: The slot's receive region on each shard; offsets inside come from the layout's placement.
    regions: list[Region]
    max_tokens: int


class Reject(Message):
    KIND: ClassVar[int] = 6
    request_id: str = ""
    reason: RejectReason
    message: str


class Done(Message):
    KIND: ClassVar[int] = 7
    request_id: str
    generation: int
    ok: bool
    nbytes: int = Field(ge=0)
    error: str | None = None
    #: "ALGORITHM:HEX" of the bytes this rank wrote, in write order (handoff.digest), of the layers no
    #: LayersDone covered (all of them without LayersDone); None when the prefill runs with digests
    #: off, or when LayersDone frames covered every layer of this rank.
    digest: str | None = Field(default=None, max_length=200)
    #: False only when no write of this sender can still land: it wrote nothing at all (it failed
    #: before its first write), or every write call it made had returned (a layer-wise sender whose
    #: prefill gave up between layers), so the node need not quarantine the slot against a late write
    #: (see decode/slots.py).
    writes_started: bool = True
    #: Seconds this rank spent in its transfer engine's write calls (all of its LayersDone batches
    #: included): what the node measures the link's bandwidth over, since under layer-wise the time
    #: from Accept to Done includes the prefill's forward. None from older senders.
    write_s: float | None = Field(default=None, ge=0)


#: Most layers one LayersDone may name (far above any model's layer count).
MAX_LAYERS = 4096


class LayersDone(Message):
    """Layer-wise handoff: the bytes of `layers` (this sender rank's, each named once per handoff) are
    written. Sent only to a node whose Hello says `layerwise`; the node checks `digest` and converts
    those layers while the rest are still in flight."""

    KIND: ClassVar[int] = 10
    request_id: str
    generation: int
    layers: list[Annotated[int, Field(ge=0, lt=MAX_LAYERS)]] = Field(min_length=1, max_length=MAX_LAYERS)
    nbytes: int = Field(ge=0)
    #: "ALGORITHM:HEX" of exactly these layers' bytes, in write order (handoff.digest.sender_ranges).
    digest: str = Field(min_length=1, max_length=200)


#: What the node answers a Done with: every rank's state has arrived, more ranks are to come, or it failed.
AckStatus = Literal["complete", "waiting_for_ranks", "failed"]


class Ack(Message):
    KIND: ClassVar[int] = 8
    request_id: str
    status: AckStatus
    message: str = ""


class Error(Message):
    KIND: ClassVar[int] = 9
    reason: RejectReason
    message: str


KINDS: dict[int, type[Message]] = {
    cls.KIND: cls for cls in (Challenge, Auth, Hello, Request, Accept, Reject, Done, Ack, Error, LayersDone)
}


def from_body(kind: int, body: dict[str, Any]) -> Message:
    """Build the typed message of `kind` from a decoded JSON body; errors name the field."""
    cls = KINDS.get(kind)
    if cls is None:
        raise MessageError(f"unknown message kind 0x{kind:02x}; known kinds: {sorted(KINDS)}")
    try:
        return cls.model_validate(body)
    except ValidationError as exc:
        raise MessageError(f"invalid {cls.__name__} message: {pydantic_errors.summary(exc)}") from exc
