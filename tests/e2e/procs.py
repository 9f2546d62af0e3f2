"""Processes the end-to-end tests start: free ports, logs kept for failures, readiness waits, and a
guaranteed kill at the end."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from tilert_serve.local.plan import LOCAL_ENV

PY = sys.executable
# What local runs give every process (NIXL agents poll instead of spinning a core each: with vLLM's
# CPU threads pinned, a spinning agent starves the vLLMs beside it), with quieter engine logs.
TRANSFER_ENV = {**LOCAL_ENV, "MC_LOG_LEVEL": "ERROR", "GLOG_minloglevel": "2"}


class Proc:
    def __init__(self, name: str, argv: list[str], log_dir: Path, env: dict[str, str] | None = None) -> None:
        self.name, self.log = name, log_dir / f"{name}.log"
        self._fh = self.log.open("wb")
        self.popen = subprocess.Popen(
            argv,
            stdout=self._fh,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, **TRANSFER_ENV, **(env or {})},
        )

    def tail(self, n: int = 60) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])

    def wait_ready(self, url: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.popen.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.popen.returncode}:\n{self.tail()}")
            try:
                with urllib.request.urlopen(url, timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{self.name} not ready at {url} after {timeout} s:\n{self.tail()}")

    def kill(self) -> None:
        if self.popen.poll() is None:
            os.killpg(self.popen.pid, signal.SIGKILL)
            self.popen.wait(30)
        self._fh.close()

    def stop(self) -> None:
        if self.popen.poll() is None:
            os.killpg(self.popen.pid, signal.SIGTERM)
            try:
                self.popen.wait(20)
            except subprocess.TimeoutExpired:
                pass
        self.kill()


def post_json(url: str, body: dict, timeout: float = 120) -> dict:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def sse_events(url: str, body: dict, timeout: float = 120) -> list[dict]:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return [json.loads(line[6:]) for line in r.read().decode().splitlines() if line.startswith("data: ")]


def metric(base_url: str, name: str, **labels: str) -> float:
    """Sum of a Prometheus metric's samples whose labels include `labels`."""
    with urllib.request.urlopen(f"{base_url}/metrics", timeout=10) as r:
        text = r.read().decode()
    found = [
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name and labels.items() <= s.labels.items()
    ]
    if not found:
        raise KeyError(f"metric {name}{labels or ''} not exported by {base_url}")
    return sum(found)
