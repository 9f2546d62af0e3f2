"""`tilert-pd router` as a process: starts from a config file, serves, stops cleanly on SIGTERM."""

from __future__ import annotations

import asyncio
import signal

import aiohttp
from router_fakes import start_router

from tilert_serve.local.runner import free_port
from tilert_serve.router import config


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
