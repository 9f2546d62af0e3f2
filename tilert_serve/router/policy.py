"""The routing decision: pure function of the policy, the request and the pools' state.

Order: the header (`x-pd-route`) wins, then the model alias, then the policy's default. A request
that needs a feature TileRT lacks goes to the native pool or gets a 400, by policy; a request for
TileRT when no slot is free goes to the native pool or gets a 429 with Retry-After, by policy, and
when no node is up (all ejected, or all failed this request) to the native pool or a 503 with
Retry-After, by the same policy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from tilert_serve.router.config import RoutingPolicy
from tilert_serve.router.errors import RouterError, bad_request
from tilert_serve.router.openai_request import ParsedRequest
from tilert_serve.router.pools import TileRTState

Route = Literal["tilert", "native"]
#: Why a route was taken, as the routes_total metric's `reason` label: a fixed set, whatever the
#: request holds (the detail, which names fields, goes to the logs).
Label = Literal[
    "requested",
    "slot free",
    "unsupported on tilert",
    "no tilert pool",
    "tilert full",
    "tilert down",
    "too long for tilert",
]


@dataclass(frozen=True)
class Decision:
    route: Route
    #: Why, for the routes_total metric (bounded).
    label: Label
    #: Why, in words, for the logs (may name the request's fields).
    detail: str = ""

    @property
    def reason(self) -> str:
        return self.detail or self.label


def requested(policy: RoutingPolicy, header_value: str | None, model: str) -> str:
    if header_value:
        v = header_value.strip().lower()
        if v not in ("tilert", "native", "auto"):
            raise bad_request(f"header {policy.header} must be tilert, native or auto; got {header_value!r}")
        return v
    if model in policy.tilert_aliases:
        return "tilert"
    if model in policy.native_aliases:
        return "native"
    return policy.default


def decide(
    policy: RoutingPolicy,
    req: ParsedRequest,
    want: str,
    *,
    tilert_nodes: int,
    tilert: TileRTState,
    native: str,
) -> Decision:
    """`tilert` is the TileRT pool's state for this request ('free', 'full', 'down': Pools.tilert_state),
    `native` the native pool's: 'ok', 'full' or 'none' (see Pools.native_state)."""
    retry_after = {"Retry-After": str(policy.retry_after_s)}

    def full() -> RouterError:
        return RouterError(
            429,
            "the decode pools are full; retry later",
            type="rate_limit_error",
            code="pool_full",
            headers=retry_after,
        )

    def to_native(label: Label, detail: str = "", *, tilert_full: bool = False) -> Decision:
        if native == "ok":
            return Decision("native", label, detail)
        if native == "full" or tilert_full:
            raise full()
        raise RouterError(
            503,
            f"no native decode server is available ({detail or label})",
            type="service_unavailable",
            code="no_native_pool",
            headers=retry_after,
        )

    if want == "native":
        return to_native("requested")

    if req.tilert_unsupported:
        fields = ", ".join(req.tilert_unsupported)
        if want == "tilert" and policy.unsupported_on_tilert == "reject":
            raise bad_request(
                f"the TileRT decode pool does not support: {fields}; drop them or send "
                f"'{policy.header}: native'",
                param=req.tilert_unsupported[0],
                code="unsupported_on_tilert",
            )
        return to_native("unsupported on tilert", f"unsupported on tilert: {fields}")

    if tilert_nodes == 0:
        if want == "tilert":
            raise RouterError(
                503, "no TileRT decode pool is configured", type="service_unavailable", code="no_tilert_pool"
            )
        return to_native("no tilert pool")

    if tilert == "free":
        return Decision("tilert", "slot free")
    if tilert == "down":
        if policy.when_tilert_full == "native" and native != "none":
            return to_native("tilert down")
        raise RouterError(
            503,
            "no TileRT decode node is available; retry later",
            type="service_unavailable",
            code="tilert_unavailable",
            headers=retry_after,
        )
    if policy.when_tilert_full == "native":
        return to_native("tilert full", tilert_full=True)
    raise full()
