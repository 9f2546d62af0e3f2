"""A decode node (recording engine) served as `tilert-pd decode-node` serves it, for the HTTP
denial-of-service tests: `python http_node_proc.py IDLE_S` prints `PORT <n>` once ready, logs as the CLI
does (to stderr), and serves until its stdin closes. The tests start it with a lowered RLIMIT_NOFILE."""

from __future__ import annotations

import asyncio
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.decode import synthetic
from tests.decode.conftest import SECRET, RecordingEngine
from tilert_serve import transfer
from tilert_serve.decode.cli import start_http
from tilert_serve.decode.http import make_app
from tilert_serve.decode.node import DecodeNode, NodeConfig

LAYOUT = synthetic.layout_for("mla-f32")


async def main(idle_s: float) -> None:
    engine = RecordingEngine(LAYOUT, 256, 1)
    config = NodeConfig(
        name="node-0",
        max_seq_len=256,
        slots=1,
        host="127.0.0.1",
        ctrl_port=0,
        http_port=0,
        shards=1,
        devices=("cpu",),
        ticket_ttl_s=30.0,
        handoff_timeout_s=30.0,
    )
    mover = transfer.create("mooncake", host="127.0.0.1", protocol="tcp", role="node")
    node = DecodeNode(config, layout=LAYOUT, engine=engine, transfer=mover, secret=SECRET)
    runner = await start_http(make_app(node), "127.0.0.1", 0, idle_s=idle_s)
    while not node.ready:
        assert not node.failed, node.failed
        await asyncio.sleep(0.02)
    print(f"PORT {runner.addresses[0][1]}", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    await runner.cleanup()


if __name__ == "__main__":
    logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    asyncio.run(main(float(sys.argv[1])))
