"""Scripted upstreams for the router benchmark, all in one process on one port: a vLLM prefill
(max_tokens=1, stream=false -> JSON with kv_transfer_params), a native vLLM decode (SSE, one event per
token), and a TileRT node (admit / generate / cancel). Each token's text is the monotonic time it was
written, so a client on the same host can measure per-token latency.

    python -m bench.router.upstream --port P [--itl-ms 0]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
import uuid

from aiohttp import web

ITL_S = web.AppKey("itl_s", float)


def _chunk(i: int, last: bool) -> bytes:
    body = {
        "id": "cmpl-b",
        "object": "text_completion",
        "created": 1,
        "model": "tiny",
        "choices": [
            {"index": 0, "text": f" {time.monotonic():.6f}", "finish_reason": "length" if last else None}
        ],
    }
    return b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"


async def completions(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    n = int(body.get("max_tokens") or 16)
    if not body.get("stream"):
        kvp = body.get("kv_transfer_params") or {}
        out_kvp = (
            {"tilert_first_token": 7, "tilert_num_tokens": 32, "tilert_status": "queued"}
            if "tilert_ticket" in kvp
            else {"remote_engine_id": "p", "remote_block_ids": [1, 2, 3]}
        )
        return web.json_response(
            {
                "id": "cmpl-p",
                "object": "text_completion",
                "created": 1,
                "model": "tiny",
                "choices": [{"index": 0, "text": f" {time.monotonic():.6f}", "finish_reason": "length"}],
                "usage": {
                    "prompt_tokens": 32,
                    "completion_tokens": 1,
                    "total_tokens": 33,
                    "prompt_tokens_details": {"cached_tokens": 16},
                },
                "kv_transfer_params": out_kvp,
            }
        )
    itl = request.app[ITL_S]
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    if itl:
        for i in range(n):
            await asyncio.sleep(itl)
            await resp.write(_chunk(i, i == n - 1))
        await resp.write(b"data: [DONE]\n\n")
    else:  # coalesced: every token in one write, the throughput case
        await resp.write(b"".join(_chunk(i, i == n - 1) for i in range(n)) + b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


async def admit(request: web.Request) -> web.Response:
    await request.read()
    return web.json_response(
        {
            "ticket": uuid.uuid4().hex,
            "slot": 0,
            "expires_in_s": 30.0,
            "ctrl_host": "127.0.0.1",
            "ctrl_port": 5556,
        }
    )


async def generate(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    n = int(body.get("max_tokens") or 16)
    itl = request.app[ITL_S]
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)

    def ev(i: int) -> bytes:
        return (
            b'data: {"token_ids":['
            + str(100 + i).encode()
            + b'],"text":" '
            + f"{time.monotonic():.6f}".encode()
            + b'"}\n\n'
        )

    done = (
        b'data: {"done":true,"finish_reason":"length","num_tokens":' + str(n).encode() + b',"timings":{}}\n\n'
    )
    if itl:
        for i in range(n):
            await asyncio.sleep(itl)
            await resp.write(ev(i))
        await resp.write(done)
    else:
        await resp.write(b"".join(ev(i) for i in range(n)) + done)
    await resp.write_eof()
    return resp


async def ok(request: web.Request) -> web.Response:
    if request.can_read_body:
        await request.read()
    return web.json_response({"cancelled": True})


def make_app(itl_s: float) -> web.Application:
    app = web.Application()
    app[ITL_S] = itl_s
    app.add_routes(
        [
            web.post("/v1/completions", completions),
            web.post("/v1/admit", admit),
            web.post("/v1/generate", generate),
            web.post("/v1/cancel", ok),
            web.get("/health", ok),
            web.get("/ready", ok),
        ]
    )
    return app


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--itl-ms", type=float, default=0.0)
    a = p.parse_args()
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    web.run_app(
        make_app(a.itl_ms / 1000), host="127.0.0.1", port=a.port, access_log=None, print=None, backlog=4096
    )


if __name__ == "__main__":
    main()
