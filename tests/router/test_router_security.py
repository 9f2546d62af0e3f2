"""The router against the attacks docs/security.md lists: idle and half-sent-header connections, a revoked API key,
anonymous /metrics, client-chosen metric labels, non-finite and out-of-range numbers, a dead TileRT pool,
a node stream cancelled under it; and the node-API token it sends to TileRT nodes (never to vLLM)."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import time
from typing import Any

import aiohttp
import openai
import pytest
from router_fakes import MODEL, until

from tilert_serve.router import policy

NODE_TOKEN = "node-token-0123456789abcdef"


async def _post(
    url: str,
    body: Any = None,
    *,
    raw: bytes | None = None,
    headers: dict[str, str] | None = None,
) -> tuple[int, dict[str, str], bytes]:
    data = raw if raw is not None else json.dumps(body).encode()
    async with (
        aiohttp.ClientSession() as http,
        http.post(url, data=data, headers={"Content-Type": "application/json", **(headers or {})}) as r,
    ):
        return r.status, dict(r.headers), await r.read()


async def _get(url: str, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    async with aiohttp.ClientSession() as http, http.get(url, headers=headers or {}) as r:
        return r.status, await r.read()


def _error(raw: bytes) -> dict[str, Any]:
    err = json.loads(raw)["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


# -- the node-API token ---------------------------------------------------------------------------------


async def test_the_node_token_goes_to_tilert_nodes_only(make_stack, tmp_path):
    token = tmp_path / "node-token"
    token.write_text(f"{NODE_TOKEN}\nold-token-still-accepted-by-nodes\n")
    s = await make_stack(node_token=NODE_TOKEN, tilert_api_token_file=str(token))
    c = s.client()
    r = await c.completions.create(
        model=MODEL, prompt="a", max_tokens=4, extra_headers={"x-pd-route": "tilert"}
    )
    assert r.choices[0].finish_reason == "length"
    await until(lambda: s.node.active == 0)
    # admit and generate carried the first token of the file; a cancel too.
    assert s.node.auth_seen and set(s.node.auth_seen) == {f"Bearer {NODE_TOKEN}"}
    s.prefill.finish_reason = "stop"  # the first token ends it: the router cancels the ticket
    await c.completions.create(model=MODEL, prompt="a", max_tokens=4, extra_headers={"x-pd-route": "tilert"})
    await until(lambda: len(s.node.cancels) == 1)
    assert set(s.node.auth_seen) == {f"Bearer {NODE_TOKEN}"}
    s.prefill.finish_reason = "length"
    await c.completions.create(model=MODEL, prompt="a", max_tokens=4, extra_headers={"x-pd-route": "native"})
    # vLLM never sees it (nor any Authorization the router made up).
    assert all("authorization" not in h for h in s.prefill.headers + s.native.headers)


async def test_a_node_that_refuses_the_router_sends_it_native(make_stack):
    s = await make_stack(node_token=NODE_TOKEN)  # the router has no token file
    r = await s.client().completions.create(model=MODEL, prompt="a", max_tokens=4)
    assert r.choices[0].text and s.node.active == 0 and len(s.native.bodies) == 1
    assert s.node.auth_seen == [None]
    _, body = await _get(s.router_url + "/metrics")
    assert 'tilert_router_admissions_total{node="t0",result="error"} 1.0' in body.decode()


async def test_the_node_token_file_is_reread_when_it_changes(make_stack, tmp_path):
    token = tmp_path / "node-token"
    token.write_text("old-token\n")
    s = await make_stack(node_token=NODE_TOKEN, tilert_api_token_file=str(token))
    new = tmp_path / "node-token.new"
    new.write_text(NODE_TOKEN + "\n")
    os.replace(new, token)
    await asyncio.sleep(1.1)  # TokenFile checks at most once a second
    r = await s.client().completions.create(
        model=MODEL, prompt="a", max_tokens=4, extra_headers={"x-pd-route": "tilert"}
    )
    assert r.choices[0].text and s.node.auth_seen[-1] == f"Bearer {NODE_TOKEN}"


# -- connections ----------------------------------------------------------------------------------------


def _closed_within(port: int, send: bytes, seconds: float) -> float | None:
    """Open a connection, send `send`, and return how long the server took to close it (None: not
    within `seconds`)."""
    t0 = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=seconds) as sock:
        if send:
            sock.sendall(send)
        try:
            while True:
                data = sock.recv(4096)
                if not data:
                    return time.monotonic() - t0
        except (TimeoutError, OSError):
            return None if time.monotonic() - t0 >= seconds else time.monotonic() - t0


@pytest.mark.parametrize(
    "send", [b"", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Ty"], ids=["idle", "half-sent-header"]
)
async def test_idle_and_half_header_connections_are_closed(make_stack, send):
    s = await make_stack(timeouts={"client_idle_s": 0.5})
    port = int(s.router_url.rsplit(":", 1)[1])
    took = await asyncio.to_thread(_closed_within, port, send, 10.0)
    assert took is not None and took < 5.0


async def test_an_idle_keepalive_connection_is_closed_after_its_response(make_stack):
    s = await make_stack(timeouts={"client_idle_s": 0.5})
    port = int(s.router_url.rsplit(":", 1)[1])

    def run() -> float | None:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            assert sock.recv(4096).startswith(b"HTTP/1.1 200")
            t0 = time.monotonic()
            while sock.recv(4096):
                pass
            return time.monotonic() - t0

    took = await asyncio.to_thread(run)
    assert took is not None and took < 5.0


async def test_a_body_sent_too_slowly_is_a_408(make_stack):
    s = await make_stack(timeouts={"client_body_s": 0.3})
    port = int(s.router_url.rsplit(":", 1)[1])
    body = json.dumps({"model": MODEL, "prompt": "a", "max_tokens": 2}).encode()

    def run() -> bytes:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: %d\r\n\r\n" % len(body) + body[:5]
            )
            return sock.recv(65536)

    answer = await asyncio.to_thread(run)
    assert answer.startswith(b"HTTP/1.1 408")
    assert _error(answer.split(b"\r\n\r\n", 1)[1])["code"] == "body_timeout"
    assert not s.prefill.bodies


# -- API keys, /metrics, /ready -------------------------------------------------------------------------


async def test_a_revoked_key_stops_working_within_seconds(make_stack, tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("key-kept\nkey-revoked\n")
    s = await make_stack(api_keys_file=str(keys))
    await s.client(api_key="key-revoked").completions.create(model=MODEL, prompt="a", max_tokens=2)
    new = tmp_path / "keys.new"
    new.write_text("key-kept\n")
    os.replace(new, keys)  # as the kubelet swaps a Secret's files; the router's config is unchanged
    t0 = time.monotonic()
    while True:
        try:
            await s.client(api_key="key-revoked").models.list()
        except openai.AuthenticationError:
            break
        assert time.monotonic() - t0 < 3.0, "the revoked key still works"
        await asyncio.sleep(0.1)
    r = await s.client(api_key="key-kept").completions.create(model=MODEL, prompt="a", max_tokens=2)
    assert r.choices[0].text


async def test_an_empty_keys_file_admits_nobody(make_stack, tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("# every key revoked\n")
    s = await make_stack(api_keys_file=str(keys))
    status, headers, raw = await _post(
        s.router_url + "/v1/completions",
        {"model": MODEL, "prompt": "a"},
        headers={"Authorization": "Bearer "},
    )
    assert status == 401 and _error(raw)["code"] == "invalid_api_key"
    assert headers["WWW-Authenticate"].startswith("Bearer")


async def test_metrics_and_ready_details_need_a_key(make_stack, tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("k1\n")
    s = await make_stack(api_keys_file=str(keys))
    status, raw = await _get(s.router_url + "/metrics")
    assert status == 401 and _error(raw)["code"] == "invalid_api_key"
    status, raw = await _get(s.router_url + "/metrics", {"Authorization": "Bearer k1"})
    assert status == 200 and b"tilert_router_endpoint_healthy" in raw and b"127.0.0.1" in raw
    # The kubelet's probe gets the verdict, not the addresses.
    status, raw = await _get(s.router_url + "/ready")
    assert status == 503 and b"127.0.0.1" not in raw and "tilert_slots" not in json.loads(raw)
    status, raw = await _get(s.router_url + "/ready", {"Authorization": "Bearer k1"})
    assert b"127.0.0.1" in raw and "tilert_slots" in json.loads(raw)


async def test_metrics_may_be_configured_public(make_stack, tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("k1\n")
    s = await make_stack(api_keys_file=str(keys), metrics_public=True)
    assert (await _get(s.router_url + "/metrics"))[0] == 200
    status, _, _ = await _post(s.router_url + "/v1/completions", {"model": MODEL, "prompt": "a"})
    assert status == 401


async def test_route_reasons_are_a_fixed_set_whatever_the_client_sends(make_stack):
    s = await make_stack()
    fields = ["logit_bias", "tools", "best_of", "min_p", "bad_words", "guided_regex", "suffix"]
    for i in range(1, len(fields) + 1):
        extra = {f: 1 for f in fields[:i]} | {"logit_bias": {"5": 1}, "tools": [{"type": "function"}]}
        status, _, _ = await _post(s.router_url + "/v1/completions", {"model": MODEL, "prompt": "a", **extra})
        assert status == 200
    _, raw = await _get(s.router_url + "/metrics")
    reasons = {
        line.split('reason="')[1].split('"')[0]
        for line in raw.decode().splitlines()
        if line.startswith("tilert_router_routes_total{")
    }
    assert reasons == {"unsupported on tilert"}
    assert reasons <= set(policy.Label.__args__)  # type: ignore[attr-defined]


# -- numbers --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "param"),
    [
        (b'"temperature": NaN', "temperature"),
        (b'"temperature": Infinity', "temperature"),
        (b'"top_p": -Infinity', "top_p"),
        (b'"top_p": 1e999', "top_p"),
        (b'"top_p": 0', "top_p"),
        (b'"presence_penalty": NaN', "presence_penalty"),
        (b'"logit_bias": {"5": NaN}', "logit_bias"),
        (b'"seed": 9223372036854775808', "seed"),
        (b'"seed": -9223372036854775809', "seed"),
        (b'"seed": ' + b"9" * 5000, None),
        (b'"max_tokens": 9223372036854775808', "max_tokens"),
        (b'"max_tokens": 0', "max_tokens"),
        (b'"top_k": -2', "top_k"),
        (b'"n": 0', "n"),
        (b'"stop_token_ids": [-1]', "stop_token_ids"),
        (b'"stop_token_ids": [18446744073709551616]', "stop_token_ids"),
        (b'"temperature": 1e308, "x": 1e309', "x"),
    ],
)
async def test_non_finite_and_out_of_range_numbers_are_400s_naming_the_field(make_stack, raw, param):
    s = await make_stack()
    status, _, body = await _post(
        s.router_url + "/v1/completions",
        raw=b'{"model": "' + MODEL.encode() + b'", "prompt": "a", ' + raw + b"}",
    )
    assert status == 400, body
    err = _error(body)
    assert err["param"] == param and (param is None or param in err["message"])
    assert not s.prefill.bodies and not s.node.admits  # refused before any work


async def test_deep_nesting_is_a_400(make_stack):
    s = await make_stack()
    status, _, body = await _post(s.router_url + "/v1/completions", raw=b"[" * 200_000 + b"]" * 200_000)
    assert status == 400 and _error(body)["type"] == "invalid_request_error"


# -- the pools' states ----------------------------------------------------------------------------------


async def test_a_dead_tilert_pool_is_a_503_with_retry_after_and_a_full_one_a_429(make_stack):
    s = await make_stack(policy={"when_tilert_full": "reject", "retry_after_s": 2})
    hdr = {"x-pd-route": "tilert"}
    body = {"model": MODEL, "prompt": "a", "max_tokens": 4}
    # Full: the node's only slot is held by a decode that waits.
    s.node.go.clear()
    held = asyncio.create_task(_post(s.router_url + "/v1/completions", body, headers=hdr))
    await until(lambda: len(s.node.generates) == 1)
    status, headers, raw = await _post(s.router_url + "/v1/completions", body, headers=hdr)
    assert status == 429 and headers["Retry-After"] == "2" and _error(raw)["code"] == "pool_full"
    s.node.go.set()
    assert (await held)[0] == 200
    await until(lambda: s.state.pools.tilert["t0"].in_use == 0)
    # Dead: the node is gone.
    await s.node.stop()
    status, headers, raw = await _post(s.router_url + "/v1/completions", body, headers=hdr)
    assert status == 503 and headers["Retry-After"] == "2" and _error(raw)["code"] == "tilert_unavailable"
    # Ejected by the health checks: the same, without even trying.
    s.state.pools.tilert["t0"].healthy = False
    status, headers, raw = await _post(s.router_url + "/v1/completions", body, headers=hdr)
    assert status == 503 and headers["Retry-After"] == "2"
    # Under the default policy a dead pool sends requests to the native pool.
    s2 = await make_stack()
    await s2.node.stop()
    status, headers, _ = await _post(s2.router_url + "/v1/completions", body)
    assert status == 200 and headers["X-PD-Route"] == "native"


# -- a node stream that ends cancelled ------------------------------------------------------------------


@pytest.mark.parametrize("end_with", ["cancelled", "cancelled_done"])
async def test_a_cancelled_node_stream_is_an_openai_error_for_the_client(make_stack, end_with):
    s = await make_stack()
    s.node.end_with = end_with
    c = s.client()
    stream = await c.completions.create(
        model=MODEL, prompt="a", max_tokens=5, stream=True, extra_headers={"x-pd-route": "tilert"}
    )
    finishes = []
    with pytest.raises(openai.APIError) as ei:
        async for chunk in stream:
            finishes.append(chunk.choices[0].finish_reason if chunk.choices else None)
    assert "cancelled" not in finishes
    assert "decode failed" in ei.value.message
    await until(lambda: s.state.pools.tilert["t0"].in_use == 0)
    # Not streamed: nothing was sent yet, so the router retries elsewhere (here: the native pool).
    r = await c.completions.create(model=MODEL, prompt="a", max_tokens=5)
    assert r.choices[0].finish_reason == "length" and len(s.native.bodies) == 1


async def test_a_reload_naming_an_unreadable_token_file_keeps_the_old_config(make_stack, tmp_path):
    from tilert_serve.router import config, reload

    keys = tmp_path / "keys"
    keys.write_text("k1\n")
    s = await make_stack(api_keys_file=str(keys))
    path = tmp_path / "config.yaml"
    path.write_text(config.dump(s.cfg.model_copy(update={"api_keys_file": str(tmp_path / "gone")})))
    s.state.config_path = path
    assert reload.reload_now(s.state) is False
    assert s.state.config.api_keys_file == str(keys)
    assert s.state.api_keys is not None and s.state.api_keys.accepts("k1")
