"""Compatibility generations at the node (tilert_serve/compat.py): the node advertises its fingerprint
in /v1/status and /ready, and takes a handoff only from a sender that names the same one. A sender of
another generation, or of an older release that names none, is refused with compat_mismatch before
anything is written, its ticket fails at once with that reason, and nothing is injected."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from pathlib import Path

import pytest

from tests.decode import handshake, synthetic
from tests.decode.conftest import SECRET, running_node
from tilert_serve.compat import Compat
from tilert_serve.handoff import framing, messages
from tilert_serve.handoff.errors import MessageError

CASE = "mla-f32"
LAYOUT = synthetic.layout_for(CASE)
MINE = Compat("tiny", "rev-1", LAYOUT.fingerprint)
OTHER = Compat("tiny", "rev-2", LAYOUT.fingerprint)


async def _status(n) -> dict:  # type: ignore[no-untyped-def]
    async with n.session.get(f"{n.url}/v1/status") as r:
        assert r.status == 200
        return await r.json()  # type: ignore[no-any-return]


async def test_the_node_advertises_its_generation(secret_file: Path) -> None:
    async with running_node(LAYOUT, secret_file, model_name="tiny", model_revision="rev-1") as n:
        status = await _status(n)
        assert status["compat"] == MINE.fingerprint != OTHER.fingerprint
        assert status["model"] == {"name": "tiny", "revision": "rev-1"}
        async with n.session.get(f"{n.url}/ready") as r:
            assert r.status == 200 and (await r.json())["compat"] == MINE.fingerprint


async def test_a_sender_of_another_generation_is_refused_and_nothing_is_injected(secret_file: Path) -> None:
    async with running_node(LAYOUT, secret_file, model_name="tiny", model_revision="rev-1") as n:
        _, adm = await n.admit("other-gen")
        line = await n.send(
            CASE, 20, 1, "mooncake", adm["ticket"], f"--compat={OTHER.fingerprint}", request_id="other-gen"
        )
        result = json.loads(line[7:])
        assert (result["ok"], result["reason"]) == (False, "compat_mismatch"), result
        # The message names both generations and what to check.
        for word in (OTHER.fingerprint, MINE.fingerprint, "model_revision", "--model-revision"):
            assert word in result["message"], result["message"]
        assert result["nbytes"] == 0
        # The ticket failed at once with the reason (not when it expires), and nothing was injected.
        status, events = await asyncio.wait_for(n.generate(adm["ticket"]), 10)
        assert status == 502 and "compat_mismatch" in events[0]["error"]["message"], events
        assert n.engine.started == []
        h = (await _status(n))["handoff"]
        assert h["last_failure"]["reason"] == "compat_mismatch", h
        assert b'tilert_decode_ctrl_errors_total{reason="compat_mismatch"} 1.0' in n.node.metrics.render()

        # The same node takes a sender of its own generation.
        _, adm = await n.admit("same-gen")
        line = await n.send(
            CASE, 20, 1, "mooncake", adm["ticket"], f"--compat={MINE.fingerprint}", request_id="same-gen"
        )
        assert json.loads(line[7:])["ok"], line
        status, events = await n.generate(adm["ticket"])
        assert status == 200 and events[-1]["done"], events
        assert len(n.engine.started) == 1


def _old_release_request(port: int, ticket: str) -> messages.Message:
    """What a sender of the release before generations sends: a Request without `compat`."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    with contextlib.closing(sock):
        chan = framing.SyncChannel(sock)
        hello = handshake.hello(chan, SECRET, "old")
        assert hello.compat == synthetic.unnamed_compat(LAYOUT.fingerprint)
        chan.send(
            messages.Request(
                request_id="old",
                ticket=ticket,
                num_tokens=20,
                last_prompt_token=1,
                layout_fingerprint=LAYOUT.fingerprint,
            )
        )
        return chan.recv()


async def test_a_sender_of_an_older_release_is_told_to_run_the_same_release(secret_file: Path) -> None:
    async with running_node(LAYOUT, secret_file) as n:
        _, adm = await n.admit("old")
        answer = await asyncio.to_thread(_old_release_request, n.ctrl_port, adm["ticket"])
        assert isinstance(answer, messages.Reject), answer
        assert answer.reason == "compat_mismatch"
        assert "older tilert-pd release" in answer.message and "same release" in answer.message
        status, events = await asyncio.wait_for(n.generate(adm["ticket"]), 10)
        assert status == 502 and "compat_mismatch" in events[0]["error"]["message"], events
        assert n.engine.started == []


def test_a_compat_field_that_is_not_a_fingerprint_is_a_bad_message() -> None:
    """The node names the sender's fingerprint in its own refusal: only hex is taken."""
    body = {"request_id": "r", "num_tokens": 1, "last_prompt_token": 0, "layout_fingerprint": "x"}
    with pytest.raises(MessageError, match="compat"):
        messages.from_body(messages.Request.KIND, {**body, "compat": "<script>alert(1)</script>"})
    assert (
        messages.from_body(messages.Request.KIND, {**body, "compat": "0123456789ab"}).compat == "0123456789ab"
    )  # type: ignore[attr-defined]
