"""A test sender's side of the control-plane handshake (Challenge -> Auth -> Hello), for the tests
that drive a control connection frame by frame. Imports nothing of the tests' package, so the sender
subprocesses (sender_proc.py) can use it too."""

from __future__ import annotations

from dataclasses import dataclass

from tilert_serve.handoff import auth, framing, messages


@dataclass(frozen=True)
class Handshake:
    challenge: messages.Challenge
    #: The sender's nonce (with the challenge's, what both session keys derive from).
    nonce: str
    #: What the node answered the Auth with: its Hello, or an Error/Reject.
    reply: messages.Message


def authenticate(
    chan: framing.SyncChannel,
    secret: bytes,
    sender: str,
    challenge: messages.Challenge | None = None,
) -> Handshake:
    """Answer the node's Challenge (read here unless given) with an Auth under `secret`, seal the
    channel with the sender's session keys and read the node's reply."""
    if challenge is None:
        got = chan.recv()
        assert isinstance(got, messages.Challenge), got
        challenge = got
    nonce = auth.new_nonce()
    chan.send(messages.Auth(mac=auth.sender_mac(secret, challenge.nonce, nonce), nonce=nonce, sender=sender))
    chan.session = framing.Session.of_sender(secret, challenge.nonce, nonce)
    return Handshake(challenge, nonce, chan.recv())


def hello(chan: framing.SyncChannel, secret: bytes, sender: str) -> messages.Hello:
    """The handshake up to the node's Hello, which it must send."""
    reply = authenticate(chan, secret, sender).reply
    assert isinstance(reply, messages.Hello), reply
    return reply
