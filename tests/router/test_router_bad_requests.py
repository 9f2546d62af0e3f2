"""Bad requests get OpenAI-shaped errors and the router keeps serving."""

from __future__ import annotations

import aiohttp
import openai
import pytest
from router_fakes import MODEL

CASES = [
    ("/v1/completions", b"{not json", 400, "not valid JSON"),
    ("/v1/completions", b"[1, 2]", 400, "JSON object"),
    ("/v1/completions", b'{"prompt": "a"}', 400, "'model'"),
    ("/v1/completions", b'{"model": "tiny", "prompt": "a", "max_tokens": "ten"}', 400, "max_tokens"),
    ("/v1/completions", b'{"model": "tiny", "prompt": "a", "max_tokens": 0}', 400, "max_tokens"),
    ("/v1/completions", b'{"model": "tiny", "prompt": "a", "temperature": -1}', 400, "temperature"),
    ("/v1/completions", b'{"model": "tiny", "prompt": "a", "stream": "yes"}', 400, "stream"),
    ("/v1/completions", b'{"model": "tiny", "prompt": "a", "stop": [1]}', 400, "stop"),
    ("/v1/completions", b'{"model": "tiny", "prompt": 5}', 400, "prompt"),
    ("/v1/completions", b'{"model": "tiny"}', 400, "prompt"),
    ("/v1/chat/completions", b'{"model": "tiny", "messages": []}', 400, "messages"),
    ("/v1/chat/completions", b'{"model": "tiny", "messages": [{"content": "x"}]}', 400, "role"),
    ("/v1/completions", b'{"model": "gpt-9", "prompt": "a"}', 404, "gpt-9"),
]


async def test_bad_requests_openai_errors_and_still_serving(make_stack):
    s = await make_stack()
    async with aiohttp.ClientSession() as http:
        for path, body, status, needle in CASES:
            async with http.post(
                s.router_url + path, data=body, headers={"Content-Type": "application/json"}
            ) as resp:
                assert resp.status == status, (body, await resp.text())
                err = (await resp.json())["error"]
                assert needle in err["message"], (body, err)
                assert set(err) == {"message", "type", "param", "code"}
                assert resp.headers["X-Request-Id"]
        # Wrong header value, unknown route, wrong method.
        async with http.post(
            s.router_url + "/v1/completions",
            json={"model": MODEL, "prompt": "a"},
            headers={"x-pd-route": "fastest"},
        ) as resp:
            assert resp.status == 400 and "x-pd-route" in (await resp.json())["error"]["message"]
        async with http.get(s.router_url + "/v1/nothing") as resp:
            assert resp.status == 404 and "error" in await resp.json()
        async with http.get(s.router_url + "/v1/completions") as resp:
            assert resp.status == 405 and "error" in await resp.json()
    r = await s.client().completions.create(model=MODEL, prompt="a", max_tokens=2)
    assert r.choices[0].text


async def test_oversized_body(make_stack):
    s = await make_stack(limits={"max_body_bytes": 4096})
    c = s.client()
    with pytest.raises(openai.APIStatusError) as ei:
        await c.completions.create(model=MODEL, prompt="x" * 10_000, max_tokens=2)
    assert ei.value.status_code == 413
    assert "too large" in ei.value.message
    r = await c.completions.create(model=MODEL, prompt="a", max_tokens=2)
    assert r.choices[0].text


async def test_openai_client_errors(make_stack):
    s = await make_stack()
    c = s.client()
    with pytest.raises(openai.NotFoundError) as ei:
        await c.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    assert ei.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError):
        await c.completions.create(model=MODEL, prompt="a", max_tokens=-3)


async def test_api_keys(make_stack, tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("# comment\nsecret-1\nsecret-2\n")
    s = await make_stack(api_keys_file=str(keys))
    with pytest.raises(openai.AuthenticationError):
        await s.client(api_key="wrong").completions.create(model=MODEL, prompt="a", max_tokens=2)
    r = await s.client(api_key="secret-2").completions.create(model=MODEL, prompt="a", max_tokens=2)
    assert r.choices[0].text
    async with aiohttp.ClientSession() as http, http.get(s.router_url + "/health") as resp:
        assert resp.status == 200  # probes need no key


async def test_models(make_stack):
    s = await make_stack(policy={"tilert_aliases": ["tiny-fast"]})
    models = await s.client().models.list()
    assert [m.id for m in models.data] == [MODEL, "tiny-fast"]
