"""Calls to vLLM servers and TileRT nodes, with failures sorted into kinds the router acts on."""

from __future__ import annotations

import json
import socket
from typing import TYPE_CHECKING, Any

import aiohttp

from tilert_serve import keepalive
from tilert_serve.router.config import Limits
from tilert_serve.router.errors import RouterError

if TYPE_CHECKING:
    from aiohappyeyeballs import AddrInfoType  # aiohttp's own dependency: the type its socket_factory takes


class UpstreamError(Exception):
    """An upstream call failed. `retryable` = another endpoint may well succeed (5xx, transport)."""

    def __init__(
        self,
        pool: str,
        url: str,
        kind: str,
        message: str,
        *,
        retryable: bool = True,
    ) -> None:
        super().__init__(f"{pool} {url}: {kind}: {message}")
        self.pool = pool
        self.url = url
        self.kind = kind
        self.message = message
        self.retryable = retryable


def new_session(limits: Limits) -> aiohttp.ClientSession:
    # One pooled session for every upstream: keep-alive connections are what makes the router cheap
    # (vLLM's demo proxy opened a session per request; vllm #26122). limit=0: the pools' own caps
    # (TileRT slots, native in-flight cap) bound concurrency, not the connector. DNS answers are kept
    # 5 s: a Service name that resolves to pod addresses (a headless Service) drops a leaving pod
    # within seconds, and a longer cache would keep sending new connections to it.
    connector = aiohttp.TCPConnector(
        limit=0,
        limit_per_host=limits.connections_per_host,
        keepalive_timeout=60,
        ttl_dns_cache=5,
        socket_factory=_socket,
    )
    return _session(connector)


def _socket(addr_info: AddrInfoType) -> socket.socket:
    """Every upstream connection drops within seconds when its peer goes silent (keepalive.py): a
    decode whose pod vanished mid-stream ends the client's stream with an error then, not after the
    idle-stream bound, and an admission to a vanished node fails over at once."""
    family, type_, proto, _, _ = addr_info
    sock = socket.socket(family=family, type=type_, proto=proto)
    keepalive.detect_silent_peer(sock)
    return sock


def fresh_session() -> aiohttp.ClientSession:
    """For a retry on the endpoint that just failed the same request: a new connection each time and
    a new DNS answer, never a pooled connection to the pod that answered 5xx or reset (a vLLM shutting
    down still answers on its open keep-alive connections: "cannot schedule new futures after
    shutdown"), so that behind a Service name the retry reaches a pod that serves."""
    return _session(
        aiohttp.TCPConnector(limit=0, force_close=True, use_dns_cache=False, socket_factory=_socket)
    )


def _session(connector: aiohttp.TCPConnector) -> aiohttp.ClientSession:
    # No session-wide timeout: each call sets its own per phase.
    return aiohttp.ClientSession(
        connector=connector,
        timeout=aiohttp.ClientTimeout(total=None),
        auto_decompress=False,
        json_serialize=lambda o: json.dumps(o, separators=(",", ":")),
    )


def error_message(body: Any, fallback: str) -> str:
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
        if isinstance(err, str):
            return err
        if isinstance(body.get("message"), str):
            return str(body["message"])
    return fallback


def client_error(status: int, body: Any) -> RouterError:
    """A vLLM server refused the client's request (bad messages, prompt too long): its error, for the
    client as it is, whichever path asked."""
    err = body.get("error") if isinstance(body, dict) else None
    if not isinstance(err, dict):
        err = {}
    param, code = err.get("param"), err.get("code")
    return RouterError(
        status,
        error_message(body, f"upstream answered {status}"),
        type=str(err.get("type") or "invalid_request_error"),
        param=param if isinstance(param, str) else None,
        code=code if isinstance(code, str | int) and not isinstance(code, bool) else None,
    )


async def read_error_body(resp: aiohttp.ClientResponse) -> Any:
    try:
        raw = await resp.read()
        return json.loads(raw) if raw else None
    except (TimeoutError, ValueError, aiohttp.ClientError):
        return None


async def post_json(
    session: aiohttp.ClientSession,
    pool: str,
    url: str,
    path: str,
    body: dict[str, Any],
    *,
    headers: dict[str, str],
    timeout: aiohttp.ClientTimeout,
) -> tuple[int, dict[str, Any]]:
    """POST JSON to `url` + `path` and read a JSON object back. Returns (status, body) for 2xx and
    4xx; raises UpstreamError (naming the endpoint `url`) for transport failures, timeouts, 5xx and
    bodies that are not JSON objects."""
    try:
        async with session.post(url + path, json=body, headers=headers, timeout=timeout) as resp:
            raw = await resp.read()
            status = resp.status
    except TimeoutError as exc:
        raise UpstreamError(
            pool, url, "timeout", f"no answer within {timeout.total or timeout.sock_read} s"
        ) from exc
    except aiohttp.ClientConnectorError as exc:
        raise UpstreamError(pool, url, "connect", str(exc)) from exc
    except aiohttp.ClientError as exc:
        raise UpstreamError(pool, url, "transport", f"{type(exc).__name__}: {exc}") from exc
    try:
        parsed = json.loads(raw) if raw else None
    except ValueError:
        parsed = None
    if status >= 500:
        raise UpstreamError(
            pool,
            url,
            f"http_{status}",
            error_message(parsed, raw[:200].decode(errors="replace")),
        )
    if not isinstance(parsed, dict):
        raise UpstreamError(pool, url, "bad_response", f"HTTP {status}: body is not a JSON object")
    return status, parsed
