"""The tiny CPU stack and vLLM alone beside it, for the benchmark and the slow test.

The stack is what `tilert-pd local up -f examples/tiny-cpu.yaml` starts (`local.cli.launch`: the
operator's rendered commands for the router, the prefill, the TileRT nodes and the native decode).
vLLM alone is the native pool's rendered command without `--kv-transfer-config`: the same model,
dtype, MTP and engine settings with no connector and no router, the reference for every output.
vLLM alone boots while the stack does (one wait for both on a 2-core box).
"""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from bench.load.client import Target
from tilert_operator import constants
from tilert_operator.spec import PDClusterSpec
from tilert_serve import tinymodel
from tilert_serve.local import cli as local_cli
from tilert_serve.local import plan as local_plan
from tilert_serve.local import runner

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "tiny-cpu.yaml"


@dataclass
class TinyStack:
    router: Target
    plain: Target
    home: Path
    local: local_cli.LocalStack


def _plain_argv(spec: PDClusterSpec, model_dir: Path, port: int) -> local_plan.Component:
    p = local_plan.plan(
        spec,
        ports=local_plan.Ports(router=0, prefill=[], native=[port], tilert=[]),
        model_dir=str(model_dir),
        secret_file="unused",
        router_config_file="unused",
    )
    native = next(c for c in p.components if c.kind == constants.NATIVE)
    argv = list(native.argv)
    if "--kv-transfer-config" in argv:
        i = argv.index("--kv-transfer-config")
        del argv[i : i + 2]
    return local_plan.Component("vllm-alone", "plain", argv, native.env, native.url, native.ready_url)


def _wait(url: str, proc: subprocess.Popen[bytes], log: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"vLLM alone exited with {proc.returncode} while starting; its log: {log}")
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except OSError:
            time.sleep(1)
    raise RuntimeError(f"vLLM alone was not ready at {url} after {timeout:.0f} s; its log: {log}")


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)


@contextmanager
def tiny_stack(
    file: Path = EXAMPLE,
    *,
    home: Path | None = None,
    say: Callable[[str], None] = print,
    timeout: float = 900.0,
) -> Iterator[TinyStack]:
    """Start the stack of `file` and vLLM alone; stop both on exit (logs stay under `home`)."""
    name, spec = local_cli.load_spec(str(file))
    home = home or Path(tempfile.mkdtemp(prefix="bench-load-"))  # mkdtemp: owner-only
    state_dir = (home / name).resolve()
    model_dir = local_cli.model_dir_for(home, name, spec)
    plain = _plain_argv(spec, model_dir, runner.free_port())
    if spec.model.weights.tiny and not tinymodel.is_current(model_dir):
        # Before vLLM alone starts: it reads the same checkpoint (launch would write it later).
        base = local_plan.paths(model_dir=str(model_dir), secret_file="unused", router_config_file="unused")
        say(f"  generating the tiny model into {model_dir} ...")
        subprocess.run(local_plan.tiny_model_argv(spec, base), check=True, stdout=subprocess.DEVNULL)
    log = home / "vllm-alone.log"
    say(f"  start  vllm-alone {plain.url} (log {log})")
    with log.open("wb") as fh:
        proc = subprocess.Popen(
            plain.argv,
            env={**os.environ, **plain.env},
            stdout=fh,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    stack: local_cli.LocalStack | None = None
    try:
        stack = local_cli.launch(
            name, spec, state_dir, file=str(file), router_port=runner.free_port(), timeout=timeout, say=say
        )
        _wait(plain.ready_url, proc, log, timeout)
        say(f"  ready  vllm-alone {plain.url}")
        yield TinyStack(
            router=Target("router", stack.router, spec.model.name),
            plain=Target("vLLM alone", plain.url, spec.model.name, routes=False),
            home=home,
            local=stack,
        )
    finally:
        if stack is not None:
            # What runs now: `tilert-pd local apply` (bench/change) replaces processes as it goes.
            procs = runner.load(state_dir)[1] if (state_dir / runner.STATE_FILE).exists() else []
            known = {p.pid for p in procs}
            runner.stop(procs + [p for p in stack.procs if p.pid not in known])
            (state_dir / runner.STATE_FILE).unlink(missing_ok=True)
        _stop(proc)
