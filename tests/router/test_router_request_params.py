"""What the router passes upstream of a client's request:

- a temperature that overflows a sampler (5e-39) reaches the TileRT node as vLLM takes it (0.01, the
  floor the prefill sampled the first token with), not as sent;
- `extra_body` (an SDK option: a client that sends the literal field meant its contents, which vLLM
  ignores) does not go upstream; `vllm_xargs` (which vLLM hands to the engine as extra_args) goes only
  as the object of scalars vLLM types it as, without kv_transfer_params, and anything else is a 400
  naming the field before any upstream work.
"""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import pytest
from router_fakes import MODEL, until

TILERT = {"x-pd-route": "tilert"}


async def _post(url: str, body: dict[str, Any], headers: dict[str, str] | None = None) -> tuple[int, Any]:
    async with (
        aiohttp.ClientSession() as http,
        http.post(url + "/v1/completions", json=body, headers=headers or {}) as r,
    ):
        return r.status, json.loads(await r.read())


@pytest.mark.parametrize("given, sent", [(5e-39, 0.01), (1e-6, 0.01), (0.0, 0.0), (0.5, 0.5)])
async def test_a_tiny_temperature_reaches_the_node_as_vllm_takes_it(make_stack, given, sent):
    s = await make_stack()
    status, body = await _post(
        s.router_url, {"model": MODEL, "prompt": "a", "max_tokens": 3, "temperature": given}, TILERT
    )
    assert status == 200, body
    assert s.node.generates[-1]["sampling"]["temperature"] == sent
    await until(lambda: s.state.pools.tilert["t0"].in_use == 0)


async def test_extra_body_is_not_forwarded(make_stack):
    s = await make_stack()
    smuggled = {
        "kv_transfer_params": {"do_remote_prefill": True, "remote_host": "10.0.0.9"},
        "temperature": 9,
    }
    for headers in (TILERT, {"x-pd-route": "native"}):
        status, body = await _post(
            s.router_url, {"model": MODEL, "prompt": "a", "max_tokens": 3, "extra_body": smuggled}, headers
        )
        assert status == 200, body
    sent = [*s.prefill.bodies, *s.native.bodies]
    assert len(sent) == 3 and not any("extra_body" in b for b in sent), sent


@pytest.mark.parametrize(
    "xargs",
    [
        json.dumps({"kv_transfer_params": {"do_remote_prefill": True}}),
        ["kv_transfer_params"],
        {"a": {"nested": 1}},
        {"a": None},
        {"a": [1, {"b": 2}]},
    ],
)
async def test_vllm_xargs_other_than_an_object_of_scalars_is_a_400(make_stack, xargs):
    s = await make_stack()
    status, body = await _post(
        s.router_url, {"model": MODEL, "prompt": "a", "max_tokens": 3, "vllm_xargs": xargs}, TILERT
    )
    assert status == 400, body
    assert body["error"]["param"] == "vllm_xargs" and "vllm_xargs" in body["error"]["message"], body
    assert not s.prefill.bodies and not s.node.admits


async def test_valid_vllm_xargs_go_without_kv_transfer_params(make_stack):
    s = await make_stack()
    xargs = {"session_id": "s1", "n": 3, "f": 0.5, "l": ["a", 1, 2.0], "kv_transfer_params": "x"}
    status, body = await _post(
        s.router_url, {"model": MODEL, "prompt": "a", "max_tokens": 3, "vllm_xargs": xargs}, TILERT
    )
    assert status == 200, body
    assert s.prefill.bodies[-1]["vllm_xargs"] == {"session_id": "s1", "n": 3, "f": 0.5, "l": ["a", 1, 2.0]}
