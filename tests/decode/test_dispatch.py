"""Gated dispatch: exact admission, deadlines, dead senders, cancel, stop rules, HTTP errors."""

from __future__ import annotations

import asyncio
import json

import pytest

from tests.decode import synthetic
from tests.decode.conftest import running_node
from tilert_serve.decode.slots import SlotState

CASE = "mla-f32"
LAYOUT = synthetic.layout_for(CASE)


async def test_concurrent_admissions_get_exactly_the_free_slots(secret_file):
    async with running_node(LAYOUT, secret_file, slots=3) as n:
        answers = await asyncio.gather(*(n.admit(f"r{i}") for i in range(40)))
        granted = [body for status, body in answers if status == 200]
        refused = [body for status, body in answers if status == 429]
        assert len(granted) == 3 and len(refused) == 37
        assert sorted(b["slot"] for b in granted) == [0, 1, 2]
        assert len({b["ticket"] for b in granted}) == 3
        assert refused[0]["error"]["type"] == "node_full"
        async with n.session.post(f"{n.url}/v1/cancel", json={"ticket": granted[0]["ticket"]}) as r:
            assert (await r.json()) == {"cancelled": True}
        status, body = await n.admit("late")
        assert status == 200 and body["slot"] == granted[0]["slot"]
        async with n.session.get(f"{n.url}/metrics") as r:
            text = await r.text()
        assert 'tilert_decode_admissions_total{outcome="full"} 37.0' in text
        assert "tilert_decode_slots_busy 3.0" in text


async def test_unused_ticket_frees_its_slot_at_the_deadline(secret_file):
    async with running_node(LAYOUT, secret_file, slots=1, ticket_ttl_s=0.3) as n:
        status, first = await n.admit("a")
        assert status == 200
        assert (await n.admit("b"))[0] == 429
        await asyncio.sleep(0.6)
        status, _ = await n.admit("b")
        assert status == 200
        # The expired ticket is dead for good.
        status, events = await n.generate(first["ticket"])
        assert status == 404 and events[0]["error"]["type"] == "unknown_ticket"


async def test_generate_without_state_times_out_and_frees_the_slot(secret_file):
    async with running_node(LAYOUT, secret_file, slots=1, ticket_ttl_s=0.4) as n:
        _, adm = await n.admit("a")
        status, events = await n.generate(adm["ticket"])
        assert status == 504 and events[0]["error"]["type"] == "handoff_timeout"
        assert n.node.slots.free == 1


async def test_sender_killed_mid_handoff_quarantines_then_frees_the_slot(secret_file):
    """Attack: reuse a slot while the vanished sender's one-sided write may still land. The slot is
    quarantined (not admitted to anyone) for quarantine_s, then scrubbed and reused."""
    async with running_node(
        LAYOUT, secret_file, slots=1, ticket_ttl_s=10, handoff_timeout_s=0.5, quarantine_s=1.0
    ) as n:
        _, adm = await n.admit("doomed")
        line = await n.send(CASE, 20, 1, "mooncake", adm["ticket"], "--die-after-accept", request_id="doomed")
        assert line == "ACCEPTED Accept"
        n.node.buffers.views(0)[0][:64] = 7  # what a late write would leave behind
        # The router's generate call learns why, with the reason; the slot is held back meanwhile.
        status, events = await n.generate(adm["ticket"])
        assert status == 502 and "disconnected" in events[0]["error"]["message"]
        assert n.node.slots.slots[0].state is SlotState.QUARANTINED
        status, body = await n.admit("too-soon")
        assert status == 429, body
        for _ in range(40):
            await asyncio.sleep(0.1)
            if n.node.slots.free == 1:
                break
        assert n.node.slots.free == 1
        assert not n.node.buffers.views(0)[0].any()  # scrubbed before reuse
        _, adm2 = await n.admit("next")
        result = json.loads((await n.send(CASE, 20, 2, "mooncake", adm2["ticket"]))[7:])
        assert result["ok"], result
        status, events = await n.generate(adm2["ticket"], max_tokens=2)
        assert status == 200 and events[-1]["finish_reason"] == "length"


async def test_unticketed_sender_takes_a_free_slot_or_is_told_busy(secret_file):
    async with running_node(LAYOUT, secret_file, slots=1) as n:
        result = json.loads((await n.send(CASE, 20, 1, "mooncake", None))[7:])
        assert result["ok"], result
        busy = json.loads((await n.send(CASE, 20, 1, "mooncake", None, request_id="second"))[7:])
        assert (busy["ok"], busy["reason"]) == (False, "busy")


@pytest.mark.parametrize(
    ("case", "tokens", "reason"), [("mla-bf16", 20, "layout_mismatch"), (CASE, 65, "too_long")]
)
async def test_a_refused_request_fails_its_ticket_at_once(secret_file, case, tokens, reason):
    # A prefill whose state this node can never take (another layout, more tokens than it holds): the
    # generate call hears why at once, not when the ticket expires.
    async with running_node(LAYOUT, secret_file, slots=1, max_seq_len=64, ticket_ttl_s=300) as n:
        _, adm = await n.admit("doomed")
        r = json.loads((await n.send(case, tokens, 1, "mooncake", adm["ticket"], request_id="doomed"))[7:])
        assert (r["ok"], r["reason"]) == (False, reason)
        status, events = await asyncio.wait_for(n.generate(adm["ticket"]), 30)
        assert status == 502 and reason in events[0]["error"]["message"]
        assert n.node.slots.free == 1


async def test_refusals_name_the_reason(secret_file, tmp_path):
    async with running_node(LAYOUT, secret_file, slots=1, max_seq_len=64) as n:
        wrong = tmp_path / "wrong"
        wrong.write_text("not-the-secret-0123456789")
        r = json.loads((await n.send(CASE, 20, 1, "mooncake", None, secret_file=wrong))[7:])
        assert (r["ok"], r["reason"]) == (False, "not_authenticated")
        r = json.loads((await n.send(CASE, 20, 1, "mooncake", "no-such-ticket"))[7:])
        assert (r["ok"], r["reason"]) == (False, "unknown_ticket")
        r = json.loads((await n.send(CASE, 65, 1, "mooncake", None))[7:])
        assert (r["ok"], r["reason"]) == (False, "too_long") and "max_seq_len 64" in r["message"]
        r = json.loads((await n.send("mla-bf16", 20, 1, "mooncake", None))[7:])
        assert (r["ok"], r["reason"]) == (False, "layout_mismatch")
        assert n.node.slots.free == 1
        r = json.loads((await n.send(CASE, 20, 1, "mooncake", None))[7:])
        assert r["ok"], r


async def test_cancel_stops_a_running_decode(secret_file):
    async with running_node(LAYOUT, secret_file, slots=1) as n:
        n.engine.step_delay_s = 0.05
        _, adm = await n.admit("long")
        assert json.loads((await n.send(CASE, 20, 1, "mooncake", adm["ticket"], request_id="long"))[7:])["ok"]
        task = asyncio.create_task(n.generate(adm["ticket"], max_tokens=10_000))
        while n.node.slots.slots[0].state is not SlotState.DECODING:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)
        async with n.session.post(f"{n.url}/v1/cancel", json={"ticket": adm["ticket"]}) as r:
            assert (await r.json()) == {"cancelled": True}
        status, events = await asyncio.wait_for(task, 5)
        # Cancelled is no OpenAI finish reason: the stream ends with an error event instead.
        assert status == 200 and events[-1]["error"]["type"] == "cancelled"
        assert 0 < sum(len(e.get("token_ids", [])) for e in events) < 10_000
        assert n.node.slots.free == 1


@pytest.mark.parametrize(
    ("extra", "eos", "tokens", "reason"),
    [
        ({"max_tokens": 5}, frozenset(), [101, 102, 103, 104, 105], "length"),
        ({"max_tokens": 50, "stop_token_ids": [104]}, frozenset(), [101, 102, 103, 104], "stop"),
        ({"max_tokens": 50}, frozenset({103}), [101, 102, 103], "stop"),
        ({"max_tokens": 6, "ignore_eos": True}, frozenset({103}), [101, 102, 103, 104, 105, 106], "length"),
        ({"max_tokens": 0}, frozenset(), [], "length"),
    ],
)
async def test_stop_rules(secret_file, extra, eos, tokens, reason):
    async with running_node(LAYOUT, secret_file, slots=1, eos=eos) as n:
        _, adm = await n.admit("s")
        assert json.loads((await n.send(CASE, 20, 1, "mooncake", adm["ticket"], request_id="s"))[7:])["ok"]
        status, events = await n.generate(adm["ticket"], first_token=100, **extra)
        assert status == 200
        assert [t for e in events[:-1] for t in e["token_ids"]] == tokens
        assert events[-1]["finish_reason"] == reason and events[-1]["num_tokens"] == len(tokens)
        timings = events[-1]["timings"]
        assert set(timings) >= {
            "wire_wait_ms",
            "convert_ms",
            "inject_ms",
            "decode_ms",
            "tpot_ms",
            "mtp_acceptance",
        }


@pytest.mark.parametrize(
    ("path", "body", "status", "kind"),
    [
        ("/v1/admit", b"{not json", 400, "invalid_json"),
        ("/v1/admit", b'{"request_id": 5}', 400, "invalid_request"),
        ("/v1/admit", b'{"request_id": "x", "prompt_tokens": 250, "max_tokens": 10}', 400, "too_long"),
        ("/v1/generate", b'{"ticket": "t", "first_token": -1, "max_tokens": 1}', 400, "invalid_request"),
        (
            "/v1/generate",
            b'{"ticket": "t", "first_token": 1, "max_tokens": 1, "colour": 1}',
            400,
            "invalid_request",
        ),
        ("/v1/generate", b'{"ticket": "t", "first_token": 1, "max_tokens": 1}', 404, "unknown_ticket"),
        ("/v1/cancel", b"{}", 400, "invalid_request"),
    ],
)
async def test_bad_http_requests_get_clear_errors(secret_file, path, body, status, kind):
    async with running_node(LAYOUT, secret_file, slots=1) as n:
        async with n.session.post(n.url + path, data=body) as r:
            assert r.status == status
            assert (await r.json())["error"]["type"] == kind
        assert (await n.admit("still-serving"))[0] == 200


async def test_health_ready_status(secret_file):
    async with running_node(LAYOUT, secret_file, slots=2) as n:
        for path in ("/health", "/ready"):
            async with n.session.get(n.url + path) as r:
                assert r.status == 200
        async with n.session.get(n.url + "/v1/status") as r:
            status = await r.json()
        assert status["layout"]["fingerprint"] == LAYOUT.fingerprint
        assert [s["state"] for s in status["slots"]] == ["free", "free"]


async def test_max_tokens_past_the_nodes_capacity_ends_as_length(secret_file):
    async with running_node(LAYOUT, secret_file, slots=1, max_seq_len=32) as n:
        _, adm = await n.admit("cap")
        assert json.loads((await n.send(CASE, 20, 1, "mooncake", adm["ticket"], request_id="cap"))[7:])["ok"]
        status, events = await n.generate(adm["ticket"], first_token=100, max_tokens=1000)
        assert status == 200
        # 20 prompt tokens + the first token + 11 more fill the 32 positions.
        assert events[-1]["finish_reason"] == "length" and events[-1]["num_tokens"] == 11
