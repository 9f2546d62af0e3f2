"""Issue 22: the token and secret files are read without ever blocking, and only when they are regular
files of a sane size. A token path replaced by a FIFO hung the node's event loop (and /health with it);
the keyring's `accept` file turned into a directory made the node refuse a rotated secret. Each case
now fails with an error naming the path, keeps what was accepted before, and recovers once the file is
a regular file again."""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import aiohttp
import pytest

from tests.decode.test_http_auth import TOKEN, node_with_token
from tilert_serve import bearer
from tilert_serve.bearer import TokenFile, TokenFileError
from tilert_serve.handoff import auth
from tilert_serve.handoff.errors import AuthError

T = TypeVar("T")
#: Longer than any read of a small file takes on a loaded box; a blocked read never ends by itself.
PATIENCE_S = 10.0


@contextlib.contextmanager
def fifo_watchdog(path: Path) -> Iterator[list[bool]]:
    """If something blocks reading the FIFO at `path` for PATIENCE_S, open and close its write end so
    the reader sees EOF (the test then fails instead of hanging); yields [whether that was needed]."""
    hung = [False]
    done = threading.Event()

    def watch() -> None:
        if done.wait(PATIENCE_S):
            return
        hung[0] = True
        with contextlib.suppress(OSError):
            os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    try:
        yield hung
    finally:
        done.set()
        thread.join()


def _fifo_at(path: Path) -> None:
    path.unlink(missing_ok=True)
    os.mkfifo(path)


def _run(fn: Callable[[], T], fifo: Path) -> tuple[T | BaseException, bool]:
    with fifo_watchdog(fifo) as hung:
        try:
            out: T | BaseException = fn()
        except BaseException as exc:
            out = exc
    return out, hung[0]


def test_a_token_file_turned_fifo_is_refused_without_blocking(tmp_path, caplog):
    path = tmp_path / "token"
    path.write_text("tok-1\n")
    tf = TokenFile(path)
    _fifo_at(path)
    with caplog.at_level(logging.ERROR, logger="tilert_serve.bearer"):
        _, hung = _run(lambda: tf.refresh(force=True), path)
    assert not hung, "reading the token file blocked on a FIFO"
    assert tf.tokens == ("tok-1",)  # the last good tokens stay in force
    assert any(str(path) in r.getMessage() and "not a regular file" in r.getMessage() for r in caplog.records)
    path.unlink()
    path.write_text("tok-2\n")
    tf.refresh(force=True)
    assert tf.tokens == ("tok-2",)


def test_a_fifo_or_directory_or_huge_token_file_at_start_is_an_error_naming_it(tmp_path):
    fifo = tmp_path / "fifo"
    _fifo_at(fifo)
    got, hung = _run(lambda: TokenFile(fifo), fifo)
    assert not hung and isinstance(got, TokenFileError), got
    assert str(fifo) in str(got) and "not a regular file" in str(got)
    with pytest.raises(TokenFileError, match="not a regular file"):
        TokenFile(tmp_path)
    huge = tmp_path / "huge"
    huge.write_bytes(b"x" * (bearer.MAX_CREDENTIAL_FILE_BYTES + 1))
    with pytest.raises(TokenFileError, match=f"{huge}.*larger than"):
        TokenFile(huge)


def test_a_secret_that_is_a_fifo_is_an_error_naming_it(tmp_path):
    fifo = tmp_path / "secret"
    _fifo_at(fifo)
    got, hung = _run(lambda: auth.load_secret(fifo), fifo)
    assert not hung and isinstance(got, AuthError), got
    assert str(fifo) in str(got) and "not a regular file" in str(got)


def test_the_keyring_takes_a_new_secret_while_its_accept_file_is_a_directory(tmp_path, caplog):
    d = tmp_path / "handoff"
    d.mkdir()
    (d / "secret").write_text("first-secret-0123456789\n")
    (d / "accept").write_text("older-secret-0123456789\n")
    ring = auth.FileKeyring(d / "secret")
    assert ring.accepted() == (b"first-secret-0123456789", b"older-secret-0123456789")
    # The accept file becomes a directory, and the secret rotates.
    (d / "accept").unlink()
    (d / "accept").mkdir()
    (d / "secret.new").write_text("second-secret-0123456789\n")
    os.replace(d / "secret.new", d / "secret")
    with caplog.at_level(logging.ERROR, logger="tilert_serve.handoff.auth"):
        assert ring.signing() == b"second-secret-0123456789"
        # What was accepted beside it stays accepted until a readable accept file says otherwise.
        assert ring.accepted() == (b"second-secret-0123456789", b"older-secret-0123456789")
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and str(d / "accept") in errors[0] and "not a regular file" in errors[0], errors
    # A regular file again: taken.
    (d / "accept").rmdir()
    (d / "accept").write_text("first-secret-0123456789\n")
    assert ring.accepted() == (b"second-secret-0123456789", b"first-secret-0123456789")


def test_the_keyring_never_blocks_on_a_fifo(tmp_path):
    d = tmp_path / "handoff"
    d.mkdir()
    (d / "secret").write_text("first-secret-0123456789\n")
    ring = auth.FileKeyring(d / "secret")
    _fifo_at(d / "accept")
    got, hung = _run(ring.accepted, d / "accept")
    assert not hung and got == (b"first-secret-0123456789",)
    _fifo_at(d / "secret")
    got, hung = _run(ring.signing, d / "secret")
    assert not hung and got == b"first-secret-0123456789"


async def test_the_nodes_health_answers_while_its_token_file_is_a_fifo(tmp_path):
    token = tmp_path / "token"
    token.write_text(TOKEN + "\n")
    secret = tmp_path / "secret"
    secret.write_bytes(b"0123456789abcdef0123456789abcdef")
    async with node_with_token(secret, token, check_interval_s=0.0) as n:
        _fifo_at(token)
        with fifo_watchdog(token) as hung:
            timeout = aiohttp.ClientTimeout(total=PATIENCE_S * 2)
            async with n.session.get(f"{n.url}/v1/status", timeout=timeout) as r:
                status = r.status
            async with n.session.get(f"{n.url}/health", timeout=timeout) as r:
                health = r.status
        assert not hung[0], "the node's event loop blocked reading its token file"
        assert (status, health) == (200, 200)  # the last good token still in force
