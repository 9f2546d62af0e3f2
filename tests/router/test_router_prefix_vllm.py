"""Greedy answers through every prefill policy equal vLLM alone's (a real vLLM on CPU, marked slow).

One vLLM server is reached as two prefills (127.0.0.1 and localhost name the same server), so every
policy really chooses, and round_robin really alternates, while the answer must stay what vLLM alone
says: the choice of prefill steers load and cache hits, never the text.
"""

from __future__ import annotations

import openai
import pytest
from router_fakes import FakeNode
from test_router_vllm_real import MODEL, vllm_url  # noqa: F401  (the session's vLLM server fixture)

from tilert_serve.router import config
from tilert_serve.router.app import bound_port, make_app, start
from tilert_serve.router.state import STATE

pytestmark = pytest.mark.slow

SYSTEM = "You answer briefly and exactly. " * 6
NATIVE = {"x-pd-route": "native"}


@pytest.mark.parametrize("policy", ["cache_aware", "least_loaded", "round_robin"])
async def test_greedy_answers_through_every_prefill_policy_equal_vllm_alone(vllm_url, policy):  # noqa: F811
    node = await FakeNode("t0", slots=1).start()
    twin = vllm_url.replace("127.0.0.1", "localhost")
    cfg = config.RouterConfig(
        model=MODEL,
        prefill=[vllm_url, twin],
        native=[vllm_url],
        tilert=[config.TileRTNode(name="t0", http_url=node.url, ctrl_host="127.0.0.1", slots=1)],
        policy=config.RoutingPolicy(prefill=policy),
    )
    app = make_app(cfg, health_checks=False)
    runner = await start(app, "127.0.0.1", 0)
    client = openai.AsyncOpenAI(
        base_url=f"http://127.0.0.1:{bound_port(runner)}/v1", api_key="x", max_retries=0, timeout=60
    )
    direct = openai.AsyncOpenAI(base_url=vllm_url + "/v1", api_key="x", max_retries=0, timeout=60)
    try:
        msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Name a colour."}]
        for turn in range(3):
            want = await direct.chat.completions.create(
                model=MODEL, messages=msgs, max_tokens=6, temperature=0
            )
            got = await client.chat.completions.create(
                model=MODEL, messages=msgs, max_tokens=6, temperature=0, extra_headers=NATIVE
            )
            assert got.choices[0].message.content == want.choices[0].message.content
            msgs += [
                {"role": "assistant", "content": want.choices[0].message.content or ""},
                {"role": "user", "content": f"Another, turn {turn}."},
            ]
        for i in range(3):
            prompt = SYSTEM + f"Count to {i + 2}:"
            want_c = await direct.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0)
            got_c = await client.completions.create(
                model=MODEL, prompt=prompt, max_tokens=6, temperature=0, extra_headers=NATIVE
            )
            assert got_c.choices[0].text == want_c.choices[0].text
        m = app[STATE].metrics.prefill_choices
        total = sum(float(c._value.get()) for c in m._children.values())
        assert total == 6  # every request's prefill was chosen by the policy under test
        assert all(key[0] == policy for key in m._children)
        if policy == "cache_aware":  # later turns and the shared system prompt were matched
            assert float(m.labels("cache_aware", "prefix")._value.get()) >= 3
    finally:
        await client.close()
        await direct.close()
        await runner.cleanup()
        await node.stop()
