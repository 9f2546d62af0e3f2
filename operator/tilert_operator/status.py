"""The PDCluster status from observed facts, pure: conditions with reasons and actionable messages.

The operator is the only writer of every condition. Ready means the stack serves disaggregated
requests as the current spec describes: a prefill and a router are ready, every configured decode
pool can take requests (the TileRT pool through wired endpoints), and every workload has rolled out
its current template (observe.rollout; until then Ready=False, RollingOut, while the old pods serve).
Missing replicas beyond that make Ready=True with reason Degraded, and the pool's own condition False.
"""

from __future__ import annotations

import datetime
import math
from collections.abc import Sequence
from typing import Any, Protocol

from tilert_operator import constants
from tilert_operator.observe import NodeReport, PoolState, Unwired
from tilert_operator.validation import Problem
from tilert_serve.router.config import TileRTNode

CONDITION_TYPES = (
    "SpecValid",
    "PrefillReady",
    "TileRTDecodeReady",
    "NativeDecodeReady",
    "RouterReady",
    "EndpointsWired",
    "HandoffReady",
    "SecretsOwned",
    "HandoffSecretRotating",
    "NodeApiTokenRotating",
    "DataPlaneProtected",
    "Progressing",
    "Ready",
)
#: The condition that reports each rotation (credentials.Scheme.request_annotation -> type).
ROTATION_CONDITIONS = {
    constants.ROTATE_HANDOFF_SECRET_ANNOTATION: "HandoffSecretRotating",
    constants.ROTATE_NODE_API_TOKEN_ANNOTATION: "NodeApiTokenRotating",
}
#: Conditions that say something is unsafe: False gets a Warning Event on a PDCluster's first status too.
SECURITY_CONDITIONS = ("SecretsOwned", "DataPlaneProtected")
POOL_CONDITIONS = {
    constants.PREFILL: "PrefillReady",
    constants.TILERT: "TileRTDecodeReady",
    constants.NATIVE: "NativeDecodeReady",
    constants.ROUTER: "RouterReady",
}
#: Status keys of the pools (printer columns read status.replicas.<key>).
POOL_KEYS = {
    constants.PREFILL: "prefill",
    constants.TILERT: "tilert",
    constants.NATIVE: "native",
    constants.ROUTER: "router",
}

Condition = dict[str, Any]
#: The reason of a pool condition, and of Ready, while a workload's current template is not rolled out.
ROLLING_OUT = "RollingOut"
#: Progressing's reasons (rollout.py orders a rollout that changes the compatibility generation).
NEW_GENERATION_STARTING = "NewGenerationStarting"
WAITING_FOR_NEW_GENERATION = "WaitingForNewGeneration"
DRAINING_OLD_GENERATION = "DrainingOldGeneration"
ROLLOUT_COMPLETE = "RolloutComplete"
ROLLOUT_STALLED = "RolloutStalled"


def is_fault(cond: Condition) -> bool:
    """Whether a condition says something is wrong (its Event is a Warning). A rotation condition
    never does: False means no rotation is under way (none asked for, or the last one finished); nor
    does a rollout under way (a spec change doing what it was asked to)."""
    return (
        cond["status"] != "True"
        and cond["type"] not in ROTATION_CONDITIONS.values()
        and cond.get("reason") not in (ROLLING_OUT, ROLLOUT_COMPLETE)
    )


def _cond(type_: str, ok: bool, reason: str, message: str) -> Condition:
    return {"type": type_, "status": "True" if ok else "False", "reason": reason, "message": message}


def _selector_hint(cluster: str, component: str) -> str:
    return f"kubectl get pods -l {constants.LABEL_CLUSTER}={cluster},{constants.LABEL_COMPONENT}={component}"


def pool_condition(cluster: str, component: str, state: PoolState) -> Condition:
    type_ = POOL_CONDITIONS[component]
    if state.rolling is not None:
        serving = f"; {state.serves} ready pod(s) serve meanwhile" if state.serves else ""
        return _cond(
            type_,
            False,
            ROLLING_OUT,
            f"{state.text} {component} pods of the current template ready; rolling "
            f"out: {state.rolling}{serving}",
        )
    if state.desired == 0:
        return _cond(type_, True, "NoReplicas", f"{component} has 0 replicas in the spec")
    if state.ready >= state.desired:
        return _cond(type_, True, "AllReady", f"{state.text} {component} pods ready")
    return _cond(
        type_,
        False,
        "PodsNotReady",
        f"{state.text} {component} pods ready; see {_selector_hint(cluster, component)}",
    )


def secrets_not_owned(problems: Sequence[str]) -> list[Condition]:
    """A Secret the pods would mount is someone else's: nothing is deployed (see credentials.py)."""
    return [
        _cond("SpecValid", True, "Valid", "the spec passed all checks"),
        _cond("SecretsOwned", False, "SecretNotOwned", "; ".join(problems)),
        _cond(
            "Ready",
            False,
            "SecretNotOwned",
            "a Secret the pods would mount is not this PDCluster's (see SecretsOwned)",
        ),
    ]


def secrets_owned(names: Sequence[str]) -> Condition:
    return _cond("SecretsOwned", True, "Owned", f"Secrets {', '.join(names)} are this PDCluster's")


class RotationScheme(Protocol):
    """What a rotation condition needs of credentials.Scheme (status stays free of API code)."""

    @property
    def what(self) -> str: ...
    @property
    def request_annotation(self) -> str: ...
    @property
    def accepting(self) -> str: ...
    @property
    def switched(self) -> str: ...


def rotation(cluster: str, scheme: RotationScheme, state: dict[str, Any]) -> Condition:
    """HandoffSecretRotating / NodeApiTokenRotating from status.handoffSecret / status.nodeApiToken
    (credentials.Rotation.status)."""
    type_ = ROTATION_CONDITIONS[scheme.request_annotation]
    phase, request, what = state.get("phase", "Idle"), state.get("request"), scheme.what
    users, readers = (
        ("senders", "nodes") if scheme.accepting == "AcceptingNewSecret" else ("the router", "the nodes")
    )
    how = f"to rotate: kubectl annotate pdc {cluster} {scheme.request_annotation}=$(date +%s) --overwrite"
    if phase == scheme.accepting:
        return _cond(
            type_,
            True,
            phase,
            f"rotation {request!r}, phase 1 of 3: {readers} accept the new {what} beside the current one; "
            f"{users} switch to it at {state.get('nextPhaseAt')}",
        )
    if phase == scheme.switched:
        return _cond(
            type_,
            True,
            phase,
            f"rotation {request!r}, phase 2 of 3: {users} use the new {what}; {readers} accept the old one "
            f"until {state.get('nextPhaseAt')}",
        )
    if state.get("lastRotated"):
        return _cond(
            type_,
            False,
            "Rotated",
            f"rotation {request!r} completed at {state['lastRotated']}; the old {what} is refused; {how}",
        )
    return _cond(type_, False, "NotRequested", f"the {what} was never rotated; {how}")


def data_plane(
    networks: Sequence[str],
    host_network: bool,
    policies_enabled: bool,
    multi_network_policy: bool | int | None,
) -> Condition:
    """DataPlaneProtected: whether a policy fences the handoff's data plane (ctrl port, transfer engines).

    `multi_network_policy`: how listing MultiNetworkPolicies went: True (or 200), False (or 404: not
    served), 403 (not allowed), None (not asked)."""
    t = "DataPlaneProtected"
    if not policies_enabled:
        return _cond(
            t,
            False,
            "PoliciesDisabled",
            "spec.networkPolicies.enabled is false: anyone who reaches a decode pod can reach its ctrl port and "
            "its transfer engine's listeners (Mooncake listens on every interface, and neither engine "
            "authenticates); enable it, or fence the pods with your own policies",
        )
    if host_network:
        return _cond(
            t,
            False,
            "HostNetworkUnprotected",
            "spec.transfer.rdma.hostNetwork: the data-plane pods share their nodes' network namespace, where no "
            "NetworkPolicy applies, and the transfer engines (which do not authenticate) listen on the nodes' "
            "interfaces: restrict the ctrl port and the engines' ports to the prefill nodes with host firewall "
            "rules or an isolated RDMA fabric, or use Multus networks (spec.transfer.rdma.networks) instead",
        )
    if not networks:
        return _cond(
            t,
            True,
            "NetworkPolicy",
            "the handoff crosses the pod network, where NetworkPolicies admit only the "
            "prefill pods to the decode pods' ctrl and transfer ports (enforced where the CNI plugin enforces "
            "NetworkPolicy)",
        )
    if multi_network_policy == 403:
        return _cond(
            t,
            False,
            "MultiNetworkPolicyForbidden",
            f"the operator may not list {constants.MULTI_NETWORK_POLICY_API_VERSION} MultiNetworkPolicies, so "
            f"nothing it renders fences the data plane on {', '.join(networks)}: give its ClusterRole "
            "list, create, patch and delete on multi-networkpolicies (the chart's role has them)",
        )
    if multi_network_policy is False or multi_network_policy == 404:
        return _cond(
            t,
            False,
            "MultiNetworkPolicyUnavailable",
            f"the API server does not serve {constants.MULTI_NETWORK_POLICY_API_VERSION} MultiNetworkPolicy, so "
            f"nothing fences the data plane on {', '.join(networks)} (the transfer engines do not authenticate): "
            "install the k8snetworkplumbingwg multi-networkpolicy CRD and an implementation "
            "(e.g. multi-networkpolicy-iptables); the operator applies the policies once it is served",
        )
    return _cond(
        t,
        True,
        "MultiNetworkPolicy",
        f"MultiNetworkPolicies on {', '.join(networks)} admit only the prefill pods to the decode pods (enforced "
        "where a MultiNetworkPolicy implementation runs; RDMA traffic that bypasses the kernel is beyond them); "
        "on the pod network NetworkPolicies admit only the router",
    )


#: A node's last successful handoff counts as recent this long (the router probes an idle node every
#: 30 s, tilert_serve/router/canary.py); a node with a slot in use is exempt (long decodes, no new state).
HANDOFF_MAX_AGE_S = 120.0
#: The node's failure category (tilert_serve/decode/record.py DATA_PLANE_FAILURES) -> the condition's reason.
HANDOFF_REASONS = {
    "not_authenticated": "NotAuthenticated",
    "layout_mismatch": "LayoutMismatch",
    "compat_mismatch": "CompatMismatch",
    "version_mismatch": "VersionMismatch",
    "timeout": "Timeout",
    "digest_mismatch": "DigestMismatch",
    "transfer_failed": "TransferFailed",
    "disconnected": "TransferFailed",
    "bad_request": "ProtocolError",
    "decode_failed": "DecodeFailed",
    "internal": "NodeError",
}
_HANDOFF_HINTS = {
    # The node records it only for an authenticated connection (a wrong MAC is anyone's to send and is
    # counted apart): a frame failed its session check after the handshake.
    "NotAuthenticated": "a control connection failed its session check after the handshake: something between the "
    "prefill and the node alters or injects frames (or the prefill lost its session); check the "
    "network path",
    "SecretDiffers": "the prefill's handoff secret may differ from the node's: check the <cluster>-handoff Secret "
    "mounts (a rotation in progress accepts both)",
    "LayoutMismatch": "the prefill and the node disagree on the model, KV-cache dtype or MTP layer",
    "VersionMismatch": "the prefill and the node run different tilert-pd versions; finish the rollout",
    "Timeout": "the state did not arrive in time: the node's ctrl port or the transfer engine is not reachable from the "
    "prefill (NetworkPolicy, Multus network, RDMA devices)",
    "DigestMismatch": "the bytes that arrived differ from what the prefill wrote: the transfer is corrupting data",
    "TransferFailed": "the transfer engine's write failed or the sender vanished; see the prefill's log",
    "Unreachable": "the operator cannot read the node's /v1/status: check the pod and the NetworkPolicy",
    "NotAuthorized": "the node refuses the cluster's node-API token: check the <cluster>-node-api Secret mount",
    "NoHandoffYet": "no handoff reached the node yet: the router probes idle nodes every 30 s; check RouterReady and "
    "the router's log",
    "HandoffStale": "no handoff reached the node recently although it is idle: check the router's probes",
}


#: The node's counts of unauthenticated control connections that point at a misconfigured prefill
#: (tilert_serve/decode/record.py SIGNALS) -> the hint each adds. Anyone can cause them, so they never
#: fail the condition; beside a failure or an absence of handoffs they say where to look.
_SIGNAL_HINTS = {"failed_authentication": "SecretDiffers", "version_mismatches": "VersionMismatch"}


def _signal_hints(counts: dict[str, Any], prefix: str = "") -> str:
    """The hints of the signals counted in `counts` (presence only: a count would rewrite the status
    on every resync)."""
    hints = [
        _HANDOFF_HINTS[hint]
        for key, hint in _SIGNAL_HINTS.items()
        if isinstance(counts.get(prefix + key), int) and counts[prefix + key] > 0
    ]
    return f" ({'; '.join(hints)})" if hints else ""


def bandwidth_band(bytes_per_s: float) -> str:
    """A measured bandwidth as the power-of-two band it falls in ("1-2 GB/s"): the condition's message
    stays the same from one probe to the next (an idle resync writes nothing) yet tells RDMA from TCP."""
    if bytes_per_s < 1:
        return "under 1 B/s"
    unit, size = next(
        (u, s) for u, s in (("GB/s", 1e9), ("MB/s", 1e6), ("kB/s", 1e3), ("B/s", 1.0)) if bytes_per_s >= s
    )
    low = 2 ** math.floor(math.log2(bytes_per_s / size))
    return f"{low:g}-{2 * low:g} {unit}"


def _gbps(handoff: dict[str, Any]) -> str:
    ok = handoff.get("last_success") or {}
    bw = ok.get("bandwidth_bytes_per_s")
    t = handoff.get("transport") or {}
    how = f"{t.get('engine') or '?'}/{t.get('protocol') or '?'}"
    return f"{how} at {bandwidth_band(float(bw))}" if isinstance(bw, int | float) else how


def node_handoff(report: NodeReport, max_age_s: float = HANDOFF_MAX_AGE_S) -> tuple[str, str]:
    """(reason, message) for one node: HandoffOK or why not."""
    if report.handoff is None:
        kind = {"not_authorized": "NotAuthorized", "old_node": "NoHandoffYet"}.get(
            report.error_kind or "", "Unreachable"
        )
        return kind, report.error or "no status"
    h = report.handoff
    ok, bad = h.get("last_success"), h.get("last_failure")
    if bad and (not ok or float(bad.get("age_s", 0)) <= float(ok.get("age_s", 0))):
        reason = HANDOFF_REASONS.get(str(bad.get("reason")), "HandoffFailed")
        # The node's own words (record.py keeps every peer's text out of them), kept to one printable line.
        said = "".join(ch if ch.isprintable() else " " for ch in str(bad.get("message", "")))[:300]
        text = f"{reason}: {said}" if reason == "HandoffFailed" else f"{bad.get('reason')}: {said}"
        if reason == "Timeout":
            # Tickets expiring unused beside control connections that failed authentication (or spoke
            # another version) since their admission: a misconfigured prefill is the likely cause.
            text += _signal_hints(bad)
        return reason, text[:600]
    recent = _signal_hints(h, "recent_")
    lately = f"; control connections failed before authenticating lately{recent}" if recent else ""
    if not ok:
        return "NoHandoffYet", f"no handoff has reached it{lately}"
    age = float(ok.get("age_s", 0))
    if age > max_age_s and not report.busy:
        return (
            "HandoffStale",
            f"no handoff for over {max_age_s:.0f} s while idle (the last: {_gbps(h)}){lately}",
        )
    # No ages or exact figures: the message changes only when what it says does (no write per resync).
    return "HandoffOK", f"decoded from a handoff within {max_age_s:.0f} s, {_gbps(h)}"


def handoff_ready(
    tilert_desired: int,
    wired: Sequence[TileRTNode],
    reports: Sequence[NodeReport] | None,
    max_age_s: float = HANDOFF_MAX_AGE_S,
) -> Condition:
    """HandoffReady: a handoff from the prefill pool reached every wired TileRT node recently and the node
    decoded from it. `reports` None: not checked (TILERT_PD_HANDOFF_CHECK=0)."""
    t = "HandoffReady"
    if tilert_desired == 0:
        return _cond(t, True, "NoTileRTPool", "no TileRT pool")
    if reports is None:
        return _cond(
            t, True, "NotChecked", "the operator does not check the data plane (TILERT_PD_HANDOFF_CHECK=0)"
        )
    if not wired:
        return _cond(t, False, "NoReadyNodes", "no TileRT node is wired (see EndpointsWired)")
    verdicts = [(r.pod, *node_handoff(r, max_age_s)) for r in reports]
    good = [f"{pod}: {msg}" for pod, reason, msg in verdicts if reason == "HandoffOK"]
    bad = [(pod, reason, msg) for pod, reason, msg in verdicts if reason != "HandoffOK"]
    if not bad:
        return _cond(t, True, "HandoffOK", "; ".join(good))
    # The worst reason names the condition: a failure the data plane reported before the absence of news.
    order = [
        *dict.fromkeys(HANDOFF_REASONS.values()),
        "HandoffFailed",
        "NotAuthorized",
        "Unreachable",
        "HandoffStale",
        "NoHandoffYet",
    ]
    reason = min((r for _, r, _ in bad), key=lambda r: order.index(r) if r in order else len(order))
    hint = _HANDOFF_HINTS.get(reason, "see the node's /metrics and log")
    text = "; ".join(f"{pod}: {r}: {msg}" for pod, r, msg in bad)
    working = f"; working: {'; '.join(good)}" if good else ""
    return _cond(
        t,
        False,
        reason,
        f"{len(bad)} of {len(verdicts)} TileRT node(s) without a working handoff: {text}. {hint}{working}",
    )


def any_handoff_working(reports: Sequence[NodeReport] | None, max_age_s: float = HANDOFF_MAX_AGE_S) -> bool:
    return reports is None or any(node_handoff(r, max_age_s)[0] == "HandoffOK" for r in reports)


def invalid(problems: Sequence[Problem]) -> list[Condition]:
    message = "; ".join(str(p) for p in problems)
    return [
        _cond("SpecValid", False, "InvalidSpec", f"{message}. Nothing in the cluster was changed."),
        _cond("Ready", False, "InvalidSpec", "fix the spec (see SpecValid)"),
    ]


def conditions(
    cluster: str,
    pools: dict[str, PoolState],
    wired: Sequence[TileRTNode],
    unwired: Sequence[Unwired] = (),
    security: Sequence[Condition] = (),
    handoff: Condition | None = None,
    handoff_working: bool = True,
    progressing: Condition | None = None,
) -> list[Condition]:
    """`security`: SecretsOwned, HandoffSecretRotating and DataPlaneProtected, placed before Ready
    (none of them changes whether the stack serves). `handoff`: HandoffReady (handoff_ready); Ready
    needs a working handoff on at least one wired node (`handoff_working`, any_handoff_working), and is
    Degraded while any lacks one. `pools`, `wired` and `handoff` are of the generation that serves
    (the old one while a new generation comes up: Ready stays True meanwhile); `progressing`: the
    rollout of a new generation (progressing()), none under way by default."""
    out = [_cond("SpecValid", True, "Valid", "the spec passed all checks")]
    out += [pool_condition(cluster, c, pools[c]) for c in POOL_CONDITIONS]
    tilert = pools[constants.TILERT]
    if tilert.desired == 0:
        out.append(
            _cond(
                "EndpointsWired",
                True,
                "NoTileRTPool",
                "no TileRT pool; the router sends everything to the native pool",
            )
        )
    elif unwired:
        # Wiring such a node over the pod network would move the state over the wrong network (and,
        # with rdma, not at all): it stays out of the router until Multus reports its address.
        left_out = "; ".join(f"{u.pod}: {u.problem}" for u in unwired)
        out.append(
            _cond(
                "EndpointsWired",
                False,
                "DataPlaneAddressMissing",
                f"{len(unwired)} ready TileRT node(s) left out of the router ({len(wired)} wired): {left_out}",
            )
        )
    elif wired:
        out.append(
            _cond(
                "EndpointsWired", True, "Wired", f"{len(wired)} TileRT node(s) in the router's endpoint list"
            )
        )
    else:
        out.append(
            _cond(
                "EndpointsWired",
                False,
                "NoReadyNodes",
                f"no TileRT node is ready to wire; see {_selector_hint(cluster, constants.TILERT)}",
            )
        )
    checked = handoff is not None
    if handoff is None:
        handoff = handoff_ready(tilert.desired, wired, None)
    working = handoff["status"] == "True" or handoff_working
    out.append(handoff)
    out += list(security)
    out.append(progressing or _cond("Progressing", False, ROLLOUT_COMPLETE, "no rollout under way"))
    missing = []
    if pools[constants.PREFILL].serves == 0:
        missing.append("no prefill pod is ready")
    if pools[constants.ROUTER].serves == 0:
        missing.append("no router pod is ready")
    if tilert.desired and not wired:
        missing.append("no TileRT node is wired")
    elif tilert.desired and not working:
        missing.append(f"no TileRT node has a working handoff ({handoff['reason']}, see HandoffReady)")
    native = pools[constants.NATIVE]
    if native.desired and native.serves == 0:
        missing.append("no native decode pod is ready")
    rolling = [f"{POOL_KEYS[c]}: {s.rolling}" for c, s in pools.items() if s.rolling is not None]
    if missing:
        out.append(_cond("Ready", False, "NotServing", "; ".join(missing)))
    elif rolling:
        # Pods of an earlier template serve, but the spec as it is now has not happened yet.
        out.append(
            _cond(
                "Ready",
                False,
                ROLLING_OUT,
                "the current spec is not rolled out yet (pods of an earlier "
                "template serve meanwhile): " + "; ".join(rolling),
            )
        )
    else:
        short = [f"{POOL_KEYS[c]} {s.text}" for c, s in pools.items() if s.ready < s.desired]
        if short:
            out.append(
                _cond("Ready", True, "Degraded", "serving, below desired replicas: " + ", ".join(short))
            )
        elif unwired:
            out.append(
                _cond(
                    "Ready",
                    True,
                    "Degraded",
                    f"serving; {len(unwired)} TileRT node(s) not wired (see EndpointsWired)",
                )
            )
        elif checked and handoff["status"] != "True":
            out.append(
                _cond(
                    "Ready",
                    True,
                    "Degraded",
                    f"serving; some TileRT nodes have no working handoff ({handoff['reason']}, "
                    "see HandoffReady)",
                )
            )
        else:
            out.append(_cond("Ready", True, "Serving", "all pools ready and TileRT endpoints wired"))
    return out


def progressing(
    reason: str, *, current: str, old: str | None, waiting: Sequence[str] = (), stuck: str | None = None
) -> Condition:
    """Progressing: where a rollout of a new compatibility generation stands (rollout.py). `current`:
    the spec's generation's fingerprint; `old`: the generation beside it (serving, or draining);
    `waiting`: what the new generation still lacks, with counts."""
    lacks = "; ".join(waiting) or "nothing"
    if reason == NEW_GENERATION_STARTING:
        msg = (
            f"generation {current} is being created beside generation {old}, which serves until "
            f"{current} is ready (waiting for: {lacks})"
        )
    elif reason == WAITING_FOR_NEW_GENERATION:
        msg = f"generation {old} serves; generation {current} is not ready yet: {lacks}"
    elif reason == ROLLOUT_STALLED:
        msg = (
            f"generation {old} serves; generation {current} is not getting ready ({stuck or lacks}): check its "
            f"pods (kubectl get pods -l {constants.LABEL_GENERATION}={current}), or set the spec back to "
            f"what generation {old} runs to end the rollout"
        )
    elif reason == DRAINING_OLD_GENERATION:
        msg = (
            f"generation {current} serves; the pods of generation {old} drain ({lacks} left) and go when their "
            "requests are done or the grace period ends"
        )
    else:
        msg = f"generation {current} serves alone"
    ok = reason in (NEW_GENERATION_STARTING, WAITING_FOR_NEW_GENERATION, DRAINING_OLD_GENERATION)
    return _cond("Progressing", ok, reason, msg)


def now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def with_transition_times(
    new: list[Condition], old: list[Condition], generation: int | None
) -> list[Condition]:
    """Keep lastTransitionTime of conditions whose status did not change."""
    by_type = {c.get("type"): c for c in old}
    out = []
    for c in new:
        prev = by_type.get(c["type"])
        stamp = prev.get("lastTransitionTime") if prev and prev.get("status") == c["status"] else None
        out.append(c | {"lastTransitionTime": stamp or now(), "observedGeneration": generation})
    return out


def transitions(new: list[Condition], old: list[Condition]) -> list[Condition]:
    """Conditions whose status or reason changed: each gets an Event. On the first status only Ready does
    (one Event per new PDCluster, not seven), plus SpecValid when the spec is invalid."""
    if not old:
        return [
            c
            for c in new
            if c["type"] == "Ready"
            or (c["type"] in ("SpecValid", *SECURITY_CONDITIONS) and c["status"] == "False")
        ]
    # A reason change is a transition too (Ready: Degraded -> Serving), a message change is not.
    before = {c.get("type"): (c.get("status"), c.get("reason")) for c in old}
    return [c for c in new if before.get(c["type"]) != (c["status"], c["reason"])]


def build(
    *,
    generation: int | None,
    conditions_: list[Condition],
    old: dict[str, Any],
    pools: dict[str, PoolState] | None = None,
    endpoints: Sequence[TileRTNode] = (),
    rotations: dict[str, dict[str, Any]] | None = None,
    applied: bool = True,
    generations: Sequence[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """`applied`: every child of this generation was accepted by the API server. Otherwise (a refused
    apply, an invalid spec, a Secret that is someone else's) the generation is not observed: the
    status keeps the last generation that was, and the conditions (stamped with this generation)
    say why."""
    observed = generation if applied else old.get("observedGeneration")
    status: dict[str, Any] = {
        "conditions": with_transition_times(conditions_, old.get("conditions") or [], generation),
    }
    if observed is not None:
        status = {"observedGeneration": observed} | status
    if pools is not None:
        status["pools"] = {POOL_KEYS[c]: {"ready": s.ready, "desired": s.desired} for c, s in pools.items()}
        status["replicas"] = {POOL_KEYS[c]: s.text for c, s in pools.items()}
        status["endpoints"] = [
            {"name": n.name, "httpUrl": n.http_url, "ctrlHost": n.ctrl_host, "ctrlPort": n.ctrl_port}
            for n in endpoints
        ]
    if generations is not None:
        status["generations"] = list(generations)
    status.update(rotations or {})
    return status


def generation_entry(
    fingerprint: str, slot: str, phase: str, pools: dict[str, PoolState], compat: str | None
) -> dict[str, Any]:
    """One item of status.generations: a generation, its slot, its phase (Starting, Serving,
    Draining) and its data-plane pools' ready/desired counts."""
    out: dict[str, Any] = {
        "fingerprint": fingerprint,
        "slot": slot,
        "phase": phase,
        "pools": {POOL_KEYS[c]: {"ready": s.ready, "desired": s.desired} for c, s in pools.items()},
    }
    if compat is not None:
        out["compat"] = compat
    return out


def merge_patch(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """The JSON merge patch that turns the maps of `new` into what they say: a key an object of `old`
    has and the same object of `new` lacks is set to null (removed). Top-level keys `new` does not
    name are left as they are; lists are replaced whole."""
    out: dict[str, Any] = {}
    for k, v in new.items():
        before = old.get(k)
        if isinstance(v, dict) and isinstance(before, dict):
            out[k] = merge_patch(before, v) | {gone: None for gone in before if gone not in v}
        else:
            out[k] = v
    return out


def same(new: dict[str, Any], old: dict[str, Any]) -> bool:
    """Whether writing `new` would change nothing a reader cares about (idle resyncs write nothing)."""

    def strip(s: dict[str, Any]) -> dict[str, Any]:
        conds = [{k: v for k, v in c.items() if k != "lastTransitionTime"} for c in s.get("conditions") or []]
        return {k: v for k, v in s.items() if k != "conditions"} | {"conditions": conds}

    n, o = strip(new), strip(old)
    return all(o.get(k) == v for k, v in n.items())
