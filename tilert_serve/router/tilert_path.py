"""The TileRT path: admit on a node (a ticket for one slot), prefill on vLLM with the ticket, send the
prefill's first token at once, stream the rest from the node.

Slot ownership: the router holds a slot from `Pools.reserve_tilert` until it knows the node freed it:
the node's `done` event, or the answer to a cancel. Every exit path (error, client gone, stop string,
request finished by the first token) ends in exactly one of the two; `_Slot` makes that hard to get
wrong. Cancels run as background tasks so a client that disconnects (handler cancelled) still frees
its slot at once.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web

from tilert_serve.router import openai_response, sse
from tilert_serve.router.call import Call
from tilert_serve.router.pools import Node
from tilert_serve.router.stops import StopMatcher
from tilert_serve.router.upstream import UpstreamError, error_message, post_json, read_error_body

log = logging.getLogger(__name__)

#: What a node's done event may end a decode with; anything else is a failed decode.
_FINISH_REASONS = ("stop", "length")


class NodeFull(Exception):
    """The node answered 429: no slot after all (another router, or a slot not yet freed)."""

    def __init__(self, retry_after_s: float) -> None:
        self.retry_after_s = retry_after_s


class TooLong(Exception):
    """The node answered 400 too_long: prompt + max_tokens exceed its max_seq_len (None: unknown here)."""

    def __init__(self, message: str, max_seq_len: int | None) -> None:
        super().__init__(message)
        self.max_seq_len = max_seq_len


@dataclass
class Admission:
    ticket: str
    ctrl_host: str
    ctrl_port: int


class _Slot:
    """The router's hold on one slot of one node, given back exactly once."""

    def __init__(self, call: Call, node: Node) -> None:
        self.call = call
        self.node = node
        self.ticket: str | None = None
        self.done = False

    def release(self) -> None:
        if not self.done:
            self.done = True
            self.call.state.pools.release(self.node)
            self.call.state.note_slots(self.node)

    def cancel(self, reason: str) -> asyncio.Task[None] | None:
        """Cancel the ticket in the background and release the slot once the node answered.
        Returns the cancel's task (None when nothing was left to cancel)."""
        if self.done:
            return None
        if self.ticket is None:
            self.release()
            return None
        ticket, self.ticket = self.ticket, None
        self.call.state.metrics.cancels.labels(reason).inc()
        return self.call.state.spawn(_cancel(self.call, self.node, ticket, self))


async def _cancel(call: Call, node: Node, ticket: str, slot: _Slot) -> None:
    t = call.cfg.timeouts
    try:
        async with call.state.http.post(
            node.url + "/v1/cancel",
            json={"ticket": ticket},
            headers=call.state.node_headers(call.upstream_headers),
            timeout=aiohttp.ClientTimeout(total=t.cancel_s, sock_connect=t.connect_s),
        ) as resp:
            await resp.read()
    except (TimeoutError, aiohttp.ClientError) as exc:
        # The node frees an unused ticket after its TTL anyway; count it and move on.
        call.state.metrics.upstream_errors.labels("tilert", "cancel").inc()
        log.warning("request %s: cancel of ticket on %s failed: %s", call.request_id, node.spec.name, exc)
    finally:
        slot.release()


async def admit(call: Call, node: Node) -> Admission:
    """Ask the node for a ticket. Raises NodeFull, TooLong or UpstreamError; the caller releases."""
    t = call.cfg.timeouts
    m = call.state.metrics
    name = node.spec.name
    status, body = await post_json(
        call.state.http,
        "tilert",
        node.url,
        "/v1/admit",
        # The router does not tokenize: the prompt's length is known only once the prefill has run. A
        # prompt + max_tokens past the node's max_seq_len ends as "length" on the node, as vLLM's own
        # get_max_tokens clamps it on the native pool; a prompt past it fails the handoff (retried).
        {"request_id": call.request_id, "prompt_tokens": None, "max_tokens": call.req.max_tokens},
        # The admission leg's traceparent (when traced): the node's admit span is its child.
        headers=call.state.node_headers(call.upstream_headers),
        timeout=aiohttp.ClientTimeout(total=t.admit_s, sock_connect=t.connect_s),
    )
    if status == 429:
        m.admissions.labels(name, "full").inc()
        raise NodeFull(float(body.get("retry_after_s") or call.cfg.policy.retry_after_s or 1))
    err = body.get("error")
    if status == 400 and isinstance(err, dict) and err.get("type") == "too_long":
        m.admissions.labels(name, "too_long").inc()
        raise TooLong(
            error_message(body, "prompt + max_tokens exceed the node's max_seq_len"), node.spec.max_seq_len
        )
    if status != 200 or not isinstance(body.get("ticket"), str):
        m.admissions.labels(name, "error").inc()
        raise UpstreamError(
            "tilert", node.url, f"admit_http_{status}", error_message(body, "bad admit answer")
        )
    m.admissions.labels(name, "ok").inc()
    return Admission(
        ticket=body["ticket"],
        ctrl_host=str(body.get("ctrl_host") or node.spec.ctrl_host),
        ctrl_port=int(body.get("ctrl_port") or node.spec.ctrl_port),
    )


def prefill_body(call: Call, node: Node, adm: Admission) -> dict[str, Any]:
    return call.prefill_body(
        {
            "tilert_host": adm.ctrl_host or node.spec.ctrl_host,
            "tilert_ctrl_port": adm.ctrl_port or node.spec.ctrl_port,
            "tilert_ticket": adm.ticket,
        }
    )


def generate_body(
    call: Call, node: Node, adm: Admission, first_token: int, prompt_tokens: int
) -> dict[str, Any]:
    r = call.req
    limit = r.max_tokens
    if limit is None:
        limit = call.cfg.limits.default_max_tokens
        if node.spec.max_seq_len is not None:
            limit = min(limit, max(node.spec.max_seq_len - prompt_tokens, 1))
    return {
        "ticket": adm.ticket,
        "request_id": call.request_id,
        "first_token": first_token,
        # The node counts tokens after the first one, which the prefill produced.
        "max_tokens": max(limit - 1, 0),
        "sampling": {
            # OpenAI's defaults where the client set nothing; top_k -1 = off (vLLM's convention).
            "temperature": 1.0 if r.temperature is None else r.temperature,
            "top_p": 1.0 if r.top_p is None else r.top_p,
            "top_k": -1 if r.top_k is None else r.top_k,
            "seed": r.seed,
        },
        "stop_token_ids": list(r.stop_token_ids),
        "ignore_eos": r.ignore_eos,
    }


class _Out:
    """Where generated text goes: the SSE stream, or a buffer for the one JSON answer."""

    def __init__(self, call: Call, writer: openai_response.ChunkWriter) -> None:
        self.call = call
        self.writer = writer
        self.parts: list[str] = []

    async def text(self, text: str) -> None:
        if self.call.req.stream:
            if self.call.response is None:
                await self.call.start_stream()
            await self.call.write(sse.data(self.writer.chunk(text)))
        elif text:
            self.parts.append(text)

    async def texts(self, parts: list[str]) -> None:
        if not parts:
            return
        if not self.call.req.stream:
            self.parts.extend(parts)
            return
        assert self.call.response is not None  # the first token started the stream
        await self.call.write(self.writer.content_chunk("".join(parts)))


async def serve(call: Call, node: Node, adm: Admission) -> web.StreamResponse:
    """Serve the request on `node`, whose slot is reserved and admitted (`adm`)."""
    slot = _Slot(call, node)
    slot.ticket = adm.ticket
    try:
        return await _serve(call, node, adm, slot)
    except UpstreamError:
        # The caller may retry, possibly on this node: wait until the node has freed the slot.
        task = slot.cancel("failed")
        if task is not None:
            await asyncio.shield(task)
        raise
    finally:
        # Whatever else happened (client gone: CancelledError), the ticket is cancelled and the slot
        # released unless the node already reported it free.
        slot.cancel("aborted")


async def _serve(call: Call, node: Node, adm: Admission, slot: _Slot) -> web.StreamResponse:
    st, r = call.state, call.req
    m = st.metrics
    prefill = st.pools.pick_prefill(call.exclude, node.generation, r, m.observe_prefill_choice)
    if prefill is None:
        # With prefills configured, they changed while the node admitted this request (a generation
        # change swapped them): deciding again pairs the request anew, before anything was sent.
        raise UpstreamError(
            "prefill",
            "-",
            "no_endpoint",
            f"no healthy prefill server of the node's generation ({node.generation})",
            retryable=bool(st.pools.prefill),
        )

    # 1. Prefill with the ticket: vLLM computes the prompt, samples the first token and, through the
    #    TileRT connector, ships the KV state to the node.
    pj = await call.prefill(prefill, prefill_body(call, node, adm))
    t_first = time.perf_counter()
    call.check_generation(prefill, pj, node)
    try:
        text, finish = openai_response.first_choice_text(r.kind, pj)
    except (KeyError, IndexError, TypeError) as exc:
        raise UpstreamError(
            "prefill", prefill.url, "bad_response", "no choices in the prefill answer"
        ) from exc
    kvp = pj.get("kv_transfer_params") or {}
    usage = pj.get("usage") or {}
    prompt_tokens = int(kvp.get("tilert_num_tokens") or usage.get("prompt_tokens") or 0)
    cached = openai_response.cached_tokens_of(pj)
    first_token = kvp.get("tilert_first_token")

    stops = StopMatcher(r.stop, r.include_stop_str_in_output)
    shown = stops.feed(text)
    # The first token ends the request: EOS or a stop token (vLLM says "stop"), a stop string, or
    # max_tokens == 1. Then the node has nothing to do: cancel the ticket instead of generating.
    ends_now = finish == "stop" or stops.stopped or r.max_tokens == 1
    if not ends_now and (kvp.get("tilert_status") != "queued" or not isinstance(first_token, int)):
        # The handoff failed on the prefill side and nothing was sent yet: the caller retries elsewhere.
        why = str(kvp.get("tilert_error") or f"prefill returned tilert_status={kvp.get('tilert_status')!r}")
        if kvp.get("tilert_fault") == "prefill":
            # The prefill ended the request itself (aborted it, or is shutting down: a pod leaving while
            # connections to it are still pooled). The node is not to blame, and with one node its
            # breaker would turn this one retry into a 503 for every request for seconds.
            raise UpstreamError("prefill", prefill.url, "handoff_failed", why)
        node.handoff_failed(time.monotonic(), f"handoff_failed: {why}")
        raise UpstreamError("tilert", node.url, "handoff_failed", why)

    writer = openai_response.ChunkWriter(r.kind, call.request_id, r.model)
    out = _Out(call, writer)
    if not r.stream:
        call.observe_first_token_unstreamed()
    await out.text(shown)  # streamed: the first token goes to the client now, before the decode starts

    completion_tokens = 1
    if ends_now:
        slot.cancel("first token ends")
        finish_reason = "stop" if (finish == "stop" or stops.stopped) else "length"
    else:
        assert isinstance(first_token, int)
        with call.leg("router.decode", node=node.spec.name):
            finish_reason, n = await _generate(
                call, node, adm, first_token, prompt_tokens, stops, out, slot, t_first
            )
        completion_tokens += n
        if finish_reason == "error":
            assert call.response is not None  # the stream already ends with an error event
            return call.response

    tail = stops.flush()
    if tail:
        await out.text(tail)
    u = openai_response.usage(prompt_tokens, completion_tokens, cached)
    m.e2e.labels("tilert").observe(time.perf_counter() - call.t0)
    if not r.stream:
        return call.json(writer.whole("".join(out.parts), finish_reason, u))
    last = sse.data(writer.chunk("", finish_reason))
    if r.include_usage:
        last += sse.data(writer.usage_chunk(u))
    await call.end(last + sse.DONE)
    assert call.response is not None
    return call.response


async def _generate(
    call: Call,
    node: Node,
    adm: Admission,
    first_token: int,
    prompt_tokens: int,
    stops: StopMatcher,
    out: _Out,
    slot: _Slot,
    t_first: float,
) -> tuple[str, int]:
    """Stream tokens from the node. Returns (finish_reason, tokens after the first); "error" when the
    stream failed after the first byte (the SSE error event is already written)."""
    st, t = call.state, call.cfg.timeouts
    m = st.metrics
    n_tokens = 0
    try:
        async with asyncio.timeout(t.decode_start_s):
            resp = await st.http.post(
                node.url + "/v1/generate",
                json=generate_body(call, node, adm, first_token, prompt_tokens),
                # The decode leg's traceparent (when traced): the node's stage spans are its children.
                headers=call.state.node_headers(call.upstream_headers),
                timeout=aiohttp.ClientTimeout(
                    total=None, sock_connect=t.connect_s, sock_read=t.idle_stream_s
                ),
            )
    except (TimeoutError, aiohttp.ClientError) as exc:
        kind = "timeout" if isinstance(exc, TimeoutError) else "transport"
        return await _decode_failed(call, node, kind, f"generate call failed: {type(exc).__name__} {exc}")
    drained = False  # the response went to a background drain, which releases it
    try:
        if resp.status != 200:
            body = await read_error_body(resp)
            err = body.get("error", {}) if isinstance(body, dict) else {}
            kind = (
                str(err.get("type") or f"http_{resp.status}")
                if isinstance(err, dict)
                else f"http_{resp.status}"
            )
            if resp.status == 404:
                slot.ticket = None  # the node does not know the ticket (expired): nothing to cancel
            return await _decode_failed(
                call, node, f"generate_{kind}", error_message(body, f"generate answered {resp.status}")
            )
        dec = sse.Decoder()
        first = True
        async for chunk in resp.content.iter_any():
            # Tokens that arrived in one network read go out as one chunk, in one write: the client
            # sees text as soon as the router has it, at a fraction of the per-event cost.
            pending: list[str] = []
            for ev in dec.feed(chunk):
                if ev.event == "error":
                    await out.texts(pending)
                    try:
                        msg = error_message(json.loads(ev.data), "decode node error")
                    except ValueError:
                        msg = ev.data[:200]
                    return await _decode_failed(call, node, "stream_error", msg)
                obj = json.loads(ev.data)
                if obj.get("done") and obj.get("finish_reason") not in _FINISH_REASONS:
                    # Not an OpenAI finish reason (an older node's "cancelled"): the decode did not finish.
                    await out.texts(pending)
                    slot.ticket = None  # the node freed the slot with its done event
                    slot.release()
                    return await _decode_failed(
                        call,
                        node,
                        "stream_error",
                        f"the decode ended with finish_reason {obj.get('finish_reason')!r}",
                    )
                if obj.get("done"):
                    await out.texts(pending)
                    # The node frees the slot when it finishes: nothing to cancel.
                    slot.ticket = None
                    slot.release()
                    _observe_timings(call, obj)
                    # The stream's end follows the done event: read it in the background so the
                    # connection goes back to the pool instead of being closed.
                    st.spawn(_drain(resp, t.cancel_s))
                    drained = True
                    n = obj.get("num_tokens")
                    return str(obj["finish_reason"]), int(n) if isinstance(n, int) else n_tokens
                if first:
                    m.handoff.observe(time.perf_counter() - t_first)
                    node.handoff_ok(time.monotonic())  # the node decoded from the handoff
                    first = False
                n_tokens += len(obj.get("token_ids") or ())
                text = stops.feed(obj.get("text") or "")
                if text:
                    pending.append(text)
                if stops.stopped:
                    await out.texts(pending)
                    slot.cancel("stop string")
                    return "stop", n_tokens
            await out.texts(pending)
        return await _decode_failed(call, node, "truncated", "decode stream ended without a done event")
    except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
        kind = "timeout" if isinstance(exc, TimeoutError) else "stream_broken"
        return await _decode_failed(call, node, kind, f"decode stream failed: {type(exc).__name__} {exc}")
    finally:
        if not drained:
            resp.close()


async def _drain(resp: aiohttp.ClientResponse, timeout_s: float) -> None:
    try:
        async with asyncio.timeout(timeout_s):
            await resp.read()
    except (TimeoutError, aiohttp.ClientError):
        pass
    finally:
        resp.release()


async def _decode_failed(call: Call, node: Node, kind: str, message: str) -> tuple[str, int]:
    call.state.metrics.upstream_errors.labels("tilert", kind).inc()
    if kind in ("generate_handoff_failed", "generate_handoff_timeout", "generate_decode_failed"):
        node.handoff_failed(time.monotonic(), f"{kind.removeprefix('generate_')}: {message}")
    log.warning("request %s: decode on %s failed: %s: %s", call.request_id, node.spec.name, kind, message)
    if call.response is None:
        # Nothing reached the client yet (non-streamed request): the caller may retry elsewhere.
        raise UpstreamError("tilert", node.url, kind, message)
    await call.fail_stream(f"decode failed mid-stream on TileRT node {node.spec.name}: {message}", kind)
    return "error", 0


def _observe_timings(call: Call, done: dict[str, Any]) -> None:
    timings = done.get("timings")
    if isinstance(timings, dict):
        log.debug("request %s: node timings %s", call.request_id, timings)
