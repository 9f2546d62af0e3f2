"""Handoff probes (HandoffReady): a real, minimal handoff to each TileRT node that has had
none recently, so the data plane's health is known when traffic is not there to show it.

Who drives it: the router, because it already knows the prefills and the nodes, holds the nodes' API
token, and sends real requests; a probe is a request like any other (admit -> prefill pinned to the
node by its ticket -> generate), just small: a short prompt, the prefill's one token, one decoded token.
The node records the outcome itself (GET /v1/status, the operator's HandoffReady); the router records
it too, for its own /ready.

A probe never takes a slot a user is waiting for: it runs only on a node this router holds no slot on
(in_use == 0), that has a free slot, and only while no request of the last `interval_s` found the
TileRT pool full. It is not user traffic: not in the request, TTFT or route metrics, only in
`tilert_router_handoff_probes_total{node, outcome}`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from typing import Any

import aiohttp

from tilert_serve.router import sse
from tilert_serve.router.config import RouterConfig
from tilert_serve.router.pools import Node
from tilert_serve.router.state import RouterState, task_ctx
from tilert_serve.router.upstream import UpstreamError, error_message, post_json, read_error_body

log = logging.getLogger(__name__)

#: Request ids of probes start with this (the nodes' and vLLM's logs show them for what they are).
PREFIX = "handoff-probe-"


def probe_body(cfg: RouterConfig) -> dict[str, Any]:
    """The router's own small request (a probe's, a native warm-up's): the probe prompt, one token."""
    return {
        "model": cfg.upstream_model or cfg.model,
        "prompt": cfg.handoff_probe.prompt,
        "max_tokens": 1,
        "stream": False,
        "temperature": 0.0,
        "ignore_eos": True,
    }


def due(state: RouterState, node: Node, now: float) -> bool:
    """Whether `node` should be probed now (pure: reads the pools and the clock only)."""
    p = state.config.handoff_probe
    if p.interval_s <= 0 or node.probing or node.healthy is not True:
        return False
    # Never a slot a user may want: this router holds none on the node, the node has one free, and no
    # request found the pool full lately.
    if node.in_use > 0 or node.free <= 0 or now - state.tilert_full_at < p.interval_s:
        return False
    if not node.handoff_ready and node.handoff_fail_at is not None:
        # The last handoff failed: try again soon (a transient failure), whatever the interval.
        return now - max(node.handoff_fail_at, node.probe_at) >= min(p.retry_s, p.interval_s)
    last = max(node.handoff_ok_at or -1e18, node.probe_at)
    return now - last >= p.interval_s


async def probe(state: RouterState, node: Node) -> bool:
    """One probe handoff to `node`; True when the node decoded from it. Records the outcome on the node."""
    cfg = state.config
    t = cfg.timeouts
    m = state.metrics
    rid = PREFIX + secrets.token_hex(6)
    headers = {"X-Request-Id": rid}
    node.in_use += 1  # the same loop turn as `due`: no user request can take this slot in between
    node.probing = True
    node.probe_at = time.monotonic()
    state.note_slots(node)
    ticket: str | None = None
    outcome, message = "error", ""
    try:
        status, body = await post_json(
            state.http,
            "tilert",
            node.url,
            "/v1/admit",
            {"request_id": rid, "prompt_tokens": None, "max_tokens": 2},
            headers=state.node_headers(headers),
            timeout=aiohttp.ClientTimeout(total=t.admit_s, sock_connect=t.connect_s),
        )
        if status == 429:
            outcome, message = "busy", "the node had no free slot"
            return False
        if status != 200 or not isinstance(body.get("ticket"), str):
            outcome, message = "admit_failed", f"admit answered {status}: {error_message(body, 'no ticket')}"
            return False
        ticket = body["ticket"]
        prefill = state.pools.pick_prefill(set(), node.generation)  # one of the node's generation
        if prefill is None:
            outcome, message = "no_prefill", f"no prefill server of the node's generation ({node.generation})"
            return False
        kvp = {
            "tilert_host": str(body.get("ctrl_host") or node.spec.ctrl_host),
            "tilert_ctrl_port": int(body.get("ctrl_port") or node.spec.ctrl_port),
            "tilert_ticket": ticket,
        }
        req = {**probe_body(cfg), "kv_transfer_params": kvp}
        prefill.inflight += 1
        try:
            status, pj = await post_json(
                state.http,
                "prefill",
                prefill.url,
                "/v1/completions",
                req,
                headers=headers,
                timeout=aiohttp.ClientTimeout(total=cfg.handoff_probe.timeout_s, sock_connect=t.connect_s),
            )
        finally:
            prefill.inflight -= 1
        out = pj.get("kv_transfer_params") or {}
        first = out.get("tilert_first_token")
        if status != 200 or out.get("tilert_status") != "queued" or not isinstance(first, int):
            outcome = "handoff_failed"
            message = (
                f"prefill {prefill.url} answered {status}: "
                f"{out.get('tilert_error') or error_message(pj, 'tilert_status=' + repr(out.get('tilert_status')))}"
            )
            return False
        gen = {
            "ticket": ticket,
            "request_id": rid,
            "first_token": first,
            "max_tokens": 1,
            "sampling": {"temperature": 0.0, "top_p": 1.0, "top_k": -1},
            "ignore_eos": True,
        }
        async with asyncio.timeout(cfg.handoff_probe.timeout_s):
            async with state.http.post(
                node.url + "/v1/generate",
                json=gen,
                headers=state.node_headers(headers),
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=t.connect_s),
            ) as resp:
                if resp.status != 200:
                    err = await read_error_body(resp)
                    kind = (err.get("error") or {}).get("type") if isinstance(err, dict) else None
                    outcome = str(kind or f"generate_http_{resp.status}")
                    message = error_message(err, f"generate answered {resp.status}")
                    if resp.status == 404:
                        ticket = None
                    return False
                dec = sse.Decoder()
                async for chunk in resp.content.iter_any():
                    for ev in dec.feed(chunk):
                        if ev.event == "error":
                            outcome, message = "decode_failed", ev.data[:300]
                            return False
                        obj = json.loads(ev.data)
                        if obj.get("done"):
                            ticket = None  # the node freed the slot
                            if obj.get("finish_reason") in ("stop", "length"):
                                outcome = "ok"
                                return True
                            outcome, message = "decode_failed", f"finish_reason {obj.get('finish_reason')!r}"
                            return False
                outcome, message = "decode_failed", "the stream ended without a done event"
                return False
    except UpstreamError as exc:  # a transport failure, timeout or 5xx of the node or the prefill
        outcome, message = f"{exc.pool}_{exc.kind}", f"{exc.url}: {exc.message}"
        return False
    except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
        outcome, message = (
            "timeout" if isinstance(exc, TimeoutError) else "transport",
            f"{type(exc).__name__} {exc}",
        )
        return False
    finally:
        if ticket is not None:
            await _cancel(state, node, ticket, headers)
        node.probing = False
        state.pools.release(node)
        state.note_slots(node)
        m.probes.labels(node.spec.name, outcome).inc()
        if outcome == "ok":
            node.handoff_ok(time.monotonic())
        elif outcome not in ("busy", "no_prefill"):
            node.handoff_failed(time.monotonic(), f"{outcome}: {message}")
            log.warning("handoff probe to %s failed: %s: %s", node.spec.name, outcome, message)


async def _cancel(state: RouterState, node: Node, ticket: str, headers: dict[str, str]) -> None:
    t = state.config.timeouts
    try:
        async with state.http.post(
            node.url + "/v1/cancel",
            json={"ticket": ticket},
            headers=state.node_headers(headers),
            timeout=aiohttp.ClientTimeout(total=t.cancel_s, sock_connect=t.connect_s),
        ) as r:
            await r.read()
    except (TimeoutError, aiohttp.ClientError):
        pass  # the node frees an unused ticket after its TTL


async def probe_due(state: RouterState) -> list[asyncio.Task[bool]]:
    """Start a probe on every node that is due; returns their tasks."""
    now = time.monotonic()
    return [state.spawn(probe(state, n)) for n in list(state.pools.tilert.values()) if due(state, n, now)]


async def _loop(state: RouterState) -> None:
    while True:
        try:
            await probe_due(state)
        except Exception:  # a round must never kill the loop
            log.exception("handoff probe round failed")
        interval = state.config.handoff_probe.interval_s
        await asyncio.sleep(min(max(interval / 4, 0.05), 1.0) if interval > 0 else 1.0)


#: cleanup_ctx: the probe loop lives as long as the app.
canary_ctx = task_ctx(_loop)
