"""A local stack's credentials: the handoff secret and the node API token are files only their owner
can read from the moment they exist (they once were written, then chmod-ed), and the
plan passes the token to the decode nodes and the router."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from tilert_operator import constants
from tilert_operator import spec as specmod
from tilert_serve.local import plan as planmod
from tilert_serve.local import runner

SPEC = {
    "model": {"name": "m", "weights": {"tiny": True}, "tilertModel": "mla"},
    "decode": {"tilert": {"engine": "reference", "gpus": 0, "replicas": 2}},
}


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.lstat().st_mode)


def test_secret_files_are_owner_only_from_creation(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    old_umask = os.umask(0)  # the worst umask: nothing taken away
    try:
        created: list[tuple[str, int, int]] = []
        during_write: list[tuple[int, bool]] = []
        real_open, real_fsync = os.open, os.fsync

        def spy_open(path: str, flags: int, mode: int = 0o777, *a: object, **k: object) -> int:
            created.append((str(path), flags, mode))
            return real_open(path, flags, mode, *a, **k)  # type: ignore[arg-type]

        def spy_fsync(fd: int) -> None:
            # While the content is written, the file's mode is already 0600 and `path` is not there yet.
            during_write.append(
                (stat.S_IMODE(os.fstat(fd).st_mode), (tmp_path / runner.NODE_API_TOKEN_FILE).exists())
            )
            real_fsync(fd)

        monkeypatch.setattr(os, "open", spy_open)
        monkeypatch.setattr(os, "fsync", spy_fsync)
        handoff, token = runner.write_secrets(tmp_path)
    finally:
        os.umask(old_umask)
    assert [p.name for p in (handoff, token)] == [runner.HANDOFF_SECRET_FILE, runner.NODE_API_TOKEN_FILE]
    assert len(created) == 2
    for _, flags, mode in created:
        assert mode == 0o600 and flags & os.O_CREAT and flags & os.O_EXCL and flags & os.O_NOFOLLOW
    assert during_write == [(0o600, False), (0o600, False)]
    for p in (handoff, token):
        assert _mode(p) == 0o600 and len(p.read_text()) == 64
    assert handoff.read_text() != token.read_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [runner.HANDOFF_SECRET_FILE, runner.NODE_API_TOKEN_FILE]
    )


def test_a_new_secret_replaces_the_old_file_and_never_follows_a_link(tmp_path: Path) -> None:
    victim = tmp_path / "elsewhere"
    victim.write_text("keep me")
    victim.chmod(0o644)
    (tmp_path / runner.HANDOFF_SECRET_FILE).symlink_to(victim)
    runner.write_secret_file(tmp_path / runner.HANDOFF_SECRET_FILE, "fresh")
    assert victim.read_text() == "keep me" and _mode(victim) == 0o644
    target = tmp_path / runner.HANDOFF_SECRET_FILE
    assert not target.is_symlink() and target.read_text() == "fresh" and _mode(target) == 0o600


def test_plan_passes_the_token_to_the_nodes_and_the_router(tmp_path: Path) -> None:
    spec = specmod.parse(SPEC)
    ports = planmod.Ports(router=8000, prefill=[9001], native=[], tilert=[(9002, 9003), (9004, 9005)])
    token = str(tmp_path / runner.NODE_API_TOKEN_FILE)
    p = planmod.plan(
        spec, ports=ports, model_dir="/m", secret_file="/s", router_config_file="/r", api_token_file=token
    )
    nodes = [c for c in p.components if c.kind == constants.TILERT]
    assert len(nodes) == 2
    for c in nodes:
        assert c.argv[c.argv.index("--api-token-file") + 1] == token
    others = [c for c in p.components if c.kind != constants.TILERT]
    assert not any("--api-token-file" in c.argv for c in others)
    assert p.router_config.tilert_api_token_file == token
    # Without a token file the nodes run as before (the HTTP API unauthenticated).
    bare = planmod.plan(spec, ports=ports, model_dir="/m", secret_file="/s", router_config_file="/r")
    assert not any("--api-token-file" in c.argv for c in bare.components)
