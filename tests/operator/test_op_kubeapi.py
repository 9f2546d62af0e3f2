"""The operator's API client keeps working as its credentials change under it: the service-account
token the kubelet rotates (re-read when the file changes, and after a 401), an exec plugin's token
that expires (renewed before it does, and after a 401), and a 401 that re-reading cannot fix (one
attempt, then the error); and its retries: a 429 waits for its Retry-After, a 422 is raised at once
with the Status body. The API server here is a small aiohttp app that accepts one token at a time."""

from __future__ import annotations

import asyncio
import datetime
import json
import os
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from aiohttp import web

from tilert_operator import kubeapi


class TokenServer:
    """Answers list calls for whoever presents the valid token, 401 for anyone else."""

    def __init__(self, valid: Any) -> None:
        self.valid = valid  # () -> the token accepted now
        self.seen: list[tuple[str, int]] = []
        self.url = ""

    async def handle(self, request: web.Request) -> web.Response:
        token = request.headers.get("Authorization", "").split(" ", 1)[-1]
        ok = token == self.valid()
        self.seen.append((token, 200 if ok else 401))
        if not ok:
            return web.json_response({"kind": "Status", "code": 401, "reason": "Unauthorized"}, status=401)
        return web.json_response({"kind": "PodList", "items": []})


@pytest.fixture()
async def token_server() -> AsyncIterator[Any]:
    def make(valid: Any) -> TokenServer:
        ts = TokenServer(valid)
        servers.append(ts)
        return ts

    servers: list[TokenServer] = []
    app = web.Application()

    async def route(request: web.Request) -> web.Response:
        return await servers[-1].handle(request)

    app.router.add_get("/api/v1/namespaces/{ns}/pods", route)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    make.url = f"http://127.0.0.1:{port}"  # type: ignore[attr-defined]
    yield make
    await runner.cleanup()


def rotate(secret_dir: Path, token: str) -> None:
    """As the kubelet updates a projected service-account volume: new directory, atomic ..data swap."""
    stamp = f"..{time.time_ns()}"
    (secret_dir / stamp).mkdir()
    (secret_dir / stamp / "token").write_text(token)
    tmp = secret_dir / "..data_tmp"
    tmp.symlink_to(stamp)
    os.replace(tmp, secret_dir / "..data")
    if not (secret_dir / "token").is_symlink():
        (secret_dir / "token").symlink_to("..data/token")


async def test_in_cluster_token_is_re_read_when_the_kubelet_rotates_it(
    token_server: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kubernetes.config import incluster_config

    sa = tmp_path / "serviceaccount"
    sa.mkdir()
    rotate(sa, "token-1")
    (sa / "ca.crt").write_text("not checked here")
    monkeypatch.setattr(incluster_config, "SERVICE_TOKEN_FILENAME", str(sa / "token"))
    monkeypatch.setattr(incluster_config, "SERVICE_CERT_FILENAME", str(sa / "ca.crt"))
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "127.0.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "6443")
    conn = kubeapi.load_connection()
    assert (conn.token, conn.token_file, conn.server) == (
        "token-1",
        str(sa / "token"),
        "https://127.0.0.1:6443",
    )

    valid = ["token-1"]
    srv = token_server(lambda: valid[0])
    async with kubeapi.Client(
        kubeapi.Connection(server=token_server.url, token=conn.token, token_file=conn.token_file)
    ) as api:
        assert await api.list("Pod", "default", "a=b") == []
        # The kubelet writes a new token and the old one stops working: the next call uses the new one.
        rotate(sa, "token-2")
        valid[0] = "token-2"
        assert await api.list("Pod", "default", "a=b") == []
        assert srv.seen == [("token-1", 200), ("token-2", 200)]
        assert api.reauths["token file"] == 1


async def test_a_401_re_reads_the_token_and_retries_once(token_server: Any, tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_text("fresh")
    srv = token_server(lambda: "fresh")
    # The client holds a token the file no longer has, and the file looks unchanged to it (the same
    # stat as when it started): only the 401 tells it.
    async with kubeapi.Client(
        kubeapi.Connection(server=token_server.url, token="stale", token_file=str(path))
    ) as api:
        assert await api.list("Pod", "default", "a=b") == []
    assert srv.seen == [("stale", 401), ("fresh", 200)]


async def test_a_401_that_re_reading_cannot_fix_fails_at_once(token_server: Any, tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_text("revoked")
    srv = token_server(lambda: "something-else")
    async with kubeapi.Client(
        kubeapi.Connection(server=token_server.url, token="revoked", token_file=str(path))
    ) as api:
        with pytest.raises(kubeapi.ApiError) as e:
            await api.list("Pod", "default", "a=b")
    assert e.value.status == 401
    assert srv.seen == [("revoked", 401)], "no blind retry with the same credentials"


PLUGIN = """
import datetime, json, os, sys
state = sys.argv[1]
s = json.load(open(state)) if os.path.exists(state) else {"n": 0}
s["n"] += 1
s["token"] = f"exec-{s['n']}"
s["expires"] = (datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(seconds=float(sys.argv[2]))).timestamp()
json.dump(s, open(state + ".tmp", "w")); os.replace(state + ".tmp", state)
exp = datetime.datetime.fromtimestamp(s["expires"], datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
print(json.dumps({"apiVersion": "client.authentication.k8s.io/v1", "kind": "ExecCredential",
                  "status": {"token": s["token"], "expirationTimestamp": exp}}))
"""


def exec_kubeconfig(tmp_path: Path, server: str, lifetime_s: float) -> tuple[Path, Path]:
    plugin, state = tmp_path / "plugin.py", tmp_path / "state.json"
    plugin.write_text(PLUGIN)
    cfg = {
        "apiVersion": "v1", "kind": "Config", "current-context": "c",
        "clusters": [{"name": "k", "cluster": {"server": server}}],
        "contexts": [{"name": "c", "context": {"cluster": "k", "user": "u"}}],
        "users": [{"name": "u", "user": {"exec": {
            "apiVersion": "client.authentication.k8s.io/v1", "command": sys.executable,
            "args": [str(plugin), str(state), str(lifetime_s)], "interactiveMode": "Never"}}}],
    }  # fmt: skip
    path = tmp_path / "kubeconfig"
    path.write_text(yaml.safe_dump(cfg))
    return path, state


async def test_exec_plugin_token_is_renewed_before_it_expires(
    token_server: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg, state = exec_kubeconfig(tmp_path, token_server.url, lifetime_s=3.0)
    monkeypatch.setenv("KUBECONFIG", str(cfg))

    def valid() -> str | None:
        s = json.loads(state.read_text())
        return str(s["token"]) if time.time() < s["expires"] else None  # an expired token is refused

    srv = token_server(valid)
    conn = kubeapi.load_connection()
    assert conn.token == "exec-1" and conn.expires_at is not None and conn.expiration() is not None
    assert 2.0 < conn.expires_at - time.time() <= 3.0
    async with kubeapi.Client(conn, refresh=kubeapi.load_connection) as api:
        deadline = time.monotonic() + 8
        while time.monotonic() < deadline:
            assert await api.list("Pod", "default", "a=b") == []
            await asyncio.sleep(0.2)
        renewed = api.reauths["before expiry"]
        assert renewed >= 2, api.reauths
        assert all(code == 200 for _, code in srv.seen), (
            "renewed before expiry: the server never saw an expired token"
        )
        assert json.loads(state.read_text())["n"] == 1 + renewed

        # The server revokes the token early: the 401 runs the plugin again and the call succeeds.
        s = json.loads(state.read_text())
        s["token"] = "revoked-by-server"
        state.write_text(json.dumps(s))
        n_before = len(srv.seen)
        assert await api.list("Pod", "default", "a=b") == []
        assert [code for _, code in srv.seen[n_before:]] == [401, 200]
        assert api.reauths["after 401"] == 1


def test_kopf_login_carries_the_expiry(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """kopf re-runs the login handler when `expiration` passes, so its watches renew the token too."""
    from tilert_operator import wiring

    cfg, _ = exec_kubeconfig(tmp_path, "http://127.0.0.1:1", lifetime_s=600)
    monkeypatch.setenv("KUBECONFIG", str(cfg))
    info = wiring.login()
    assert info.token == "exec-1" and info.expiration is not None
    assert 590 < (info.expiration - datetime.datetime.now(datetime.UTC)).total_seconds() <= 600


async def test_kubeconfig_token_file_is_followed(
    token_server: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A kubeconfig user with `tokenFile` (relative to the kubeconfig) is read like the service account's."""
    (tmp_path / "tok").write_text("file-1")
    cfg = {
        "apiVersion": "v1", "kind": "Config", "current-context": "c",
        "clusters": [{"name": "k", "cluster": {"server": token_server.url}}],
        "contexts": [{"name": "c", "context": {"cluster": "k", "user": "u"}}],
        "users": [{"name": "u", "user": {"tokenFile": "tok"}}],
    }  # fmt: skip
    (tmp_path / "kubeconfig").write_text(yaml.safe_dump(cfg))
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "kubeconfig"))
    conn = kubeapi.load_connection()
    assert (conn.token, conn.token_file) == ("file-1", str(tmp_path / "tok"))
    valid = ["file-1"]
    srv = token_server(lambda: valid[0])
    async with kubeapi.Client(conn, refresh=kubeapi.load_connection) as api:
        assert await api.list("Pod", "default", "a=b") == []
        (tmp_path / "tok").write_text("file-2-longer")
        valid[0] = "file-2-longer"
        assert await api.list("Pod", "default", "a=b") == []
    assert srv.seen == [("file-1", 200), ("file-2-longer", 200)]


async def test_a_failing_exec_plugin_keeps_the_current_token(
    token_server: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The plugin fails while the token is about to expire: calls go on with the current token, the
    plugin is retried a few seconds later, not on every call."""
    cfg, _ = exec_kubeconfig(tmp_path, token_server.url, lifetime_s=1.0)
    monkeypatch.setenv("KUBECONFIG", str(cfg))
    conn = kubeapi.load_connection()
    srv = token_server(lambda: "exec-1")
    attempts = []

    def broken() -> kubeapi.Connection:
        attempts.append(time.monotonic())
        raise RuntimeError("exec: process returned 1")

    async with kubeapi.Client(conn, refresh=broken) as api:
        await asyncio.sleep(1.0)  # within the renewal margin
        for _ in range(5):
            assert await api.list("Pod", "default", "a=b") == []
        assert len(attempts) == 1 and api.reauths["failed"] == 1
    assert [t for t, _ in srv.seen] == ["exec-1"] * 5


async def test_a_429_waits_as_long_as_retry_after_says() -> None:
    """API Priority and Fairness answers 429 with Retry-After: the retry comes no sooner, and a
    Status error that retrying cannot fix is raised with its body (reason and causes) for the
    conditions to quote."""
    seen: list[float] = []

    async def handle(request: web.Request) -> web.Response:
        seen.append(time.monotonic())
        if request.method == "PATCH":
            return web.json_response(
                {"kind": "Status", "code": 422, "reason": "Invalid", "message": "bad",
                 "details": {"causes": [{"field": "spec.replicas", "message": "must be >= 0"}]}},
                status=422,
            )  # fmt: skip
        if len(seen) == 1:
            return web.json_response(
                {"kind": "Status", "code": 429, "reason": "TooManyRequests"},
                status=429,
                headers={"Retry-After": "1"},
            )
        return web.json_response({"kind": "PodList", "metadata": {"resourceVersion": "7"}, "items": []})

    app = web.Application()
    app.router.add_route("*", "/api/v1/namespaces/{ns}/pods", handle)
    app.router.add_route("*", "/api/v1/namespaces/{ns}/pods/{name}", handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        conn = kubeapi.Connection(server=f"http://127.0.0.1:{port}")
        async with kubeapi.Client(conn, retry=kubeapi.Retry(first_delay=0.01)) as api:
            items, rv = await api.list_versioned("Pod", "ns", "a=b")
            assert (items, rv) == ([], "7")
            assert len(seen) == 2 and seen[1] - seen[0] >= 1.0, "retried before Retry-After"
            assert api.calls["list"] == 2
            with pytest.raises(kubeapi.ApiError) as e:
                await api.apply({"kind": "Pod", "metadata": {"name": "p", "namespace": "ns"}})
            assert e.value.status == 422 and len(seen) == 3, "a 422 is not retried"
            assert (
                e.value.body is not None and e.value.body["details"]["causes"][0]["field"] == "spec.replicas"
            )
    finally:
        await runner.cleanup()


def test_retry_after_parsing() -> None:
    assert kubeapi.retry_after("3") == 3.0
    assert kubeapi.retry_after(None) is None
    assert kubeapi.retry_after("Wed, 21 Oct 2026 07:28:00 GMT") is None  # a date: the backoff applies
