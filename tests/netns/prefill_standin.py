"""The prefill pod's part of the handoff without vLLM (which boots in minutes on 2 cores): an HTTP server
answering the router's prefill leg as vLLM with TileRTConnector does (first token, kv_transfer_params
with tilert_status=queued), after writing a seeded synthetic state into the node with the project's
own Sender over a real Mooncake or NIXL engine bound to this pod's data-plane address.

usage: prefill_standin.py --port P --data-host ADDR --transfer ENGINE --model-dir DIR --secret-file F
                          --num-tokens N [--seed S]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import sys
from pathlib import Path

import torch
from aiohttp import web

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.decode import synthetic
from tilert_serve import layouts, transfer
from tilert_serve.compat import Compat
from tilert_serve.handoff import auth
from tilert_serve.handoff.sender import HandoffRequest, Sender
from tilert_serve.layouts import Placement

FIRST_TOKEN = 7


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--data-host", required=True)
    p.add_argument("--transfer", required=True)
    p.add_argument("--model-dir", required=True)
    p.add_argument("--kv-cache-dtype", default="float32")
    p.add_argument("--secret-file", required=True)
    p.add_argument("--num-tokens", type=int, required=True)
    p.add_argument("--seed", type=int, default=3)
    # The compatibility generation it hands over as (the node refuses another): as a vLLM prefill's.
    p.add_argument("--served-model-name", default="")
    p.add_argument("--model-revision", default="")
    args = p.parse_args()

    hf_config = json.loads((Path(args.model_dir) / "config.json").read_text())
    layout = layouts.for_hf_config("mla", hf_config, args.kv_cache_dtype)
    staging = Placement(layout, max_tokens=args.num_tokens)
    buf = torch.zeros(staging.total_nbytes(), dtype=torch.uint8)
    synthetic.fill(staging, [buf], args.num_tokens, args.seed)
    engine = transfer.create(args.transfer, host=args.data_host, protocol="tcp", role="prefill-standin")
    engine.register(buf.data_ptr(), buf.numel())
    sender = Sender(
        name="prefill-standin",
        secret=auth.load_secret(args.secret_file),
        engine=engine,
        staging=staging,
        staging_buffers=[buf],
        timeout_s=20,
        compat=Compat(args.served_model_name, args.model_revision, layout.fingerprint).fingerprint,
    )
    results: list[dict] = []
    lock = asyncio.Lock()

    async def completions(request: web.Request) -> web.Response:
        body = await request.json()
        kvp = body.get("kv_transfer_params") or {}
        req = HandoffRequest(
            request_id=request.headers.get("X-Request-Id") or f"standin-{len(results)}",
            num_tokens=args.num_tokens,
            last_prompt_token=FIRST_TOKEN - 1,
            ticket=kvp.get("tilert_ticket"),
            prompt_token_ids=list(range(args.num_tokens)),
        )
        async with lock:
            result = await asyncio.to_thread(
                sender.send, str(kvp["tilert_host"]), int(kvp["tilert_ctrl_port"]), req
            )
        info = {"host": kvp["tilert_host"], "port": kvp["tilert_ctrl_port"], **dataclasses.asdict(result)}
        results.append(info)
        print("HANDOFF " + json.dumps(info), flush=True)
        out_kvp = (
            {
                "tilert_status": "queued",
                "tilert_first_token": FIRST_TOKEN,
                "tilert_num_tokens": args.num_tokens,
            }
            if result.ok
            else {"tilert_status": "failed", "tilert_error": result.message}
        )
        return web.json_response(
            {
                "id": "cmpl-standin",
                "object": "text_completion",
                "model": body.get("model"),
                "choices": [
                    {"index": 0, "text": f"<{FIRST_TOKEN}>", "finish_reason": None, "logprobs": None}
                ],
                "usage": {
                    "prompt_tokens": args.num_tokens,
                    "completion_tokens": 1,
                    "total_tokens": args.num_tokens + 1,
                },
                "kv_transfer_params": out_kvp,
            }
        )

    async def health(_: web.Request) -> web.Response:
        return web.json_response({})

    async def handoffs(_: web.Request) -> web.Response:
        return web.json_response(results)

    app = web.Application()
    app.add_routes(
        [web.post("/v1/completions", completions), web.get("/health", health), web.get("/handoffs", handoffs)]
    )
    try:
        web.run_app(app, host=args.host, port=args.port, print=None, access_log=None)
    finally:
        os._exit(
            0
        )  # NIXL/UCX teardown can crash at exit (docs/reference/transfer-engines.md, "Exit-time crash")


if __name__ == "__main__":
    main()
