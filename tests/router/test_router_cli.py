"""`tilert-pd router` as a process: starts from a config file, serves, stops cleanly on SIGTERM."""

from __future__ import annotations

import asyncio
import signal
import sys
from pathlib import Path
from typing import Any

import aiohttp

from tilert_serve.local.runner import free_port
from tilert_serve.router import config


async def start_router(
    cfg_path: Path, port: int, *extra: str, log_level: str = "WARNING", **kwargs: Any
) -> asyncio.subprocess.Process:
    """`tilert-pd router` as a process serving `cfg_path` on 127.0.0.1:`port`; `extra`: more flags,
    `kwargs`: create_subprocess_exec's (the output's pipes)."""
    return await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "tilert_serve.router.cli",
        "--config",
        str(cfg_path),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--log-level",
        log_level,
        *extra,
        **kwargs,
    )


async def test_cli_serves_and_stops(make_stack, tmp_path):
    s = await make_stack()
    path = tmp_path / "config.yaml"
    path.write_text(config.dump(s.cfg))
    port = free_port()
    proc = await start_router(path, port, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    try:
        async with aiohttp.ClientSession() as http:
            for _ in range(300):
                try:
                    async with http.get(f"http://127.0.0.1:{port}/health") as resp:
                        if resp.status == 200:
                            break
                except aiohttp.ClientError:
                    await asyncio.sleep(0.05)
            body = {"model": "tiny", "prompt": "a", "max_tokens": 3}
            async with http.post(f"http://127.0.0.1:{port}/v1/completions", json=body) as resp:
                assert resp.status == 200, await resp.text()
                assert (await resp.json())["choices"][0]["text"] == " hello w0 w1"
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 10) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


def test_cli_arguments():
    import argparse

    from tilert_serve.router import cli

    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    a = p.parse_args(["--config", "c.yaml"])
    assert a.port == 8000 and a.host == "0.0.0.0"
