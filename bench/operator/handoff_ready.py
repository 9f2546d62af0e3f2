"""HandoffReady's reaction times in the full local stack: how long after a data-plane fault the condition
turns False with the fault's reason, and how long after the repair it is True again.

    .venv/bin/python -m bench.operator.handoff_ready [--reps 3]

The stack is `tilert-pd local up`'s (tilert_serve.local.cli.launch) for examples/tiny-cpu.yaml with one
TileRT node and no native pool: the tiny generated model, vLLM's CPU prefill with the TileRTConnector and
MTP, the node on the reference engine, the router probing the node with a real handoff every 2 s while
idle (1 s after a failure; the operator renders 30 s and 5 s). HandoffReady is computed by the operator's
own code (tilert_operator.handoff reads the node's authenticated /v1/status, status.handoff_ready), polled
every 0.25 s (a status read that times out takes 3 s). The faults (ctrl_blocked only as root with iptables) and how they are injected:
tests/local/handoff_stack.py. Times are from the moment the fault (or the repair) is in place: the secret
file written, SIGSTOP/SIGCONT sent, the restarted node ready (its restart time is given apart).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench.common import record, table

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.local import handoff_stack as hs  # noqa: E402

FAULTS = ["secret", "unreachable", "ctrl_blocked", "layout"]


def _fmt(xs: list[float]) -> str:
    if not xs:
        return "-"
    return f"{statistics.median(xs):.1f} ({min(xs):.1f}-{max(xs):.1f})"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=3, help="repetitions of each fault")
    args = p.parse_args(argv)
    faults = [f for f in FAULTS if f != "ctrl_blocked" or hs.ctrl_blocking_unavailable() is None]
    times: dict[str, dict[str, list[float]]] = {
        f: {"down": [], "up": [], "inject": [], "repair": []} for f in faults
    }
    reasons: dict[str, set[str]] = {f: set() for f in faults}
    with tempfile.TemporaryDirectory(prefix="bench-handoff-ready-") as tmp:
        t0 = time.monotonic()
        stack = hs.start(Path(tmp) / "home", say=print)
        try:
            _, first = stack.until_true()
            print(
                f"stack up in {time.monotonic() - t0:.0f} s; HandoffReady True {first:.1f} s after launch returned"
            )
            for rep in range(args.reps):
                for fault in faults:
                    stack.until_true()
                    t = time.monotonic()
                    stack.inject(fault)
                    times[fault]["inject"].append(time.monotonic() - t)
                    try:
                        cond, down = stack.until_false(hs.EXPECTED[fault])
                        reasons[fault].add(cond["reason"])
                    finally:
                        t = time.monotonic()
                        stack.repair(fault)
                        times[fault]["repair"].append(time.monotonic() - t)
                    _, up = stack.until_true()
                    times[fault]["down"].append(down)
                    times[fault]["up"].append(up)
                    print(
                        f"rep {rep + 1} {fault:<12} False ({cond['reason']}) after {down:5.1f} s, True again "
                        f"{up:5.1f} s after the repair",
                        flush=True,
                    )
        finally:
            stack.stop()
    what = {
        "secret": "node's handoff secret rewritten to another value / back",
        "unreachable": "node's process group SIGSTOP / SIGCONT",
        "ctrl_blocked": "iptables DROP of the node's ctrl port on loopback / rule deleted",
        "layout": f"node restarted with KV-cache dtype {hs.WRONG_KV_DTYPE} / with the rendered command",
    }
    rows = [
        [
            f,
            what[f],
            " ".join(sorted(reasons[f])),
            _fmt(times[f]["down"]),
            _fmt(times[f]["up"]),
            _fmt(times[f]["inject"] if f == "layout" else []),
        ]
        for f in faults
    ]
    body = table(
        [
            "fault",
            "injected as (fault / repair)",
            "reason",
            "fault -> False (s)",
            "repair -> True (s)",
            "node restart (s)",
        ],
        rows,
    )
    print(body)
    record(
        "operator-handoff-ready",
        "HandoffReady in the local stack (`bench/operator/handoff_ready.py`, CPU box)",
        body,
        notes=f"Median (min-max) of {args.reps} repetitions of each fault, in turn, on one stack. The stack: "
        "`tilert-pd local up`'s processes (cli.launch) for examples/tiny-cpu.yaml with one TileRT node and "
        "no native pool; real vLLM CPU prefill with the TileRTConnector and MTP, the node on the "
        f"reference engine, router probes every {hs.PROBE_INTERVAL_S:g} s while idle and "
        f"{hs.PROBE_RETRY_S:g} s after a failure (the operator renders 30 s and 5 s). HandoffReady from "
        "the operator's code (handoff.poll, status.handoff_ready) polled every 0.25 s; a status read "
        "that times out takes 3 s. In a cluster the operator computes it at each reconcile, so add up to "
        "its resync period (TILERT_PD_RESYNC_S, 30 s by default) to these data-plane times. "
        f"Load average (1 min) at the end {os.getloadavg()[0]:.1f}.",
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
