"""Bearer tokens kept in a file: the decode node's API credential and the router's client API keys.

The file holds one token a line (blank lines and lines starting with `#` are skipped), so a credential
rotates without an outage: add the new token, roll the callers, remove the old one. A `TokenFile`
re-reads the file when it changed (inode, size or mtime, which also catches a Kubernetes Secret's
`..data` symlink swap), checking at most once every `check_interval_s` and only when a token is used:
a revoked token stops working within about a second. If the file goes missing or unreadable after a
good read, the last tokens stay in force and the error is logged once (a Secret update swaps the
whole directory atomically, so that is an operator's mistake, not a rotation). An empty file accepts
nobody: a configured credential never fails open.

Tokens are compared in constant time: each presented token is hashed and compared with every
token's hash by `hmac.compare_digest`, without stopping at the first match, so neither the position
of a match nor a token's length shows in the timing.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import time
from collections.abc import Callable, Mapping
from pathlib import Path

log = logging.getLogger(__name__)

#: How often (seconds) a token file is checked for changes, at most.
CHECK_INTERVAL_S = 1.0


class TokenFileError(Exception):
    """The token file cannot be read at all (at start: the component refuses to run)."""


def parse_tokens(text: str) -> tuple[str, ...]:
    """The tokens in a file's text, in order, without duplicates."""
    tokens = (line.strip() for line in text.splitlines())
    return tuple(dict.fromkeys(t for t in tokens if t and not t.startswith("#")))


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).digest()


def bearer_token(headers: Mapping[str, str]) -> str | None:
    """The token of an `Authorization: Bearer <token>` header; None when there is none."""
    auth = headers.get("Authorization", "")
    if auth[:7].lower() != "bearer ":
        return None
    token = auth[7:].strip()
    return token or None


class TokenFile:
    """The tokens of one file, re-read when it changes (see the module docstring)."""

    def __init__(self, path: str | Path, *, check_interval_s: float = CHECK_INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.path = Path(path)
        self.check_interval_s = check_interval_s
        self._clock = clock
        self._signature: tuple[int, int, int] | None = None
        self._tokens: tuple[str, ...] = ()
        self._digests: tuple[bytes, ...] = ()
        self._checked = clock()
        self._failing = False
        try:
            self._load(self._stat())
        except OSError as exc:
            raise TokenFileError(f"cannot read the token file {self.path}: {exc.strerror or exc}") from exc
        if not self._tokens:
            log.warning("token file %s holds no token: every request presenting one is refused", self.path)

    def _stat(self) -> tuple[int, int, int]:
        s = os.stat(self.path)
        return (s.st_ino, s.st_size, s.st_mtime_ns)

    def _load(self, signature: tuple[int, int, int]) -> None:
        tokens = parse_tokens(self.path.read_text(encoding="utf-8", errors="surrogateescape"))
        self._tokens, self._digests = tokens, tuple(_digest(t) for t in tokens)
        self._signature = signature

    def refresh(self, *, force: bool = False) -> None:
        """Re-read the file if it changed since the last read (checked at most once an interval)."""
        now = self._clock()
        if not force and now - self._checked < self.check_interval_s:
            return
        self._checked = now
        try:
            sig = self._stat()
            if sig != self._signature:
                self._load(sig)
                log.info("token file %s reloaded: %d token(s)", self.path, len(self._tokens))
        except OSError as exc:
            if not self._failing:
                log.error("token file %s cannot be read, keeping its last %d token(s): %s", self.path,
                          len(self._tokens), exc)
            self._failing = True
            return
        self._failing = False

    @property
    def tokens(self) -> tuple[str, ...]:
        self.refresh()
        return self._tokens

    def first(self) -> str | None:
        """The token a caller sends (the first line: rotation adds the new token at the top)."""
        tokens = self.tokens
        return tokens[0] if tokens else None

    def accepts(self, presented: str | None) -> bool:
        """Whether `presented` is one of the file's tokens, in constant time."""
        self.refresh()
        if presented is None:
            return False
        d = _digest(presented)
        ok = False
        for known in self._digests:
            ok |= hmac.compare_digest(d, known)
        return ok
