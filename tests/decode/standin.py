"""A prefill stand-in as a process (tests/netns/prefill_standin.py: the project's own Sender over a real
Mooncake engine, answering the router as vLLM with TileRTConnector does), for stacks that need a
prefill without vLLM's minutes of start-up, and the minimal checkpoint config it and a node read."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import aiohttp

from tests.decode.conftest import SENDER_ENV
from tilert_serve.layouts import registry

STANDIN = Path(__file__).resolve().parents[1] / "netns" / "prefill_standin.py"


def model_dir(path: Path, main_layers: int, mtp_layers: int) -> Path:
    path.mkdir()
    (path / "config.json").write_text(
        json.dumps(
            {
                "kv_lora_rank": registry.KV_LORA_RANK,
                "qk_rope_head_dim": registry.ROPE_DIM,
                "num_hidden_layers": main_layers,
                "num_nextn_predict_layers": mtp_layers,
            }
        )
    )
    return path


async def start(port: int, model_dir: Path, secret: Path) -> asyncio.subprocess.Process:
    log = open(model_dir.parent / f"standin-{model_dir.name}-{secret.name}.log", "w")
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        str(STANDIN),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--data-host",
        "127.0.0.1",
        "--transfer",
        "mooncake",
        "--model-dir",
        str(model_dir),
        "--secret-file",
        str(secret),
        "--num-tokens",
        "16",
        env=SENDER_ENV,
        stdout=log,
        stderr=asyncio.subprocess.STDOUT,
    )
    log.close()
    async with aiohttp.ClientSession() as http:
        for _ in range(600):
            try:
                async with http.get(f"http://127.0.0.1:{port}/health") as r:
                    if r.status == 200:
                        return proc
            except aiohttp.ClientError:
                pass
            assert proc.returncode is None, "the prefill stand-in exited"
            await asyncio.sleep(0.1)
    raise AssertionError("the prefill stand-in did not come up")


async def stop(proc: asyncio.subprocess.Process) -> None:
    if proc.returncode is None:
        proc.terminate()
        await asyncio.wait_for(proc.wait(), 20)
