"""Fixtures for the tests that build and run the images (docker/, `make images`).

- `docker_engine` (session): the engine's server version; skips the test, with the reason, only when
  no Docker engine answers (`docker info`). CI always has one (scripts/docker-engine.sh).
- `images` (session): an `Images` with the three tags `make images` builds (operator, serve-cpu,
  vllm-prefill-cpu), built once per session by scripts/images.sh; the layer cache makes that fast when
  nothing changed. TILERT_PD_IMAGES_REUSE=1 skips the build when all three tags exist. Tests that use
  it get the build's timeout (BUILD_TIMEOUT_S) on top of the suite's.
- `containers` (function): starts containers carrying labels of the test's own and removes them all
  when the test ends, also when it fails.
"""

from __future__ import annotations

import itertools
import os
import shutil
import subprocess
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LABEL = "tilert-pd.test"  # every container a test starts carries LABEL=<that test's id>
BUILD_TIMEOUT_S = 3600


def image_table() -> dict[str, str]:
    """docker/images.txt's images built here: Dockerfile name (no suffix) -> tag."""
    out: dict[str, str] = {}
    for line in (ROOT / "docker" / "images.txt").read_text().splitlines():
        row = line.split()
        if row and not row[0].startswith("#") and row[2] == "yes":
            out[row[0].removesuffix(".Dockerfile")] = row[1]
    return out


@dataclass(frozen=True)
class Images:
    """The tags of the images `make images` built (present in the engine when the fixture returns)."""

    operator: str
    serve_cpu: str
    vllm_prefill_cpu: str

    def all(self) -> list[str]:
        return [self.operator, self.serve_cpu, self.vllm_prefill_cpu]


def docker(*args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess[str]:
    out = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout)
    if check and out.returncode != 0:
        raise AssertionError(f"docker {' '.join(args)} failed ({out.returncode}): {out.stderr[-2000:]}")
    return out


def _engine_version() -> str | None:
    if shutil.which("docker") is None:
        return None
    try:
        out = subprocess.run(
            ["docker", "info", "--format", "{{.ServerVersion}}"], capture_output=True, text=True, timeout=20
        )
    except subprocess.TimeoutExpired:
        return None
    return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else None


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A test that uses `images` may be the one whose setup builds them (minutes, cold): the suite's
    600 s timeout (pyproject) would kill that build, so such tests get the build's bound on top, unless
    they set a timeout of their own."""
    for item in items:
        if "images" in getattr(item, "fixturenames", ()) and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(BUILD_TIMEOUT_S + 600))


@pytest.fixture(scope="session")
def docker_engine() -> str:
    version = _engine_version()
    if version is None:
        pytest.skip("no Docker engine answers `docker info` (scripts/docker-engine.sh starts one as root)")
    return version


@pytest.fixture(scope="session")
def images(docker_engine: str) -> Images:
    tags = image_table()
    result = Images(
        operator=tags["operator"], serve_cpu=tags["serve-cpu"], vllm_prefill_cpu=tags["vllm-prefill-cpu"]
    )
    present = all(docker("image", "inspect", t, check=False).returncode == 0 for t in result.all())
    if not (present and os.environ.get("TILERT_PD_IMAGES_REUSE") == "1"):
        start = time.monotonic()
        proc = subprocess.run(
            ["bash", str(ROOT / "scripts" / "images.sh")],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=BUILD_TIMEOUT_S,
        )
        if proc.returncode != 0:
            pytest.fail(
                f"scripts/images.sh failed after {time.monotonic() - start:.0f}s:\n"
                f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
            )
    for tag in result.all():
        docker("image", "inspect", tag)
    return result


class Containers:
    """Containers of one test: named tilert-pd-test-<id>-<n>, labelled LABEL=<id>; `remove_all` at the end."""

    def __init__(self) -> None:
        self.id = uuid.uuid4().hex[:10]
        self._n = itertools.count()
        self.names: list[str] = []

    def run(self, image: str, *command: str, docker_args: Sequence[str] = (), name: str | None = None) -> str:
        """`docker run -d` with the test's name and label; returns the container's name."""
        name = name or f"tilert-pd-test-{self.id}-{next(self._n)}"
        self.names.append(name)
        docker("run", "-d", "--name", name, "--label", f"{LABEL}={self.id}", *docker_args, image, *command)
        return name

    def logs(self, name: str) -> str:
        out = docker("logs", name, check=False)
        return out.stdout + out.stderr

    def remove_all(self) -> None:
        listed = docker("ps", "-aq", "--filter", f"label={LABEL}={self.id}", check=False).stdout.split()
        for ref in [*self.names, *listed]:
            docker("rm", "-f", "-v", ref, check=False)


@pytest.fixture()
def containers(docker_engine: str) -> Iterator[Containers]:
    c = Containers()
    try:
        yield c
    finally:
        c.remove_all()
