"""A decode node that goes silent (its pod deleted along with its network, its machine lost: no reset
comes back, unlike a killed process on a live host) costs the prefill's handoff seconds, not the
message timeout. Each handoff holds one of the prefill's few staging regions while it waits, so a wait
of the full timeout on a dead node stalls every other request's handoff behind it.

Three pods on one bridge, as pods on a node's bridge are: the prefill runs the project's Sender with a
real Mooncake engine; the "node" accepts, sends its Challenge, reads the Auth, and is then cut off the
network (its link deleted: its address goes silent). The Sender, waiting for the node's Hello, must
give up within seconds (keepalive), and a second handoff to the silent address must give up on connect
within seconds; both far inside the message timeout (30 s) they used to wait out.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from tests.netns import bed
from tests.netns.conftest import ROOT

PORT = 5556
#: The Sender's message timeout, which a silent node used to cost in full.
TIMEOUT_S = 30.0

_NODE = r"""
import socket, sys
from tilert_serve.handoff import auth, framing, messages
srv = socket.create_server((sys.argv[1], int(sys.argv[2])))
print("LISTENING", flush=True)
conn, _ = srv.accept()
conn.sendall(framing.encode(messages.Challenge(nonce=auth.new_nonce(), node="silent-node")))
conn.recv(1 << 16)
print("AUTH", flush=True)
conn.recv(1)  # never returns: the link is deleted under it
"""

_SENDER = r"""
import json, sys, time
from pathlib import Path
from tilert_serve import layouts, transfer
from tilert_serve.handoff.sender import HandoffRequest, Sender
from tilert_serve.layouts import Placement
host, node, port, model, timeout = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], float(sys.argv[5])
layout = layouts.for_hf_config("mla", json.loads((Path(model) / "config.json").read_text()), "float32")
sender = Sender(
    name="prefill", secret=b"s" * 32, engine=transfer.create("mooncake", host=host, protocol="tcp", role="prefill"),
    staging=Placement(layout, max_tokens=16), timeout_s=timeout,
)
req = HandoffRequest(request_id="r", num_tokens=4, last_prompt_token=1, ticket="t", prompt_token_ids=[0, 1, 2, 3])
for case in ("handshake", "connect"):
    t0 = time.monotonic()
    result = sender.send(node, port, req)
    print("RESULT " + json.dumps({"case": case, "reason": result.reason, "message": result.message,
                                  "elapsed": time.monotonic() - t0}), flush=True)
"""


_STREAMER = r"""
import asyncio, sys
from aiohttp import web
async def stream(request):
    resp = web.StreamResponse()
    await resp.prepare(request)
    await resp.write(b"data: first\n\n")
    print("STREAMING", flush=True)
    await asyncio.sleep(3600)  # the link is deleted under it
    return resp
app = web.Application()
app.router.add_get("/stream", stream)
app.router.add_get("/health", lambda request: web.Response(text="ok"))
web.run_app(app, host=sys.argv[1], port=int(sys.argv[2]), print=None)
"""

_ROUTER_CLIENT = r"""
import asyncio, json, sys, time
import aiohttp
from tilert_serve.router import upstream
from tilert_serve.router.config import Limits
async def main():
    async with upstream.new_session(Limits()) as http:
        timeout = aiohttp.ClientTimeout(total=None, sock_read=float(sys.argv[2]))
        async with http.get(sys.argv[1], timeout=timeout) as resp:
            await resp.content.readline()
            print("FIRST", flush=True)
            t0 = time.monotonic()
            try:
                await resp.content.read()
                error = "none"
            except Exception as exc:
                error = type(exc).__name__ + " " + str(exc)
            print("RESULT " + json.dumps({"error": error, "elapsed": time.monotonic() - t0}), flush=True)
asyncio.run(main())
"""


def _wait_for_line(proc: bed.PodProcess, line: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while line not in proc.log.read_text(errors="replace"):
        assert proc.alive(), f"{proc.name} exited:\n{proc.tail()}"
        assert time.monotonic() < deadline, f"{proc.name} never said {line}:\n{proc.tail()}"
        time.sleep(0.05)


def test_a_node_gone_silent_is_given_up_within_seconds(
    netns_available: None, tiny_model: Path, tmp_path: Path
) -> None:
    b = bed.Bed("silent")
    procs: list[bed.PodProcess] = []
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MC_LOG_LEVEL": "WARNING"}
    try:
        b.network("pod", {"prefill": "eth0", "node": "eth0", "other": "eth0"}, ["10.252.0.0/24"])
        prefill, node = b.pods["prefill"], b.pods["node"]
        node_ip = node.ip("eth0")
        server = bed.PodProcess(
            node, "node", [sys.executable, "-c", _NODE, node_ip, str(PORT)], env, tmp_path
        )
        procs.append(server)
        _wait_for_line(server, "LISTENING", 60)
        argv = [sys.executable, "-c", _SENDER, prefill.ip("eth0"), node_ip, str(PORT), str(tiny_model)]
        sender = bed.PodProcess(prefill, "sender", [*argv, str(TIMEOUT_S)], env, tmp_path)
        procs.append(sender)
        _wait_for_line(server, "AUTH", 120)
        bed.ip("-n", node.ns, "link", "del", "eth0")  # the node's address goes silent
        assert sender.wait_exit(2 * 2 * TIMEOUT_S) == 0, sender.tail()
        results = {
            r["case"]: r
            for r in (
                json.loads(line.removeprefix("RESULT "))
                for line in sender.log.read_text().splitlines()
                if line.startswith("RESULT ")
            )
        }
        # Each gives up as "unreachable" (the node is gone), well inside the message timeout.
        handshake, connect = results["handshake"], results["connect"]
        assert handshake["reason"] == "unreachable" and "went silent" in handshake["message"], handshake
        assert handshake["elapsed"] < TIMEOUT_S / 2, handshake
        assert connect["reason"] == "unreachable" and "cannot reach" in connect["message"], connect
        assert connect["elapsed"] < TIMEOUT_S / 2, connect
    finally:
        for proc in procs:
            proc.stop()
        assert not b.close()


def test_the_routers_stream_from_a_decode_gone_silent_ends_within_seconds(
    netns_available: None, tmp_path: Path
) -> None:
    """The router's upstream connections (router/upstream.py) carry the same keepalive: a decode whose
    pod vanished mid-stream ends the client's stream with an error within seconds, not after the
    idle-stream bound (here 60 s)."""
    b = bed.Bed("silentstream")
    procs: list[bed.PodProcess] = []
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    try:
        b.network("pod", {"router": "eth0", "node": "eth0", "other": "eth0"}, ["10.253.0.0/24"])
        router, node = b.pods["router"], b.pods["node"]
        url = f"http://{node.ip('eth0')}:{PORT}/stream"
        server = bed.PodProcess(
            node, "streamer", [sys.executable, "-c", _STREAMER, node.ip("eth0"), str(PORT)], env, tmp_path
        )
        procs.append(server)
        bed.wait_http(router, f"http://{node.ip('eth0')}:{PORT}/health", 60, server)
        client = bed.PodProcess(
            router, "client", [sys.executable, "-c", _ROUTER_CLIENT, url, str(2 * TIMEOUT_S)], env, tmp_path
        )
        procs.append(client)
        _wait_for_line(client, "FIRST", 60)
        bed.ip("-n", node.ns, "link", "del", "eth0")
        assert client.wait_exit(3 * TIMEOUT_S) == 0, client.tail()
        (line,) = [x for x in client.log.read_text().splitlines() if x.startswith("RESULT ")]
        result = json.loads(line.removeprefix("RESULT "))
        assert result["error"] != "none" and result["elapsed"] < TIMEOUT_S / 2, result
    finally:
        for proc in procs:
            proc.stop()
        assert not b.close()
