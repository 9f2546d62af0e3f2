"""The TileRT path over scripted upstreams, through the official openai client."""

from __future__ import annotations

import asyncio

import pytest
from router_fakes import MODEL, WORDS, until

ROUTE = {"x-pd-route": "tilert"}


async def test_completion_not_streamed(make_stack):
    s = await make_stack()
    c = s.client()
    r = await c.completions.create(model=MODEL, prompt="hi", max_tokens=5, extra_headers=ROUTE)
    assert r.choices[0].text == " hello" + "".join(WORDS[:4])
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == 7 and r.usage.completion_tokens == 5
    assert r.usage.prompt_tokens_details.cached_tokens == 3
    # The prefill got the contract: max_tokens=1, not streamed, the ticket and the node's ctrl address.
    pb = s.prefill.bodies[0]
    assert pb["max_tokens"] == 1 and pb["stream"] is False
    kvp = pb["kv_transfer_params"]
    assert kvp["tilert_host"] == "127.0.0.1" and kvp["tilert_ctrl_port"] == 5556
    assert kvp["tilert_ticket"] == s.node.generates[0]["ticket"]
    g = s.node.generates[0]
    assert g["first_token"] == 42 and g["max_tokens"] == 4
    # One request id through router, prefill and decode.
    rid = s.prefill.headers[0]["x-request-id"]
    assert g["request_id"] == rid == s.node.admits[0]["request_id"]
    assert r.id == "cmpl-" + rid
    assert s.node.active == 0 and s.state.pools.tilert["t0"].in_use == 0


async def test_chat_streamed_with_usage(make_stack):
    s = await make_stack()
    c = s.client()
    stream = await c.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=4,
        stream=True,
        stream_options={"include_usage": True},
        extra_headers=ROUTE,
    )
    texts, finishes, usage, ids = [], [], None, set()
    async for chunk in stream:
        ids.add(chunk.id)
        if chunk.usage:
            usage = chunk.usage
        for ch in chunk.choices:
            texts.append(ch.delta.content or "")
            finishes.append(ch.finish_reason)
    assert "".join(texts) == " hello" + "".join(WORDS[:3])
    assert finishes[-1] == "length" and finishes[0] is None
    assert usage.completion_tokens == 4 and usage.prompt_tokens_details.cached_tokens == 3
    assert len(ids) == 1
    assert "stream_options" not in s.prefill.bodies[0]
    assert s.prefill.bodies[0]["max_completion_tokens"] == 1


async def test_first_token_reaches_client_before_decode(make_stack):
    """The prefill's token is sent at once: the client has it while the node has sent nothing."""
    s = await make_stack()
    s.node.go.clear()  # the node holds its stream until the client has the first token
    c = s.client()
    stream = await c.completions.create(
        model=MODEL, prompt="hi", max_tokens=3, stream=True, extra_headers=ROUTE
    )
    # A router that waited for the decode would wait here forever: the bound only stops a hang.
    first = await asyncio.wait_for(stream.__anext__(), 30)
    assert first.choices[0].text == " hello"
    assert s.node.tokens_sent == 0
    s.node.go.set()
    rest = [ch async for ch in stream]
    assert "".join(ch.choices[0].text for ch in rest) == "".join(WORDS[:2])


@pytest.mark.parametrize("case", ["max_tokens_1", "eos"])
async def test_first_token_ends_request_cancels_ticket(make_stack, case):
    s = await make_stack()
    if case == "eos":
        s.prefill.finish_reason = "stop"
    c = s.client()
    r = await c.completions.create(
        model=MODEL, prompt="hi", max_tokens=1 if case == "max_tokens_1" else 10, extra_headers=ROUTE
    )
    assert r.choices[0].text == " hello"
    assert r.choices[0].finish_reason == ("length" if case == "max_tokens_1" else "stop")
    assert r.usage.completion_tokens == 1
    assert s.node.generates == []
    await until(lambda: len(s.node.cancels) == 1 and s.state.pools.tilert["t0"].in_use == 0)
    assert s.node.active == 0


async def test_stop_string_cut_and_cancelled(make_stack):
    s = await make_stack()
    s.node.token_interval_s = 0.01
    c = s.client()
    # WORDS[2] is " w2": stop on "w2" must drop it and everything after, and free the slot.
    stream = await c.completions.create(
        model=MODEL, prompt="hi", max_tokens=50, stop=["w2"], stream=True, extra_headers=ROUTE
    )
    chunks = [ch async for ch in stream]
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert text == " hello w0 w1 "
    assert chunks[-1].choices[0].finish_reason == "stop"
    await until(lambda: s.state.pools.tilert["t0"].in_use == 0 and s.node.active == 0)
    assert len(s.node.cancels) == 1


async def test_eos_from_node_and_sampling_forwarded(make_stack):
    s = await make_stack()
    s.node.stop_after = 2
    c = s.client()
    r = await c.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "x"}],
        max_tokens=20,
        temperature=0.5,
        top_p=0.9,
        seed=7,
        extra_body={"top_k": 5, "stop_token_ids": [3, 4], "ignore_eos": False},
        extra_headers=ROUTE,
    )
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.content == " hello w0 w1"
    g = s.node.generates[0]
    assert g["sampling"] == {"temperature": 0.5, "top_p": 0.9, "top_k": 5, "seed": 7}
    assert g["stop_token_ids"] == [3, 4] and g["ignore_eos"] is False and g["max_tokens"] == 19
    assert s.prefill.bodies[0]["seed"] == 7


async def test_auto_prefers_tilert_and_alias_routes(make_stack):
    s = await make_stack(policy={"native_aliases": ["tiny-native"], "tilert_aliases": ["tiny-fast"]})
    c = s.client()
    await c.completions.create(model=MODEL, prompt="a", max_tokens=3)
    assert len(s.node.generates) == 1 and s.native.bodies == []
    r = await c.completions.create(model="tiny-native", prompt="a", max_tokens=3)
    assert len(s.native.bodies) == 1 and r.model == "tiny-native"
    assert s.native.bodies[0]["model"] == MODEL  # vLLM is asked for the name it serves
    await c.completions.create(model="tiny-fast", prompt="a", max_tokens=3)
    assert len(s.node.generates) == 2


async def test_unsupported_feature_goes_native_or_400(make_stack):
    s = await make_stack()
    c = s.client()
    await c.completions.create(model=MODEL, prompt="a", max_tokens=3, presence_penalty=0.5)
    assert len(s.native.bodies) == 1 and s.node.admits == []
    s2 = await make_stack(policy={"unsupported_on_tilert": "reject"})
    import openai

    with pytest.raises(openai.BadRequestError, match="presence_penalty"):
        await s2.client().completions.create(
            model=MODEL, prompt="a", max_tokens=3, presence_penalty=0.5, extra_headers=ROUTE
        )


async def test_no_max_tokens_sends_a_number_to_the_node(make_stack):
    """The node's generate needs an int: the config's default, capped by the node's max_seq_len."""
    s = await make_stack(limits={"default_max_tokens": 100})
    r = await s.client().completions.create(model=MODEL, prompt="a", extra_headers=ROUTE)
    assert s.node.generates[0]["max_tokens"] == 99
    assert r.usage.completion_tokens == 100
    node = s.state.pools.tilert["t0"]
    node.spec = node.spec.model_copy(update={"max_seq_len": 20})
    await s.client().completions.create(model=MODEL, prompt="a", extra_headers=ROUTE)
    assert s.node.generates[1]["max_tokens"] == 20 - 7 - 1  # 7 prompt tokens, the first token from prefill
