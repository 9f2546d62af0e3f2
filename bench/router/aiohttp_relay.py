"""Baseline: vLLM's toy-proxy flow on aiohttp, built the way aiohttp's docs build a client: one
ClientSession for the app's life, made in cleanup_ctx, its connection pool unbounded like the toy
proxy's httpx pools. Per request: prefill with do_remote_decode and max_tokens=1, then the decode with
the returned kv_transfer_params, its bytes streamed back untouched.

This is the router's own stack (aiohttp server and client, uvloop) doing the least a PD relay can do,
so the router's ratio to it is what routing, admission, metrics and health cost on top.

    python -m bench.router.aiohttp_relay --port P --upstream URL
"""

from __future__ import annotations

import argparse
import json
from collections.abc import AsyncIterator

import aiohttp
from aiohttp import web

from bench.router.pd import decode_body, prefill_body

UPSTREAM = web.AppKey("upstream", str)
HTTP = web.AppKey("http", aiohttp.ClientSession)


async def client_ctx(app: web.Application) -> AsyncIterator[None]:
    # limit=0: no cap on the pool, as the toy proxy's httpx.Limits(max_connections=None).
    app[HTTP] = aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=None)
    )
    yield
    await app[HTTP].close()


async def completions(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    http, url = request.app[HTTP], request.app[UPSTREAM] + "/v1/completions"
    async with http.post(url, json=prefill_body(body)) as presp:
        presp.raise_for_status()
        answer = json.loads(await presp.read())
    async with http.post(url, json=decode_body(body, answer)) as dresp:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        async for chunk in dresp.content.iter_any():
            await resp.write(chunk)
        await resp.write_eof()
        return resp


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--upstream", required=True)
    a = p.parse_args()
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    app = web.Application()
    app[UPSTREAM] = a.upstream
    app.cleanup_ctx.append(client_ctx)
    app.add_routes([web.post("/v1/completions", completions)])
    web.run_app(app, host="127.0.0.1", port=a.port, access_log=None, print=None, backlog=4096)


if __name__ == "__main__":
    main()
