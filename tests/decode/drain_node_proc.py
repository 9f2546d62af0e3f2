"""A decode node (recording engine) served by `cli.serve`, exactly as `tilert-pd decode-node` serves one:
SIGTERM starts its drain. `python drain_node_proc.py DRAIN_TIMEOUT_S STEP_DELAY_S SECRET_FILE` prints
`PORTS <http> <ctrl>` once ready, logs as the CLI does (to stderr), and prints `OUTCOME <drained|timeout>`
before it exits 0."""

from __future__ import annotations

import asyncio
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.decode import synthetic
from tests.decode.conftest import RecordingEngine
from tilert_serve import transfer
from tilert_serve.decode import cli
from tilert_serve.decode.http import make_app
from tilert_serve.decode.node import DecodeNode, NodeConfig
from tilert_serve.handoff.auth import FileKeyring
from tilert_serve.local.runner import free_port

LAYOUT = synthetic.layout_for("mla-f32")


async def main(drain_timeout_s: float, step_delay_s: float, secret_file: str) -> None:
    engine = RecordingEngine(LAYOUT, 512, 2)
    engine.step_delay_s = step_delay_s
    port = free_port()
    config = NodeConfig(
        name="node-0",
        max_seq_len=512,
        slots=2,
        host="127.0.0.1",
        ctrl_port=0,
        http_port=port,
        ticket_ttl_s=30.0,
        handoff_timeout_s=30.0,
    )
    node = DecodeNode(
        config,
        layout=LAYOUT,
        engine=engine,
        transfer=transfer.create("mooncake", host="127.0.0.1", protocol="tcp", role="node"),
        secret=FileKeyring(secret_file),
    )

    async def announce() -> None:
        while not node.ready:
            assert not node.failed, node.failed
            await asyncio.sleep(0.02)
        print(f"PORTS {port} {node.ctrl_port}", flush=True)

    task = asyncio.create_task(announce())
    outcome = await cli.serve(make_app(node), node, "127.0.0.1", port, drain_timeout_s)
    task.cancel()
    print(f"OUTCOME {outcome}", flush=True)


if __name__ == "__main__":
    logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    asyncio.run(main(float(sys.argv[1]), float(sys.argv[2]), sys.argv[3]))
