"""tilert_serve.bearer: the token files of the router's API keys and of the node API."""

from __future__ import annotations

import os

import pytest

from tilert_serve import bearer
from tilert_serve.bearer import TokenFile, TokenFileError, bearer_token


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_tokens_one_a_line_comments_and_blanks_skipped(tmp_path):
    path = tmp_path / "t"
    path.write_text("# rotated 2026-12-01\n  new-token  \n\nold-token\nnew-token\n")
    tf = TokenFile(path)
    assert tf.tokens == ("new-token", "old-token") and tf.first() == "new-token"
    assert tf.accepts("new-token") and tf.accepts("old-token")
    assert not tf.accepts("new-token ") and not tf.accepts("") and not tf.accepts(None)
    assert not tf.accepts("# rotated 2026-12-01") and not tf.accepts("\udcff")


def test_changes_are_seen_at_most_once_an_interval(tmp_path):
    path = tmp_path / "t"
    path.write_text("a\n")
    clock = Clock()
    tf = TokenFile(path, check_interval_s=1.0, clock=clock)
    new = tmp_path / "t.new"
    new.write_text("b\n")
    os.replace(new, path)
    assert tf.accepts("a")  # not checked again yet: no stat storm
    clock.now += 1.0
    assert not tf.accepts("a") and tf.accepts("b")


def test_an_empty_file_accepts_nobody_and_a_vanished_one_keeps_its_last_tokens(tmp_path, caplog):
    path = tmp_path / "t"
    path.write_text("")
    clock = Clock()
    tf = TokenFile(path, clock=clock)
    assert tf.tokens == () and tf.first() is None and not tf.accepts("")
    path.write_text("k\n")
    clock.now += 1.0
    assert tf.accepts("k")
    path.unlink()
    clock.now += 1.0
    with caplog.at_level("ERROR"):
        assert tf.accepts("k")
        clock.now += 1.0
        assert tf.accepts("k")
    assert caplog.text.count("cannot be read") == 1  # logged once, not once a check


def test_a_missing_file_at_start_is_an_error_naming_it(tmp_path):
    with pytest.raises(TokenFileError, match=str(tmp_path / "nope")):
        TokenFile(tmp_path / "nope")


def test_the_comparison_looks_at_every_token(tmp_path, monkeypatch):
    path = tmp_path / "t"
    path.write_text("a\nb\nc\n")
    tf = TokenFile(path)
    calls: list[tuple[bytes, bytes]] = []
    real = bearer.hmac.compare_digest

    def spy(x: bytes, y: bytes) -> bool:
        calls.append((x, y))
        return real(x, y)

    monkeypatch.setattr(bearer.hmac, "compare_digest", spy)
    assert tf.accepts("a")  # the first matches: the others are compared all the same
    assert len(calls) == 3 and all(len(x) == len(y) == 32 for x, y in calls)  # digests: lengths never differ


@pytest.mark.parametrize(
    ("header", "token"),
    [
        ("Bearer abc", "abc"),
        ("bearer  abc ", "abc"),
        ("BEARER abc", "abc"),
        ("Bearer ", None),
        ("Basic abc", None),
        ("", None),
        ("Bearerabc", None),
    ],
)
def test_bearer_token(header, token):
    assert bearer_token({"Authorization": header} if header else {}) == token
