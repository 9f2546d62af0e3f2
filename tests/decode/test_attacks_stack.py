"""The data-plane attacker against the serving path as a client meets it: the real router in front of
a real decode node (its HTTP API, control port and Mooncake TCP receive buffers) and a prefill
stand-in whose sender behaves as the TileRTConnector's (a private copy hashed, a registered staging
region written; vLLM itself boots in minutes on 2 cores, and tests/e2e runs it). An attacker with
its own Mooncake engine and no secret, token or API key keeps writing junk into the node's receive
region and the prefill's registered staging while requests flow, for every layout dtype, layer-wise
and whole-state. Every request that comes back 200 must have decoded exactly the state the prefill
hashed; the others are refused with a clean error, and the router serves them from the native pool or answers a clean error; the node serves the next
request.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import openai
import pytest
import torch
from aiohttp import web

from tests.decode import synthetic
from tests.decode.attacker import Scribbler
from tests.decode.conftest import SECRET, RunningNode, running_node
from tests.decode.sender_proc import OneByOne
from tests.decode.test_layerwise import whole_state
from tests.router.router_fakes import MODEL, FakeNative, FakePrefill, stack_config
from tilert_serve import transfer
from tilert_serve.handoff.sender import HandoffRequest, Sender
from tilert_serve.layouts import Placement
from tilert_serve.router import config
from tilert_serve.router.app import bound_port, make_app, start

NUM_TOKENS = 70
SEED = 4
REQUESTS = 6


class StandinPrefill(FakePrefill):
    """The prefill's side of a TileRT request: answers the router's prefill leg at once and hands the
    seeded synthetic state to the node in the background, as vLLM's connector does."""

    def __init__(self, case: str, layerwise: bool) -> None:
        super().__init__([self])  # FakePrefill tells its "nodes" of each handoff: here, itself
        self.layout = synthetic.layout_for(case)
        self.layerwise = layerwise
        self.prompt_tokens = NUM_TOKENS
        self.staging = Placement(self.layout, max_tokens=NUM_TOKENS)
        self.private = torch.zeros(self.staging.total_nbytes(), dtype=torch.uint8)
        synthetic.fill(self.staging, [self.private], NUM_TOKENS, SEED)
        self.registered = torch.zeros_like(self.private)
        self.engine = transfer.create("mooncake", host="127.0.0.1", protocol="tcp", role="standin-prefill")
        self.engine.register(self.registered.data_ptr(), self.registered.numel())
        self.sender = Sender(
            name="standin",
            secret=SECRET,
            engine=self.engine,
            staging=self.staging,
            staging_buffers=[self.private],
            staging_addrs=[self.registered.data_ptr()],
            timeout_s=20,
        )
        self._kvp: dict[str, Any] = {}
        self.sent: list[bool] = []

    async def complete(self, request: web.Request) -> web.Response:
        self._kvp = (await request.json()).get("kv_transfer_params") or {}
        return await super().complete(request)

    def handoff(self, ticket: str, num_tokens: int = 0) -> bool:
        host, port = self._kvp["tilert_host"], int(self._kvp["tilert_ctrl_port"])
        asyncio.get_running_loop().run_in_executor(None, self._send, host, port, ticket)
        return True

    def _send(self, host: str, port: int, ticket: str) -> None:
        self.registered.copy_(self.private)  # what the gather would publish for this request
        req = HandoffRequest(
            request_id=f"r{len(self.sent)}",
            num_tokens=NUM_TOKENS,
            last_prompt_token=11,
            ticket=ticket,
            prompt_token_ids=list(range(NUM_TOKENS)),
        )
        layers = OneByOne(self.layout.num_layers) if self.layerwise else None
        self.sent.append(self.sender.send(host, port, req, layers=layers).ok)


def _same(n: RunningNode, case: str) -> bool:
    got = n.engine.started[-1]
    want = whole_state(case, NUM_TOKENS, SEED)
    return all(
        torch.equal(a, b)
        for layer, ref in zip(got.layers, want, strict=True)
        for a, b in zip(
            (layer.kv, layer.pe) + ((layer.ki,) if layer.ki is not None else ()), ref, strict=True
        )
    )


@pytest.fixture
def secret_file(tmp_path):
    path = tmp_path / "secret"
    path.write_bytes(SECRET)
    return path


@pytest.fixture
def standins() -> Iterator[list[StandinPrefill]]:
    made: list[StandinPrefill] = []
    yield made
    for p in made:
        p.engine.close()


@pytest.mark.parametrize("layerwise", [False, True], ids=["whole", "layerwise"])
@pytest.mark.parametrize("case", list(synthetic.LAYOUT_CASES))
async def test_no_tampered_state_is_decoded_through_the_router(
    case, layerwise, secret_file, standins, capsys
):
    shards = 2 if case.startswith("glm5") else 1
    async with running_node(
        synthetic.layout_for(case), secret_file, slots=1, max_seq_len=128, shards=shards
    ) as n:
        prefill = StandinPrefill(case, layerwise)
        standins.append(prefill)
        await prefill.start()
        native = await FakeNative().start()
        # Every request tries the node (a refused handoff would otherwise send the next ones straight
        # to native for a while): this test is about what the node decodes.
        cfg = config.RouterConfig.model_validate(
            stack_config(
                [prefill.url],
                [native.url],
                [("t0", n.url, 1)],
                max_seq_len=128,
                breaker={"failures_to_open": 1000},
            )
        )
        runner = await start(make_app(cfg, health_checks=False), "127.0.0.1", 0)
        client = openai.AsyncOpenAI(
            base_url=f"http://127.0.0.1:{bound_port(runner)}/v1", api_key="none", max_retries=0, timeout=60
        )
        targets = [(n.node.transfer.peer_info(), r.addr, r.nbytes) for r in n.node.buffers.regions(0)]
        targets.append(
            (prefill.engine.peer_info(), prefill.registered.data_ptr(), prefill.registered.numel())
        )
        ok = fell_back = refused = tampered = 0
        try:
            with Scribbler(targets) as attacker:
                for _ in range(REQUESTS):
                    started = len(n.engine.started)
                    try:
                        await client.completions.create(
                            model=MODEL, prompt="hi", max_tokens=2, extra_headers={"x-pd-route": "tilert"}
                        )
                    except openai.APIStatusError as exc:
                        assert exc.status_code in (502, 503, 504), exc  # a clean refusal, not a crash
                        refused += 1
                        continue
                    if len(n.engine.started) == started:  # the node refused it; the router went native
                        fell_back += 1
                        continue
                    ok += 1
                    tampered += not _same(n, case)
                writes = attacker.writes
            # The attack is over: the node serves again, the state it decodes is the prefill's.
            await client.completions.create(
                model=MODEL, prompt="hi", max_tokens=2, extra_headers={"x-pd-route": "tilert"}
            )
            assert _same(n, case)
        finally:
            await client.close()
            await runner.cleanup()
            await prefill.stop()
            await native.stop()
        with capsys.disabled():
            print(
                f"\n  {case} {'layer-wise' if layerwise else 'whole'}: {REQUESTS} requests under "
                f"{writes} attacker writes: {ok} decoded by the node (200), {fell_back} refused by the node and "
                f"served by native, {refused} refused, {tampered} tampered"
            )
        assert tampered == 0
        assert writes > 0
        assert n.node.slots.free == 1
