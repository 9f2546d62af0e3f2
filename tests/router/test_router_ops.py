"""Operations: readiness, health-check ejection and return, metrics, config reload by symlink swap."""

from __future__ import annotations

import os

import aiohttp
import yaml
from router_fakes import MODEL, until

from tilert_serve.router import config
from tilert_serve.router.app import bound_port, make_app, start


async def _get(url: str) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as http, http.get(url) as resp:
        return resp.status, await resp.json()


async def test_ready_needs_a_healthy_prefill_and_decode_per_pool(make_stack):
    s = await make_stack(health_checks=True, health={"interval_s": 0.05, "failures_to_eject": 1})
    await until(lambda: all(e.healthy for e in s.state.pools.all()))
    status, body = await _get(s.router_url + "/ready")
    assert status == 200 and body["ready"]
    s.node.ready = False  # TileRT node loading its engine
    await until(lambda: s.state.pools.tilert["t0"].healthy is False)
    status, body = await _get(s.router_url + "/ready")
    assert status == 503 and "TileRT" in body["reasons"][0]
    # An ejected node gets no traffic: auto goes native.
    r = await s.client().completions.create(model=MODEL, prompt="a", max_tokens=2)
    assert len(s.native.bodies) == 1 and r.choices[0].text
    s.node.ready = True
    await until(lambda: s.state.pools.tilert["t0"].healthy is True)
    await s.client().completions.create(model=MODEL, prompt="a", max_tokens=2)
    assert len(s.node.generates) == 1


async def test_dead_prefill_ejected_and_back(make_stack):
    s = await make_stack(n_prefill=2, health_checks=True, health={"interval_s": 0.05, "failures_to_eject": 2})
    dead = s.prefills[0]
    await dead.stop()
    await until(lambda: s.state.pools.prefill[dead.url].healthy is False)
    c = s.client()
    for _ in range(3):
        await c.completions.create(model=MODEL, prompt="a", max_tokens=2)
    assert len(s.prefills[1].bodies) == 3
    port = int(dead.url.rsplit(":", 1)[1])
    from aiohttp import web

    runner = web.AppRunner(dead.app())  # the fake comes back on its old port
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        await until(lambda: s.state.pools.prefill[dead.url].healthy is True)
    finally:
        await runner.cleanup()


async def test_metrics_exposed(make_stack):
    s = await make_stack()
    c = s.client()
    await c.completions.create(model=MODEL, prompt="a", max_tokens=3)
    stream = await c.completions.create(
        model=MODEL, prompt="a", max_tokens=3, stream=True, extra_headers={"x-pd-route": "native"}
    )
    async for _ in stream:
        pass
    async with aiohttp.ClientSession() as http, http.get(s.router_url + "/metrics") as resp:
        text = await resp.text()
    for name in (
        'tilert_router_ttft_seconds_count{path="tilert"}',
        'tilert_router_ttft_seconds_count{path="native"}',
        "tilert_router_inter_token_seconds",
        "tilert_router_request_duration_seconds",
        "tilert_router_handoff_seconds",
        'tilert_router_admissions_total{node="t0",result="ok"}',
        "tilert_router_upstream_errors_total",
        "tilert_router_rejections_total",
    ):
        assert name in text, name


async def test_config_reload_by_symlink_swap(make_stack, tmp_path):
    """Kubernetes swaps `..data` to a new directory; the router picks the new file up."""
    s = await make_stack()  # upstreams only; build a file-backed router on top
    base = s.cfg.model_dump(mode="json")
    base["tilert"] = []
    base["reload_interval_s"] = 0.05
    d1, d2 = tmp_path / "..v1", tmp_path / "..v2"
    d1.mkdir()
    d2.mkdir()
    (d1 / "config.yaml").write_text(yaml.safe_dump(base))
    os.symlink(d1.name, tmp_path / "..data")
    os.symlink("..data/config.yaml", tmp_path / "config.yaml")
    path = tmp_path / "config.yaml"
    app = make_app(config.load(path), config_path=path, health_checks=False)
    runner = await start(app, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{bound_port(runner)}/v1/completions"
    try:
        async with aiohttp.ClientSession() as http:
            async with http.post(url, json={"model": MODEL, "prompt": "a", "max_tokens": 2}) as resp:
                assert resp.status == 200 and resp.headers["X-PD-Route"] == "native"
            # New config: the TileRT node appears. Swap atomically, as kubelet does.
            new = dict(base, tilert=s.cfg.model_dump(mode="json")["tilert"])
            (d2 / "config.yaml").write_text(yaml.safe_dump(new))
            os.symlink(d2.name, tmp_path / "..data_tmp")
            os.replace(tmp_path / "..data_tmp", tmp_path / "..data")
            from tilert_serve.router.state import STATE

            await until(lambda: len(app[STATE].pools.tilert) == 1)
            async with http.post(url, json={"model": MODEL, "prompt": "a", "max_tokens": 2}) as resp:
                assert resp.status == 200 and resp.headers["X-PD-Route"] == "tilert"
            # A broken file is refused; the old config stays in force.
            (d1 / "config.yaml").write_text("model: [broken\n")
            os.symlink(d1.name, tmp_path / "..data_tmp")
            os.replace(tmp_path / "..data_tmp", tmp_path / "..data")
            reg = app[STATE].metrics.registry
            await until(
                lambda: reg.get_sample_value("tilert_router_config_reloads_total", {"result": "error"}) == 1
            )
            assert len(app[STATE].pools.tilert) == 1
            async with http.post(url, json={"model": MODEL, "prompt": "a", "max_tokens": 2}) as resp:
                assert resp.status == 200
    finally:
        await runner.cleanup()
