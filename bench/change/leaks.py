"""What the stack still holds once the load has stopped: a TileRT slot not free, a request the router
counts in flight, a slot the router thinks it holds. After every change has been made and every
request answered, all of it should be zero; anything else leaked."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from tilert_operator import constants
from tilert_serve.local import runner

#: The router's gauges that must read 0 when nothing is in flight (router/metrics.py).
ROUTER_GAUGES = ("tilert_router_inflight_requests", "tilert_router_tilert_slots_in_use")


def _get(url: str, token: str | None = None) -> bytes:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    with urllib.request.urlopen(req, timeout=10) as r:
        return bytes(r.read())


def held(state_dir: Path) -> list[str]:
    """One line per thing still held (empty: nothing leaked). Reads each running TileRT node's
    /v1/status and each router's /metrics."""
    _, procs = runner.load(state_dir)
    token_file = state_dir / runner.NODE_API_TOKEN_FILE
    token = token_file.read_text().split()[0] if token_file.exists() else None
    out: list[str] = []
    for p in procs:
        if not runner.running(p):
            continue
        if p.kind == constants.TILERT:
            status = json.loads(_get(f"{p.url}/v1/status", token))
            busy = [s for s in status["slots"] if s["state"] != "free"]
            out += [f"{p.name}: slot {s['index']} is {s['state']}" for s in busy]
        elif p.kind == constants.ROUTER:
            for family in text_string_to_metric_families(_get(f"{p.url}/metrics").decode()):
                if family.name in ROUTER_GAUGES:
                    out += [
                        f"{p.name}: {family.name}{s.labels} = {s.value:g}" for s in family.samples if s.value
                    ]
    return out
