"""Requests at the context length answer the same on both paths, and the same as vLLM alone.

What vLLM 0.32 does, measured on the CPU build with --max-model-len 256: a max_tokens past the context
length is a 400 (`max_tokens=300 cannot be greater than max_model_len=256`, param max_tokens); a prompt
past it is a 400 (`This model's maximum context length is ...`, param input_tokens); a prompt + max_tokens
past it is not refused: the generation is clamped and ends as "length" (200 prompt + 100 asked gives 56
tokens). The fakes copy those answers; the TileRT node clamps as the real one does.
"""

from __future__ import annotations

import aiohttp
import pytest
from router_fakes import MODEL, until

CONTEXT = 32


async def _post(s, route: str, **body) -> tuple[int, dict]:
    async with (
        aiohttp.ClientSession() as http,
        http.post(
            s.router_url + "/v1/completions",
            json={"model": MODEL, "prompt": "a", **body},
            headers={"x-pd-route": route},
        ) as resp,
    ):
        return resp.status, await resp.json()


async def _nothing_held(s) -> None:
    await until(
        lambda: (
            all(n.in_use == 0 for n in s.state.pools.tilert.values()) and all(n.active == 0 for n in s.nodes)
        )
    )
    assert all(e.inflight == 0 for e in s.state.pools.all())


@pytest.mark.parametrize("route", ["tilert", "native"])
async def test_prompt_plus_max_tokens_past_the_context_ends_as_length(make_stack, route):
    s = await make_stack(context=CONTEXT)
    s.native.tokens = 1000  # the fake's script would otherwise end it first
    status, body = await _post(s, route, max_tokens=CONTEXT - 2)
    assert status == 200, body
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == CONTEXT - 7  # the prompt is 7 tokens
    assert (len(s.node.generates), len(s.native.bodies)) == ((1, 0) if route == "tilert" else (0, 1))
    await _nothing_held(s)


async def test_max_tokens_past_the_context_is_vllms_400_on_every_path(make_stack):
    """Whichever server refuses it, the client reads vLLM's refusal: native, TileRT sent on to the
    native pool, and TileRT with no native pool to send it to (the router answers for vLLM)."""
    want = {
        "error": {
            "message": f"max_tokens=40 cannot be greater than max_model_len={CONTEXT}. Please request "
            "fewer output tokens. (parameter=max_tokens, value=40)",
            "type": "BadRequestError",
            "param": "max_tokens",
            "code": 400,
        }
    }
    s = await make_stack(context=CONTEXT)
    assert await _post(s, "native", max_tokens=40) == (400, want)
    assert await _post(s, "tilert", max_tokens=40) == (400, want)
    assert s.node.admits and not s.node.generates
    await _nothing_held(s)
    alone = await make_stack(context=CONTEXT, n_native=0)
    assert await _post(alone, "tilert", max_tokens=40) == (400, want)
    assert await _post(alone, "auto", max_tokens=40) == (400, want)
    assert alone.prefill.bodies == []
    await _nothing_held(alone)


@pytest.mark.parametrize("route", ["tilert", "native"])
async def test_prompt_past_the_context_is_vllms_400(make_stack, route):
    s = await make_stack(context=CONTEXT)
    s.prefill.prompt_tokens = CONTEXT + 3
    status, body = await _post(s, route, max_tokens=4)
    assert status == 400
    assert body["error"] == {
        "message": f"This model's maximum context length is {CONTEXT} tokens. However, your "
        f"prompt contains {CONTEXT + 3} input tokens, which exceeds this limit even "
        "without any output tokens. Please reduce the length of the input prompt. "
        f"(parameter=input_tokens, value={CONTEXT + 3})",
        "type": "BadRequestError",
        "param": "input_tokens",
        "code": 400,
    }
    assert s.node.generates == [] and s.native.bodies == []
    await _nothing_held(s)
    if route == "tilert":
        assert len(s.node.cancels) == 1  # the ticket taken for it was given back
