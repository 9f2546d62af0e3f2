"""HandoffReady's facts in a small stack: a real decode node, the real router with handoff
probes on, and a prefill stand-in (tests/netns/prefill_standin.py: the project's own Sender over a real
Mooncake engine, answering the router as vLLM with TileRTConnector does; vLLM itself boots in minutes
here). A prefill with the wrong handoff secret: the router's probe fails, the node counts the failed
authentications on its /v1/status (anyone can send a wrong MAC: no failure of the node's, but the
operator's hint names the secret), the router is not ready (no other decode route). The prefill comes
back with the right secret but another model (a layout mismatch): the node says so. Then with the
right model: the next probe decodes, both recover."""

from __future__ import annotations

import asyncio

from tests.decode import standin as standin_proc
from tests.decode import synthetic
from tests.decode.conftest import running_node
from tilert_operator import observe
from tilert_operator import status as op_status
from tilert_serve.local.runner import free_port
from tilert_serve.router import config as router_config
from tilert_serve.router.app import make_app, start

CASE = "mla-f32"
LAYOUT = synthetic.layout_for(CASE)


async def _until(what: str, fn, timeout: float = 60.0):  # type: ignore[no-untyped-def]
    for _ in range(int(timeout / 0.1)):
        got = await fn()
        if got:
            return got
        await asyncio.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


async def test_wrong_secret_fails_the_probe_and_the_node_says_why_then_both_recover(secret_file, tmp_path):
    model_dir = standin_proc.model_dir(tmp_path / "model", LAYOUT.num_main_layers, LAYOUT.num_mtp_layers)
    other_model = standin_proc.model_dir(
        tmp_path / "other-model", LAYOUT.num_main_layers + 1, LAYOUT.num_mtp_layers
    )
    wrong = tmp_path / "wrong"
    wrong.write_text("not-the-secret-0123456789")
    port = free_port()
    async with running_node(LAYOUT, secret_file, slots=1, ticket_ttl_s=20, handoff_timeout_s=20) as n:
        standin = await standin_proc.start(port, model_dir, wrong)
        cfg = router_config.RouterConfig(
            model="m",
            prefill=[f"http://127.0.0.1:{port}"],
            tilert=[
                router_config.TileRTNode(
                    name="node-0", http_url=n.url, ctrl_host="127.0.0.1", ctrl_port=n.ctrl_port, slots=1
                )
            ],
            health=router_config.HealthChecks(interval_s=0.2),
            handoff_probe=router_config.HandoffProbe(interval_s=0.5, timeout_s=30),
        )
        runner = await start(make_app(cfg), "127.0.0.1", 0)
        router = f"http://127.0.0.1:{runner.addresses[0][1]}"
        try:

            async def node_handoff() -> dict:
                async with n.session.get(f"{n.url}/v1/status") as r:
                    return (await r.json())["handoff"]

            async def failed() -> dict | None:
                # A wrong MAC is anyone's to send, so the node counts it apart and records no failure (the
                # router cancels its probe's ticket); the operator's hint then names the secret.
                h = await node_handoff()
                return h if h["recent_failed_authentication"] else None

            h = await _until("the node's count of failed authentications", failed)
            assert h["last_success"] is None and h["last_failure"] is None
            verdict = op_status.node_handoff(observe.NodeReport("node-0", h))
            assert verdict[0] == "NoHandoffYet" and "handoff secret may differ" in verdict[1], verdict
            async with n.session.get(f"{router}/ready") as r:
                body = await r.json()
            assert r.status == 503 and body["degraded"][0].startswith("TileRT node node-0: handoff_failed")

            await standin_proc.stop(standin)
            standin = await standin_proc.start(port, other_model, secret_file)

            async def mismatch() -> dict | None:
                h = await node_handoff()
                bad = h["last_failure"]
                return h if bad and bad["reason"] == "layout_mismatch" else None

            h = await _until("the node's layout_mismatch", mismatch)
            assert "layout" in h["last_failure"]["message"] and h["last_success"] is None

            await standin_proc.stop(standin)
            standin = await standin_proc.start(port, model_dir, secret_file)

            async def recovered() -> dict | None:
                h = await node_handoff()
                ok, bad = h["last_success"], h["last_failure"]
                return h if ok and ok["age_s"] < bad["age_s"] else None

            h = await _until("a decoded handoff", recovered)
            assert h["last_success"]["bytes"] > 0 and h["transport"] == {
                "engine": "mooncake",
                "protocol": "tcp",
            }

            async def ready() -> bool:
                async with n.session.get(f"{router}/ready") as r:
                    return r.status == 200

            await _until("the router's readiness", ready, timeout=10)
        finally:
            await runner.cleanup()
            await standin_proc.stop(standin)
