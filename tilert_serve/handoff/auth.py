"""Mutual authentication with the shared secret: each side proves it holds the secret by an HMAC
over both sides' fresh nonces, so a recorded exchange cannot be replayed and state never goes to
(or comes from) a process without the secret. Only the prefill pool mounts the secret besides the
decode nodes.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from pathlib import Path

from tilert_serve.handoff.errors import AuthError

_DOMAIN = b"tilert-pd handoff v1"
MIN_SECRET_BYTES = 16


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
    return hmac.compare_digest(expected.encode(), got.encode())


def load_secret(path: str | Path) -> bytes:
    """Read the shared secret; a missing, unreadable or short secret is a start-up error that says
    how to fix it."""
    p = Path(path)
    try:
        secret = p.read_bytes().strip()
    except OSError as exc:
        raise AuthError(f"cannot read the handoff secret at {p}: {exc.strerror}; mount the PDCluster's "
                        "handoff Secret there, or for local runs write one with "
                        "`python -c 'import secrets; print(secrets.token_hex(32))' > FILE`") from exc
    if len(secret) < MIN_SECRET_BYTES:
        raise AuthError(f"the handoff secret at {p} is {len(secret)} bytes; use at least {MIN_SECRET_BYTES} "
                        "random bytes (e.g. 64 hex characters)")
    return secret
