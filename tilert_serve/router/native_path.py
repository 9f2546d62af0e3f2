"""The native path, as vLLM's own PD proxy does it: prefill with do_remote_decode, then decode on the
native vLLM pool with the kv_transfer_params the prefill returned, relaying the decode's bytes.

The relay passes the decode's SSE bytes through untouched except the usage event, whose
`prompt_tokens_details.cached_tokens` comes from the prefill (the decode pulled the whole prompt, so
its own count would say everything was cached; vllm-project/router #193).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any

import aiohttp
from aiohttp import web

from tilert_serve.router import openai_response, sse
from tilert_serve.router.call import Call
from tilert_serve.router.pools import Endpoint
from tilert_serve.router.upstream import UpstreamError, client_error, error_message, read_error_body

log = logging.getLogger(__name__)

# What the toy proxy sends: "decode happens elsewhere; keep the blocks for it".
_REMOTE_DECODE = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


def prefill_body(call: Call) -> dict[str, Any]:
    return call.prefill_body(dict(_REMOTE_DECODE))


async def serve(call: Call) -> web.StreamResponse:
    st, cfg = call.state, call.cfg
    prefill = st.pools.pick_prefill(call.exclude)
    decode = st.pools.pick_native(call.exclude, cfg.limits.native_max_inflight)
    if prefill is None or decode is None:
        which = "prefill" if prefill is None else "native decode"
        raise UpstreamError(which, "-", "no_endpoint", f"no healthy {which} server", retryable=False)

    decode.inflight += 1  # counted from now: the decode is committed to this request
    try:
        pj = await call.prefill(prefill, prefill_body(call))
        kvp = pj.get("kv_transfer_params")
        cached = openai_response.cached_tokens_of(pj)
        body = call.upstream_body()
        if kvp:
            body["kv_transfer_params"] = kvp
        return await _decode(call, decode, body, cached)
    finally:
        decode.inflight -= 1


async def _decode(call: Call, decode: Endpoint, body: dict[str, Any], cached: int | None) -> web.StreamResponse:
    st, t = call.state, call.cfg.timeouts
    url = decode.url + call.api_path
    try:
        async with asyncio.timeout(t.decode_start_s):
            resp = await st.http.post(
                url, json=body, headers=call.upstream_headers,
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=t.connect_s, sock_read=t.idle_stream_s),
            )
    except TimeoutError as exc:
        raise UpstreamError("native", decode.url, "timeout", f"no answer within {t.decode_start_s} s") from exc
    except aiohttp.ClientConnectorError as exc:
        raise UpstreamError("native", decode.url, "connect", str(exc)) from exc
    except aiohttp.ClientError as exc:
        raise UpstreamError("native", decode.url, "transport", f"{type(exc).__name__}: {exc}") from exc
    try:
        if resp.status != 200:
            eb = await read_error_body(resp)
            if resp.status >= 500:
                raise UpstreamError("native", decode.url, f"http_{resp.status}",
                                    error_message(eb, "decode failed"))
            raise client_error(resp.status, eb)
        if not call.req.stream:
            return await _whole(call, decode, resp, cached)
        return await _relay(call, decode, resp, cached)
    finally:
        resp.close()


def _rename(call: Call) -> tuple[bytes, bytes] | None:
    """Bytes that carry vLLM's model name, and the client's; None when they are the same."""
    served = call.cfg.upstream_model or call.cfg.model
    if served == call.req.model:
        return None
    return (b'"model":"' + served.encode() + b'"', b'"model":"' + call.req.model.encode() + b'"')


async def _whole(call: Call, decode: Endpoint, resp: aiohttp.ClientResponse, cached: int | None) -> web.Response:
    try:
        raw = await resp.read()
        obj = json.loads(raw)
    except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
        raise UpstreamError("native", decode.url, "bad_response", f"{type(exc).__name__}: {exc}") from exc
    if not isinstance(obj, dict):
        raise UpstreamError("native", decode.url, "bad_response", "body is not a JSON object")
    obj["usage"] = openai_response.with_cached_tokens(obj.get("usage"), cached)
    obj["model"] = call.req.model
    call.observe_first_token_unstreamed()
    call.state.metrics.e2e.labels("native").observe(time.perf_counter() - call.t0)
    return call.json(obj)


async def _relay(call: Call, decode: Endpoint, resp: aiohttp.ClientResponse, cached: int | None) -> web.StreamResponse:
    """Relay the decode's SSE bytes. Complete events go out as soon as they arrive; a partial event
    waits for its end, so the usage event can be rewritten whole."""
    rename = _rename(call)
    pending = b""
    saw_done = False
    try:
        await call.start_stream()
        async for chunk in resp.content.iter_any():
            buf = pending + chunk if pending else chunk
            cut = buf.rfind(b"\n\n")
            if cut < 0:
                pending = buf
                continue
            out, pending = buf[: cut + 2], buf[cut + 2 :]
            if cached is not None and b'"prompt_tokens"' in out:
                out = _rewrite_usage(out, cached)
            if rename is not None:
                out = out.replace(*rename)
            saw_done = saw_done or out.endswith(sse.DONE)
            await call.write(out)
        if pending.strip():
            await call.write(pending)
            saw_done = pending.rstrip().endswith(b"[DONE]")
        if not saw_done:
            # vLLM always ends with [DONE]; a clean close without it means the decode died.
            raise aiohttp.ClientPayloadError("decode stream ended without [DONE]")
    except (TimeoutError, aiohttp.ClientError) as exc:
        kind = "timeout" if isinstance(exc, TimeoutError) else "stream_broken"
        call.state.metrics.upstream_errors.labels("native", kind).inc()
        log.warning("request %s: native decode %s failed mid-stream: %s", call.request_id, decode.url, exc)
        if call.response is None:
            raise UpstreamError("native", decode.url, kind, str(exc)) from exc
        await call.fail_stream(f"decode failed: {type(exc).__name__} {exc}", "upstream_error", kind)
        return call.response
    assert call.response is not None
    call.state.metrics.e2e.labels("native").observe(time.perf_counter() - call.t0)
    await call.end()
    return call.response


def _rewrite_usage(out: bytes, cached: int) -> bytes:
    parts = []
    for ev in sse.Decoder().feed(out):
        if b'"prompt_tokens"' in ev.raw and ev.data.startswith("{"):
            try:
                obj = json.loads(ev.data)
            except ValueError:
                parts.append(ev.raw)
                continue
            if isinstance(obj, dict) and isinstance(obj.get("usage"), dict):
                obj["usage"] = openai_response.with_cached_tokens(obj["usage"], cached)
                parts.append(sse.data(obj))
                continue
        parts.append(ev.raw)
    return b"".join(parts)
