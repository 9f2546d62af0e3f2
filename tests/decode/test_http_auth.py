"""The decode node's HTTP API behind its bearer token: anonymous callers take no slot, see no
request id and cancel nothing; only the ticket cancels, and a cancelled stream ends as an error; the
token file rotates; aiohttp's own refusals (413, 404, 405) have the JSON error shape."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest

from tests.decode import synthetic
from tests.decode.conftest import SECRET, SENDER_ENV, RecordingEngine, RunningNode, node_transfer, serve_node
from tilert_serve.bearer import TokenFile
from tilert_serve.decode import api_auth
from tilert_serve.decode.cli import api_token_file
from tilert_serve.decode.http import make_app
from tilert_serve.decode.node import DecodeNode, NodeConfig
from tilert_serve.decode.slots import SlotState

CASE = "mla-f32"
LAYOUT = synthetic.layout_for(CASE)
TOKEN = "node-api-token-0123456789abcdef"
OLD_TOKEN = "node-api-token-old-fedcba987654"


@contextlib.asynccontextmanager
async def node_with_token(
    secret_file: Path,
    token_file: Path | None,
    *,
    slots: int = 1,
    check_interval_s: float = 0.2,
    token: str = TOKEN,
) -> AsyncIterator[RunningNode]:
    """A node (recording engine, Mooncake over loopback) whose API takes `token_file`'s tokens; the
    returned RunningNode's session sends `token` (its admit/generate helpers are the router's calls)."""
    for key in ("UCX_TLS", "UCX_NET_DEVICES", "UCX_MODULES"):
        os.environ.setdefault(key, SENDER_ENV[key])
    engine = RecordingEngine(LAYOUT, 256, slots)
    config = NodeConfig(
        name="node-0",
        max_seq_len=256,
        slots=slots,
        host="127.0.0.1",
        ctrl_port=0,
        http_port=0,
        shards=1,
        devices=("cpu",),
        ticket_ttl_s=30.0,
        handoff_timeout_s=30.0,
    )
    mover = node_transfer()
    node = DecodeNode(config, layout=LAYOUT, engine=engine, transfer=mover, secret=SECRET)
    tokens = TokenFile(token_file, check_interval_s=check_interval_s) if token_file is not None else None
    runner, url = await serve_node(make_app(node, tokens), node)
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {token}"}) as session:
        try:
            yield RunningNode(node, engine, url, secret_file, session)
        finally:
            await runner.cleanup()


@pytest.fixture
def token_file(tmp_path: Path) -> Path:
    path = tmp_path / "token"
    path.write_text(TOKEN + "\n")
    return path


async def _call(
    method: str, url: str, body: object = None, token: str | None = None, data: bytes | None = None
) -> tuple[int, dict[str, str], bytes]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with (
        aiohttp.ClientSession() as s,
        s.request(method, url, json=body if data is None else None, data=data, headers=headers) as r,
    ):
        return r.status, dict(r.headers), await r.read()


def _assert_401(status: int, headers: dict[str, str], raw: bytes) -> None:
    assert status == 401
    assert headers["WWW-Authenticate"].startswith('Bearer realm="tilert-decode-node"')
    err = json.loads(raw)["error"]
    assert err["type"] == "unauthorized" and err["message"]


async def test_two_anonymous_admits_take_no_slot(secret_file, token_file):
    async with node_with_token(secret_file, token_file, slots=2) as n:
        for i in range(2):
            _assert_401(*await _call("POST", n.url + "/v1/admit", {"request_id": f"anon-{i}"}))
        # A wrong token is refused the same way, and says the token was not valid.
        status, headers, raw = await _call("POST", n.url + "/v1/admit", {"request_id": "x"}, token="guess")
        _assert_401(status, headers, raw)
        assert 'error="invalid_token"' in headers["WWW-Authenticate"]
        assert n.node.slots.free == 2
        status, body = await n.admit("router-1")
        assert status == 200 and isinstance(body["ticket"], str)


async def test_anonymous_status_cancel_and_generate_are_refused_and_nothing_leaks(secret_file, token_file):
    async with node_with_token(secret_file, token_file) as n:
        status, adm = await n.admit("secret-request-id-42")
        assert status == 200
        for method, path, body in [
            ("GET", "/v1/status", None),
            ("POST", "/v1/cancel", {"ticket": adm["ticket"]}),
            ("POST", "/v1/cancel", {"request_id": "secret-request-id-42"}),
            ("POST", "/v1/generate", {"ticket": adm["ticket"], "first_token": 1, "max_tokens": 1}),
            ("POST", "/v1/anything", {}),
            ("DELETE", "/v1/admit", None),
        ]:
            status, headers, raw = await _call(method, n.url + path, body)
            _assert_401(status, headers, raw)
            assert b"secret-request-id-42" not in raw and adm["ticket"].encode() not in raw
        assert n.node.slots.slots[0].state is SlotState.RESERVED  # still the router's
        for path in ("/health", "/ready", "/metrics"):
            status, _, raw = await _call("GET", n.url + path)
            assert status == 200
            assert b"secret-request-id-42" not in raw and adm["ticket"].encode() not in raw
            assert b"127.0.0.1" not in raw
        # The router (with the token) sees the request id.
        async with n.session.get(n.url + "/v1/status") as r:
            assert r.status == 200
            assert (await r.json())["slots"][0]["request_id"] == "secret-request-id-42"


async def test_a_node_without_token_lists_no_request_ids(secret_file):
    async with node_with_token(secret_file, None) as n:
        status, _ = await n.admit("visible?")
        assert status == 200
        status, _, raw = await _call("GET", n.url + "/v1/status")
        assert status == 200
        slots = json.loads(raw)["slots"]
        assert slots[0]["state"] == "reserved" and "request_id" not in slots[0]


async def test_cancel_takes_only_the_ticket(secret_file, token_file):
    async with node_with_token(secret_file, token_file) as n:
        _, adm = await n.admit("victim")
        async with n.session.post(n.url + "/v1/cancel", json={"request_id": "victim"}) as r:
            assert r.status == 400
            err = (await r.json())["error"]
            assert err["type"] == "invalid_request" and "ticket" in err["message"]
        async with n.session.post(n.url + "/v1/cancel", json={"ticket": "not-" + adm["ticket"]}) as r:
            assert (await r.json()) == {"cancelled": False}
        assert n.node.slots.free == 0
        async with n.session.post(n.url + "/v1/cancel", json={"ticket": adm["ticket"]}) as r:
            assert (await r.json()) == {"cancelled": True}
        assert n.node.slots.free == 1


async def test_another_clients_stream_cannot_be_cancelled_and_a_cancelled_stream_ends_as_an_error(
    secret_file, token_file
):
    async with node_with_token(secret_file, token_file) as n:
        n.engine.step_delay_s = 0.05
        _, adm = await n.admit("long")
        assert json.loads((await n.send(CASE, 20, 1, "mooncake", adm["ticket"], request_id="long"))[7:])["ok"]
        task = asyncio.create_task(n.generate(adm["ticket"], max_tokens=10_000))
        while n.node.slots.slots[0].state is not SlotState.DECODING:
            await asyncio.sleep(0.01)
        # Anonymous, then by request id with the token: neither stops the stream.
        _assert_401(*await _call("POST", n.url + "/v1/cancel", {"request_id": "long"}))
        _assert_401(*await _call("POST", n.url + "/v1/cancel", {"ticket": adm["ticket"]}))
        async with n.session.post(n.url + "/v1/cancel", json={"request_id": "long"}) as r:
            assert r.status == 400
        await asyncio.sleep(0.2)
        assert not task.done() and n.node.slots.slots[0].state is SlotState.DECODING
        # Its owner cancels by ticket: the stream ends with an error event, never a "cancelled" finish.
        async with n.session.post(n.url + "/v1/cancel", json={"ticket": adm["ticket"]}) as r:
            assert (await r.json()) == {"cancelled": True}
        status, events = await asyncio.wait_for(task, 5)
        assert status == 200
        assert events[-1] == {
            "error": {"type": "cancelled", "message": "the request was cancelled by its ticket"}
        }
        assert not any(e.get("finish_reason") == "cancelled" for e in events)
        assert n.node.slots.free == 1


async def test_rotation_accepts_every_listed_token_and_a_removed_one_stops_working(secret_file, tmp_path):
    path = tmp_path / "token"
    path.write_text(f"{TOKEN}\n{OLD_TOKEN}\n")
    async with node_with_token(secret_file, path) as n:
        for token in (TOKEN, OLD_TOKEN):
            status, _, _ = await _call("GET", n.url + "/v1/status", token=token)
            assert status == 200
        # Remove the old token as a Secret update does: a new file swapped in.
        new = tmp_path / "token.new"
        new.write_text(TOKEN + "\n")
        os.replace(new, path)
        for _ in range(100):
            status, _, _ = await _call("GET", n.url + "/v1/status", token=OLD_TOKEN)
            if status == 401:
                break
            await asyncio.sleep(0.05)
        assert status == 401
        assert (await _call("GET", n.url + "/v1/status", token=TOKEN))[0] == 200


async def test_aiohttps_own_refusals_have_the_json_error_shape(secret_file, token_file):
    async with node_with_token(secret_file, token_file) as n:
        status, _, raw = await _call(
            "POST", n.url + "/v1/admit", data=b'{"request_id": "' + b"x" * (2 << 20) + b'"}', token=TOKEN
        )
        assert status == 413 and json.loads(raw)["error"]["type"] == "request_too_large"
        status, _, raw = await _call("GET", n.url + "/nowhere")
        assert status == 404 and json.loads(raw)["error"]["type"] == "not_found"
        status, headers, raw = await _call("GET", n.url + "/v1/admit", token=TOKEN)
        assert status == 405 and json.loads(raw)["error"]["type"] == "method_not_allowed"
        assert headers["Allow"] == "POST"
        # Input that broke the JSON parser's own limits is a 400, not a 500.
        for data in (
            b"[" * 100_000 + b"]" * 100_000,
            b'{"request_id": "a", "max_tokens": ' + b"9" * 5000 + b"}",
            b'{"request_id": "a", "max_tokens": NaN}',
            b"\xff\xfe",
        ):
            status, _, raw = await _call("POST", n.url + "/v1/admit", data=data, token=TOKEN)
            assert status == 400, (data[:40], raw)
            assert json.loads(raw)["error"]["type"] in ("invalid_json", "invalid_request")
        assert (await n.admit("still-serving"))[0] == 200


def test_the_flag_and_the_default_path(tmp_path, monkeypatch, caplog):
    path = tmp_path / "token"
    path.write_text(TOKEN)
    tf = api_token_file(str(path))
    assert tf is not None and tf.accepts(TOKEN) and not tf.accepts(TOKEN + "x")
    assert api_token_file("") is None  # explicitly open
    with pytest.raises(Exception, match="cannot read the token file"):
        api_token_file(str(tmp_path / "missing"))
    # No flag: the mounted default when it exists, else open (with the warning make_app logs).
    monkeypatch.setattr("tilert_serve.decode.cli.defaults.NODE_API_TOKEN_PATH", str(path))
    assert api_token_file(None) is not None
    monkeypatch.setattr("tilert_serve.decode.cli.defaults.NODE_API_TOKEN_PATH", str(tmp_path / "absent"))
    assert api_token_file(None) is None
    with caplog.at_level("WARNING"):
        api_auth.middlewares(None)
    assert "has no token" in caplog.text
