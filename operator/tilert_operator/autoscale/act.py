"""How a decision becomes replicas, without ping-pong: pure functions between the planner's decision,
the PDCluster's `status.autoscaling` and the replicas the renderers should use.

The status is the one place a decision lives. Each reconcile renders a pool's replicas from it (not
from `spec.replicas`, which is only the starting point of an autoscaled pool), so a resync renders
the number already decided; and it holds the recommendations the stabilization windows need, so an
operator that restarts keeps its windows. With `actuator: HPA` an autoscaled pool's replicas are left
to its HorizontalPodAutoscaler (None here: the workload is applied without the field).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tilert_operator.autoscale.decision import POOLS, Decision, History, PoolName, Recommendation
from tilert_operator.autoscale.planner import history_keep_s, pool_bounds
from tilert_operator.spec import PDClusterSpec

#: The most recommendations kept in status (a 3600 s window at the 5 s minimum interval is 720; the
#: status stays small: about 60 bytes each).
MAX_RECOMMENDATIONS = 720


@dataclass(frozen=True)
class PoolStatus:
    desired: int
    recommended: int
    reason: str
    #: When `desired` last changed (RFC 3339), for the Event and `kubectl describe`.
    last_scale_time: str


@dataclass(frozen=True)
class AutoscalingStatus:
    """`status.autoscaling`, parsed."""

    pools: dict[PoolName, PoolStatus]
    history: History
    drain_first: tuple[int, ...] = ()
    last_run: str = ""


def parse_status(raw: dict[str, Any] | None) -> AutoscalingStatus | None:
    """`status.autoscaling` as the operator wrote it; None when absent. A field the operator did not
    write (an older status, a hand edit) is dropped rather than trusted."""
    if not raw:
        return None
    pools: dict[PoolName, PoolStatus] = {}
    for p in POOLS:
        got = (raw.get("pools") or {}).get(p)
        if isinstance(got, dict) and isinstance(got.get("desired"), int) and got["desired"] >= 0:
            pools[p] = PoolStatus(
                got["desired"],
                rec if isinstance(rec := got.get("recommended"), int) else got["desired"],
                str(got.get("reason", "")),
                str(got.get("lastScaleTime", "")),
            )
    records = []
    for r in raw.get("recommendations") or []:
        if (
            isinstance(r, dict)
            and isinstance(r.get("at"), int | float)
            and all(isinstance(r.get(p), int) for p in POOLS)
        ):
            records.append(Recommendation(float(r["at"]), {p: int(r[p]) for p in POOLS}))
    return AutoscalingStatus(
        pools,
        History(tuple(sorted(records, key=lambda r: r.at))),
        tuple(int(i) for i in raw.get("drainFirst") or [] if isinstance(i, int)),
        str(raw.get("lastRun", "")),
    )


def replicas(spec: PDClusterSpec, status: AutoscalingStatus | None) -> dict[PoolName, int | None]:
    """What each pool's workload is rendered with: `replicas` when the pool is not autoscaled; with the
    HPA actuator None (the HPA owns the field); else the last decision, clamped to the spec's current
    bounds (they may have changed since), or `replicas` (clamped) before the first decision."""
    bounds = pool_bounds(spec)
    fixed = {
        "prefill": spec.prefill.replicas,
        "tilert": spec.decode.tilert.replicas,
        "native": spec.decode.native.replicas,
    }
    out: dict[PoolName, int | None] = {}
    for p in POOLS:
        b = bounds[p]
        if not b.enabled:
            out[p] = fixed[p]
        elif spec.autoscaling.actuator == "HPA":
            out[p] = None
        else:
            last = status.pools.get(p) if status else None
            start = last.desired if last is not None else fixed[p]
            out[p] = min(max(start, b.lo), b.hi)
    return out


def current(spec: PDClusterSpec, status: AutoscalingStatus | None) -> dict[str, int]:
    """The planner's `Observed.current`: what the workloads are asked for now (HPA-owned pools: the
    last decision, or the starting replicas)."""
    rendered = replicas(spec, status)
    out: dict[str, int] = {}
    for p, n in rendered.items():
        last = status.pools.get(p) if status else None
        out[p] = n if n is not None else (last.desired if last else pool_bounds(spec)[p].lo)
    return out


def status_patch(
    spec: PDClusterSpec, last: AutoscalingStatus | None, decision: Decision, now_rfc3339: str
) -> dict[str, Any]:
    """The `status.autoscaling` to write after `decision`: each pool's decision (lastScaleTime moves
    only when desired changes), the drain list, and the windows' recommendations, trimmed to what the
    longest window needs."""
    history = (last.history if last else History()).add(decision, history_keep_s(spec))
    records = history.records[-MAX_RECOMMENDATIONS:]
    pools: dict[str, Any] = {}
    for p in POOLS:
        d = decision.pool(p)
        before = last.pools.get(p) if last else None
        moved = before is None or before.desired != d.desired
        pools[p] = {
            "desired": d.desired,
            "recommended": d.recommended,
            "reason": d.reason,
            "lastScaleTime": now_rfc3339 if moved or before is None else before.last_scale_time,
        }
    return {
        "autoscaling": {
            "lastRun": now_rfc3339,
            "pools": pools,
            "drainFirst": list(decision.drain_first),
            "recommendations": [{"at": r.at, **r.replicas} for r in records],
        }
    }


def effective(spec: PDClusterSpec, status: AutoscalingStatus | None) -> PDClusterSpec:
    """The spec the renderers and the status see: each autoscaled pool's `replicas` replaced by
    `current` (the decision in status, clamped; under the HPA actuator the last decision or the
    pool's minimum until the workload's own count is known: `with_replicas`). The one place where a
    pool's rendered replicas are decided; `spec` itself when nothing is autoscaled."""
    return with_replicas(spec, current(spec, status))


def with_replicas(spec: PDClusterSpec, replicas: Mapping[str, int]) -> PDClusterSpec:
    """`spec` with the named pools' `replicas` replaced (`spec` itself when nothing changes)."""
    have = {
        "prefill": spec.prefill.replicas,
        "tilert": spec.decode.tilert.replicas,
        "native": spec.decode.native.replicas,
    }
    want = have | {p: n for p, n in replicas.items() if p in have}
    if want == have:
        return spec
    decode = spec.decode.model_copy(
        update={
            "tilert": spec.decode.tilert.model_copy(update={"replicas": want["tilert"]}),
            "native": spec.decode.native.model_copy(update={"replicas": want["native"]}),
        }
    )
    return spec.model_copy(
        update={"prefill": spec.prefill.model_copy(update={"replicas": want["prefill"]}), "decode": decode}
    )


def hpa_pools(spec: PDClusterSpec) -> tuple[PoolName, ...]:
    """The pools whose replicas an HPA owns (the HPA actuator, autoscaling enabled)."""
    if spec.autoscaling.actuator != "HPA":
        return ()
    bounds = pool_bounds(spec)
    return tuple(p for p in POOLS if bounds[p].enabled)


def operator_driven(spec: PDClusterSpec) -> bool:
    """Whether the operator runs the planner for this spec: a pool is autoscaled and the operator acts."""
    return spec.autoscaling.actuator == "Operator" and any(b.enabled for b in pool_bounds(spec).values())
