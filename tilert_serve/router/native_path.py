"""The native path, as vLLM's own PD proxies do it: prefill with do_remote_decode, then decode on the
native vLLM pool with what its connector needs to pull the prompt's KV, relaying the decode's bytes.

What each connector needs (vLLM 0.32):

- NixlConnector: the prefill's own answer. Its request_finished returns the kv_transfer_params the
  decode reads (remote_engine_id, remote_block_ids, remote_request_id, remote_host, remote_port, ...;
  nixl/pull_scheduler.py, nixl/metadata.py), so the router passes them on (toy_proxy_server.py).
- MooncakeConnector: its request_finished returns nothing; the proxy names the transfer on both legs
  (mooncake_connector.py: MooncakeConnectorMetadata.add_new_req reads transfer_id, remote_engine_id and
  remote_bootstrap_addr). The decode asks the prefill's bootstrap registry (GET /query) for the
  workers of remote_engine_id, and the prefill's sender waits for transfer_id; the router learns the
  engine id from the same registry, as vLLM's mooncake_connector_proxy.py does.

The relay passes the decode's SSE bytes through untouched except the usage event, whose
`prompt_tokens_details.cached_tokens` comes from the prefill (the decode pulled the whole prompt, so
its own count would say everything was cached; vllm-project/router #193).
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
import uuid
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import aiohttp
from aiohttp import web

from tilert_serve import dataplane
from tilert_serve.router import openai_response, sse
from tilert_serve.router.call import Call
from tilert_serve.router.pools import Endpoint
from tilert_serve.router.state import RouterState
from tilert_serve.router.upstream import UpstreamError, client_error, error_message, read_error_body

log = logging.getLogger(__name__)

# What the toy proxy sends: "decode happens elsewhere; keep the blocks for it".
_NIXL_REMOTE_DECODE = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


@dataclass(frozen=True)
class MooncakeSource:
    """One prefill engine as the decode's MooncakeConnector finds it."""

    bootstrap_addr: str
    engine_id: str
    #: The data-parallel rank the prefill is pinned to (X-data-parallel-rank); None with one rank.
    dp_rank: int | None


def _mooncake_params(transfer_id: str) -> dict[str, Any]:
    # Without transfer_id the prefill frees the blocks at once (update_state_after_alloc warns
    # "Missing transfer_id in kv_transfer_params from router!").
    return {"do_remote_decode": True, "do_remote_prefill": False, "transfer_id": transfer_id}


def mooncake_decode_params(
    prefill_answer: dict[str, Any], src: MooncakeSource, transfer_id: str
) -> dict[str, Any] | None:
    """What the decode needs to pull the prompt's KV; None when the prefill kept none for it.

    The prefill keeps the blocks only for a request that ended by length (request_finished marks any
    other ending "not processed" and frees them); a decode sent to pull those would wait for a sender
    that never comes (VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT, 480 s). Without params it recomputes the
    prompt, as a NIXL decode does when its prefill returned none.
    """
    choices = prefill_answer.get("choices")
    first = choices[0] if isinstance(choices, list) and choices and isinstance(choices[0], dict) else {}
    if first.get("finish_reason") != "length":
        return None
    return {
        "do_remote_decode": False,
        "do_remote_prefill": True,
        "remote_engine_id": src.engine_id,
        "remote_bootstrap_addr": src.bootstrap_addr,
        "transfer_id": transfer_id,
    }


def bootstrap_addr(prefill_url: str, port: int) -> str:
    return dataplane.http_url(urlsplit(prefill_url).hostname or "", port)


async def mooncake_source(state: RouterState, prefill: Endpoint) -> MooncakeSource:
    """Ask the prefill's bootstrap registry for its engine id. Asked on every request, not cached: a
    restarted prefill registers under a new engine id, and the decode finds only the current one."""
    addr = bootstrap_addr(prefill.url, state.config.mooncake_bootstrap_port)
    t = state.config.timeouts
    try:
        async with state.http.get(
            addr + "/query", timeout=aiohttp.ClientTimeout(total=t.admit_s, sock_connect=t.connect_s)
        ) as resp:
            raw = await resp.read()
            status = resp.status
    except (TimeoutError, aiohttp.ClientError) as exc:
        raise UpstreamError(
            "prefill", prefill.url, "bootstrap", f"{addr}/query: {type(exc).__name__}: {exc}"
        ) from exc
    try:
        registry = json.loads(raw) if status == 200 else None
    except ValueError:
        registry = None
    # {dp_rank: {"engine_id": ..., "worker_addr": {tp_rank: {pp_rank: addr}}}} (mooncake_utils.py)
    ranks = {}
    if isinstance(registry, dict):
        for rank, entry in registry.items():
            if isinstance(entry, dict) and isinstance(entry.get("engine_id"), str) and str(rank).isdigit():
                ranks[int(rank)] = entry["engine_id"]
    if not ranks:
        raise UpstreamError(
            "prefill", prefill.url, "bootstrap", f"{addr}/query answered {status} with no registered engine"
        )
    if len(ranks) == 1:
        return MooncakeSource(addr, next(iter(ranks.values())), None)
    rank = random.choice(sorted(ranks))
    return MooncakeSource(addr, ranks[rank], rank)


@dataclass(frozen=True)
class PrefillLeg:
    """The prefill leg of a native request, as the connector (`native_connector`) needs it: the
    kv_transfer_params and headers the prefill gets, and the decode's params read from its answer."""

    params: dict[str, Any]
    headers: dict[str, str]
    #: MooncakeConnector: the prefill engine the decode pulls from, and this transfer's id.
    source: MooncakeSource | None = None
    transfer_id: str = ""

    def decode_params(self, answer: dict[str, Any]) -> dict[str, Any] | None:
        """What the decode needs to pull the prompt's KV; None when the prefill kept none for it."""
        if self.source is not None:
            return mooncake_decode_params(answer, self.source, self.transfer_id)
        kvp = answer.get("kv_transfer_params")  # NixlConnector: the prefill's own answer
        return kvp if isinstance(kvp, dict) and kvp else None


async def prefill_leg(state: RouterState, prefill: Endpoint) -> PrefillLeg:
    """The prefill leg for `prefill` (a user's request and a warm-up alike, native_warmup.py)."""
    if state.config.native_connector != "MooncakeConnector":
        return PrefillLeg(dict(_NIXL_REMOTE_DECODE), {})
    src = await mooncake_source(state, prefill)
    # Fresh per attempt: a retry on the same prefill must not find the first attempt's transfer, and
    # the client's X-Request-Id may repeat.
    transfer_id = f"xfer-{uuid.uuid4().hex}"
    headers = {"X-data-parallel-rank": str(src.dp_rank)} if src.dp_rank is not None else {}
    return PrefillLeg(_mooncake_params(transfer_id), headers, src, transfer_id)


async def _handoff(call: Call, prefill: Endpoint) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """Run the prefill leg; return its answer and the kv_transfer_params for the decode (None: none)."""
    leg = await prefill_leg(call.state, prefill)
    pj = await call.prefill(prefill, call.prefill_body(leg.params), leg.headers or None)
    return pj, leg.decode_params(pj)


async def serve(call: Call) -> web.StreamResponse:
    st, cfg = call.state, call.cfg
    # The decode first, among those a usable prefill can pair with; then a prefill of its generation
    # (both preferring pairs that have moved KV before: native_pairs.py).
    decode = st.pools.pick_native(call.exclude, cfg.limits.native_max_inflight)
    prefill = (
        st.pools.pick_prefill(
            call.exclude, decode.generation, call.req, st.metrics.observe_prefill_choice, native=decode
        )
        if decode is not None
        else None
    )
    if prefill is None or decode is None:
        which = "prefill" if decode is not None else "native decode"
        raise UpstreamError(which, "-", "no_endpoint", f"no healthy {which} server", retryable=False)

    decode.inflight += 1  # counted from now: the decode is committed to this request
    try:
        pj, kvp = await _handoff(call, prefill)
        call.check_generation(prefill, pj, decode)
        cached = openai_response.cached_tokens_of(pj)
        body = call.upstream_body()
        if kvp is not None:
            body["kv_transfer_params"] = kvp
        with call.leg("router.decode", endpoint=decode.url):
            resp = await _decode(call, decode, body, cached)
        if kvp is not None:
            st.pools.pairs.succeeded(prefill, decode)
        return resp
    finally:
        decode.inflight -= 1


async def _decode(
    call: Call, decode: Endpoint, body: dict[str, Any], cached: int | None
) -> web.StreamResponse:
    st, t = call.state, call.cfg.timeouts
    url = decode.url + call.api_path
    try:
        async with asyncio.timeout(t.decode_start_s):
            resp = await st.http_for(decode.url, call.exclude).post(
                url,
                json=body,
                # vLLM's own span of the decode is the decode leg's child (when traced).
                headers=call.upstream_headers,
                timeout=aiohttp.ClientTimeout(
                    total=None, sock_connect=t.connect_s, sock_read=t.idle_stream_s
                ),
            )
    except TimeoutError as exc:
        raise UpstreamError(
            "native", decode.url, "timeout", f"no answer within {t.decode_start_s} s"
        ) from exc
    except aiohttp.ClientConnectorError as exc:
        raise UpstreamError("native", decode.url, "connect", str(exc)) from exc
    except aiohttp.ClientError as exc:
        raise UpstreamError("native", decode.url, "transport", f"{type(exc).__name__}: {exc}") from exc
    try:
        if resp.status < 500:
            decode.breaker_ok()
        if resp.status != 200:
            eb = await read_error_body(resp)
            if resp.status >= 500:
                raise UpstreamError(
                    "native", decode.url, f"http_{resp.status}", error_message(eb, "decode failed")
                )
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


async def _whole(
    call: Call, decode: Endpoint, resp: aiohttp.ClientResponse, cached: int | None
) -> web.Response:
    try:
        raw = await resp.read()
    except (TimeoutError, aiohttp.ClientError) as exc:
        # The decode died before its answer was complete; nothing reached the client: retried.
        kind = "timeout" if isinstance(exc, TimeoutError) else "stream_broken"
        raise UpstreamError("native", decode.url, kind, f"{type(exc).__name__}: {exc}") from exc
    try:
        obj = json.loads(raw)
    except ValueError as exc:
        raise UpstreamError("native", decode.url, "bad_response", f"{type(exc).__name__}: {exc}") from exc
    if not isinstance(obj, dict):
        raise UpstreamError("native", decode.url, "bad_response", "body is not a JSON object")
    obj["usage"] = openai_response.with_cached_tokens(obj.get("usage"), cached)
    obj["model"] = call.req.model
    call.observe_first_token_unstreamed()
    call.state.metrics.e2e.labels("native").observe(time.perf_counter() - call.t0)
    return call.json(obj)


async def _relay(
    call: Call, decode: Endpoint, resp: aiohttp.ClientResponse, cached: int | None
) -> web.StreamResponse:
    """Relay the decode's SSE bytes. Complete events go out as soon as they arrive; a partial event
    waits for its end, so the usage event can be rewritten whole."""
    rename = _rename(call)
    pending = b""
    saw_done = False
    try:
        # The client's stream starts with the decode's first event, not before: a decode that dies
        # before sending anything has sent nothing on, and the request is retried elsewhere.
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
            if call.response is None:
                await call.start_stream()
            await call.write(out)
        if pending.strip():
            if call.response is None:
                await call.start_stream()
            await call.write(pending)
            saw_done = pending.rstrip().endswith(b"[DONE]")
        if not saw_done:
            # vLLM always ends with [DONE]; a clean close without it means the decode died.
            raise aiohttp.ClientPayloadError("decode stream ended without [DONE]")
    except (TimeoutError, aiohttp.ClientError) as exc:
        kind = "timeout" if isinstance(exc, TimeoutError) else "stream_broken"
        if call.response is None:
            raise UpstreamError("native", decode.url, kind, str(exc)) from exc
        call.state.metrics.upstream_errors.labels("native", kind).inc()
        decode.breaker_failed(time.monotonic(), f"{kind}: {exc}")
        log.warning("request %s: native decode %s failed mid-stream: %s", call.request_id, decode.url, exc)
        await call.fail_stream(
            f"decode failed mid-stream on a native decode server: {type(exc).__name__} {exc}", kind
        )
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
