"""A decode that dies mid-stream ends the client's stream cleanly: vLLM's error event
(`data: {"error": {...}}`, then `data: [DONE]`), never a silent cut; counted. A client that goes away
cancels its upstream."""

from __future__ import annotations

import json

import aiohttp
import pytest
from router_fakes import MODEL, WORDS, until

TILERT = {"x-pd-route": "tilert"}
NATIVE = {"x-pd-route": "native"}


async def _raw_stream(url: str, headers: dict[str, str]) -> tuple[int, list[bytes]]:
    """The stream's events as the client's socket received them."""
    async with aiohttp.ClientSession() as http:
        async with http.post(
            url + "/v1/completions",
            json={"model": MODEL, "prompt": "a", "max_tokens": 10, "stream": True},
            headers=headers,
        ) as resp:
            raw = await resp.read()
            return resp.status, [e + b"\n\n" for e in raw.split(b"\n\n") if e]


@pytest.mark.parametrize("route", ["tilert", "native"])
async def test_a_decode_dying_mid_stream_ends_with_vllms_error_event(make_stack, route):
    s = await make_stack()
    s.node.die_after = s.native.die_after = 2
    status, events = await _raw_stream(s.router_url, {"x-pd-route": route})
    assert status == 200
    *tokens, err, done = events
    assert done == b"data: [DONE]\n\n"
    # vLLM's shape: a data line holding {"error": {...}}, no `event:` line (create_streaming_error_response).
    assert err.startswith(b"data: {") and b"event:" not in err
    error = json.loads(err[len(b"data: ") :])["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "upstream_error" and "decode failed mid-stream" in error["message"]
    texts = [json.loads(t[len(b"data: ") :])["choices"][0]["text"] for t in tokens]
    first = [" hello"] if route == "tilert" else []
    assert "".join(texts) == "".join(first + WORDS[:2])
    m = s.state.metrics
    assert m.stream_errors.labels(route, error["code"])._value.get() == 1
    if route == "tilert":
        await until(lambda: s.state.pools.tilert["t0"].in_use == 0)


async def test_a_client_that_goes_away_cancels_the_native_decode(make_stack):
    s = await make_stack()
    s.native.tokens = 10_000
    s.native.token_interval_s = 0.01  # 100 s to finish: only a cancel ends it within the wait below
    async with aiohttp.ClientSession() as http:
        resp = await http.post(
            s.router_url + "/v1/completions",
            json={"model": MODEL, "prompt": "a", "max_tokens": 10_000, "stream": True},
            headers=NATIVE,
        )
        assert resp.status == 200
        await resp.content.readuntil(b"\n\n")  # the first event arrived: the decode is streaming
        assert s.native.active == 1
        resp.close()  # the client goes away
    await until(lambda: s.native.active == 0)
    assert s.state.metrics.stream_errors.labels("native", "stream_broken")._value.get() == 0


async def test_a_client_that_goes_away_cancels_the_tilert_ticket(make_stack):
    s = await make_stack()
    s.node.default_tokens = 10_000
    s.node.token_interval_s = 0.01
    async with aiohttp.ClientSession() as http:
        resp = await http.post(
            s.router_url + "/v1/completions",
            json={"model": MODEL, "prompt": "a", "stream": True},
            headers=TILERT,
        )
        await resp.content.readuntil(b"\n\n")
        await until(lambda: s.node.tokens_sent > 0)
        resp.close()
    await until(lambda: s.node.active == 0 and s.state.pools.tilert["t0"].in_use == 0)
    assert len(s.node.cancels) == 1
