"""One run of the planner for one PDCluster, as the controller's worker calls it every
`spec.autoscaling.intervalSeconds` (controller.py owns the timer): list the pods, scrape their
/metrics, turn the two latest scrapes into `inputs.Observed`, plan, and write the decision into
`status.autoscaling` (act.status_patch). It applies nothing: the reconcile that follows renders the
workloads from that status (act.effective), so the decision survives a restart of the operator and
a resync renders the same numbers.

The scrape before the first decision only sets the baseline: rates need two samples. A pod that did
not answer is named in the log and left out of the interval (scrape.py); a ready TileRT node that did
not answer counts as full, so it is never scaled away unseen (observe.busy_by_node).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from tilert_operator import constants, credentials, status
from tilert_operator import observe as pods_observe
from tilert_operator.autoscale import act, observe, planner, scrape
from tilert_operator.autoscale.decision import POOLS, Decision, History
from tilert_operator.autoscale.inputs import Observed
from tilert_operator.autoscale.observe import Ready, Snapshot
from tilert_operator.kubeapi import Client, Obj
from tilert_operator.reconcile_events import Note
from tilert_operator.spec import PDClusterSpec

log = logging.getLogger(__name__)

Scraper = Callable[[Sequence[scrape.Target]], Awaitable[Snapshot]]
_ORDINAL = re.compile(r"-(\d+)$")
#: Event reasons: a pool's desired replicas moved; the planner wants more (or fewer) than its bounds allow.
SCALED = "AutoscaleScaled"
AT_BOUND = "AutoscaleAtBound"


@dataclass
class State:
    """What one PDCluster's planner remembers between runs (its windows live in status, not here)."""

    previous: Snapshot | None = None
    #: The last decision made (for the operator's metrics).
    decision: Decision | None = None
    observed: Observed | None = None
    missing: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Ran:
    """What one run did: the decision (None on the baseline scrape), the PDCluster as the status
    patch returned it, and the Events it calls for."""

    decision: Decision | None
    written: Obj | None
    notes: list[Note]


def ready(pods: list[Obj]) -> Ready:
    def count(component: str) -> list[Obj]:
        return [p for p in pods_observe.pods_of(pods, component) if pods_observe.is_ready(p)]

    ordinals = tuple(
        int(m.group(1)) for p in count(constants.TILERT) if (m := _ORDINAL.search(p["metadata"]["name"]))
    )
    return Ready(
        len(count(constants.PREFILL)), len(count(constants.TILERT)), len(count(constants.NATIVE)), ordinals
    )


def notes(before: act.AutoscalingStatus | None, decision: Decision) -> list[Note]:
    """An Event per pool whose desired replicas moved (from -> to, why), and one when a pool comes to
    be held at a bound it would pass."""
    out: list[Note] = []
    for p in POOLS:
        d = decision.pool(p)
        last = before.pools.get(p) if before else None
        if d.change:
            out.append(
                Note(
                    True, SCALED, f"{p}: {d.current} -> {d.desired} replicas: {d.reason}", f"{p} {d.desired}"
                )
            )
        bound = next((b for b in ("maxReplicas", "minReplicas") if f"; {b}" in d.reason), "")
        was_held = last is not None and bound != "" and f"; {bound}" in last.reason
        if bound and not was_held:
            out.append(
                Note(
                    False,
                    AT_BOUND,
                    f"{p}: the load asks for {d.recommended} replicas, held at {bound} {d.desired} "
                    f"(spec.*.autoscaling.{bound} raises the bound)",
                    f"{p} at {bound}",
                )
            )
    return out


def needs_token(spec: PDClusterSpec) -> bool:
    """Whether the router's /metrics asks for a credential (API keys, and not `metricsPublic`)."""
    return spec.router.api_keys_secret is not None and not spec.router.metrics_public


def router_token(spec: PDClusterSpec, node_api_secret: Obj | None) -> str | None:
    """The token the router's /metrics takes from the operator: none where it asks for no key."""
    if not needs_token(spec):
        return None
    return credentials.metrics_token(node_api_secret)


async def run(
    api: Client,
    body: Obj,
    spec: PDClusterSpec,
    state: State,
    now: float,
    scraper: Scraper = scrape.scrape,
) -> Ran:
    meta = body["metadata"]
    ns, name = meta["namespace"], meta["name"]
    pods = await api.list("Pod", ns, f"{constants.LABEL_CLUSTER}={name}")
    secret = await api.get("Secret", ns, constants.node_api_secret_name(name)) if needs_token(spec) else None
    snap = await scraper(scrape.targets(spec, pods, router_token(spec, secret)))
    state.missing = dict(snap.missing)
    if snap.missing:
        log.warning(
            "[%s/%s] autoscaling: no metrics from %s; left out of this interval",
            ns,
            name,
            "; ".join(f"{p}: {why}" for p, why in sorted(snap.missing.items())[:5]),
        )
    previous, state.previous = state.previous, snap
    if previous is None:
        return Ran(None, None, [])
    last = act.parse_status((body.get("status") or {}).get("autoscaling"))
    obs = observe.observed(
        previous,
        snap,
        ready(pods),
        act.current(spec, last),
        percentile=spec.autoscaling.objective.percentile,
        slots_per_node=spec.decode.tilert.slots,
    )
    decision = planner.plan(spec, obs, last.history if last else History(), now)
    state.decision, state.observed = decision, obs
    patch = act.status_patch(spec, last, decision, status.now())
    written = await api.patch_status(constants.KIND, ns, name, patch)
    moved = [
        f"{p} {decision.pool(p).current}->{decision.pool(p).desired}"
        for p in POOLS
        if decision.pool(p).change
    ]
    if moved:
        log.info("[%s/%s] autoscaling: %s", ns, name, ", ".join(moved))
    return Ran(decision, written, notes(last, decision))
