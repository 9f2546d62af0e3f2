"""Attack test: the operator's metrics-only token (the `metrics-token` key of the `<cluster>-node-api`
Secret, credentials.py) opens the router's GET /metrics and nothing else. Every route the router
serves is asked with it and without any credential: the token must get exactly what an anonymous
caller gets, except /metrics. A route added later is covered without editing this test."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from tilert_operator import constants, credentials
from tilert_serve.router.app import make_app
from tilert_serve.router.config import RouterConfig

TOKEN = "metrics-only-token"
KEY = "a-client-key"
BODY = {"model": "m", "prompt": "a", "messages": [{"role": "user", "content": "a"}], "max_tokens": 2}


@pytest.fixture()
async def router(tmp_path: Path) -> Any:
    (tmp_path / "keys").write_text(f"{KEY}\n")
    (tmp_path / "metrics-token").write_text(f"{TOKEN}\n")
    cfg = RouterConfig.model_validate(
        {
            "model": "m",
            # Nothing listens there: a request let through would fail upstream, not answer 401.
            "prefill": ["http://127.0.0.1:9"],
            "native": ["http://127.0.0.1:9"],
            "api_keys_file": str(tmp_path / "keys"),
            "metrics_token_file": str(tmp_path / "metrics-token"),
        }
    )
    app = make_app(cfg, health_checks=False)
    async with TestClient(TestServer(app)) as client:
        yield client, app


async def _ask(client: TestClient, method: str, path: str, token: str | None) -> tuple[int, bytes]:
    headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
    kw: dict[str, Any] = {"json": BODY} if method == "POST" else {}
    async with client.request(method, path, headers=headers, **kw) as resp:
        return resp.status, await resp.read()


async def test_the_metrics_token_opens_metrics_and_nothing_else(router: Any) -> None:
    client, app = router
    routes = sorted({(r.method, r.resource.canonical) for r in app.router.routes() if r.method != "HEAD"})
    assert ("GET", "/metrics") in routes and ("POST", "/v1/chat/completions") in routes
    for method, path in routes:
        with_token = await _ask(client, method, path, TOKEN)
        anonymous = await _ask(client, method, path, None)
        if path == "/metrics":
            assert anonymous[0] == 401
            assert with_token[0] == 200 and b"tilert_router_" in with_token[1]
            continue
        # Exactly what a caller without any credential gets: the token adds nothing.
        assert with_token == anonymous, (method, path, with_token, anonymous)
    # The clients' keys still work, and the token is not one of them.
    assert (await _ask(client, "GET", "/v1/models", KEY))[0] == 200
    assert (await _ask(client, "GET", "/v1/models", TOKEN))[0] == 401
    assert (await _ask(client, "GET", "/metrics", "guess"))[0] == 401


def test_the_node_api_secret_carries_the_token_and_the_operator_reads_it() -> None:
    import base64

    secret = {"data": {constants.METRICS_TOKEN_KEY: base64.b64encode(b"t0k\n").decode()}}
    assert credentials.metrics_token(secret) == "t0k"
    assert credentials.metrics_token({"data": {}}) is None and credentials.metrics_token(None) is None
