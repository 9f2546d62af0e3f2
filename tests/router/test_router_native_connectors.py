"""What the native path sends for each nativeConnector, checked against vLLM 0.32's own connector code,
and the rule that a client's kv_transfer_params never reach an upstream."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import openai
import pytest
from aiohttp import web
from router_fakes import MODEL, WORDS, Fake

from tilert_serve.router import native_path

NATIVE = {"x-pd-route": "native"}
MOONCAKE = {"native_connector": "MooncakeConnector"}


class FakeBootstrap(Fake):
    """The registry a prefill's MooncakeConnector serves on VLLM_MOONCAKE_BOOTSTRAP_PORT."""

    def __init__(self, engines: dict[int, str]) -> None:
        self.engines = engines
        self.queries = 0

    def app(self) -> web.Application:
        app = web.Application()
        app.add_routes([web.get("/query", self.query)])
        return app

    async def query(self, request: web.Request) -> web.Response:
        self.queries += 1
        return web.json_response(
            {
                str(rank): {"engine_id": eid, "worker_addr": {"0": {"0": "127.0.0.1:1"}}}
                for rank, eid in self.engines.items()
            }
        )


@pytest.fixture
async def bootstrap():
    b = await FakeBootstrap({0: "engine-p0"}).start()
    yield b
    await b.stop()


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


async def mooncake_stack(make_stack, bootstrap: FakeBootstrap, **kw: Any):
    s = await make_stack(**MOONCAKE, mooncake_bootstrap_port=_port(bootstrap.url), **kw)
    for p in s.prefills:
        p.kv_params = None  # MooncakeConnector.request_finished returns no params
    return s


@pytest.mark.parametrize("route", ["native", "tilert"])
@pytest.mark.parametrize("where", ["body", "vllm_xargs"])
async def test_client_kv_transfer_params_reach_no_upstream(make_stack, route, where):
    s = await make_stack()
    s.prefill.kv_params = None  # the decode leg gets nothing from the prefill to overwrite them with
    own = {
        "do_remote_prefill": True,
        "remote_host": "10.9.9.9",
        "remote_port": 1,
        "remote_engine_id": "x",
        "remote_block_ids": [7],
    }
    extra: dict[str, Any] = {"kv_transfer_params": own, "vllm_xargs": {"keep": 1}}
    if where == "vllm_xargs":
        # vLLM copies kv_transfer_params into extra_args, where the engine reads them: same effect.
        extra = {"vllm_xargs": {"kv_transfer_params": "x", "keep": 1}}
    r = await s.client().completions.create(
        model=MODEL, prompt="a", max_tokens=3, extra_body=extra, extra_headers={"x-pd-route": route}
    )
    assert r.choices[0].text
    sent = [*s.prefill.bodies, *s.native.bodies]
    assert sent
    for body in sent:
        assert body["vllm_xargs"] == {"keep": 1}
        assert "10.9.9.9" not in json.dumps(body)
    if route == "native":
        assert "kv_transfer_params" not in s.native.bodies[0]


async def test_mooncake_names_the_transfer_on_both_legs(make_stack, bootstrap):
    s = await mooncake_stack(make_stack, bootstrap)
    r = await s.client().completions.create(model=MODEL, prompt="a", max_tokens=3, extra_headers=NATIVE)
    assert r.choices[0].text == "".join(WORDS[:3])
    pkv, dkv = s.prefill.bodies[0]["kv_transfer_params"], s.native.bodies[0]["kv_transfer_params"]
    tid = pkv["transfer_id"]
    assert tid and pkv == {"do_remote_decode": True, "do_remote_prefill": False, "transfer_id": tid}
    assert dkv == {
        "do_remote_decode": False,
        "do_remote_prefill": True,
        "remote_engine_id": "engine-p0",
        "remote_bootstrap_addr": f"http://127.0.0.1:{_port(bootstrap.url)}",
        "transfer_id": tid,
    }
    assert "x-data-parallel-rank" not in s.prefill.headers[0]
    _check_with_vllm(pkv, dkv, "engine-p0", f"http://127.0.0.1:{_port(bootstrap.url)}")


def _check_with_vllm(prefill_kv: dict, decode_kv: dict, engine_id: str, bootstrap_addr: str) -> None:
    """Feed what the router sent through vLLM's MooncakeConnectorScheduler, prefill side and decode
    side, and read back the metadata its workers would act on."""
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.mooncake_connector import (
        MooncakeConnectorScheduler,
    )
    from vllm.v1.request import RequestStatus

    def scheduler(role: str) -> MooncakeConnectorScheduler:
        # __init__ wants a whole VllmConfig and KV-cache config; these methods read only this state.
        sch = MooncakeConnectorScheduler.__new__(MooncakeConnectorScheduler)
        sch.is_kv_producer, sch.is_kv_consumer = role == "kv_producer", role == "kv_consumer"
        sch._reqs_need_recv, sch._reqs_need_send, sch._reqs_not_processed = {}, {}, set()
        sch.kv_cache_config = SimpleNamespace(transfer_group_ids=[0])
        sch._is_hma_required = False
        return sch

    p = scheduler("kv_producer")
    p_req = SimpleNamespace(
        request_id="p-req", kv_transfer_params=dict(prefill_kv), status=RequestStatus.FINISHED_LENGTH_CAPPED
    )
    p.update_state_after_alloc(p_req, SimpleNamespace(), 0)
    assert "p-req" in p._reqs_need_send  # not "Missing transfer_id in kv_transfer_params from router!"
    delay_free, _ = p.request_finished(p_req, ([3, 4],))
    assert delay_free  # the blocks wait for the decode
    sent = p.build_connector_meta(SimpleNamespace())
    assert sent.reqs_to_send["p-req"] == (prefill_kv["transfer_id"], [[3, 4]])

    d = scheduler("kv_consumer")
    blocks = SimpleNamespace(get_unhashed_block_ids_all_groups=lambda: ([8, 9],))
    d_req = SimpleNamespace(request_id="d-req", kv_transfer_params=dict(decode_kv))
    d.update_state_after_alloc(d_req, blocks, 17)
    assert "d-req" in d._reqs_need_recv  # not "Got invalid KVTransferParams"
    pulls = d.build_connector_meta(SimpleNamespace()).reqs_to_recv
    pull = pulls[engine_id]["d-req"]
    assert (pull.transfer_id, pull.remote_bootstrap_addr, pull.local_block_ids) == (
        prefill_kv["transfer_id"],
        bootstrap_addr,
        [[8, 9]],
    )


async def test_mooncake_transfer_ids_are_fresh_per_request(make_stack, bootstrap):
    s = await mooncake_stack(make_stack, bootstrap)
    c = s.client()
    for _ in range(2):
        await c.completions.create(
            model=MODEL,
            prompt="a",
            max_tokens=2,
            extra_headers={**NATIVE, "X-Request-Id": "same-id-from-the-client"},
        )
    ids = [b["kv_transfer_params"]["transfer_id"] for b in s.prefill.bodies]
    assert len(set(ids)) == 2
    assert [b["kv_transfer_params"]["transfer_id"] for b in s.native.bodies] == ids


async def test_mooncake_prefill_that_stopped_kept_nothing_to_pull(make_stack, bootstrap):
    """A prefill that ended on its first token (EOS, stop) frees its blocks: a decode told to pull them
    would wait for a sender that never comes, so it gets no params and computes the prompt itself."""
    s = await mooncake_stack(make_stack, bootstrap)
    s.prefill.finish_reason = "stop"
    await s.client().completions.create(model=MODEL, prompt="a", max_tokens=3, extra_headers=NATIVE)
    assert s.prefill.bodies[0]["kv_transfer_params"]["transfer_id"]
    assert "kv_transfer_params" not in s.native.bodies[0]


async def test_mooncake_pins_the_data_parallel_rank_it_names(make_stack):
    b = await FakeBootstrap({0: "engine-dp0", 1: "engine-dp1"}).start()
    try:
        s = await mooncake_stack(make_stack, b)
        c = s.client()
        for _ in range(8):
            await c.completions.create(model=MODEL, prompt="a", max_tokens=2, extra_headers=NATIVE)
        pairs = {
            (h["x-data-parallel-rank"], body["kv_transfer_params"]["remote_engine_id"])
            for h, body in zip(s.prefill.headers, s.native.bodies, strict=True)
        }
        assert pairs <= {("0", "engine-dp0"), ("1", "engine-dp1")} and pairs
    finally:
        await b.stop()


async def test_mooncake_without_bootstrap_fails_before_the_prefill(make_stack, bootstrap):
    s = await mooncake_stack(make_stack, bootstrap)
    await bootstrap.stop()
    with pytest.raises(openai.APIStatusError) as exc:
        await s.client().completions.create(model=MODEL, prompt="a", max_tokens=2, extra_headers=NATIVE)
    assert exc.value.status_code == 502 and "/query" in str(exc.value)
    assert s.prefill.bodies == []  # no blocks held on a prefill whose engine the decode cannot find


async def test_mooncake_retry_asks_again_under_a_new_transfer(make_stack, bootstrap):
    """A retry on another prefill asks its registry again and names a new transfer."""
    s = await mooncake_stack(make_stack, bootstrap, n_prefill=2)
    s.prefills[0].fail_status = 500
    s.state.pools.prefill[s.prefills[1].url].inflight = 1  # the other one is the least loaded: picked first
    await s.client().completions.create(model=MODEL, prompt="a", max_tokens=2, extra_headers=NATIVE)
    assert bootstrap.queries == 2  # both fakes listen on 127.0.0.1: one registry serves both here
    first, second = (p.bodies[0]["kv_transfer_params"]["transfer_id"] for p in s.prefills)
    assert first != second
    assert s.native.bodies[0]["kv_transfer_params"]["transfer_id"] == second


def test_bootstrap_addr_brackets_ipv6() -> None:
    assert native_path.bootstrap_addr("http://[fd00:10:244::5]:8100", 8998) == "http://[fd00:10:244::5]:8998"
    assert native_path.bootstrap_addr("http://prefill.ns.svc:8100", 9000) == "http://prefill.ns.svc:9000"
