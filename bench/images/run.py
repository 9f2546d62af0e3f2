"""The images `make images` builds: size, build time (cold and cached), time until a container is ready.

    .venv/bin/python -m bench.images.run [--no-cold] [--no-vllm-serve] [--reps 3]

Build times come from scripts/images.sh (IMAGES_SUMMARY_JSON), one image at a time:
- cold: `--no-cache` (every step runs: apt, pip downloads from PyPI and the wheelhouse, installs), on a
  base already present; the offline base's own build (docker/offline-base.sh) is timed separately;
- cached: the same command again with nothing changed (every step a layer-cache hit), measured on the
  second of two runs.
Time to ready, from `docker run` to the first answer, median of --reps runs (container start included;
`docker run --rm IMAGE true` is the floor):
- operator: `tilert-pd operator` against the API test server (tests/operator) until /healthz answers;
- serve-cpu: `tilert-pd router` with a one-prefill config until /health answers;
- vllm-prefill-cpu: `vllm --help` through the shim (imports vLLM), and once, `vllm serve` of the tiny
  generated model (float32, no connector) until /health answers.
Containers run with --network host (the engine here runs with --bridge=none) and are removed after.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from bench.common import record, table
from bench.operator.run import api_server
from tilert_serve.local.runner import free_port

ROOT = Path(__file__).resolve().parents[2]

LABEL = f"tilert-pd.bench=images-{uuid.uuid4().hex[:8]}"


def images() -> dict[str, str]:
    out = {}
    for line in (ROOT / "docker" / "images.txt").read_text().splitlines():
        row = line.split()
        if row and not row[0].startswith("#") and row[2] == "yes":
            out[row[0].removesuffix(".Dockerfile")] = row[1]
    return out


def docker(*args: str, timeout: float = 600, check: bool = True) -> subprocess.CompletedProcess[str]:
    out = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout)
    if check and out.returncode != 0:
        raise RuntimeError(f"docker {' '.join(args[:4])}...: {out.stderr[-2000:]}")
    return out


def build(names: list[str], *, no_cache: bool) -> dict[str, dict[str, Any]]:
    with tempfile.NamedTemporaryFile(suffix=".jsonl", delete=False) as f:
        summary = Path(f.name)
    env = os.environ | {"IMAGES_SUMMARY_JSON": str(summary), "IMAGES_NO_CACHE": "1" if no_cache else "0"}
    print(
        f"== scripts/images.sh {' '.join(names)} ({'cold: --no-cache' if no_cache else 'cached'})", flush=True
    )
    subprocess.run(["bash", str(ROOT / "scripts" / "images.sh"), *names], env=env, cwd=ROOT, check=True)
    rows = [json.loads(line) for line in summary.read_text().splitlines() if line.strip()]
    summary.unlink()
    return {r["name"]: r for r in rows}


def image_id(tag: str) -> str | None:
    out = docker("image", "inspect", "-f", "{{.Id}}", tag, check=False)
    return out.stdout.strip() if out.returncode == 0 else None


def offline_base_seconds() -> float:
    """Make the offline base anew under its own tag (docker/offline-base.sh makes it when missing), then
    put the tag back on the image the built images were made on, so the cached builds stay hits."""
    tag = subprocess.run(
        ["bash", str(ROOT / "docker" / "offline-base.sh")],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    ).stdout.strip()
    old = image_id(tag)
    docker("tag", tag, tag + "-bench-keep")
    docker("rmi", tag)
    t0 = time.monotonic()
    try:
        subprocess.run(
            ["bash", str(ROOT / "docker" / "offline-base.sh")],
            check=True,
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
        )
        return time.monotonic() - t0
    finally:
        new = image_id(tag)
        docker("tag", tag + "-bench-keep", tag)
        docker("rmi", tag + "-bench-keep", check=False)
        if new and new != old:
            docker("rmi", new, check=False)


def drop_untagged(ids: dict[str, str | None]) -> None:
    """After a --no-cache build moved a tag: remove the image it left behind (ours, by id), if unused."""
    for tag, old in ids.items():
        if old and image_id(tag) != old:
            docker("rmi", old, check=False)


def wait_http(url: str, timeout: float, alive: Callable[[], bool]) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                if resp.status == 200:
                    return time.monotonic()
        except OSError:
            pass
        if not alive():
            raise RuntimeError(f"the container exited before {url} answered")
        time.sleep(0.05)
    raise RuntimeError(f"{url} did not answer within {timeout}s")


def time_to_ready(
    image: str, command: list[str], url: str, docker_args: list[str], timeout: float = 120
) -> float:
    name = f"tilert-pd-bench-{uuid.uuid4().hex[:8]}"
    t0 = time.monotonic()
    docker("run", "-d", "--name", name, "--label", LABEL, "--network", "host", *docker_args, image, *command)
    try:

        def alive() -> bool:
            return docker("inspect", "-f", "{{.State.Running}}", name, check=False).stdout.strip() == "true"

        return wait_http(url, timeout, alive) - t0
    except BaseException:
        logs = docker("logs", name, check=False)
        print(logs.stdout[-3000:], logs.stderr[-3000:])
        raise
    finally:
        docker("rm", "-f", name, check=False)


def run_once(image: str, *args: str, entrypoint: str | None = None) -> float:
    ep = ["--entrypoint", entrypoint] if entrypoint else []
    t0 = time.monotonic()
    docker("run", "--rm", "--label", LABEL, "--network", "none", *ep, image, *args)
    return time.monotonic() - t0


def med(fn: Callable[[], float], reps: int) -> float:
    return statistics.median(fn() for _ in range(reps))


def operator_ready(image: str, reps: int) -> float:
    st, cfg = api_server("bench-images-")
    cfg.chmod(0o644)
    try:

        def once() -> float:
            port = free_port()
            return time_to_ready(
                image,
                ["tilert-pd", "operator", "--liveness", f"http://127.0.0.1:{port}/healthz"],
                f"http://127.0.0.1:{port}/healthz",
                [
                    "-v",
                    f"{cfg}:/etc/kubeconfig:ro",
                    "-e",
                    "KUBECONFIG=/etc/kubeconfig",
                    "-e",
                    "TILERT_PD_METRICS_PORT=0",
                ],
            )

        return med(once, reps)
    finally:
        st.stop()


def router_ready(image: str, reps: int) -> float:
    tmp = Path(tempfile.mkdtemp(prefix="bench-images-"))
    cfg = tmp / "router.yaml"
    cfg.write_text(yaml.safe_dump({"model": "tiny", "prefill": ["http://127.0.0.1:9"]}))
    cfg.chmod(0o644)

    def once() -> float:
        port = free_port()
        return time_to_ready(
            image,
            [
                "router",
                "--config",
                "/etc/router.yaml",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--no-health-checks",
            ],
            f"http://127.0.0.1:{port}/health",
            ["-v", f"{cfg}:/etc/router.yaml:ro"],
        )

    return med(once, reps)


def vllm_serve_ready(image: str) -> float:
    from tilert_serve import vllm_cpu
    from tilert_serve.tinymodel.generate import TinySpec, generate

    tmp = Path(tempfile.mkdtemp(prefix="bench-images-"))
    model = tmp / "tiny"
    generate(TinySpec(), model)
    os.chmod(tmp, 0o755)
    port = free_port()
    env = [a for k, v in vllm_cpu.serve_env().items() for a in ("-e", f"{k}={v}")]
    cmd = [
        "/models/tiny",
        "--served-model-name",
        "tiny",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--enforce-eager",
        "--max-model-len",
        "512",
        "--kv-cache-memory-bytes",
        str(256 << 20),
        *vllm_cpu.serve_args(),
    ]
    # ENTRYPOINT is `vllm serve`: the arguments are the model and vLLM's flags, as the operator renders them.
    # --shm-size: vLLM's engine core and worker talk through a shared-memory ring; Docker's default 64 MB
    # /dev/shm is too small for it ("check_shm_free_space" fails at start).
    return time_to_ready(
        image,
        cmd,
        f"http://127.0.0.1:{port}/health",
        ["--shm-size", "1g", "-v", f"{model}:/models/tiny:ro", *env],
        timeout=600,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--no-cold", action="store_true", help="skip the cold (--no-cache) builds")
    ap.add_argument("--no-vllm-serve", action="store_true", help="skip vLLM serving the tiny model")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    tags = images()
    names = list(tags)

    base_s: float | None = None
    cold: dict[str, dict[str, Any]] = {}
    if not args.no_cold:
        base_s = offline_base_seconds()
        for name in names:
            before = {tags[name]: image_id(tags[name])}
            cold |= build([name], no_cache=True)
            drop_untagged(before)
    # Cached: a first run brings the layer cache up to date with the tree (after --no-cache builds the
    # legacy builder may follow another chain of layers; others' edits may have landed), the second is
    # the one measured.
    build(names, no_cache=False)
    warm = build(names, no_cache=False)

    floor = {n: med(lambda t=t: run_once(t, "true", entrypoint="true"), args.reps) for n, t in tags.items()}
    ready = {
        "operator": ("`tilert-pd operator` /healthz", operator_ready(tags["operator"], args.reps)),
        "serve-cpu": ("`tilert-pd router` /health", router_ready(tags["serve-cpu"], args.reps)),
        "vllm-prefill-cpu": (
            "`vllm --help` (shim, imports vLLM)",
            med(lambda: run_once(tags["vllm-prefill-cpu"], "--help", entrypoint="vllm"), args.reps),
        ),
    }
    serve_s: float | None = None
    serve_error = ""
    if not args.no_vllm_serve:
        try:
            serve_s = vllm_serve_ready(tags["vllm-prefill-cpu"])
        except RuntimeError as exc:  # recorded, not lost: the other numbers took minutes
            serve_error = str(exc)

    rows = []
    for name in names:
        w = warm[name]
        c = cold.get(name)
        what, secs = ready[name]
        rows.append(
            [
                f"`{tags[name]}`",
                f"{w['size_bytes'] / 1e6:,.0f} MB",
                f"{c['seconds']} s" if c else "-",
                f"{w['seconds']} s ({w['cached_steps']}/{w['steps']} steps cached)",
                f"{floor[name]:.2f} s",
                f"{what}: {secs:.2f} s",
            ]
        )
    # The prefill image's `vllm serve` rows: only the first and last columns.
    serve_rows = [f"`vllm serve` tiny model: failed ({serve_error})"] if serve_error else []
    if serve_s is not None:
        serve_rows.append(f"`vllm serve` tiny model (float32, no connector) /health: {serve_s:.1f} s")
    rows += [[f"`{tags['vllm-prefill-cpu']}`", "", "", "", "", text] for text in serve_rows]
    load = os.getloadavg()
    base = warm[names[0]]["base"]
    notes = [
        f"Base: `{base}`"
        + (
            f" (offline: debootstrap bookworm minbase + python3 3.11.2 + venv; made in {base_s:.0f} s)"
            if base_s is not None
            else ""
        )
        + "."
    ]
    notes.append(
        "Cold = `docker build --no-cache` on the present base, one image at a time: apt from the Debian mirror, pip from PyPI "
        "(torch's +cpu wheel from a wheelhouse the host's pip filled, served on 127.0.0.1), so network "
        "speed is part of it. Cached = the same builds again, nothing changed (the second of two runs). Time to ready is from "
        f"`docker run` to the first 200, median of {args.reps}. Load average at the end: "
        f"{load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} (other work shared the 2 cores)."
    )
    body = table(
        ["image", "size", "build cold", "build cached", "`docker run ... true`", "time to ready"], rows
    )
    print(body)
    record("images", "Images (`bench/images/run.py`, CPU box)", body, notes="\n".join(notes))
    docker(
        "rm",
        "-f",
        *docker("ps", "-aq", "--filter", f"label={LABEL}", check=False).stdout.split(),
        check=False,
    )


if __name__ == "__main__":
    main()
