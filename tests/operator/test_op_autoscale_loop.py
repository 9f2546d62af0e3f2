"""The operator acts on the planner (autoscale/loop.py, controller.py): against the API test server,
with each pod's /metrics served by the test over HTTP, a load that rises raises the TileRT
StatefulSet's and the native Deployment's replicas through status.autoscaling; a resync renders the
same numbers; the load falling lowers them after the scale-down window; a pod that does not answer
/metrics is left out and the loop goes on."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import pdc_harness as h
import pdc_helpers as helpers
from aiohttp import web

from tilert_operator import constants, reconcile
from tilert_operator.autoscale import scrape
from tilert_operator.autoscale.observe import Snapshot
from tilert_operator.controller import Controller, Settings
from tilert_operator.kubeapi import Client, Connection
from tilert_serve import metric_defs as m

NAME = "tiny"
SLOTS = 4
DOWN_WINDOW_S = 2


def _spec() -> dict[str, Any]:
    doc = helpers.example("tiny-cpu")
    decode = doc["spec"]["decode"]
    window = {"scaleDownStabilizationSeconds": DOWN_WINDOW_S}
    decode["tilert"] |= {
        "replicas": 1,
        "autoscaling": {"enabled": True, "minReplicas": 1, "maxReplicas": 4} | window,
    }
    decode["native"] |= {
        "replicas": 1,
        "autoscaling": {"enabled": True, "minReplicas": 1, "maxReplicas": 4} | window,
    }
    return doc


class FakeMetrics:
    """Each pod's /metrics, from a load the test sets: counters grow at the set rates."""

    def __init__(self) -> None:
        self.t0 = time.time()
        self.overflow_per_s = 0.0
        self.admit_per_s = 0.0
        self.native_per_s = 0.0
        self.busy = 0
        self.kv = 0.0
        self.running = 0
        #: Pods that answer 503 (as a pod whose server is stuck would).
        self.silent: set[str] = set()
        self.served: dict[str, int] = {}
        self._counts = {"tilert": 0.0, "overflow": 0.0, "native": 0.0}
        self._last = time.time()

    def _advance(self) -> None:
        now = time.time()
        dt, self._last = now - self._last, now
        self._counts["tilert"] += self.admit_per_s * dt
        self._counts["overflow"] += self.overflow_per_s * dt
        self._counts["native"] += self.native_per_s * dt

    def text(self, pod: str, role: str) -> str:
        self._advance()
        if role == "router":
            c = self._counts
            return (
                f"# TYPE {m.ROUTER_ROUTES.removesuffix('_total')} counter\n"
                f'{m.ROUTER_ROUTES}{{path="tilert",reason="slot free"}} {c["tilert"]}\n'
                f'{m.ROUTER_ROUTES}{{path="native",reason="tilert full"}} {c["overflow"]}\n'
                f'{m.ROUTER_ROUTES}{{path="native",reason="requested"}} {c["native"]}\n'
                f"# TYPE {m.ROUTER_REQUEST_DURATION} histogram\n"
                + "".join(
                    f'{m.ROUTER_REQUEST_DURATION}_bucket{{path="{p}",le="+Inf"}} {n}\n'
                    f'{m.ROUTER_REQUEST_DURATION}_sum{{path="{p}"}} {n * 4}\n'
                    f'{m.ROUTER_REQUEST_DURATION}_count{{path="{p}"}} {n}\n'
                    for p, n in (("tilert", c["tilert"]), ("native", c["overflow"] + c["native"]))
                )
            )
        if role == "tilert":
            return f"{m.DECODE_SLOTS} {SLOTS}\n{m.DECODE_SLOTS_BUSY} {self.busy}\n"
        if role == "native":
            return f"{m.VLLM_KV_USAGE} {self.kv}\n{m.VLLM_RUNNING} {self.running}\n{m.VLLM_WAITING} 0\n"
        return f"{m.VLLM_WAITING} 0\n"

    async def handle(self, request: web.Request) -> web.Response:
        pod, role = request.match_info["pod"], request.match_info["role"]
        self.served[pod] = self.served.get(pod, 0) + 1
        if pod in self.silent:
            return web.Response(status=503)
        return web.Response(text=self.text(pod, role))


async def until(
    what: str, fn: Callable[[], Any], timeout: float = 60.0, show: Callable[[], Any] | None = None
) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := fn():
            return value
        await asyncio.sleep(0.05)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}; {show() if show else ''}")


async def test_load_raises_and_lowers_tilert_and_native_through_status(apiserver: Any) -> None:
    srv = apiserver.server
    fake = FakeMetrics()
    app = web.Application()
    app.router.add_get("/{role}/{pod}/metrics", fake.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    seen: list[Sequence[scrape.Target]] = []

    async def scraper(targets: Sequence[scrape.Target]) -> Snapshot:
        # The operator's own HTTP scrape, at the test's server instead of the pods' addresses.
        seen.append(targets)
        moved = [replace(t, url=f"http://127.0.0.1:{port}/{t.role}/{t.pod}/metrics") for t in targets]
        return await scrape.scrape(moved, timeout_s=2.0)

    def replicas(kind: str, component: str) -> int | None:
        obj = srv.get(kind, "default", constants.child_name(NAME, component))
        return None if obj is None else int(obj["spec"].get("replicas", 1))

    def status() -> dict[str, Any]:
        return (h.body(apiserver, NAME).get("status") or {}).get("autoscaling") or {}

    def pools() -> Any:
        return status().get("pools")

    apiserver.call(srv.put(h.PDC, h.pdc(_spec())))
    async with Client(Connection(server=apiserver.url)) as api:
        ctl = Controller(api, Settings(resync_s=0.3, scraper=scraper, autoscale_interval_s=0.3))
        try:
            ctl.observe(h.body(apiserver, NAME))
            await until("the workloads", lambda: replicas("statefulsets", constants.TILERT) == 1)
            for component in (constants.PREFILL, constants.TILERT, constants.NATIVE, constants.ROUTER):
                h.roll(apiserver, NAME, component)
            await until("a first decision", lambda: status().get("pools"), show=pools)
            assert replicas("statefulsets", constants.TILERT) == 1
            assert replicas("deployments", constants.NATIVE) == 1

            # ---- the load rises: TileRT full and overflowing, native's KV cache filling ----------
            fake.busy, fake.admit_per_s, fake.overflow_per_s, fake.native_per_s = SLOTS, 2.0, 1.0, 6.0
            fake.kv, fake.running = 0.95, 8
            await until(
                "TileRT raised", lambda: (replicas("statefulsets", constants.TILERT) or 0) > 1, show=pools
            )
            await until(
                "native raised", lambda: (replicas("deployments", constants.NATIVE) or 0) > 1, show=pools
            )
            pools = status()["pools"]
            # What is rendered is what status decided: one source.
            await until(
                "the workloads at the decision",
                lambda: (
                    replicas("statefulsets", constants.TILERT) == status()["pools"]["tilert"]["desired"]
                    and replicas("deployments", constants.NATIVE) == status()["pools"]["native"]["desired"]
                ),
                show=pools,
            )
            assert pools["tilert"]["reason"] and pools["native"]["reason"]
            events = [e for e in srv.objects("events", "default") if e.get("reason") == "AutoscaleScaled"]
            assert any("tilert: 1 ->" in e["message"] for e in events), events
            # kubectl get pdc: desired follows the decision.
            text = (h.body(apiserver, NAME).get("status") or {}).get("replicas", {})
            await until(
                "status.replicas shows the decision",
                lambda: (
                    (h.body(apiserver, NAME).get("status") or {})
                    .get("pools", {})
                    .get("tilert", {})
                    .get("desired")
                    == status()["pools"]["tilert"]["desired"]
                ),
                show=lambda: text,
            )

            # ---- a resync with the load held renders the same numbers: no ping-pong -------------
            up_t, up_n = replicas("statefulsets", constants.TILERT), replicas("deployments", constants.NATIVE)
            assert up_t is not None and up_n is not None
            fake.busy, fake.admit_per_s, fake.overflow_per_s, fake.native_per_s = 0, 0.0, 0.0, 0.0
            fake.kv, fake.running = 0.0, 0
            quiet_at = time.monotonic()
            held = reconcile.reconcile
            outcome = await held(api, h.body(apiserver, NAME))
            assert not any(k.startswith(("StatefulSet/", "Deployment/")) for k in outcome.applied), (
                outcome.applied
            )

            # ---- a pod that does not answer: left out, the loop goes on -------------------------
            native0 = f"{NAME}-{constants.NATIVE}-0"
            fake.silent.add(native0)
            mark = fake.served.get(native0, 0)
            runs = len(seen)
            await until("two more runs", lambda: len(seen) >= runs + 2 and fake.served.get(native0, 0) > mark)
            assert (
                ctl._workers[("default", NAME)]
                .autoscale.missing.get(native0, "")
                .startswith("GET /metrics answered 503")
            )
            fake.silent.clear()

            # ---- the load falls: lowered once the scale-down window has passed ------------------
            await until("TileRT lowered", lambda: replicas("statefulsets", constants.TILERT) == 1, show=pools)
            await until("native lowered", lambda: replicas("deployments", constants.NATIVE) == 1, show=pools)
            # Not before the window: the quiet intervals' recommendations must cover all of it (the
            # last loud one may have run up to an interval before the load went quiet).
            assert time.monotonic() - quiet_at >= DOWN_WINDOW_S - 0.5
            metrics = ctl.metrics.render().decode()
            assert (
                helpers.sample(
                    metrics,
                    "tilert_pd_autoscale_desired_replicas",
                    pdcluster_namespace="default",
                    pdcluster=NAME,
                    pool="tilert",
                )
                == 1
            )

            # ---- autoscaling turned off: the spec's replicas again, no decision reported ---------
            off = {"replicas": 2, "autoscaling": {"enabled": False}}
            await api.request(
                "patch",
                "PATCH",
                f"/apis/{constants.GROUP}/{constants.VERSION}/namespaces/default/{constants.PLURAL}/{NAME}",
                body={"spec": {"decode": {"tilert": off, "native": off}}},
                content_type="application/merge-patch+json",
            )
            ctl.observe(h.body(apiserver, NAME))  # what the PDCluster watch delivers
            await until("the spec's replicas", lambda: replicas("statefulsets", constants.TILERT) == 2)
            await until("the decision's series gone", lambda: not ctl.metrics.autoscale)
        finally:
            await ctl.stop()
            await runner.cleanup()
