"""A real Prometheus (Debian's) against a running stack: a real decode node, the real router with API
keys, and the prefill stand-in (tests/netns/prefill_standin.py: the project's own Sender over Mooncake,
answering the router as vLLM with TileRTConnector does), started as tests/decode's stack test starts
them. `tilert_serve.observe` starts Prometheus on 127.0.0.1, scraping the router with one of its API
keys as a bearer token and the node's open /metrics, with the chart's rules.

After a few requests, every recording rule whose inputs this stack exposes returns series, and so
does every query of the dashboards. Then two faults: a prefill for another model (the node refuses
its handoffs: layout_mismatch) fires the handoff-failure alert, and a stopped node fires the alerts
for a node gone. Every wait
is on Prometheus' API. The scrape and evaluation intervals are half a second, and the alerts' `for:`
is cut to one second in the copy of the rules loaded here (the expressions are the chart's)."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
import yaml

from tests.decode import standin as standin_proc
from tests.decode import synthetic
from tests.decode.conftest import SECRET, running_node
from tests.observability.conftest import recorded
from tests.observability.promql import metric_names
from tilert_serve import observe
from tilert_serve.local.runner import free_port
from tilert_serve.observe import paths
from tilert_serve.router import config as router_config
from tilert_serve.router.app import make_app, start
from tilert_serve.tinymodel.tokenizer import train_tokenizer

LAYOUT = synthetic.layout_for("mla-f32")
SCRAPE_KEY = "scrape-key-0123456789"
CLIENT_KEY = "client-key-0123456789"
T = TypeVar("T")

# Recorded series this stack cannot have, and why; every other recording rule must return series.
NOT_HERE = {
    "tilert_pd:decode_handoff_failures:rate5m": "no handoff fails before the fault",
    "tilert_pd:decode_handoff_failures:ratio_rate5m": "no handoff fails before the fault",
    "tilert_pd:prefill_handoff_failures:ratio_rate5m": "the prefill stand-in is not vLLM: no vllm:* metrics",
    "tilert_pd:prefill_handoff_write_bandwidth_bytes_per_second:rate5m": "no vllm:* metrics",
    "tilert_pd:operator_reconcile_errors:rate5m": "no operator runs here",
}
# Metrics no series of which this stack has (beside those rules' inputs): a dashboard query that reads
# only these or NOT_HERE's series is not expected to answer.
NO_SERIES_HERE = {
    **NOT_HERE,
    **dict.fromkeys(
        [
            "tilert_router_upstream_errors_total",
            "tilert_decode_ctrl_errors_total",
            "tilert_decode_ctrl_unauthenticated_total",
            "tilert_decode_expired_slots_total",
        ],
        "a labelled counter has no series before its first failure, and nothing fails before the faults",
    ),
    **dict.fromkeys(
        [
            "vllm:tilert_handoffs_total",
            "vllm:tilert_extract_seconds_total",
            "vllm:tilert_write_seconds_total",
            "vllm:tilert_ack_seconds_total",
            "vllm:tilert_handoff_seconds_total",
            "vllm:tilert_layers_sent_total",
            "vllm:tilert_layers_early_total",
        ],
        "the prefill stand-in is not vLLM",
    ),
}


async def until(what: str, fn: Callable[[], Awaitable[T | None]], timeout: float = 90.0) -> T:
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        got = await fn()
        if got:
            return got
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        await asyncio.sleep(0.2)


class Api:
    def __init__(self, handle: observe.Prometheus, http: aiohttp.ClientSession) -> None:
        self.url = handle.url
        self.headers = {"Authorization": handle.authorization()}
        self.http = http

    async def get(self, path: str, **params: str) -> Any:
        async with self.http.get(f"{self.url}{path}", params=params, headers=self.headers) as r:
            body = await r.json()
            assert r.status == 200 and body["status"] == "success", body
            return body["data"]

    async def query(self, expr: str) -> list[dict[str, Any]]:
        return list((await self.get("/api/v1/query", query=expr))["result"])

    async def alerts(self, state: str) -> list[dict[str, Any]]:
        return [a for a in (await self.get("/api/v1/alerts"))["alerts"] if a["state"] == state]


def quick_rules(tmp: Path) -> Path:
    """The chart's rules with every alert's `for:` cut to one second."""
    doc = yaml.safe_load(paths.rules_file().read_text())
    for group in doc["groups"]:
        for rule in group["rules"]:
            if "alert" in rule:
                rule["for"] = "1s"
    out = tmp / "rules-quick.yaml"
    out.write_text(yaml.safe_dump(doc))
    return out


def dashboard_queries() -> list[tuple[str, str]]:
    out = []
    for path in paths.dashboards():
        for panel in json.loads(path.read_text())["panels"]:
            for t in panel.get("targets", []):
                # Grafana's "All" for the variables.
                out.append((panel["title"], re.sub(r"\$(namespace|pdcluster)", ".*", t["expr"])))
    return out


async def _requests(router: str, http: aiohttp.ClientSession, count: int) -> None:
    headers = {"Authorization": f"Bearer {CLIENT_KEY}"}
    for i in range(count):
        # Streamed, so that the router writes several chunks (its time per output token).
        body = {"model": "m", "prompt": f"hello {i}", "max_tokens": 8, "stream": True}
        async with http.post(f"{router}/v1/completions", json=body, headers=headers) as r:
            text = await r.text()
            assert r.status == 200 and text.rstrip().endswith("data: [DONE]"), text
    # One refused request (no key): the rejections series.
    async with http.post(f"{router}/v1/completions", json={"model": "m", "prompt": "x"}) as r:
        assert r.status == 401


async def test_prometheus_scrapes_the_stack_records_and_alerts_on_a_stopped_node(tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_bytes(SECRET)
    keys = tmp_path / "api-keys"
    keys.write_text(
        f"# the scrape's key first: observe sends a file's first token\n{SCRAPE_KEY}\n{CLIENT_KEY}\n"
    )
    model_dir = standin_proc.model_dir(tmp_path / "model", LAYOUT.num_main_layers, LAYOUT.num_mtp_layers)
    other_model = standin_proc.model_dir(
        tmp_path / "other-model", LAYOUT.num_main_layers + 1, LAYOUT.num_mtp_layers
    )
    port = free_port()
    # A tokenizer, so that the node's tokens carry text and the router writes them as chunks.
    tokenizer = train_tokenizer(1024)
    node_ctx = running_node(
        LAYOUT, secret, slots=2, ticket_ttl_s=20, handoff_timeout_s=20, tokenizer=tokenizer
    )
    n = await node_ctx.__aenter__()
    node_up = True
    standin = await standin_proc.start(port, model_dir, secret)
    cfg = router_config.RouterConfig(
        model="m",
        prefill=[f"http://127.0.0.1:{port}"],
        tilert=[
            router_config.TileRTNode(
                name="node-0", http_url=n.url, ctrl_host="127.0.0.1", ctrl_port=n.ctrl_port, slots=2
            )
        ],
        api_keys_file=str(keys),
        health=router_config.HealthChecks(interval_s=0.2),
        handoff_probe=router_config.HandoffProbe(interval_s=0.5, timeout_s=30),
    )
    runner = await start(make_app(cfg), "127.0.0.1", 0)
    router = f"http://127.0.0.1:{runner.addresses[0][1]}"
    targets = [
        observe.Target("router", router.removeprefix("http://"), token_file=keys),
        observe.Target("tilert-decode", n.url.removeprefix("http://")),
    ]
    handle = await asyncio.to_thread(
        observe.start,
        tmp_path / "state",
        targets,
        rules=[quick_rules(tmp_path)],
        intervals=observe.Intervals(scrape_s=0.5, evaluation_s=0.5),
    )
    try:
        async with aiohttp.ClientSession() as http:
            api = Api(handle, http)
            # Its API takes the password, and nothing without it.
            async with http.get(f"{handle.url}/api/v1/query", params={"query": "up"}) as r:
                assert r.status == 401
            # The router's /metrics takes a key: the scrape is up only because observe sends one.
            async with http.get(f"{router}/metrics") as r:
                assert r.status == 401

            async def both_up() -> list[dict[str, Any]] | None:
                got = await api.query('up{pdcluster="local"} == 1')
                return got if {s["metric"]["job"] for s in got} == {"router", "tilert-decode"} else None

            await until("both targets scraped", both_up)
            await _requests(router, http, 6)

            expected = recorded() - set(NOT_HERE)
            assert set(NOT_HERE) <= recorded(), "NOT_HERE names a rule the file no longer has"
            for name in sorted(expected):

                async def series(name: str = name) -> list[dict[str, Any]]:
                    return await api.query(name)

                got = await until(f"recorded series {name}", series)
                assert all(s["metric"].get("pdcluster") in ("local", None) for s in got), got

            # The numbers are the stack's: six requests ok on the TileRT path, slots of two, bytes moved.
            ok = await api.query('tilert_router_requests_total{path="tilert", outcome="ok"}')
            assert [s["value"][1] for s in ok] == ["6"]
            occupancy = await api.query("tilert_decode_slots")
            assert [s["value"][1] for s in occupancy] == ["2"]
            moved = await api.query("tilert_decode_handoff_bytes_total > 0")
            assert moved, "the node received no handoff bytes"

            for title, expr in dashboard_queries():
                if metric_names(expr) <= set(NO_SERIES_HERE):
                    continue

                async def panel(expr: str = expr) -> list[dict[str, Any]]:
                    return await api.query(expr)

                await until(f"dashboard panel {title!r}: {expr}", panel)

            # Nothing fires on a healthy stack.
            firing = {a["labels"]["alertname"] for a in await api.alerts("firing")}
            assert not firing & {
                "TilertPDTargetDown",
                "TilertPDTileRTPathDown",
                "TilertPDPoolNoHealthyEndpoint",
            }

            # The first fault: a prefill for another model (a layout mismatch) hands off to the node.
            await standin_proc.stop(standin)
            standin = await standin_proc.start(port, other_model, secret)

            async def mismatch_alert() -> list[dict[str, Any]] | None:
                got = [
                    a
                    for a in await api.alerts("firing")
                    if a["labels"]["alertname"] == "TilertPDHandoffFailures"
                    and a["labels"]["reason"] == "layout_mismatch"
                ]
                return got or None

            (failing,) = await until("the layout mismatch's alert to fire", mismatch_alert)
            assert failing["labels"]["pdcluster"] == "local" and failing["labels"]["severity"] == "warning"
            ratio = await api.query(
                'tilert_pd:decode_handoff_failures:ratio_rate5m{reason="layout_mismatch"}'
            )
            assert ratio and 0 < float(ratio[0]["value"][1]) <= 1, ratio

            # The second fault: the decode node goes away.
            await node_ctx.__aexit__(None, None, None)
            node_up = False

            async def fired() -> set[str] | None:
                got = {
                    (a["labels"]["alertname"], a["labels"].get("job") or a["labels"].get("pool"))
                    for a in await api.alerts("firing")
                }
                want = {
                    ("TilertPDTargetDown", "tilert-decode"),
                    ("TilertPDPoolNoHealthyEndpoint", "tilert"),
                    ("TilertPDTileRTPathDown", None),
                }
                return {a for a, _ in want} if want <= got else None

            await until("the stopped node's alerts to fire", fired)
            alerts = {a["labels"]["alertname"]: a for a in await api.alerts("firing")}
            down = alerts["TilertPDTargetDown"]
            assert down["labels"]["severity"] == "warning" and down["labels"]["pdcluster"] == "local"
            assert "tilert-decode" in down["annotations"]["summary"]
            assert alerts["TilertPDTileRTPathDown"]["labels"]["severity"] == "critical"
            assert alerts["TilertPDTileRTPathDown"]["annotations"]["runbook_url"].endswith("#handoffready")
            # The router stays up: only the node's target is down.
            assert [s["metric"]["job"] for s in await api.query("up == 0")] == ["tilert-decode"]
    finally:
        await asyncio.to_thread(observe.stop, handle)
        await runner.cleanup()
        await standin_proc.stop(standin)
        if node_up:
            await node_ctx.__aexit__(None, None, None)
    assert handle.process.returncode == 0, f"prometheus ended with {handle.process.returncode}"
