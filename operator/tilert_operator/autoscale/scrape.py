"""Reading the pods' /metrics for the planner: which pods (`targets`, pure) and fetching them
(`scrape`, the I/O), all at once within a bounded concurrency, each call within a timeout.

A pod that does not answer, answers an error or answers text that does not parse is named in the
snapshot's `missing` with the reason and left out of this interval; it never stops the others or the
loop. Where each is reached: the router on its API port (with the cluster's metrics-only token when
its /metrics takes a key: credentials.py), vLLM (prefill, native decode) on its port, a TileRT node
on its HTTP port (what the router calls; observe.tilert_nodes). Only ready pods are read: one that is
starting has nothing to say about load, and one being removed is leaving.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from tilert_operator import constants
from tilert_operator import observe as pods_observe
from tilert_operator.autoscale.observe import MetricsTextError, PodSample, Role, Snapshot, parse
from tilert_operator.spec import PDClusterSpec
from tilert_serve import dataplane, defaults

#: Seconds one pod's /metrics may take (a vLLM server under load answers in milliseconds).
TIMEOUT_S = 3.0
#: Pods read at once: a large pool is read in a few rounds, not with hundreds of connections.
CONCURRENCY = 32
#: The most bytes of one answer read (vLLM's exposition is tens of kilobytes).
MAX_BYTES = 4 << 20

_ROLES: dict[str, Role] = {
    constants.ROUTER: "router",
    constants.PREFILL: "prefill",
    constants.NATIVE: "native",
}
_ORDINAL = re.compile(r"-(\d+)$")


@dataclass(frozen=True)
class Target:
    pod: str
    role: Role
    url: str
    ordinal: int | None = None
    #: Bearer token to send (the router's metrics-only token); never in a log or an error.
    token: str | None = field(default=None, repr=False)


def targets(spec: PDClusterSpec, pods: list[dict[str, Any]], router_token: str | None) -> list[Target]:
    """The /metrics of every ready router, prefill, native and TileRT pod of the cluster."""
    out: list[Target] = []
    for component, role in _ROLES.items():
        # The router listens on its Service's port (commands.router), vLLM on its fixed one.
        port = spec.router.service.port if role == "router" else defaults.VLLM_PORT
        for pod in pods_observe.pods_of(pods, component):
            ip = (pod.get("status") or {}).get("podIP")
            if not ip or not pods_observe.is_ready(pod):
                continue
            out.append(
                Target(
                    pod["metadata"]["name"],
                    role,
                    dataplane.http_url(ip, port) + "/metrics",
                    token=router_token if role == "router" else None,
                )
            )
    nodes, _ = pods_observe.tilert_nodes(spec, pods)
    for n in nodes:
        m = _ORDINAL.search(n.name)
        out.append(Target(n.name, "tilert", n.http_url + "/metrics", int(m.group(1)) if m else None))
    return out


async def _one(
    http: aiohttp.ClientSession, t: Target, timeout_s: float, clock: Callable[[], float]
) -> PodSample | str:
    headers = {"Authorization": f"Bearer {t.token}"} if t.token else {}
    try:
        async with http.get(
            t.url, headers=headers, timeout=aiohttp.ClientTimeout(total=timeout_s), allow_redirects=False
        ) as resp:
            if resp.status in (401, 403):
                return f"GET /metrics answered {resp.status}: check the metrics token (credentials.py)"
            if resp.status != 200:
                return f"GET /metrics answered {resp.status}"
            raw = await resp.content.read(MAX_BYTES + 1)
            at = clock()
    except TimeoutError:
        return f"GET /metrics timed out after {timeout_s:g} s"
    except aiohttp.ClientError as e:
        return f"GET /metrics failed: {type(e).__name__}"
    if len(raw) > MAX_BYTES:
        return f"GET /metrics answered more than {MAX_BYTES} bytes"
    try:
        return PodSample(t.pod, t.role, at, parse(raw.decode("utf-8", errors="replace")), t.ordinal)
    except MetricsTextError as e:
        return str(e)[:200]


async def scrape(
    targets: Sequence[Target],
    *,
    timeout_s: float = TIMEOUT_S,
    concurrency: int = CONCURRENCY,
    clock: Callable[[], float] = time.time,
) -> Snapshot:
    """Every target's /metrics, at most `concurrency` at once; the ones that failed, with why."""
    gate = asyncio.Semaphore(concurrency)

    async def bounded(http: aiohttp.ClientSession, t: Target) -> PodSample | str:
        async with gate:
            return await _one(http, t, timeout_s, clock)

    if not targets:
        return Snapshot()
    async with aiohttp.ClientSession() as http:
        got = await asyncio.gather(*(bounded(http, t) for t in targets))
    pods = {t.pod: g for t, g in zip(targets, got, strict=True) if isinstance(g, PodSample)}
    missing = {t.pod: g for t, g in zip(targets, got, strict=True) if isinstance(g, str)}
    return Snapshot(pods, missing)
