"""The native path (vLLM's own PD flow) over scripted upstreams."""

from __future__ import annotations

import openai
import pytest
from router_fakes import MODEL, WORDS

NATIVE = {"x-pd-route": "native"}


async def test_native_flow_and_params_forwarded(make_stack):
    s = await make_stack()
    c = s.client()
    r = await c.completions.create(
        model=MODEL, prompt="a", max_tokens=3, extra_headers=NATIVE, extra_body={"min_tokens": 2}
    )
    assert r.choices[0].text == "".join(WORDS[:3])
    pb = s.prefill.bodies[0]
    assert pb["kv_transfer_params"]["do_remote_decode"] is True
    assert pb["kv_transfer_params"]["do_remote_prefill"] is False
    assert pb["max_tokens"] == 1 and pb["stream"] is False and "min_tokens" not in pb
    db = s.native.bodies[0]
    assert db["kv_transfer_params"] == {"remote_engine_id": "p0", "remote_block_ids": [1, 2]}
    assert db["max_tokens"] == 3 and db["min_tokens"] == 2
    # Cached tokens come from the prefill (3), not from the decode, which pulled everything (7).
    assert r.usage.prompt_tokens_details.cached_tokens == 3
    assert s.node.admits == []


@pytest.mark.parametrize("kind", ["chat", "completions"])
async def test_native_streamed_usage_rewritten(make_stack, kind):
    s = await make_stack()
    c = s.client()
    if kind == "chat":
        stream = await c.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "a"}],
            max_tokens=4,
            stream=True,
            stream_options={"include_usage": True},
            extra_headers=NATIVE,
        )
    else:
        stream = await c.completions.create(
            model=MODEL,
            prompt="a",
            max_tokens=4,
            stream=True,
            stream_options={"include_usage": True},
            extra_headers=NATIVE,
        )
    text, usage = [], None
    async for ch in stream:
        if ch.usage:
            usage = ch.usage
        for choice in ch.choices:
            text.append(choice.delta.content if kind == "chat" else choice.text)
    assert "".join(t or "" for t in text) == "".join(WORDS[:4])
    assert usage.completion_tokens == 4 and usage.prompt_tokens_details.cached_tokens == 3


async def test_native_prefill_without_params_decodes_whole(make_stack):
    """A prefill without a connector returns no kv_transfer_params: the decode gets none (toy proxy)."""
    s = await make_stack()
    s.prefill.kv_params = None
    s.prefill.cached_tokens = None
    r = await s.client().completions.create(model=MODEL, prompt="a", max_tokens=2, extra_headers=NATIVE)
    assert "kv_transfer_params" not in s.native.bodies[0]
    assert r.usage.prompt_tokens_details.cached_tokens == 7  # the decode's own count stands


async def test_native_decode_dies_mid_stream(make_stack):
    s = await make_stack()
    s.native.die_after = 2
    stream = await s.client().completions.create(
        model=MODEL, prompt="a", max_tokens=5, stream=True, extra_headers=NATIVE
    )
    got = []
    with pytest.raises(openai.APIError, match="decode failed"):
        async for ch in stream:
            got.append(ch.choices[0].text)
    assert "".join(got) == "".join(WORDS[:2])
    assert s.state.pools.native[s.native.url].inflight == 0


async def test_native_decode_500_retried_on_other(make_stack):
    s = await make_stack(n_native=2)
    s.natives[0].fail_status = 500
    c = s.client()
    for _ in range(3):
        r = await c.completions.create(
            model=MODEL, prompt="a", max_tokens=2, extra_headers=NATIVE, stream=False
        )
        assert r.choices[0].text == "".join(WORDS[:2])


async def test_upstream_4xx_passed_through(make_stack):
    s = await make_stack()
    s.prefill.fail_status = 400
    with pytest.raises(openai.BadRequestError, match="scripted prefill failure"):
        await s.client().completions.create(model=MODEL, prompt="a", max_tokens=2, extra_headers=NATIVE)
    assert len(s.prefill.bodies) == 1  # a client error is not retried
