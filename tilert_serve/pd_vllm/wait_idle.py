"""`tilert-pd wait-idle`: the preStop hook of a vLLM pod (prefill or native decode) that lets a
scale-down or rollout lose nothing.

The kubelet runs the hook before SIGTERM, while the endpoints controller and the proxies take the
terminating pod out of its Services (and the router's probes see it go). The hook first waits
`--min-wait` seconds (the classic preStop sleep, so requests routed just before the pod left still
arrive), then polls until the server is idle:

- vLLM's own gauges on its /metrics: `vllm:num_requests_running` and `vllm:num_requests_waiting`
  (every engine's, summed) are 0: no request is being prefilled or decoded;
- for a prefill with TileRTConnector, the handoffs its workers still have to send are 0
  (pending.py: one file per worker under `--pending-dir`): the state of every request it answered has
  reached its decode node, so exiting cannot fail a request whose first token the client already has.

It returns 0 once idle, or 2 when `--timeout` passes first (naming what was left; the kubelet then
sends SIGTERM anyway, and vLLM's own --shutdown-timeout drain takes over). A vLLM that does not answer
on its port (connection refused) counts as having nothing running (it is gone or not started), while
one that answers with an error or not in time counts as busy; the pending handoffs are always waited
for. What it cannot see: a native (NIXL) prefill's blocks that a native decode has not pulled yet
(vLLM exposes no gauge of them); `--min-wait` covers the usual pull, seconds after the prefill answered.

Pure decision (`decide`) over polled facts; the polling and printing are the edges.
"""

from __future__ import annotations

import argparse
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass

from tilert_serve.pd_vllm import pending

#: vLLM's gauges of requests it is working on.
GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting")


@dataclass(frozen=True)
class Poll:
    """One look at the server: its gauges and its pending handoffs. `vllm`: "ok" (the gauges were
    read), "gone" (nothing listens on its port) or why /metrics could not be read (counted busy)."""

    running: float
    waiting: float
    pending_sends: int
    vllm: str = "ok"

    @property
    def idle(self) -> bool:
        return (
            self.vllm in ("ok", "gone") and not self.running and not self.waiting and self.pending_sends == 0
        )

    def describe(self) -> str:
        vllm = {
            "ok": f"{self.running:g} running, {self.waiting:g} waiting",
            "gone": "vLLM not listening",
        }.get(self.vllm, f"vLLM's /metrics unreadable ({self.vllm})")
        return f"{vllm}, {self.pending_sends} handoff(s) to send"


def decide(poll: Poll, elapsed: float, min_wait: float, timeout: float) -> int | None:
    """The exit code now (0 idle, 2 timed out), or None to poll again."""
    if elapsed >= min_wait and poll.idle:
        return 0
    if elapsed >= timeout:
        return 2
    return None


def parse_gauges(text: str) -> tuple[float, float]:
    """(running, waiting) summed over vLLM's engines and label sets, from its /metrics text."""
    from prometheus_client.parser import text_string_to_metric_families

    sums = dict.fromkeys(GAUGES, 0.0)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in sums:
                sums[sample.name] += sample.value
    return sums[GAUGES[0]], sums[GAUGES[1]]


def fetch_gauges(url: str, timeout: float) -> tuple[float, float, str]:
    """(running, waiting, "ok" | "gone" | why not read) from vLLM's /metrics."""
    try:
        with urllib.request.urlopen(f"{url.rstrip('/')}/metrics", timeout=timeout) as resp:
            return (*parse_gauges(resp.read().decode()), "ok")
    except urllib.error.URLError as exc:
        if isinstance(exc.reason, ConnectionRefusedError):
            return 0.0, 0.0, "gone"
        return 0.0, 0.0, str(exc.reason)[:200]
    except (OSError, ValueError) as exc:
        if isinstance(exc, ConnectionRefusedError):
            return 0.0, 0.0, "gone"
        return 0.0, 0.0, f"{type(exc).__name__}: {exc}"[:200]


def poll_once(url: str, pending_dir: str, http_timeout: float) -> Poll:
    running, waiting, state = fetch_gauges(url, http_timeout)
    return Poll(running, waiting, sum(pending.read(pending_dir).values()), state)


def wait(
    poll: Callable[[], Poll],
    *,
    min_wait: float,
    timeout: float,
    interval: float,
    say: Callable[[str], None],
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> int:
    start = clock()
    last = ""
    while True:
        now = poll()
        elapsed = clock() - start
        code = decide(now, elapsed, min_wait, timeout)
        line = now.describe()
        if code == 0:
            say(f"wait-idle: idle after {elapsed:.1f} s ({line})")
            return 0
        if code == 2:
            say(
                f"wait-idle: still busy after --timeout {timeout:g} s ({line}); the pod's SIGTERM comes "
                "next and vLLM's --shutdown-timeout drain takes over; raise terminationGracePeriodSeconds "
                "if this repeats"
            )
            return 2
        if line != last:  # progress, once per change
            say(f"wait-idle: {elapsed:.1f} s: {line}")
            last = line
        sleep(interval)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the local vLLM's base URL (its /metrics)")
    p.add_argument(
        "--pending-dir",
        default=pending.DEFAULT_DIR,
        help="the TileRTConnector's tilert_pending_dir (a prefill's handoffs still to send); "
        "absent on a native decode, which has none",
    )
    p.add_argument(
        "--min-wait",
        type=float,
        default=5.0,
        help="seconds to wait before the first idle answer counts, while Services and the router drop "
        "the pod (the preStop sleep this hook replaces)",
    )
    p.add_argument(
        "--timeout",
        type=float,
        required=True,
        help="seconds after which to give up waiting (the grace period less the drain after SIGTERM)",
    )
    p.add_argument("--interval", type=float, default=0.5, help="seconds between polls")


def run(args: argparse.Namespace) -> int:
    if args.timeout < args.min_wait:
        raise SystemExit(
            f"wait-idle: --timeout {args.timeout:g} is shorter than --min-wait {args.min_wait:g}"
        )
    try:
        pending.read(args.pending_dir)
    except pending.UnsafeDirectory as exc:
        raise SystemExit(f"wait-idle: --pending-dir: {exc}") from exc
    return wait(
        lambda: poll_once(args.url, args.pending_dir, max(0.5, min(args.interval * 4, 5.0))),
        min_wait=args.min_wait,
        timeout=args.timeout,
        interval=args.interval,
        say=lambda s: print(s, file=sys.stderr, flush=True),
    )
