"""HandoffReady's facts: each wired TileRT node's own record of its data plane, read from its
authenticated GET /v1/status with the cluster's node-API token (the `<cluster>-node-api` Secret the
operator owns). The router drives the handoffs (its probes, tilert_serve/router/canary.py, and user
traffic); the node records what reached it; the operator reads the nodes, not the router, because the
node is where a handoff lands and is decoded, whichever router or prefill sent it.

Reached on the pod IP and the node's HTTP port, as the router reaches it; the decode pods'
NetworkPolicy admits the operator's pods there (render/network.py). `TILERT_PD_HANDOFF_CHECK=0`
turns the check off (HandoffReady is then True with reason NotChecked and Ready does not wait for it).
"""

from __future__ import annotations

import asyncio
import base64
import os
from collections.abc import Sequence
from typing import Any

import aiohttp

from tilert_operator import constants
from tilert_operator.observe import NodeReport
from tilert_serve.router.config import TileRTNode

#: Seconds for one node's status call.
TIMEOUT_S = 3.0


def enabled() -> bool:
    return os.environ.get("TILERT_PD_HANDOFF_CHECK", "1") != "0"


def node_token(secret: dict[str, Any] | None) -> str | None:
    """The first token of the node-API Secret (what the router sends; the nodes accept every line)."""
    raw = ((secret or {}).get("data") or {}).get(constants.NODE_API_TOKEN_KEY)
    if not raw:
        return None
    lines = [ln.strip() for ln in base64.b64decode(raw).decode(errors="replace").splitlines() if ln.strip()]
    return lines[0] if lines else None


async def _one(http: aiohttp.ClientSession, node: TileRTNode, token: str | None) -> NodeReport:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        async with http.get(
            node.http_url + "/v1/status", headers=headers, timeout=aiohttp.ClientTimeout(total=TIMEOUT_S)
        ) as resp:
            if resp.status in (401, 403):
                return NodeReport(
                    node.name,
                    error=f"GET /v1/status answered {resp.status}: the node does not take the "
                    "cluster's node-API token",
                    error_kind="not_authorized",
                )
            if resp.status != 200:
                return NodeReport(
                    node.name, error=f"GET /v1/status answered {resp.status}", error_kind="unreachable"
                )
            body = await resp.json(content_type=None)
    except TimeoutError:
        return NodeReport(
            node.name, error=f"GET /v1/status timed out after {TIMEOUT_S:.0f} s", error_kind="timeout"
        )
    except (aiohttp.ClientError, ValueError) as exc:
        return NodeReport(
            node.name, error=f"GET /v1/status failed: {type(exc).__name__}", error_kind="unreachable"
        )
    if not isinstance(body, dict):
        return NodeReport(node.name, error="GET /v1/status answered no object", error_kind="unreachable")
    return NodeReport.from_status(node.name, body)


async def poll(nodes: Sequence[TileRTNode], secret: dict[str, Any] | None) -> list[NodeReport]:
    """Every wired node's report, fetched at once."""
    if not nodes:
        return []
    token = node_token(secret)
    async with aiohttp.ClientSession() as http:
        return list(await asyncio.gather(*(_one(http, n, token) for n in nodes)))
