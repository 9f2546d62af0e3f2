"""Issue 22: `tilert-pd local` keeps the handoff secret, the node-API token and the PIDs it will signal
in its --home. A home another user can write to (a pre-created 0777 directory, or one owned by someone
else) let that user swap them, so it is refused, with the fix in the error, before anything is written
or signalled; a home `local` creates itself is owner-only."""

from __future__ import annotations

import argparse
import os
import stat
from pathlib import Path

import pytest

from tilert_serve.local import cli as local_cli
from tilert_serve.local import runner

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tiny-cpu.yaml"


def _up(home: Path) -> argparse.Namespace:
    return argparse.Namespace(
        action="up",
        filename=str(EXAMPLE),
        router_port=runner.free_port(),
        timeout=1.0,
        home=home,
        runtime="process",
    )


@pytest.fixture
def launched(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """`up` goes no further than launch, which records the state directory it was given."""
    calls: list[Path] = []

    def fake_launch(name: str, spec: object, state_dir: Path, **_: object) -> object:
        calls.append(state_dir)
        raise ValueError("stopped here by the test")

    monkeypatch.setattr(local_cli, "launch", fake_launch)
    return calls


def _shared(path: Path, mode: int = 0o777) -> Path:
    path.mkdir(exist_ok=True)
    os.chmod(path, mode)
    return path


@pytest.mark.parametrize("mode", [0o777, 0o775, 0o1777])
def test_up_refuses_a_home_others_can_write(
    tmp_path: Path, launched: list[Path], mode: int, capsys: pytest.CaptureFixture[str]
) -> None:
    home = _shared(tmp_path / "home", mode)
    assert local_cli.run(_up(home)) == 1
    err = capsys.readouterr().err
    assert launched == [] and list(home.iterdir()) == []
    assert str(home) in err and "writable by" in err and f"chmod go-w {home}" in err and "--home" in err, err


def test_up_refuses_a_cluster_state_directory_others_can_write(
    tmp_path: Path, launched: list[Path], capsys: pytest.CaptureFixture[str]
) -> None:
    home = tmp_path / "home"
    home.mkdir(mode=0o700)
    _shared(home / "tiny")  # examples/tiny-cpu.yaml's cluster
    assert local_cli.run(_up(home)) == 1
    assert launched == [] and "writable by" in capsys.readouterr().err


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a directory to another user needs root")
def test_up_refuses_a_home_owned_by_someone_else(
    tmp_path: Path, launched: list[Path], capsys: pytest.CaptureFixture[str]
) -> None:
    home = tmp_path / "home"
    home.mkdir(mode=0o700)
    os.chown(home, 4242, 4242)
    assert local_cli.run(_up(home)) == 1
    err = capsys.readouterr().err
    assert launched == [] and "owned by uid 4242" in err and "chown" in err, err


def test_launch_writes_no_secret_into_a_shared_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    written: list[Path] = []
    monkeypatch.setattr(runner, "write_secrets", lambda d: written.append(d) or (d / "s", d / "t"))
    state_dir = _shared(tmp_path / "home") / "c"
    with pytest.raises(ValueError, match="writable by"):
        local_cli.launch("c", object(), state_dir, file="x.yaml", router_port=runner.free_port())  # type: ignore[arg-type]
    assert written == []


def test_status_and_down_refuse_a_shared_home(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    home = _shared(tmp_path / "home")
    for action in ("status", "down"):
        assert local_cli.run(argparse.Namespace(action=action, home=home, json=False)) == 1
        assert "writable by" in capsys.readouterr().err


def test_a_new_home_is_owner_only(tmp_path: Path, launched: list[Path]) -> None:
    home = tmp_path / "new" / "home"
    old = os.umask(0)
    try:
        assert local_cli.run(_up(home)) == 1  # the test's launch stops it
    finally:
        os.umask(old)
    assert launched and stat.S_IMODE(home.stat().st_mode) == 0o700
    assert stat.S_IMODE(launched[0].parent.stat().st_mode) == 0o700
