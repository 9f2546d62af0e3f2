"""HTTP handlers: the two OpenAI endpoints, models, health, readiness and metrics."""

from __future__ import annotations

import asyncio
import logging
import re
import time

from aiohttp import web

from tilert_serve import httpserver, tracing, tracing_otel
from tilert_serve.bearer import bearer_token
from tilert_serve.router import health as health_checks
from tilert_serve.router import metrics as metrics_mod
from tilert_serve.router import native_path, openai_request, policy, tilert_path
from tilert_serve.router.call import ATTEMPTS_HEADER, TRACER, Call, RequestTrace
from tilert_serve.router.errors import REQUEST_ID, ClientGone, RouterError
from tilert_serve.router.metrics import CONTENT_TYPE
from tilert_serve.router.openai_request import Kind
from tilert_serve.router.pools import Endpoint, Node
from tilert_serve.router.state import STATE, RouterState
from tilert_serve.router.upstream import UpstreamError

log = logging.getLogger(__name__)


def authenticated(state: RouterState, request: web.Request) -> bool:
    """Whether the request may use the API: no keys configured, or one of them presented (compared in
    constant time; the keys file is re-read within about a second of a change)."""
    return state.api_keys is None or state.api_keys.accepts(bearer_token(request.headers))


def check_api_key(state: RouterState, request: web.Request) -> None:
    if not authenticated(state, request):
        raise RouterError(
            401,
            "invalid or missing API key (Authorization: Bearer <key>)",
            type="invalid_request_error",
            code="invalid_api_key",
            headers={"WWW-Authenticate": 'Bearer realm="tilert-pd"'},
        )


async def read_body(request: web.Request, timeout_s: float) -> bytes:
    """The request body, within `timeout_s` of its headers (a body sent a byte at a time holds a
    connection and a handler for nothing); past client_max_size aiohttp raises 413."""
    try:
        async with asyncio.timeout(timeout_s):
            return await request.read()
    except TimeoutError:
        raise RouterError(
            408, f"request body not received within {timeout_s:g} s", code="body_timeout"
        ) from None
    except httpserver.BadBody:
        raise RouterError(400, httpserver.BAD_BODY, code="malformed_http") from None


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _serve(request, "chat")


async def completions(request: web.Request) -> web.StreamResponse:
    return await _serve(request, "completions")


async def _serve(request: web.Request, kind: Kind) -> web.StreamResponse:
    state = request.app[STATE]
    cfg = state.config
    rid = request[REQUEST_ID]
    tracer = request.app[TRACER]
    arrived = time.time_ns() if tracer is not None else 0
    try:
        check_api_key(state, request)
        raw = await read_body(request, cfg.timeouts.client_body_s)
        req = openai_request.parse(kind, raw, cfg.served_models())
    except RouterError as err:
        state.metrics.rejections.labels(str(err.status)).inc()
        raise
    call = Call(request=request, state=state, cfg=cfg, req=req, request_id=rid)
    if tracer is not None:
        call.trace = _begin_trace(tracer, request, kind, rid, arrived)
    outcome = "error"
    try:
        resp = await _route(call)
        outcome = "ok"
        return resp
    except RouterError as err:
        state.metrics.rejections.labels(str(err.status)).inc()
        outcome = f"http_{err.status}"
        raise
    except ClientGone:
        # The paths already let go of their upstreams (TileRT tickets are cancelled in their finally).
        outcome = "client_gone"
        log.info("request %s: client went away", rid)
        assert call.response is not None
        return call.response
    except asyncio.CancelledError:
        # Handler cancellation is on (app.start): a client that disconnects cancels its handler, most
        # often before any write could notice.
        outcome = "client_gone"
        raise
    finally:
        if call.path:
            state.metrics.requests.labels(call.path, outcome).inc()
        if call.trace is not None:
            root = call.trace.root
            root.set_attributes({"tilert_pd.route": call.path, "tilert_pd.outcome": outcome})
            root.set_attribute("tilert_pd.attempts", call.attempts)
            root.end()


def _begin_trace(
    tracer: tracing_otel.Tracer, request: web.Request, kind: Kind, rid: str, at_ns: int
) -> RequestTrace:
    """The request's server span, from its arrival: a child of the client's traceparent when it sent a
    valid one (a malformed one is ignored), else a new root that the sample ratio may sample."""
    root = tracer.start(
        "router.request",
        tracing.parent_of(request.headers),
        "server",
        start_ns=at_ns,
        attributes={"http.route": request.path, "tilert_pd.kind": kind, "tilert_pd.request_id": rid},
    )
    return RequestTrace(tracer, root)


async def _route(call: Call) -> web.StreamResponse:
    """Pick the path and serve. A failure before the first byte reached the client is retried, on
    another endpoint when there is one, up to `policy.retries` times and within the retry budget
    (retry_budget.py); each retry runs the whole request again, from the prefill."""
    st, cfg = call.state, call.cfg
    m = st.metrics
    want = policy.requested(cfg.policy, call.request.headers.get(cfg.policy.header), call.req.model)
    st.retry_budget.request(time.monotonic())
    attempts = 1 + cfg.policy.retries
    last: UpstreamError | None = None
    for attempt in range(attempts):
        call.attempts = attempt + 1
        with call.leg("router.admission", attempt=attempt + 1):
            node, adm, decision = await _choose(call, want)
        call.path = decision.route
        m.routes.labels(decision.route, decision.label).inc()
        m.inflight.labels(decision.route).inc()
        try:
            if node is not None and adm is not None:
                return await tilert_path.serve(call, node, adm)
            return await native_path.serve(call)
        except UpstreamError as err:
            last = err
            m.upstream_errors.labels(err.pool, err.kind).inc()
            _note_failure(st, err)
            log.warning(
                "request %s: attempt %d on %s failed: %s", call.request_id, attempt + 1, decision.route, err
            )
            if call.started:
                raise  # cannot happen by contract: paths end started streams themselves
            if not err.retryable or attempt == attempts - 1:
                break
            if not st.retry_budget.try_retry(time.monotonic()):
                m.retries_denied.labels(decision.route).inc()
                log.warning("request %s: not retried: the retry budget is spent", call.request_id)
                break
            call.exclude.add(err.url)
            if call.prefill_url is not None:
                # A handoff or decode failure may be the prefill's as well: prefer another one.
                call.exclude.add(call.prefill_url)
                call.prefill_url = None
            if (
                err.pool == "tilert"
                and want == "auto"
                and cfg.policy.when_tilert_full == "native"
                and st.pools.native_state(cfg.limits.native_max_inflight) == "ok"
            ):
                # Another TileRT node would likely fail the same way (a control plane locked out, a
                # broken data plane) and cost the client a second handoff timeout: native is the retry.
                call.exclude.update(n.url for n in st.pools.tilert.values())
            m.retries.labels(decision.route, retry_reason(err.kind)).inc()
        finally:
            m.inflight.labels(decision.route).dec()
    assert last is not None
    status = 504 if last.kind == "timeout" else (503 if last.kind == "no_endpoint" else 502)
    headers = {ATTEMPTS_HEADER: str(call.attempts)}
    if status == 503:
        headers["Retry-After"] = str(cfg.policy.retry_after_s)
    raise RouterError(
        status,
        f"{last.pool} failed: {last.message}",
        type="upstream_error",
        code=metrics_mod.bounded_kind(last.kind),
        headers=headers,
    )


def retry_reason(kind: str) -> str:
    """The retries_total reason for an upstream failure's kind (metrics.RETRY_REASONS)."""
    if kind in ("connect", "timeout", "compat_mismatch", "bad_response", "handoff_failed"):
        return kind
    if kind in ("transport", "stream_broken", "truncated", "generate_transport"):
        return "reset"
    if kind in ("generate_handoff_timeout", "generate_timeout"):
        return "timeout"
    if re.fullmatch(r"(admit_|generate_)?http_5[0-9][0-9]", kind):
        return "http_5xx"
    if kind.startswith("admit_"):
        return "admit_failed"
    if kind == "generate_handoff_failed":
        return "handoff_failed"
    return "decode_failed"


#: Failure kinds that count against a vLLM server's circuit breaker: it is gone, cut the connection,
#: did not answer in time, or answered 5xx. (A TileRT node's breaker counts failed handoffs.)
_BREAKER_KINDS = re.compile(r"connect|transport|timeout|stream_broken|truncated|http_5[0-9][0-9]")


def _note_failure(st: RouterState, err: UpstreamError) -> None:
    """Passive health checking: refused and broken connections count toward ejection like failed
    probes, and failures toward the endpoint's circuit breaker; a refused connection (nothing listens
    there any more: a killed or deleted server) opens it at once, so new requests avoid the endpoint
    from now on."""
    now = time.monotonic()
    for ep in st.pools.all():
        if ep.url != err.url:
            continue
        # Not a timeout: requests that time out together under load are one slow spell, not N failures
        # in a row, and would eject a pool's every node at once; the probes judge slowness
        # (HealthChecks.timeouts_to_eject).
        if err.kind in ("connect", "transport"):
            ep.record_failure(st.config.health, err.message)
        if err.kind == "connect" or (ep.pool != "tilert" and _BREAKER_KINDS.fullmatch(err.kind)):
            was = ep.breaker
            ep.breaker_failed(now, f"{err.kind}: {err.message}", at_once=err.kind == "connect")
            if was == "closed" and ep.breaker != "closed":
                log.warning("%s endpoint %s: circuit breaker open (%s)", ep.pool, ep.url, err.kind)


def _count_unpaired(call: Call, want: str, tilert: str, native: str, route: str | None) -> None:
    """Count, once per request, a decode pool that could have taken it but has no server of a
    generation a usable prefill has (pairing.PoolState "no_pair"), when that sent the request elsewhere
    or failed it: TileRT when a request that may use it did not get a slot, native likewise.
    `route` is where the decision sent it (None: it was refused)."""
    if call.unpaired_counted:
        return
    m = call.state.metrics
    if tilert == "no_pair" and route != "tilert" and want != "native":
        m.no_pair.labels("tilert").inc()
        call.unpaired_counted = True
    if native == "no_pair" and route != "native" and want != "tilert":
        m.no_pair.labels("native").inc()
        call.unpaired_counted = True


async def _choose(call: Call, want: str) -> tuple[Node | None, tilert_path.Admission | None, policy.Decision]:
    """Decide the path (_choose_now). When that is a 503 for want of a TileRT node while one may come
    back soon (Pools.tilert_may_return: ejected for a moment, failing its admission, the node list
    being swapped), wait for a change to the pools and decide again, within `policy.tilert_wait_s` of
    the request's first wait; only then the 503. A client that goes away cancels the wait; nothing is
    held while waiting (no slot, no ticket)."""
    st = call.state
    m = st.metrics
    waited = False
    try:
        while True:
            try:
                chosen = await _choose_now(call, want)
            except RouterError as err:
                left = _tilert_wait_left(call) if err.code == "tilert_unavailable" else 0.0
                if left <= 0:
                    if waited:
                        m.tilert_waits.labels("timed_out").inc()
                    raise
                waited = True
                health_checks.probe_now(st, st.pools.tilert_may_return(call.exclude))
                m.tilert_waiting.inc()
                try:
                    # Inside the admission leg: its span's length includes the wait.
                    await st.pools.changes.wait(left)
                finally:
                    m.tilert_waiting.dec()
                continue
            if waited:
                m.tilert_waits.labels("resumed").inc()
            return chosen
    except asyncio.CancelledError:
        if waited:
            m.tilert_waits.labels("client_gone").inc()
        raise


def _tilert_wait_left(call: Call) -> float:
    """How long the request may still wait for a TileRT node to come back: its bound's rest, or 0 when
    no node may come back (Pools.tilert_may_return). The bound starts at its first wait."""
    if not call.state.pools.tilert_may_return(call.exclude):
        return 0.0
    now = time.monotonic()
    if call.tilert_wait_until is None:
        call.tilert_wait_until = now + call.cfg.policy.tilert_wait_s
    return call.tilert_wait_until - now


async def _choose_now(
    call: Call, want: str
) -> tuple[Node | None, tilert_path.Admission | None, policy.Decision]:
    """Decide the path; on TileRT, reserve a slot and admit. A node that turns out full is skipped
    (bounded by the number of nodes); one that finds the request too long sends it native."""
    st, cfg = call.state, call.cfg
    m = st.metrics
    pools = st.pools
    tried: set[str] = set(call.exclude)
    #: Nodes that answered (full or too long) as opposed to failing: none = the pool is down, not full.
    answered = False
    too_long: tilert_path.TooLong | None = None
    for _ in range(len(pools.tilert) + 1):
        native = pools.native_state(cfg.limits.native_max_inflight)
        tilert = pools.tilert_state(tried)
        pairs = (pools.tilert_pairing(tried), pools.native_pairing(cfg.limits.native_max_inflight))
        if too_long is not None or (tilert == "down" and answered):
            tilert = "full"  # a node answered: the pool is there, it cannot take this request now
        if tilert == "full" and too_long is None:
            st.tilert_full_at = time.monotonic()  # a user wanted a slot: handoff probes hold off
        try:
            decision = policy.decide(
                cfg.policy, call.req, want, tilert_nodes=len(pools.tilert), tilert=tilert, native=native
            )
        except RouterError:
            _count_unpaired(call, want, *pairs, None)
            if too_long is not None:
                raise _too_long(call, too_long) from None
            raise
        _count_unpaired(call, want, *pairs, decision.route)
        if decision.route == "native":
            if too_long is not None:
                decision = policy.Decision("native", "too long for tilert")
            return None, None, decision
        node = pools.reserve_tilert(tried)  # same loop turn as the check: no other request in between
        assert node is not None
        st.note_slots(node)
        try:
            adm = await tilert_path.admit(call, node)
            return node, adm, decision
        except tilert_path.NodeFull as full:
            node.full_until = time.monotonic() + full.retry_after_s
            tried.add(node.url)
            answered = True
        except tilert_path.TooLong as exc:
            too_long = exc
            answered = True
        except UpstreamError as err:
            m.upstream_errors.labels("tilert", err.kind).inc()
            _note_failure(st, err)
            tried.add(node.url)
            m.retries.labels("tilert", "admit_failed").inc()
        except BaseException:
            pools.release(node)
            raise
        pools.release(node)
        st.note_slots(node)
    retry = {"Retry-After": str(cfg.policy.retry_after_s)}
    if not answered:
        raise RouterError(
            503,
            "no TileRT decode node answered; retry later",
            type="service_unavailable",
            code="tilert_unavailable",
            headers=retry,
        )
    raise RouterError(
        429,
        "the TileRT decode pool is full; retry later",
        type="rate_limit_error",
        code="pool_full",
        headers=retry,
    )


def _too_long(call: Call, exc: tilert_path.TooLong) -> RouterError:
    """vLLM's own refusal of a max_tokens past the context length (vllm/renderers/params.py), so that a
    request no native server could take reads the same as one a native server refused."""
    r = call.req
    param = (
        "max_completion_tokens"
        if r.kind == "chat" and r.body.get("max_completion_tokens") is not None
        else "max_tokens"
    )
    if r.max_tokens is not None and exc.max_seq_len is not None and r.max_tokens > exc.max_seq_len:
        message = (
            f"{param}={r.max_tokens} cannot be greater than max_model_len={exc.max_seq_len}. "
            f"Please request fewer output tokens. (parameter={param}, value={r.max_tokens})"
        )
    else:
        message = str(exc)
    return RouterError(400, message, type="BadRequestError", param=param, code=400)


async def models(request: web.Request) -> web.Response:
    state = request.app[STATE]
    check_api_key(state, request)
    created = int(state.started)
    data = [
        {
            "id": name,
            "object": "model",
            "created": created,
            "owned_by": "tilert-pd",
            "root": state.config.model,
        }
        for name in state.config.served_models()
    ]
    return web.json_response({"object": "list", "data": data})


async def health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def ready(request: web.Request) -> web.Response:
    """Ready = the router can route.

    With handoff probes on (`handoff_probe.interval_s`, as the operator renders it): a probed-healthy
    prefill and at least one decode route, that is a TileRT node whose last handoff (a user's or a
    probe's) decoded, or a probed-healthy native decode server; TileRT nodes without a working handoff
    are listed in `degraded`. With probes off: a probed-healthy prefill and a probed-healthy decode in
    every configured pool (the data plane is not known then).

    With API keys, an anonymous caller (the kubelet's probe) gets the verdict and the reasons without
    endpoint addresses or the nodes' slot table; a caller with a key gets everything."""
    state = request.app[STATE]
    pools = state.pools
    reasons: list[str] = []
    full = authenticated(state, request)
    if state.config.handoff_probe.interval_s > 0:
        return _ready_routes(state, full)

    def has(eps: list, what: str) -> None:  # type: ignore[type-arg]
        if not any(e.healthy is True for e in eps):
            detail = "; ".join(
                f"{e.url}: {e.last_error or 'not probed yet'}" for e in eps if e.healthy is not True
            )
            reasons.append(f"no healthy {what}" + (f" ({detail})" if detail and full else ""))

    has(list(pools.prefill.values()), "prefill server")
    if pools.tilert:
        has(list(pools.tilert.values()), "TileRT node")
    if pools.native:
        has(list(pools.native.values()), "native decode server")
    if not pools.tilert and not pools.native:
        reasons.append("no decode pool configured")
    paths = _paths(state)
    degraded = _breakers(state, full)
    if paths["tilert"] == "down" and paths["native"] != "up":
        reasons.append(
            "no decode route: every TileRT node's circuit breaker is open and no native decode "
            f"server is healthy ({'; '.join(degraded)})"
        )
    return _verdict(state, reasons, degraded, paths, full)


def _paths(state: RouterState) -> dict[str, str]:
    """Each decode path: "up", "down" (configured, nothing can take a request now) or "none"."""
    pools = state.pools
    tilert = "none" if not pools.tilert else ("up" if pools.tilert_path_up() else "down")
    native = (
        "none"
        if not pools.native
        else ("up" if any(e.healthy is True for e in pools.native.values()) else "down")
    )
    return {"tilert": tilert, "native": native}


def _breakers(state: RouterState, full: bool) -> list[str]:
    """TileRT nodes behind an open breaker, with the last handoff failure (its kind only, anonymously)."""
    now = time.monotonic()
    out = []
    for n in state.pools.tilert.values():
        if n.breaker == "open":
            why = n.breaker_error if full else n.breaker_error.split(":", 1)[0]
            out.append(
                f"TileRT node {n.spec.name}: {why or 'handoff failed'} (circuit breaker open for "
                f"{max(n.open_until - now, 0.0):.1f} s more after {n.handoff_fails} failed handoff(s))"
            )
    return out


def _ready_routes(state: RouterState, full: bool) -> web.Response:
    pools = state.pools
    reasons: list[str] = []
    degraded: list[str] = []
    if not any(e.healthy is True for e in pools.prefill.values()):
        reasons.append("no healthy prefill server")
    handoff = [
        n for n in pools.tilert.values() if n.healthy is True and n.handoff_ready and not n.compat_mismatch
    ]
    native = [e for e in pools.native.values() if e.healthy is True and not e.compat_mismatch]
    for n in pools.tilert.values():
        if n.breaker == "open":
            continue  # _breakers says why
        if n.compat_mismatch:
            degraded.append(
                f"TileRT node {n.spec.name}: advertises generation {n.advertised}, configured {n.compat}"
            )
        elif not (n.healthy is True and n.handoff_ready):
            if n.healthy is not True:
                why = "not probed healthy"
            elif n.handoff_fail_at is not None:
                why = n.handoff_error or "handoff failed"
            else:
                why = "no handoff yet"
            degraded.append(f"TileRT node {n.spec.name}: " + (why if full else why.split(":", 1)[0]))
    degraded[:0] = _breakers(state, full)
    if not handoff and not native:
        reasons.append(
            "no decode route: no TileRT node with a working handoff and no healthy native decode server"
            + (f" ({'; '.join(degraded)})" if degraded else "")
        )
    paths = _paths(state)
    if paths["tilert"] == "up" and not handoff:
        paths["tilert"] = "down"  # no handoff decoded lately: the probes say what the breaker does not
    return _verdict(state, reasons, degraded, paths, full, handoff_ready=True)


def _verdict(
    state: RouterState,
    reasons: list[str],
    degraded: list[str],
    paths: dict[str, str],
    full: bool,
    *,
    handoff_ready: bool = False,
) -> web.Response:
    """/ready's answer: 200 when nothing is wrong; a caller with a key also gets the slot table (with
    each node's HandoffReady where the handoff probes run)."""
    body: dict[str, object] = {"ready": not reasons, "reasons": reasons, "degraded": degraded, "paths": paths}
    if full:
        body["tilert_slots"] = {
            n.spec.name: {
                "slots": n.spec.slots,
                "in_use": n.in_use,
                "healthy": n.healthy,
                **({"handoff_ready": n.handoff_ready} if handoff_ready else {}),
                "breaker": n.breaker,
            }
            for n in state.pools.tilert.values()
        }
    return web.json_response(body, status=200 if not reasons else 503)


async def metrics(request: web.Request) -> web.Response:
    """Prometheus metrics (they name every endpoint's address): with API keys, only for a caller with
    a key unless the config says `metrics_public: true`. The operator's metrics-only token opens this
    endpoint and no other."""
    state = request.app[STATE]
    scraper = state.metrics_token is not None and state.metrics_token.accepts(bearer_token(request.headers))
    if not state.config.metrics_public and not scraper:
        check_api_key(state, request)
    for ep in state.pools.all():
        state.metrics.healthy.labels(ep.pool, ep.url).set(-1 if ep.healthy is None else int(ep.healthy))
    for ep in state.pools.all():
        state.metrics.endpoint_breaker_open.labels(ep.pool, ep.url).set(int(ep.breaker != "closed"))
    state.metrics.breaker_open.keep_only({(name,) for name in state.pools.tilert})
    for name, node in state.pools.tilert.items():
        state.metrics.breaker_open.labels(name).set(int(node.breaker != "closed"))
    for path, up in _paths(state).items():
        state.metrics.path_up.labels(path).set(-1 if up == "none" else int(up == "up"))
    pools = state.pools
    for pair_state, n in pools.pairs.counts(pools.prefill.values(), pools.native.values()).items():
        state.metrics.native_pairs.labels(pair_state).set(n)
    return web.Response(body=state.metrics.render(), headers={"Content-Type": CONTENT_TYPE})


def _endpoint_status(ep: Endpoint, now: float) -> dict[str, object]:
    out: dict[str, object] = {
        "url": ep.url,
        "compat": ep.compat,
        "advertised": ep.advertised,
        "compat_mismatch": ep.compat_mismatch,
        "healthy": ep.healthy,
        "inflight": ep.inflight,
        "breaker": ep.breaker,
    }
    if ep.breaker != "closed":
        out["breaker_open_for_s"] = round(max(ep.open_until - now, 0.0), 3)
        out["breaker_error"] = ep.breaker_error
    if isinstance(ep, Node):
        out |= {
            "name": ep.spec.name,
            "slots": ep.spec.slots,
            "in_use": ep.in_use,
            "handoff_ready": ep.handoff_ready,
        }
    return out


async def status(request: web.Request) -> web.Response:
    """What the router routes to now (API key required: it names every endpoint): each endpoint with
    its configured and advertised generation, health, breaker and load; how many endpoints of each
    generation each pool has (`generations`, "unknown" for endpoints without one); the retry budget."""
    state = request.app[STATE]
    check_api_key(state, request)
    now = time.monotonic()
    pools = state.pools
    groups: dict[str, list[Endpoint]] = {
        "prefill": list(pools.prefill.values()),
        "tilert": list(pools.tilert.values()),
        "native": list(pools.native.values()),
    }
    generations: dict[str, dict[str, int]] = {}
    for pool, eps in groups.items():
        for ep in eps:
            gen = generations.setdefault(ep.generation or "unknown", {"prefill": 0, "tilert": 0, "native": 0})
            gen[pool] += 1
    return web.json_response(
        {
            "model": state.config.model,
            "endpoints": {pool: [_endpoint_status(ep, now) for ep in eps] for pool, eps in groups.items()},
            "generations": generations,
            "paths": _paths(state),
            "retry_budget": state.retry_budget.snapshot(now),
        }
    )


def routes() -> list[web.RouteDef]:
    return [
        web.post("/v1/chat/completions", chat_completions),
        web.post("/v1/completions", completions),
        web.get("/v1/models", models),
        web.get("/v1/status", status),
        web.get("/health", health),
        web.get("/ready", ready),
        web.get("/metrics", metrics),
    ]
