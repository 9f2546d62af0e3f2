"""Compatibility generations: the router pairs a prefill only with a decode server of its
generation; a node advertising another generation than configured takes no request; a prefill whose
state is of another generation than the chosen decode's is retried on a compatible pair; a request
with no compatible pair falls back as if the pool were full, and is counted."""

from __future__ import annotations

import json

import aiohttp
import pytest
from router_fakes import MODEL, until

from tilert_serve.router import health, pairing
from tilert_serve.router.pairing import Decode

A, B = "aaaaaaaaaaaa", "bbbbbbbbbbbb"
TILERT = {"x-pd-route": "tilert"}
NATIVE = {"x-pd-route": "native"}


@pytest.mark.parametrize(
    ("decode", "prefills", "ok"),
    [
        (A, {A}, True),
        (A, {B}, False),
        (A, {B, A}, True),
        (A, {None}, True),  # a prefill of unknown generation pairs with anything
        (None, {B}, True),  # so does a decode of unknown generation
        (A, set(), True),  # no prefill: pairing does not decide, the missing prefill does
    ],
)
def test_pairable(decode, prefills, ok):
    assert pairing.pairable(decode, prefills) is ok


@pytest.mark.parametrize(
    ("decodes", "prefills", "state"),
    [
        ([], {A}, "down"),
        ([Decode(A, False)], {A}, "full"),
        ([Decode(A, True)], {A}, "free"),
        ([Decode(A, True)], {B}, "no_pair"),
        ([Decode(A, True), Decode(B, False)], {B}, "no_pair"),  # B has no slot, A no prefill
        ([Decode(A, True), Decode(B, True)], {B}, "free"),
        ([Decode(A, False), Decode(B, False)], {B}, "full"),
        ([Decode(None, True)], {B}, "free"),
    ],
)
def test_pool_state(decodes, prefills, state):
    assert pairing.pool_state(decodes, prefills) == state


def test_for_decode_keeps_only_compatible_prefills():
    items = [(A, "p-a"), (B, "p-b"), (None, "p-any")]
    assert pairing.for_decode(A, items) == ["p-a", "p-any"]
    assert pairing.for_decode(None, items) == ["p-a", "p-b", "p-any"]


def _two_generations(s, *, node=A, native=B) -> None:
    """prefill 0 and the node are generation A, prefill 1 and the native server B (as during a
    rollout that changes the fingerprint: both generations live side by side)."""
    s.prefills[0].compat, s.prefills[1].compat = A, B
    cfg = s.state.base_config
    s.state.apply(
        cfg.model_copy(
            update={
                "prefill": [
                    cfg.prefill[0].model_copy(update={"compat": A}),
                    cfg.prefill[1].model_copy(update={"compat": B}),
                ],
                "tilert": [cfg.tilert[0].model_copy(update={"compat": node})],
                "native": [cfg.native[0].model_copy(update={"compat": native})],
            }
        )
    )


async def test_each_request_stays_inside_one_generation(make_stack):
    s = await make_stack(n_prefill=2)
    _two_generations(s)
    c = s.client()
    for _ in range(4):
        r = await c.completions.create(model=MODEL, prompt="a", max_tokens=3, extra_headers=TILERT)
        assert r.choices[0].text == " hello w0 w1"
        r = await c.completions.create(model=MODEL, prompt="a", max_tokens=3, extra_headers=NATIVE)
        assert r.choices[0].text
    # TileRT requests only ever went to prefill A, native ones only to prefill B.
    assert all("tilert_ticket" in b["kv_transfer_params"] for b in s.prefills[0].bodies)
    assert all("do_remote_decode" in b["kv_transfer_params"] for b in s.prefills[1].bodies)
    assert len(s.prefills[0].bodies) == 4 and len(s.prefills[1].bodies) == 4
    assert s.state.metrics.no_pair.labels("tilert")._value.get() == 0


async def test_no_compatible_pair_falls_back_like_a_full_pool_and_is_counted(make_stack):
    s = await make_stack(n_prefill=2)
    _two_generations(s, node="cccccccccccc", native=B)  # no prefill of the node's generation
    c = s.client()
    r = await c.completions.create(model=MODEL, prompt="a", max_tokens=3)  # auto: native, as if full
    assert r.choices[0].text and len(s.native.bodies) == 1 and not s.node.admits
    assert s.state.metrics.no_pair.labels("tilert")._value.get() == 1
    # Asked for TileRT by header under when_tilert_full: native, the same happens.
    await c.completions.create(model=MODEL, prompt="a", max_tokens=3, extra_headers=TILERT)
    assert not s.node.admits and s.state.metrics.no_pair.labels("tilert")._value.get() == 2
    s.state.apply(
        s.state.base_config.model_copy(
            update={"policy": s.cfg.policy.model_copy(update={"when_tilert_full": "reject"})}
        )
    )
    async with aiohttp.ClientSession() as http:
        async with http.post(
            s.router_url + "/v1/completions",
            json={"model": MODEL, "prompt": "a", "max_tokens": 3},
            headers=TILERT,
        ) as resp:
            assert resp.status == 429 and resp.headers.get("Retry-After")


@pytest.mark.parametrize("in_ready", [True, False])
async def test_a_node_advertising_another_generation_is_not_routed_to(make_stack, in_ready):
    s = await make_stack(node_slots=(1, 1))
    cfg = s.state.base_config
    s.state.apply(cfg.model_copy(update={"tilert": [n.model_copy(update={"compat": A}) for n in cfg.tilert]}))
    s.nodes[0].compat, s.nodes[1].compat = B, A  # t0 runs something else than its spec says
    s.nodes[0].compat_in_ready = s.nodes[1].compat_in_ready = in_ready
    await health.probe_all(s.state)
    t0, t1 = s.state.pools.tilert["t0"], s.state.pools.tilert["t1"]
    assert t0.compat_mismatch and not t1.compat_mismatch
    assert s.state.metrics.compat_mismatches.labels("tilert")._value.get() == 1
    await health.probe_all(s.state)  # counted once per change, not per probe
    assert s.state.metrics.compat_mismatches.labels("tilert")._value.get() == 1
    c = s.client()
    for _ in range(3):
        r = await c.completions.create(model=MODEL, prompt="a", max_tokens=2, extra_headers=TILERT)
        assert r.choices[0].text == " hello w0"
    assert not s.nodes[0].admits and len(s.nodes[1].admits) == 3
    # Fixed (the pod was replaced): routed to again from the next probe.
    s.nodes[0].compat = A
    await health.probe_all(s.state)
    assert not t0.compat_mismatch and t0.routable


async def test_a_prefill_state_of_another_generation_is_not_decoded_there(make_stack):
    s = await make_stack(n_prefill=2, node_slots=(1,))
    cfg = s.state.base_config
    # Neither prefill has a configured generation (a hand-written list); one of them runs B.
    s.state.apply(cfg.model_copy(update={"tilert": [cfg.tilert[0].model_copy(update={"compat": A})]}))
    s.prefills[0].compat, s.prefills[1].compat = B, A
    p1 = s.state.pools.prefill[s.prefills[1].url]
    p1.inflight = 1  # prefill 0 is the least loaded: the first pick
    c = s.client()
    r = await c.completions.create(model=MODEL, prompt="a", max_tokens=3, extra_headers=TILERT)
    assert r.choices[0].text == " hello w0 w1"
    assert len(s.prefills[0].bodies) == 1 and len(s.prefills[1].bodies) == 1
    assert s.state.metrics.retries.labels("tilert", "compat_mismatch")._value.get() == 1
    p1.inflight = 0
    for _ in range(3):
        r = await c.completions.create(model=MODEL, prompt="a", max_tokens=3, extra_headers=TILERT)
        assert r.choices[0].text == " hello w0 w1"
    # Its answer said B: prefill 0 is not paired with node A again.
    assert len(s.prefills[0].bodies) == 1 and len(s.prefills[1].bodies) == 4
    assert s.state.pools.prefill[s.prefills[0].url].generation == B
    assert len(s.node.generates) == 4  # no generate call for the B state
    await until(lambda: s.node.active == 0)  # the B attempt's ticket was cancelled


async def test_status_shows_each_endpoint_generation_and_the_counts(make_stack):
    s = await make_stack(n_prefill=2)
    _two_generations(s)
    async with aiohttp.ClientSession() as http:
        async with http.get(s.router_url + "/v1/status") as resp:
            assert resp.status == 200
            body = json.loads(await resp.read())
    assert body["generations"] == {
        A: {"prefill": 1, "tilert": 1, "native": 0},
        B: {"prefill": 1, "tilert": 0, "native": 1},
    }
    assert [e["compat"] for e in body["endpoints"]["prefill"]] == [A, B]
    assert (
        body["endpoints"]["tilert"][0]["name"] == "t0"
        and body["endpoints"]["tilert"][0]["breaker"] == "closed"
    )
    assert set(body["retry_budget"]) == {"window_s", "requests", "retries", "allowed"}


async def test_status_needs_an_api_key_when_keys_are_set(make_stack, tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("k1\n")
    s = await make_stack(api_keys_file=str(keys))
    async with aiohttp.ClientSession() as http:
        async with http.get(s.router_url + "/v1/status") as resp:
            assert resp.status == 401
        async with http.get(s.router_url + "/v1/status", headers={"Authorization": "Bearer k1"}) as resp:
            assert resp.status == 200


async def test_a_native_pool_without_a_pairable_server_is_full_and_counted(make_stack):
    s = await make_stack(n_prefill=2)
    _two_generations(s, node=A, native="cccccccccccc")
    async with aiohttp.ClientSession() as http:
        async with http.post(
            s.router_url + "/v1/completions",
            json={"model": MODEL, "prompt": "a", "max_tokens": 3},
            headers=NATIVE,
        ) as resp:
            assert resp.status == 429 and resp.headers.get("Retry-After")
    assert not s.native.bodies
    assert s.state.metrics.no_pair.labels("native")._value.get() == 1
    # A TileRT request is not counted against the native pool it did not need.
    r = await s.client().completions.create(model=MODEL, prompt="a", max_tokens=3, extra_headers=TILERT)
    assert r.choices[0].text == " hello w0 w1"
    assert s.state.metrics.no_pair.labels("native")._value.get() == 1
    assert s.state.metrics.no_pair.labels("tilert")._value.get() == 0


async def test_ready_lists_a_node_of_another_generation_as_degraded(make_stack):
    s = await make_stack(n_native=0, handoff_probe={"interval_s": 3600})
    cfg = s.state.base_config
    s.state.apply(cfg.model_copy(update={"tilert": [cfg.tilert[0].model_copy(update={"compat": A})]}))
    s.node.compat = B
    await health.probe_all(s.state)
    s.state.pools.tilert["t0"].handoff_ok(0.0)  # its handoffs worked: only the generation is wrong
    async with aiohttp.ClientSession() as http:
        async with http.get(s.router_url + "/ready") as resp:
            body = await resp.json()
    assert resp.status == 503 and not body["ready"]
    assert f"TileRT node t0: advertises generation {B}, configured {A}" in body["degraded"]
