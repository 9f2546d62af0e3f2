"""A stream of requests through the router, one at a time, every outcome kept: the apply tests'
check that a change loses nothing (bench/load is the full harness; this is the least that asserts it)."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field


@dataclass
class Load:
    """A request at a time through the router until stopped; every outcome kept, each failure also in
    `timed` with when its request started and ended (monotonic s), so that a failure can be told to be
    the request in flight when a node was killed, or a later one."""

    router: str
    ok: int = 0
    failures: list[str] = field(default_factory=list)
    timed: list[tuple[float, float, str]] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def window(self) -> tuple[int, int]:
        """(ok, failed) so far."""
        return self.ok, len(self.failures)

    def run(self) -> None:
        body = json.dumps({"model": "tiny-mla", "prompt": "hello there", "max_tokens": 4}).encode()
        while not self.stop.is_set():
            req = urllib.request.Request(
                f"{self.router}/v1/completions", data=body, headers={"Content-Type": "application/json"}
            )
            t0 = time.monotonic()
            try:
                with urllib.request.urlopen(req, timeout=120) as r:
                    out = json.loads(r.read())
                assert out["choices"][0]["text"] is not None
                self.ok += 1
            except (urllib.error.URLError, OSError, AssertionError, KeyError, ValueError) as exc:
                detail = (
                    exc.read().decode(errors="replace")[:300]
                    if isinstance(exc, urllib.error.HTTPError)
                    else ""
                )
                text = f"{type(exc).__name__}: {exc} {detail}"
                self.failures.append(text)
                self.timed.append((t0, time.monotonic(), text))
