"""A container's probes, run as the kubelet runs them: from outside the container, against the pod's
address, with the probe's own timeout; `Tracker` counts successes and failures against the probe's
thresholds, so `up` decides readiness (and gives up) exactly when a kubelet would.
"""

from __future__ import annotations

import socket
import ssl
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tilert_serve.local.pods import Probe

#: Runs an exec probe's command in the container: (argv, timeout) -> exit code.
Exec = Callable[[Sequence[str], float], int]


def run(probe: Probe, ip: str, exec_: Exec) -> tuple[bool, str]:
    """One probe attempt: (succeeded, what happened, for messages)."""
    if probe.kind == "exec":
        try:
            code = exec_(probe.command, probe.timeout_s)
        except Exception as exc:  # any failure to run the command is a failed probe, with its reason
            return False, f"exec failed: {exc}"
        return code == 0, f"exit code {code}"
    if probe.kind == "tcp":
        try:
            with socket.create_connection((ip, int(probe.port or 0)), timeout=probe.timeout_s):
                return True, "connected"
        except OSError as exc:
            return False, f"connect failed: {exc}"
    scheme = probe.scheme.lower()
    url = f"{scheme}://{ip}:{probe.port}{probe.path}"
    # The kubelet does not verify an HTTPS probe's certificate.
    context = ssl._create_unverified_context() if scheme == "https" else None
    try:
        with urllib.request.urlopen(url, timeout=probe.timeout_s, context=context) as r:
            code = int(r.status)
    except urllib.error.HTTPError as exc:
        code = exc.code
    except (urllib.error.URLError, OSError, ValueError) as exc:
        return False, f"{url}: {getattr(exc, 'reason', exc)}"
    # The kubelet counts 200-399 as success.
    return 200 <= code < 400, f"{url}: HTTP {code}"


@dataclass
class Tracker:
    """A probe's state over time: when it is due, and whether it has passed or given up."""

    probe: Probe
    started: float
    successes: int = 0
    failures: int = 0
    next_at: float = 0.0
    passed: bool = False
    last: str = "not run yet"

    def __post_init__(self) -> None:
        self.next_at = self.started + self.probe.initial_delay_s

    @property
    def given_up(self) -> bool:
        return self.failures >= self.probe.failure_threshold

    def due(self, now: float) -> bool:
        return now >= self.next_at

    def record(self, ok: bool, detail: str, now: float) -> None:
        self.last = detail
        self.next_at = now + self.probe.period_s
        if ok:
            self.failures = 0
            self.successes += 1
            self.passed = self.passed or self.successes >= self.probe.success_threshold
        else:
            self.successes = 0
            self.failures += 1
            self.passed = False


def now() -> float:
    return time.monotonic()
