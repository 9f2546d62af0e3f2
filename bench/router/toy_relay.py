"""A second baseline, closer still to vLLM's toy proxy (toy_proxy_server.py): FastAPI on uvicorn,
httpx as the client, and here a new httpx.AsyncClient per request (no pooling), as the issue asks of
the naive relay. FastAPI, uvicorn and httpx come with vLLM; the router itself does not use them.

    python -m bench.router.toy_relay --port P --upstream URL
"""

from __future__ import annotations

import argparse

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

app = FastAPI()
UPSTREAM = {"url": ""}


@app.post("/v1/completions")
async def completions(request: Request) -> StreamingResponse:
    body = await request.json()
    pbody = dict(body, max_tokens=1, stream=False, kv_transfer_params={
        "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
        "remote_block_ids": None, "remote_host": None, "remote_port": None})
    pbody.pop("stream_options", None)
    client = httpx.AsyncClient(timeout=None, base_url=UPSTREAM["url"])
    presp = await client.post("/v1/completions", json=pbody)
    presp.raise_for_status()
    kvp = presp.json().get("kv_transfer_params")
    dbody = dict(body)
    if kvp:
        dbody["kv_transfer_params"] = kvp

    async def relay():
        try:
            async with client.stream("POST", "/v1/completions", json=dbody) as dresp:
                async for chunk in dresp.aiter_bytes():
                    yield chunk
        finally:
            await client.aclose()

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
