"""The native path's decode speed on vLLM's CPU build, against vLLM without a connector.

    .venv/bin/python -m bench.native_cpu.run [--rounds 4] [--max-tokens 24]

Starts examples/tiny-cpu.yaml with `tilert-pd local up` twice: as rendered, and with vLLM's own core
reservation (the rendered VLLM_CPU_NUM_OF_RESERVED_CPU left out, as before tilert_serve/vllm_cpu.py
set it). Beside both, one plain vLLM: the native pool's rendered command without
`--kv-transfer-config`. Requests go through the router with `x-pd-route: native` and straight to the
plain vLLM, alternately, measured as `make demo` measures them (streamed; TPOT is the mean gap between
chunks after the first, so an MTP step that yields two tokens counts once). The ratio is the native
path's median TPOT over the plain vLLM's, measured in the same run, which cancels most of the load other
work puts on a shared box.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

from bench.common import record, table
from tilert_operator import constants
from tilert_operator.spec import PDClusterSpec
from tilert_serve import vllm_cpu
from tilert_serve.local import cli as local_cli
from tilert_serve.local import demo, runner
from tilert_serve.local import plan as local_plan

SPEC = "examples/tiny-cpu.yaml"


def _start_plain(spec: PDClusterSpec, model_dir: Path, log: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = runner.free_port()
    pl = local_plan.plan(
        spec,
        ports=local_plan.Ports(router=0, prefill=[0], native=[port], tilert=[]),
        model_dir=str(model_dir),
        secret_file="unused",
        router_config_file="unused",
    )
    native = next(c for c in pl.components if c.kind == constants.NATIVE)
    argv = list(native.argv)
    i = argv.index("--kv-transfer-config")
    del argv[i : i + 2]
    env = {**os.environ, **native.env}
    env.pop(vllm_cpu.VLLM_CPU_RESERVED_CPU_ENV, None)
    proc = subprocess.Popen(
        argv, env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(f"{url}/health", timeout=2)
            return proc, url
        except OSError:
            if proc.poll() is not None:
                raise RuntimeError(f"plain vLLM exited; see {log}") from None
            time.sleep(1)
    raise RuntimeError(f"plain vLLM not ready in 600 s; see {log}")


def _stop(proc: subprocess.Popen[bytes]) -> None:
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=4, help="passes over the demo's prompts per variant")
    ap.add_argument("--max-tokens", type=int, default=24)
    args = ap.parse_args()
    home = Path(tempfile.mkdtemp(prefix="bench-native-cpu-"))
    name, spec = local_cli.load_spec(SPEC)
    rendered_env = vllm_cpu.serve_env
    plain: subprocess.Popen[bytes] | None = None
    plain_url = ""
    rows = []
    try:
        for variant in ("rendered", "vLLM's default reserve"):
            # The local plan renders through vllm_cpu.serve_env, so this is what pods would get.
            vllm_cpu.serve_env = (
                rendered_env if variant == "rendered" else (lambda tensor_parallel_size=1: {})
            )
            up = argparse.Namespace(
                action="up", filename=SPEC, router_port=runner.free_port(), timeout=900.0, home=home
            )
            if local_cli.run(up) != 0:
                raise SystemExit(f"the stack did not start; logs under {home}")
            try:
                meta, _ = runner.load((home / name).resolve())
                if plain is None:
                    vllm_cpu.serve_env = rendered_env
                    plain, plain_url = _start_plain(
                        spec, local_cli.model_dir_for(home, name, spec), home / "plain-vllm.log"
                    )
                    demo.complete(plain_url, spec.model.name, demo.PROMPTS[0], "plain", 4)  # warm-up
                native_tpot, plain_tpot, texts_equal = [], [], True
                for _ in range(args.rounds):
                    for prompt, chat in [*((p, False) for p in demo.PROMPTS), (demo.CHAT, True)]:
                        n = demo.complete(
                            str(meta["router"]), spec.model.name, prompt, "native", args.max_tokens, chat
                        )
                        p = demo.complete(plain_url, spec.model.name, prompt, "plain", args.max_tokens, chat)
                        native_tpot.append(n["tpot_ms"])
                        plain_tpot.append(p["tpot_ms"])
                        texts_equal &= n["text"] == p["text"] and n["served_by"] == "native"
                load = os.getloadavg()[0]
                nat, pla = statistics.median(native_tpot), statistics.median(plain_tpot)
                rows.append(
                    [
                        variant,
                        f"{nat:.1f}",
                        f"{pla:.1f}",
                        f"{nat / pla:.2f}x",
                        str(len(native_tpot)),
                        "yes" if texts_equal else "NO",
                        f"{load:.1f}",
                    ]
                )
                print(rows[-1], flush=True)
            finally:
                local_cli.run(argparse.Namespace(action="down", home=home))
    finally:
        vllm_cpu.serve_env = rendered_env
        if plain is not None:
            _stop(plain)
    body = table(
        [
            "native pool's core reserve",
            "native TPOT ms (median)",
            "vLLM alone TPOT ms (median)",
            "ratio",
            "requests",
            "same text",
            "load avg",
        ],
        rows,
    )
    print(body)
    record("native-cpu", "Native path on vLLM's CPU build (`bench/native_cpu/run.py`, CPU box)", body)


if __name__ == "__main__":
    main()
