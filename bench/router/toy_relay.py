"""Baseline: vLLM's toy PD proxy (tests/v1/kv_connector/nixl_integration/toy_proxy_server.py; also
under examples/online_serving/disaggregated_serving) rebuilt on its own stack: FastAPI on uvicorn,
httpx as the client. As upstream: one pooled httpx.AsyncClient per prefill and per decode instance,
created once in the app's lifespan with no timeout and unbounded pools; per request a uuid request id
sent as X-Request-Id, the prefill's body read before its connection goes back to the pool, the
decode's bytes streamed back through a StreamingResponse.

Different from upstream, on purpose: uvicorn's access log is off (upstream keeps uvicorn's default,
one log line per request; the router under test logs at WARNING), and there is no Authorization
header (no upstream here checks one).

    python -m bench.router.toy_relay --port P --upstream URL
"""

from __future__ import annotations

import argparse
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from bench.router.pd import decode_body, prefill_body

UPSTREAM = {"url": ""}


def pooled(base_url: str) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        base_url=base_url,
        timeout=None,
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),
    )


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    # One prefill and one decode instance, as the toy proxy's default; both are the scripted upstream.
    app.state.prefill = pooled(UPSTREAM["url"] + "/v1")
    app.state.decode = pooled(UPSTREAM["url"] + "/v1")
    yield
    await app.state.prefill.aclose()
    await app.state.decode.aclose()


app = FastAPI(lifespan=lifespan)


@app.post("/v1/completions")
async def completions(request: Request) -> StreamingResponse:
    body = await request.json()
    headers = {"X-Request-Id": str(uuid.uuid4())}
    presp = await request.app.state.prefill.post("/completions", json=prefill_body(body), headers=headers)
    presp.raise_for_status()
    await presp.aread()
    dbody = decode_body(body, presp.json())
    decode: httpx.AsyncClient = request.app.state.decode

    async def relay() -> AsyncIterator[bytes]:
        async with decode.stream("POST", "/completions", json=dbody, headers=headers) as dresp:
            dresp.raise_for_status()
            async for chunk in dresp.aiter_bytes():
                yield chunk

    return StreamingResponse(relay(), media_type="text/event-stream")


@app.get("/")
async def root() -> dict[str, bool]:
    return {"ok": True}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--upstream", required=True)
    a = p.parse_args()
    UPSTREAM["url"] = a.upstream
    uvicorn.run(app, host="127.0.0.1", port=a.port, log_level="warning", access_log=False)


if __name__ == "__main__":
    main()
