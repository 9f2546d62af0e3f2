"""The baseline: a PD relay built the way vLLM's toy proxy is (toy_proxy_server.py): for every request
a new HTTP client (no pooling, no keep-alive across requests), prefill with do_remote_decode and
max_tokens=1, then the decode with the returned kv_transfer_params, its bytes streamed back.

    python -m bench.router.naive_relay --port P --upstream URL
"""

from __future__ import annotations

import argparse
import json

import aiohttp
from aiohttp import web

UPSTREAM = web.AppKey("upstream", str)


async def completions(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    up = request.app[UPSTREAM]
    pbody = dict(body, max_tokens=1, stream=False, kv_transfer_params={
        "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
        "remote_block_ids": None, "remote_host": None, "remote_port": None})
    pbody.pop("stream_options", None)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as http:
        async with http.post(up + "/v1/completions", json=pbody) as presp:
            presp.raise_for_status()
            pj = json.loads(await presp.read())
        dbody = dict(body)
        if pj.get("kv_transfer_params"):
            dbody["kv_transfer_params"] = pj["kv_transfer_params"]
        async with http.post(up + "/v1/completions", json=dbody) as dresp:
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
    app.add_routes([web.post("/v1/completions", completions)])
    web.run_app(app, host="127.0.0.1", port=a.port, access_log=None, print=None, backlog=4096)


if __name__ == "__main__":
    main()
