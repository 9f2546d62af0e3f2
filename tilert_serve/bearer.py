"""Bearer tokens kept in a file: the decode node's API credential and the router's client API keys.

The file holds one token a line (blank lines and lines starting with `#` are skipped), so a credential
rotates without an outage: add the new token, roll the callers, remove the old one. A `TokenFile`
re-reads the file when it changed (inode, size or mtime, which also catches a Kubernetes Secret's
`..data` symlink swap), checking at most once every `check_interval_s` and only when a token is used:
a revoked token stops working within about a second. If the file goes missing or unreadable after a
good read, the last tokens stay in force and the error is logged once (a Secret update swaps the
whole directory atomically, so that is an operator's mistake, not a rotation). An empty file accepts
nobody: a configured credential never fails open.

The file is read only if it is a regular file of at most MAX_CREDENTIAL_FILE_BYTES (`read_regular`):
it is opened without blocking, so a FIFO, a device or a directory put at its path is refused with an
error naming the path (the last tokens stay in force) instead of hanging the event loop that reads it.

Tokens are compared in constant time: each presented token is hashed and compared with every
token's hash by `hmac.compare_digest`, without stopping at the first match, so neither the position
of a match nor a token's length shows in the timing.
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import logging
import os
import stat
import time
from collections.abc import Callable, Mapping
from pathlib import Path

log = logging.getLogger(__name__)

#: How often (seconds) a token file is checked for changes, at most.
CHECK_INTERVAL_S = 1.0
#: The largest token or secret file read (a few hundred tokens fit many times over).
MAX_CREDENTIAL_FILE_BYTES = 1 << 20


def read_regular(path: str | Path, max_bytes: int = MAX_CREDENTIAL_FILE_BYTES) -> bytes:
    """The content of the regular file at `path`, of at most `max_bytes`; OSError naming the path and
    what is wrong otherwise.

    Opened with O_NONBLOCK, so opening a FIFO returns at once (then fstat refuses it) rather than
    waiting for a writer. Symlinks are followed: a Kubernetes Secret's files are symlinks into its
    `..data` directory, so O_NOFOLLOW would refuse every mounted credential."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            kind = (
                "a directory"
                if stat.S_ISDIR(st.st_mode)
                else "a FIFO"
                if stat.S_ISFIFO(st.st_mode)
                else "a device or socket"
            )
            raise OSError(
                errno.EINVAL,
                f"not a regular file (it is {kind}); put the credential in a plain file there",
                str(path),
            )
        chunks, size = [], 0
        while size <= max_bytes:
            chunk = os.read(fd, max_bytes + 1 - size)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        if size > max_bytes:
            raise OSError(
                errno.EFBIG,
                f"larger than {max_bytes} bytes, which no credential file is; check what is mounted there",
                str(path),
            )
        return b"".join(chunks)
    finally:
        os.close(fd)


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

    def __init__(
        self,
        path: str | Path,
        *,
        check_interval_s: float = CHECK_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
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
            raise TokenFileError(
                f"cannot read the token file {self.path}: {exc.strerror or exc}; point the flag at a "
                "readable file of tokens, one a line"
            ) from exc
        if not self._tokens:
            log.warning("token file %s holds no token: every request presenting one is refused", self.path)

    def _stat(self) -> tuple[int, int, int]:
        s = os.stat(self.path)
        return (s.st_ino, s.st_size, s.st_mtime_ns)

    def _load(self, signature: tuple[int, int, int]) -> None:
        tokens = parse_tokens(read_regular(self.path).decode("utf-8", errors="surrogateescape"))
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
                log.error(
                    "token file %s cannot be read, keeping its last %d token(s): %s",
                    self.path,
                    len(self._tokens),
                    exc.strerror or exc,
                )
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
