"""Handoff probes (canary.py) and /ready as "can route" (HandoffReady): a probe goes to each
idle TileRT node without a recent handoff, pinned to it by its ticket, never while a user holds or
wants a slot, and is not counted as user traffic."""

from __future__ import annotations

import asyncio
import time

import aiohttp
from router_fakes import MODEL, until

from tilert_serve.router import canary

PROBE = {"interval_s": 0.3, "timeout_s": 5.0}
HEALTH = {"interval_s": 0.05, "failures_to_eject": 1}


async def _ready(url: str) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as http, http.get(url + "/ready") as resp:
        return resp.status, await resp.json()


def _probes(node) -> list[dict]:  # type: ignore[no-untyped-def]
    return [a for a in node.admits if a["request_id"].startswith(canary.PREFIX)]


class _Timed(list):  # type: ignore[type-arg]
    """A fake node's admissions, each with when it arrived (time.monotonic, the router's clock)."""

    def __init__(self, items: list[dict]) -> None:
        super().__init__(items)
        self.at: list[float | None] = [None] * len(items)

    def append(self, item: dict) -> None:  # type: ignore[override]
        self.at.append(time.monotonic())
        super().append(item)


def _holder(s, request_id: str):  # type: ignore[no-untyped-def]
    """The fake node whose slot `request_id` holds, or None."""
    return next((n for n in s.nodes if any(t.request_id == request_id for t in n.tickets.values())), None)


async def test_probe_pinned_to_each_node_then_ready(make_stack):
    s = await make_stack(
        node_slots=(1, 1), n_native=0, health_checks=True, health=HEALTH, handoff_probe=PROBE
    )
    await until(lambda: all(_probes(n) for n in s.nodes) and all(n.completed for n in s.nodes))
    for node in s.nodes:
        probe = _probes(node)[0]
        gen = next(g for g in node.generates if g["request_id"] == probe["request_id"])
        # The prefill was told this node's ticket: the handoff went to this node and no other.
        body = next(b for b in s.prefill.bodies if b["kv_transfer_params"]["tilert_ticket"] == gen["ticket"])
        assert body["max_tokens"] == 1 and body["stream"] is False
        assert gen["max_tokens"] == 1
    await until(lambda: all(n.handoff_ready for n in s.state.pools.tilert.values()))
    status, body = await _ready(s.router_url)
    assert status == 200 and body["ready"] and body["degraded"] == []
    text = s.state.metrics.render().decode()
    assert 'tilert_router_handoff_probes_total{node="t0",outcome="ok"}' in text
    assert "tilert_router_requests_total{" not in text  # probes are not user traffic
    # The node is probed again, but only once the interval has passed since its last success.
    fake, node = s.nodes[0], s.state.pools.tilert["t0"]
    fake.admits = timed = _Timed(fake.admits)
    ok_at = node.handoff_ok_at
    assert ok_at is not None
    n_before = len(timed)
    await until(lambda: any(a["request_id"].startswith(canary.PREFIX) for a in timed[n_before:]))
    again = next(i for i in range(n_before, len(timed)) if timed[i]["request_id"].startswith(canary.PREFIX))
    at = timed.at[again]
    assert at is not None and at - ok_at >= PROBE["interval_s"], (at, ok_at)


async def test_not_ready_until_a_handoff_decoded_and_failures_named(make_stack):
    s = await make_stack(n_native=0, health_checks=True, health=HEALTH, handoff_probe=PROBE)
    s.prefill.fail_handoffs = 10**6  # every TileRT prefill reports tilert_status "failed"
    await until(lambda: s.state.pools.tilert["t0"].handoff_fail_at is not None)
    status, body = await _ready(s.router_url)
    assert status == 503 and "no decode route" in body["reasons"][0]
    assert body["degraded"][0].startswith("TileRT node t0: handoff_failed: ")
    assert 'outcome="handoff_failed"' in s.state.metrics.render().decode()
    # The fault goes away: the next probe (one interval later) makes the node a route again.
    s.prefill.fail_handoffs = 0
    await until(lambda: s.state.pools.tilert["t0"].handoff_ready, timeout=5)
    status, _ = await _ready(s.router_url)
    assert status == 200


async def test_a_failing_prefill_is_named(make_stack):
    s = await make_stack(n_native=0, health_checks=True, health=HEALTH, handoff_probe=PROBE)
    s.prefill.fail_status = 500
    await until(lambda: s.state.pools.tilert["t0"].handoff_fail_at is not None)
    assert s.state.pools.tilert["t0"].handoff_error.startswith("prefill_http_500: ")
    assert s.node.tickets == {}  # the probe's ticket was cancelled
    assert s.state.pools.tilert["t0"].in_use == 0


async def test_native_pool_is_a_route_while_tilert_has_no_handoff(make_stack):
    s = await make_stack(health_checks=True, health=HEALTH, handoff_probe=PROBE)
    s.node.generate_status = 502  # the node refuses the state
    await until(lambda: s.state.pools.tilert["t0"].handoff_fail_at is not None)
    await until(lambda: s.state.pools.native[s.native.url].healthy is True)
    status, body = await _ready(s.router_url)
    assert status == 200 and body["degraded"][0].startswith("TileRT node t0: handoff_failed")


async def test_no_probe_while_a_user_holds_the_slot(make_stack):
    interval = 1.0
    s = await make_stack(
        node_slots=(1, 1), health_checks=True, health=HEALTH, handoff_probe={**PROBE, "interval_s": interval}
    )
    pools = s.state.pools.tilert
    client = s.client()
    # The first probes, at start.
    await until(lambda: all(n.handoff_ready and not n.probing for n in pools.values()))
    # The nodes are due again one interval after those probes: the user's request takes a slot before.
    for fake in s.nodes:
        fake.go.clear()  # the user's decode holds its node's only slot
    user = asyncio.create_task(
        client.completions.create(
            model=MODEL, prompt="a", max_tokens=4, extra_headers={"x-pd-route": "tilert"}
        )
    )
    await until(
        lambda: any(
            t.generating and not t.request_id.startswith(canary.PREFIX)
            for n in s.nodes
            for t in n.tickets.values()
        )
    )
    held = next(
        n for n in s.nodes if any(not t.request_id.startswith(canary.PREFIX) for t in n.tickets.values())
    )
    witness = next(n for n in s.nodes if n is not held)
    witness.go.set()  # the other node's probes decode
    probes, seen = len(_probes(held)), len(_probes(witness))
    # Two more probes of the idle node: the probe loop has run through two intervals meanwhile.
    t0 = time.monotonic()
    await until(lambda: len(_probes(witness)) >= seen + 2, timeout=30)
    assert time.monotonic() - t0 >= interval
    assert len(_probes(held)) == probes
    held.go.set()
    await user
    # The user's handoff decoded: that counts as the node's handoff, no probe needed for an interval.
    assert pools[held.name].handoff_ready


async def test_due_rules(make_stack):
    s = await make_stack(node_slots=(2,), handoff_probe=PROBE)
    st, node = s.state, s.state.pools.tilert["t0"]
    now = time.monotonic()
    assert not canary.due(st, node, now)  # not probed healthy yet
    node.healthy = True
    assert canary.due(st, node, now)
    node.in_use = 1  # a user's request holds a slot (one is still free): not this node
    assert not canary.due(st, node, now)
    node.in_use = 0
    st.tilert_full_at = now - 0.1  # a user found the pool full a moment ago: users want slots
    assert not canary.due(st, node, now)
    st.tilert_full_at = now - 1.0
    assert canary.due(st, node, now)
    node.handoff_ok(now - 0.1)  # a handoff decoded lately
    assert not canary.due(st, node, now)
    node.handoff_ok(now - 1.0)
    assert canary.due(st, node, now)
    # A failed handoff since: probed again after retry_s, not a whole interval.
    st.config = st.config.model_copy(
        update={
            "handoff_probe": st.config.handoff_probe.model_copy(update={"interval_s": 100.0, "retry_s": 0.2})
        }
    )
    st.tilert_full_at = -1e18
    node.handoff_failed(now - 0.1, "handoff_timeout: scripted")
    assert not canary.due(st, node, now)
    node.handoff_failed(now - 0.3, "handoff_timeout: scripted")
    assert canary.due(st, node, now)
    node.probing = True
    assert not canary.due(st, node, now)
    node.probing = False
    node.full_until = now + 5  # the node said it was full
    assert not canary.due(st, node, now)


async def test_full_pool_marks_users_waiting(make_stack):
    s = await make_stack(n_native=0, handoff_probe=PROBE)
    s.node.go.clear()
    first = asyncio.create_task(s.client().completions.create(model=MODEL, prompt="a", max_tokens=4))
    await until(lambda: s.node.tickets)
    t0 = time.monotonic()
    try:
        await s.client().completions.create(model=MODEL, prompt="b", max_tokens=4)
    except Exception:
        pass  # 429: the pool is full
    assert s.state.tilert_full_at >= t0
    s.node.go.set()
    await first


async def test_probes_off_by_default(make_stack):
    s = await make_stack(health_checks=True, health=HEALTH)
    await until(lambda: all(e.healthy for e in s.state.pools.all()))
    st, node = s.state, s.state.pools.tilert["t0"]
    # Healthy, idle, never handed off: what a probe is for, yet none is due with probes off...
    assert not canary.due(st, node, time.monotonic())
    # ...while the same node is due the moment probes are on (no await in between: the loop sees none
    # of it).
    off = st.config
    st.config = off.model_copy(
        update={"handoff_probe": off.handoff_probe.model_copy(update={"interval_s": PROBE["interval_s"]})}
    )
    try:
        assert canary.due(st, node, time.monotonic())
    finally:
        st.config = off
    assert not _probes(s.node)
    status, _ = await _ready(s.router_url)
    assert status == 200  # probes off: a probed-healthy node counts, as before
