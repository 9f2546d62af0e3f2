"""Mutual authentication with the shared secret, and the session keys that bind every later frame.

Handshake: each side proves it holds the secret by an HMAC over both sides' fresh nonces, so a
recorded exchange cannot be replayed and state never goes to (or comes from) a process without the
secret. Only the prefill pool mounts the secret besides the decode nodes.

Session: the handshake alone protects only its own messages; a relay could pass it through and then
rewrite Hello.peer or Accept.regions, or add its own Request. So both sides derive per-connection keys
from the secret and both nonces (`session_keys`) and MAC every frame after the handshake with them,
under an implicit per-direction sequence number (framing.Session): a changed, injected, dropped,
replayed or reordered frame fails its tag and ends the connection.

Rotation: the secret is a directory as the handoff Secret mounts it: `secret` (what senders sign with
and nodes accept) and an optional `accept` (more secrets the node accepts, one per line, e.g. the
previous one during a rotation). `Keyring` re-reads them when either file changes (one stat per
handshake), so a rotation needs no restart.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
import threading
from pathlib import Path
from typing import Protocol

from tilert_serve.bearer import read_regular
from tilert_serve.handoff.errors import AuthError

log = logging.getLogger(__name__)

_DOMAIN = b"tilert-pd handoff v1"
MIN_SECRET_BYTES = 16
#: The largest secret (or accept) file read: a few secrets of 64 hex characters fit many times over.
MAX_SECRET_FILE_BYTES = 64 * 1024
#: The file beside `secret` holding the extra secrets a node accepts (one per line, may be empty or absent).
ACCEPT_FILE = "accept"


def new_nonce() -> str:
    return secrets.token_hex(32)


def _mac(secret: bytes, role: bytes, first: str, second: str) -> str:
    msg = b"|".join((_DOMAIN, role, first.encode(), second.encode()))
    return hmac.new(secret, msg, hashlib.sha256).hexdigest()


def sender_mac(secret: bytes, node_nonce: str, sender_nonce: str) -> str:
    return _mac(secret, b"sender", node_nonce, sender_nonce)


def node_mac(secret: bytes, node_nonce: str, sender_nonce: str) -> str:
    return _mac(secret, b"node", sender_nonce, node_nonce)


def verify(expected: str, got: str) -> bool:
    # Both are ASCII hex on our side; a peer's string is validated as hex before it gets here.
    return hmac.compare_digest(expected.encode(), got.encode("utf-8", "replace"))


def session_keys(secret: bytes, node_nonce: str, sender_nonce: str) -> tuple[bytes, bytes]:
    """(sender->node key, node->sender key) for one connection: HKDF-SHA256 (RFC 5869) with the
    secret as input key material, both nonces as salt, and the direction as info.

    Why this shape: the salt makes the keys fresh for every connection (frames of one session fail
    in any other); one key per direction means a frame reflected back to its sender never verifies;
    the secret itself never keys a frame tag, so a handshake MAC can never pass for a frame tag or the
    reverse. HKDF from hmac/hashlib needs no extra dependency, and both ends already hold the inputs.
    """
    salt = b"|".join((_DOMAIN, b"session", node_nonce.encode(), sender_nonce.encode()))
    prk = hmac.new(salt, secret, hashlib.sha256).digest()  # HKDF-Extract

    def expand(info: bytes) -> bytes:  # HKDF-Expand, one block (32 bytes) is all we take
        return hmac.new(prk, info + b"\x01", hashlib.sha256).digest()

    return expand(b"sender->node"), expand(b"node->sender")


class Keyring(Protocol):
    """Which secret this side signs with, and which it accepts from a peer."""

    def signing(self) -> bytes: ...

    def accepted(self) -> tuple[bytes, ...]: ...


class StaticKeyring:
    """One fixed secret (tests, benchmarks, and callers that load it themselves)."""

    def __init__(self, secret: bytes, accept: tuple[bytes, ...] = ()) -> None:
        self._secret, self._accept = secret, (secret, *accept)

    def signing(self) -> bytes:
        return self._secret

    def accepted(self) -> tuple[bytes, ...]:
        return self._accept


def keyring(secret: bytes | Keyring) -> Keyring:
    return StaticKeyring(secret) if isinstance(secret, bytes) else secret


class FileKeyring:
    """The mounted handoff Secret: `path` (signing, accepted) and `accept` beside it (accepted too).

    Each call stats both files (a few microseconds) and re-reads the one whose identity, size or mtime
    changed; the kubelet's atomic symlink swap on a Secret update changes all three. Each file stands on
    its own: one that cannot be read (briefly missing or short during an update, or no regular file: a
    FIFO or a directory put at its path, which is never waited on) keeps its last good secrets, logged
    once per change, while the other is still taken; a readable file is taken as soon as it is there.
    Thread-safe: the connector's sender thread and the node's event loop both call it.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.accept_path = self.path.parent / ACCEPT_FILE
        self._lock = threading.Lock()
        self._signing = load_secret(self.path)
        self._secret_stamp = self._stat(self.path)
        self._accept_stamp = self._stat(self.accept_path)
        try:
            extra = self._read_accept()
        except OSError as exc:
            log.error(
                "%s cannot be read (%s): accepting only %s until it is a readable file",
                self.accept_path,
                exc.strerror or exc,
                self.path,
            )
            extra = []
        self._accepted = (self._signing, *extra)

    @staticmethod
    def _stat(path: Path) -> object:
        try:
            st = os.stat(path)
        except OSError:
            return None
        return (st.st_ino, st.st_size, st.st_mtime_ns)

    def _read_accept(self) -> list[bytes]:
        try:
            lines = read_regular(self.accept_path, MAX_SECRET_FILE_BYTES).splitlines()
        except FileNotFoundError:
            return []
        out = []
        for line in (ln.strip() for ln in lines):
            if not line:
                continue
            if len(line) < MIN_SECRET_BYTES:
                log.warning(
                    "%s: ignoring an accepted secret of %d bytes (fewer than %d)",
                    self.accept_path,
                    len(line),
                    MIN_SECRET_BYTES,
                )
                continue
            out.append(line)
        return out

    def _refresh(self) -> None:
        secret_stamp, accept_stamp = self._stat(self.path), self._stat(self.accept_path)
        with self._lock:
            if (secret_stamp, accept_stamp) == (self._secret_stamp, self._accept_stamp):
                return
            signing, extra = self._signing, list(self._accepted[1:])
            if secret_stamp != self._secret_stamp:
                self._secret_stamp = secret_stamp
                try:
                    signing = load_secret(self.path)
                except AuthError as exc:
                    log.warning(
                        "handoff secret changed but cannot be read (%s); keeping the previous one", exc
                    )
            if accept_stamp != self._accept_stamp:
                self._accept_stamp = accept_stamp
                try:
                    extra = self._read_accept()
                except OSError as exc:
                    log.error(
                        "%s changed but cannot be read (%s); still accepting the %d secret(s) it held before",
                        self.accept_path,
                        exc.strerror or exc,
                        len(extra),
                    )
            if (signing, *extra) == self._accepted:
                return
            self._signing, self._accepted = signing, (signing, *extra)
            log.info("handoff secrets reloaded from %s: %d accepted", self.path.parent, len(self._accepted))

    def signing(self) -> bytes:
        self._refresh()
        return self._signing

    def accepted(self) -> tuple[bytes, ...]:
        self._refresh()
        return self._accepted


def load_secret(path: str | Path) -> bytes:
    """Read the shared secret; a missing, unreadable or short secret is a start-up error that says
    how to fix it."""
    p = Path(path)
    try:
        secret = read_regular(p, MAX_SECRET_FILE_BYTES).strip()
    except OSError as exc:
        raise AuthError(
            f"cannot read the handoff secret at {p}: {exc.strerror}; mount the PDCluster's "
            "handoff Secret there, or for local runs write one with "
            "`python -c 'import secrets; print(secrets.token_hex(32))' > FILE`"
        ) from exc
    if len(secret) < MIN_SECRET_BYTES:
        raise AuthError(
            f"the handoff secret at {p} is {len(secret)} bytes; use at least {MIN_SECRET_BYTES} "
            "random bytes (e.g. 64 hex characters)"
        )
    return secret
