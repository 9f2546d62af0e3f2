"""Who may use the decode node's HTTP API, and the shape of every error it answers.

`/v1/admit`, `/v1/generate`, `/v1/cancel` and `/v1/status` take the cluster's node-API bearer token
(`Authorization: Bearer <token>`; the Secret `<cluster>-node-api`, mounted on the TileRT pods and the
router pods, one token a line so it rotates: any line is accepted, see tilert_serve.bearer). Anything
else under `/v1/` without a valid token is a 401 with `WWW-Authenticate`, whatever the path or method,
before the body is read. `/health`, `/ready` and `/metrics` stay open for probes and scrapers, and say
nothing a scraper does not need: no request ids, tickets or addresses.

A node started without a token (`--api-token-file ''`) serves its API to anyone, says so in its log,
and still keeps request ids out of `/v1/status` (no caller is authenticated there).

The error middleware gives aiohttp's own refusals (404, 405, 413 body too large, 400 bad HTTP) and any
unexpected failure the JSON shape the handlers use, `{"error": {"type", "message"}}`, with no traceback.
"""

from __future__ import annotations

import json
import logging

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from tilert_serve.bearer import TokenFile, bearer_token

log = logging.getLogger(__name__)

#: True on a request that presented a valid node-API token (always False on a node without one).
AUTHENTICATED = web.RequestKey("tilert_node_authenticated", bool)
#: The paths that need the token: everything under it.
PROTECTED_PREFIX = "/v1/"
REALM = "tilert-decode-node"

_KINDS = {
    400: "bad_request",
    401: "unauthorized",
    404: "not_found",
    405: "method_not_allowed",
    408: "request_timeout",
    413: "request_too_large",
    415: "unsupported_media_type",
}


def error_body(kind: str, message: str) -> str:
    return json.dumps({"error": {"type": kind, "message": message}})


def unauthorized(presented: bool) -> web.Response:
    challenge = f'Bearer realm="{REALM}"' + (', error="invalid_token"' if presented else "")
    message = "the node's API takes the cluster's node-API token (Authorization: Bearer <token>); " + (
        "the token presented is not valid" if presented else "none was presented"
    )
    return web.Response(
        status=401,
        text=error_body("unauthorized", message),
        content_type="application/json",
        headers={"WWW-Authenticate": challenge},
    )


def auth_middleware(tokens: TokenFile | None) -> Middleware:
    """Refuse /v1/* without a valid token (when the node has a token file)."""

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        request[AUTHENTICATED] = False
        if tokens is not None:
            presented = bearer_token(request.headers)
            ok = tokens.accepts(presented)
            request[AUTHENTICATED] = ok
            if not ok and request.path.startswith(PROTECTED_PREFIX):
                return unauthorized(presented is not None)
        return await handler(request)

    return middleware


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400 or exc.content_type == "application/json":
            raise
        kind = _KINDS.get(exc.status, f"http_{exc.status}")
        message = exc.text or exc.reason
        if exc.status == 413:
            message = f"request body too large: {message}"
        return web.Response(
            status=exc.status,
            text=error_body(kind, message),
            content_type="application/json",
            headers={k: v for k, v in exc.headers.items() if k.lower() in ("allow", "retry-after")},
        )
    except Exception:
        log.exception("%s %s failed", request.method, request.path)
        return web.Response(
            status=500,
            text=error_body("internal_error", "internal error; see the node's log"),
            content_type="application/json",
        )


def middlewares(tokens: TokenFile | None) -> list[Middleware]:
    """The node app's middlewares, outermost first: errors shaped, then authentication."""
    if tokens is None:
        log.warning(
            "the decode node's HTTP API has no token: anyone who reaches its port may admit, generate "
            "and cancel (start it with --api-token-file to require the cluster's node-API token)"
        )
    return [error_middleware, auth_middleware(tokens)]


def public_reason(failed: str) -> str:
    """A failure as /health and /ready tell it to anyone: what failed and the exception's type, not its
    message (which may hold addresses); the whole text is in the log and in /v1/status."""
    return ": ".join(failed.split(": ")[:2])
