"""The load generator: closed-loop (saturation) and open-loop (fixed rate) streams of completions,
measuring time to first token and, when tokens carry their send time, per-token latency."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import aiohttp

from bench.router.pd import decode_body, prefill_body


@dataclass
class Target:
    name: str
    url: str  # base URL
    headers: dict[str, str] = field(default_factory=dict)
    #: True = the client itself calls prefill then decode on `url` (the "direct" baseline).
    direct: bool = False


@dataclass
class Result:
    ok: int = 0
    failed: int = 0
    ttft: list[float] = field(default_factory=list)
    token_lat: list[float] = field(default_factory=list)
    #: CPU seconds the measured process used during the timed window (closed_loop with a `cpu` clock).
    cpu_s: float = 0.0


def body(tokens: int) -> dict:
    return {"model": "tiny", "prompt": "x" * 2000, "max_tokens": tokens, "stream": True, "temperature": 0}


async def one(http: aiohttp.ClientSession, t: Target, tokens: int, res: Result, per_token: bool) -> None:
    b = body(tokens)
    t0 = time.monotonic()
    try:
        if t.direct:
            async with http.post(t.url + "/v1/completions", json=prefill_body(b)) as pr:
                pj = await pr.json()
            b = decode_body(b, pj)
        async with http.post(t.url + "/v1/completions", json=b, headers=t.headers) as resp:
            if resp.status != 200:
                await resp.read()
                res.failed += 1
                return
            first = True
            tail = b""
            buf = b""
            async for chunk in resp.content.iter_any():
                now = time.monotonic()
                if first:
                    res.ttft.append(now - t0)
                    first = False
                if per_token:
                    buf += chunk
                    *events, buf = buf.split(b"\n\n")
                    for ev in events:
                        if ev.startswith(b"data: {"):
                            obj = json.loads(ev[6:])
                            for c in obj.get("choices") or ():
                                txt = c.get("text") or (c.get("delta") or {}).get("content") or ""
                                if txt.strip():
                                    res.token_lat.append(now - float(txt))
                tail = (tail + chunk)[-32:]
            if b"[DONE]" in tail:
                res.ok += 1
            else:
                res.failed += 1
    except (aiohttp.ClientError, TimeoutError, ValueError, KeyError):
        res.failed += 1


def session(limit: int) -> aiohttp.ClientSession:
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=limit, limit_per_host=0),
        timeout=aiohttp.ClientTimeout(total=120),
    )


async def closed_loop(
    t: Target, concurrency: int, seconds: float, tokens: int, cpu: Callable[[], float] = lambda: 0.0
) -> tuple[float, Result]:
    """Each of `concurrency` workers sends its next request when the previous one ends.

    `cpu` reads the measured process's CPU clock; it is read at the same two instants as the wall
    clock, so the warm-up requests count in neither the rate nor the CPU time."""
    res = Result()
    async with session(concurrency) as http:
        # warm the pools
        await asyncio.gather(*(one(http, t, tokens, Result(), False) for _ in range(concurrency)))
        c0 = cpu()
        t0 = time.monotonic()
        deadline = t0 + seconds

        async def worker() -> None:
            while time.monotonic() < deadline:
                await one(http, t, tokens, res, False)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = time.monotonic() - t0
        res.cpu_s = cpu() - c0
    return res.ok / elapsed, res


async def open_loop(t: Target, rate: float, seconds: float, tokens: int, per_token: bool = False) -> Result:
    """Start requests at a fixed rate whatever the answers do (latency under a known load)."""
    res = Result()
    n = int(rate * seconds)
    async with session(0) as http:
        await asyncio.gather(*(one(http, t, tokens, Result(), False) for _ in range(8)))  # warm-up
        t0 = time.monotonic()
        tasks = []
        for i in range(n):
            delay = t0 + i / rate - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.ensure_future(one(http, t, tokens, res, per_token)))
        await asyncio.gather(*tasks)
    return res
