"""The node's lifecycle owners apart from the wire: the handoff pipeline's timings (decode/pipeline.py)
and the node's phase (decode/node.py), as /health, /ready and /v1/admit show it."""

from __future__ import annotations

import asyncio
import os

import aiohttp
import pytest
from aiohttp import web

from tests.decode import synthetic
from tests.decode.conftest import SECRET, SENDER_ENV, RecordingEngine, node_transfer
from tilert_serve.decode import pipeline
from tilert_serve.decode.http import make_app
from tilert_serve.decode.node import DecodeNode, NodeConfig, NodePhase
from tilert_serve.decode.slots import Slot

LAYOUT = synthetic.layout_for("mla-f32")


def test_timings_split_the_converters_work_at_the_moment_generate_found_the_state() -> None:
    build = pipeline.Build(generation=1, layers_reported=3, last_frame_layers=1, t_last_layer=10.0)
    # Converter work (perf_counter seconds): a layer-wise digest and conversion before /generate came
    # at t0=2, the rest of the check and the assembly after it, until the state was there at t1=5.
    build.spans = [("digest", 0.0, 1.0), ("convert", 1.0, 3.0), ("digest", 4.0, 5.0)]
    slot = Slot(0, t_ready=10.5)
    t = pipeline.timings(build, slot, t0=2.0, t1=5.0, t_found=10.75)
    assert t["hidden_digest_ms"] == pytest.approx(1000.0)
    assert t["hidden_convert_ms"] == pytest.approx(1000.0)  # 1..2 of the 1..3 conversion
    assert t["digest_ms"] == pytest.approx(1000.0)  # 4..5
    assert t["convert_ms"] == pytest.approx(2000.0)  # the rest of t0..t1
    assert t["layerwise"] == 1.0 and t["layers_layerwise"] == 3.0 and t["layers_early"] == 2.0
    assert t["last_layer_to_ready_ms"] == pytest.approx(500.0)
    assert t["ready_to_generate_ms"] == pytest.approx(250.0)


def test_a_whole_state_handoff_has_no_layerwise_timings() -> None:
    t = pipeline.timings(pipeline.Build(generation=1), Slot(0, t_ready=3.0), t0=1.0, t1=1.5, t_found=2.0)
    assert t["layerwise"] == 0.0 and t["layers_layerwise"] == 0.0 and t["last_layer_to_ready_ms"] == 0.0
    assert t["convert_ms"] == pytest.approx(500.0) and t["digest_ms"] == 0.0
    assert t["ready_to_generate_ms"] == 0.0  # found before READY (never negative)


class _BrokenEngine(RecordingEngine):
    def load(self) -> None:
        raise RuntimeError("no checkpoint at /models/x")


async def test_a_failed_start_is_reported_until_the_node_stops() -> None:
    for key in ("UCX_TLS", "UCX_NET_DEVICES", "UCX_MODULES"):
        os.environ.setdefault(key, SENDER_ENV[key])
    config = NodeConfig(name="node-0", max_seq_len=256, host="127.0.0.1", ctrl_port=0, http_port=0)
    node = DecodeNode(
        config, layout=LAYOUT, engine=_BrokenEngine(LAYOUT, 256, 1), transfer=node_transfer(), secret=SECRET
    )
    assert node.phase is NodePhase.STARTING and not node.ready and node.failed is None
    runner = web.AppRunner(make_app(node))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    url = f"http://127.0.0.1:{port}"
    try:
        async with asyncio.timeout(30):
            while node.phase is NodePhase.STARTING:  # the start runs in the background
                await asyncio.sleep(0.01)
        assert node.phase is NodePhase.FAILED
        assert node.failed is not None and "RuntimeError" in node.failed
        async with aiohttp.ClientSession() as http:
            async with http.get(url + "/health") as r:
                assert r.status == 500 and (await r.json())["status"] == "failed"
            async with http.get(url + "/ready") as r:
                body = await r.json()
                assert r.status == 503 and body["ready"] is False and "RuntimeError" in body["reason"]
                assert "/models/x" not in body["reason"]  # the message stays in the log and /v1/status
            async with http.post(url + "/v1/admit", json={"request_id": "r"}) as r:
                assert r.status == 503 and (await r.json())["error"]["type"] == "not_ready"
    finally:
        await runner.cleanup()
    # Stopped, the reason for the failure is still the node's to report.
    assert node.phase is NodePhase.STOPPED and node.stopping and "RuntimeError" in (node.failed or "")
