"""TileRT nodes found through DNS (the pool's headless Service) join the router within one lookup,
and leave when the name stops naming them; configured nodes win for an address in both."""

from __future__ import annotations

import asyncio
from urllib.parse import urlsplit

import aiohttp
from router_fakes import MODEL, until

from tilert_serve.router import config
from tilert_serve.router.app import make_app, start
from tilert_serve.router.discovery import nodes_from, refresh
from tilert_serve.router.state import STATE

ROUTE = {"x-pd-route": "tilert"}


def test_nodes_from_addresses_and_the_merge():
    d = config.TileRTDiscovery(service="pool.ns.svc", http_port=5557, ctrl_port=5556, slots=2, max_seq_len=99)
    nodes = nodes_from(["10.0.0.2", "10.0.0.1", "10.0.0.2", "fd00::7"], d)
    assert [n.http_url for n in nodes] == [
        "http://10.0.0.1:5557",
        "http://10.0.0.2:5557",
        "http://[fd00::7]:5557",
    ]
    assert (nodes[0].ctrl_host, nodes[0].ctrl_port, nodes[0].slots, nodes[0].max_seq_len) == (
        "10.0.0.1",
        5556,
        2,
        99,
    )
    static = config.TileRTNode(name="pod-0", http_url="http://10.0.0.1:5557", ctrl_host="192.168.7.1")
    cfg = config.RouterConfig(model="m", prefill=["http://p"], tilert=[static], tilert_discovery=d)
    merged = config.with_discovered(cfg, nodes)
    # The configured entry (with its RDMA address) stays; the others are added once.
    assert [n.name for n in merged.tilert] == ["pod-0", "pool.ns.svc/10.0.0.2", "pool.ns.svc/fd00::7"]
    assert config.with_discovered(cfg, []) is cfg


async def test_a_discovered_node_serves_and_leaves(make_stack):
    answer: list[str] = []

    async def resolver(name: str) -> list[str]:
        assert name == "pool.test"
        return list(answer)

    stack = await make_stack(
        tilert=[],
        resolver=resolver,
        tilert_discovery={"service": "pool.test", "http_port": 1, "interval_s": 3600},
    )
    node = stack.node
    # Point discovery at the fake node's port (the fixture starts the nodes before writing the config).
    stack.state.apply(
        stack.state.base_config.model_copy(
            update={
                "tilert_discovery": config.TileRTDiscovery(
                    service="pool.test", http_port=urlsplit(node.url).port, interval_s=3600
                )
            }
        )
    )
    assert not stack.state.pools.tilert

    answer[:] = ["127.0.0.1"]
    assert await refresh(stack.state, resolver)
    assert not await refresh(stack.state, resolver)  # unchanged: nothing re-applied
    assert [n.url for n in stack.state.pools.tilert.values()] == [node.url]
    c = stack.client()
    r = await c.completions.create(model=MODEL, prompt="hi", max_tokens=4, extra_headers=ROUTE)
    assert r.choices[0].text and node.completed == 1

    answer.clear()
    assert await refresh(stack.state, resolver)
    assert not stack.state.pools.tilert
    # A config reload keeps what discovery found (and a later lookup can drop it).
    answer[:] = ["127.0.0.1"]
    assert await refresh(stack.state, resolver)
    stack.state.apply(stack.state.base_config)
    assert [n.url for n in stack.state.pools.tilert.values()] == [node.url]


async def test_the_loop_runs_with_the_app(tmp_path):
    calls: list[str] = []

    async def resolver(name: str) -> list[str]:
        calls.append(name)
        return ["127.0.0.9"]

    cfg = config.RouterConfig(
        model=MODEL,
        prefill=["http://127.0.0.1:9"],
        tilert_discovery=config.TileRTDiscovery(service="svc.test", interval_s=0.05),
    )
    app = make_app(cfg, health_checks=False, resolver=resolver)
    runner = await start(app, "127.0.0.1", 0)
    try:
        for _ in range(100):
            if len(calls) >= 2:
                break
            await asyncio.sleep(0.02)
        assert len(calls) >= 2 and set(calls) == {"svc.test"}
        assert [n.ctrl_host for n in app[STATE].config.tilert] == ["127.0.0.9"]
    finally:
        await runner.cleanup()


async def test_a_discovered_node_the_config_then_names_keeps_its_slots(make_stack):
    """A pod found through DNS first, then named by the ConfigMap: the same node (its address), so a
    request in flight still holds its one slot and the router asks no more of it."""
    answer = ["127.0.0.1"]

    async def resolver(name: str) -> list[str]:
        return list(answer)

    stack = await make_stack(
        tilert=[], resolver=resolver, tilert_discovery={"service": "pool.test", "interval_s": 3600}
    )
    node, st = stack.node, stack.state
    st.apply(
        st.base_config.model_copy(
            update={
                "tilert_discovery": config.TileRTDiscovery(
                    service="pool.test", http_port=urlsplit(node.url).port, interval_s=3600
                )
            }
        )
    )
    await refresh(st, resolver)
    node.go.clear()  # the first request keeps the node's only slot
    c = stack.client()
    first = asyncio.create_task(c.completions.create(model=MODEL, prompt="a", max_tokens=3))
    await until(lambda: len(node.generates) == 1)

    named = config.TileRTNode(name="tilert-0", http_url=node.url, ctrl_host="127.0.0.1")
    st.apply(st.base_config.model_copy(update={"tilert": [named]}))
    assert list(st.pools.tilert) == ["tilert-0"] and st.pools.tilert["tilert-0"].in_use == 1
    r = await c.completions.create(model=MODEL, prompt="a", max_tokens=3)
    assert r.choices[0].text and len(stack.native.bodies) == 1
    assert node.rejected_full == 0  # the router knew the slot was taken
    node.go.set()
    await first
    await until(lambda: st.pools.tilert["tilert-0"].in_use == 0)
    metrics = st.metrics.render().decode()
    assert 'tilert_router_tilert_slots_in_use{node="tilert-0"} 0.0' in metrics
    assert "pool.test/" not in metrics.split("tilert_router_tilert_slots_in_use", 1)[1].split("# HELP", 1)[0]


async def test_gauges_of_nodes_that_left_are_removed(make_stack):
    stack = await make_stack(node_slots=(1, 1))
    st = stack.state
    c = stack.client()
    for n in stack.nodes:
        n.go.clear()  # both requests in flight at once: one on each node
    both = [
        asyncio.create_task(c.completions.create(model=MODEL, prompt="a", max_tokens=2, extra_headers=ROUTE))
        for _ in range(2)
    ]
    await until(lambda: all(n.generates for n in stack.nodes))
    for n in stack.nodes:
        n.go.set()
    await asyncio.gather(*both)
    async with aiohttp.ClientSession() as http, http.get(stack.router_url + "/metrics") as resp:
        before = await resp.text()
    gone = stack.nodes[1]
    assert f'node="{gone.name}"' in before and f'endpoint="{gone.url}"' in before
    st.apply(st.base_config.model_copy(update={"tilert": st.base_config.tilert[:1]}))
    async with aiohttp.ClientSession() as http, http.get(stack.router_url + "/metrics") as resp:
        after = await resp.text()
    slot_lines = [ln for ln in after.splitlines() if ln.startswith("tilert_router_tilert_slots_in_use{")]
    health_lines = [ln for ln in after.splitlines() if ln.startswith("tilert_router_endpoint_healthy{")]
    assert slot_lines == [f'tilert_router_tilert_slots_in_use{{node="{stack.nodes[0].name}"}} 0.0']
    assert not [ln for ln in health_lines if gone.url in ln]
    assert [ln for ln in health_lines if stack.nodes[0].url in ln]


async def test_one_discovery_per_generation_gives_each_node_its_generation(make_stack):
    answers = {"gen-a.test": ["127.0.0.1"], "gen-b.test": ["127.0.0.2", "127.0.0.1"]}

    async def resolver(name: str) -> list[str]:
        return list(answers.get(name, []))

    stack = await make_stack(
        tilert=[],
        resolver=resolver,
        tilert_discovery=[
            {"service": "gen-a.test", "interval_s": 3600, "compat": "aaaaaaaaaaaa"},
            {"service": "gen-b.test", "interval_s": 3600, "compat": "bbbbbbbbbbbb"},
        ],
    )
    await refresh(stack.state, resolver)  # the app's own loop may have looked already
    nodes = {n.spec.ctrl_host: n for n in stack.state.pools.tilert.values()}
    # A pod under both names (a Service that moved) counts under the first entry.
    assert {h: n.compat for h, n in nodes.items()} == {
        "127.0.0.1": "aaaaaaaaaaaa",
        "127.0.0.2": "bbbbbbbbbbbb",
    }
    answers["gen-a.test"] = []
    assert await refresh(stack.state, resolver)
    assert {n.spec.ctrl_host: n.compat for n in stack.state.pools.tilert.values()} == {
        "127.0.0.1": "bbbbbbbbbbbb",
        "127.0.0.2": "bbbbbbbbbbbb",
    }
