"""OpenAI-shaped errors and the one middleware that renders them.

Handlers raise `RouterError`; the middleware turns it (and aiohttp's own HTTP exceptions, and anything
unexpected) into `{"error": {"message", "type", "param", "code"}}` with the right status. Once a
handler has started an SSE stream the middleware must not write a body: the streaming code ends the
stream with an error event itself and marks the request (`STREAMING`), and the middleware only logs.
"""

from __future__ import annotations

import json
import logging
import re
import uuid
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from aiohttp import web

log = logging.getLogger(__name__)

#: Set on a request once its SSE response is prepared: from then on errors travel inside the stream.
STREAMING = web.RequestKey("tilert_router_streaming", bool)
#: The request id (client's X-Request-Id or a fresh one), for logs and error responses.
REQUEST_ID = web.RequestKey("tilert_router_request_id", str)


class RouterError(Exception):
    """An error with the HTTP status and OpenAI error type the client should see."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | int | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class ClientGone(Exception):
    """The client closed its connection while the router was writing to it: nothing more to send.
    Kept apart from aiohttp's client errors, which here mean an upstream failed."""


def bad_request(message: str, param: str | None = None, code: str | None = None) -> RouterError:
    return RouterError(400, message, param=param, code=code)


def error_response(err: RouterError, request_id: str | None = None) -> web.Response:
    headers = dict(err.headers)
    if request_id:
        headers["X-Request-Id"] = request_id
    return web.Response(
        status=err.status, text=json.dumps(err.body()), content_type="application/json", headers=headers
    )


# aiohttp's own statuses (no route, wrong method, body too large) mapped to OpenAI's error types.
_HTTP_TYPES = {
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
}


_ID_OK = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")


def assign_request_id(request: web.Request) -> str:
    """The client's X-Request-Id when it is a sane token, else a fresh one; stored on the request."""
    rid = request.headers.get("X-Request-Id", "")
    if not _ID_OK.match(rid):
        rid = uuid.uuid4().hex
    request[REQUEST_ID] = rid
    return rid


@web.middleware
async def error_middleware(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    # The id is assigned here, first, so that every error response carries it too.
    request_id = assign_request_id(request)
    try:
        return await handler(request)
    except RouterError as err:
        if request.get(STREAMING):
            log.warning("request %s: error after the stream started: %s", request_id, err.message)
            raise
        return error_response(err, request_id)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        message = exc.text or exc.reason
        if exc.status == 413:
            message = f"request body too large: {message}"
        mapped = RouterError(exc.status, message, type=_HTTP_TYPES.get(exc.status, "invalid_request_error"))
        return error_response(mapped, request_id)
    except Exception:
        if request.get(STREAMING):
            log.exception("request %s: unexpected error after the stream started", request_id)
            raise
        log.exception("request %s: unexpected error", request_id)
        return error_response(RouterError(500, "internal router error", type="internal_error"), request_id)
