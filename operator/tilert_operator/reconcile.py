"""One idempotent reconcile of one PDCluster: validate, observe, render, apply what differs, report.

Reads: the handoff and node API Secrets, the cluster's pods, and its children of each kind (by
label). Writes only what differs from the rendered intent (a resync with nothing to change writes
nothing): the Secrets when created, adopted or rotated (credentials.py), server-side apply of changed
or missing children, deletion of children the spec no longer wants, the status when it changed, and
an Event per condition transition. A Secret with the expected name that is not this PDCluster's
stops the reconcile before anything is applied (SecretsOwned=False). MultiNetworkPolicies are
applied only when the API server serves them; otherwise DataPlaneProtected says so and the rest of
the stack is reconciled as usual.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from tilert_operator import constants, credentials, observe, render, status, validation
from tilert_operator.credentials import owner_reference
from tilert_operator.kubeapi import ApiError, Client, Obj

log = logging.getLogger(__name__)

#: Kinds the operator applies as children (the Secrets are created apart, once).
CHILD_KINDS = ("Deployment", "StatefulSet", "Service", "ConfigMap", "NetworkPolicy", "MultiNetworkPolicy")
API_VERSIONS = {"Deployment": "apps/v1", "StatefulSet": "apps/v1", "Service": "v1", "ConfigMap": "v1",
                "NetworkPolicy": "networking.k8s.io/v1", "MultiNetworkPolicy": constants.MULTI_NETWORK_POLICY_API_VERSION}
#: Kinds served by an optional CRD: a 404 on listing them means "not installed", not a failure.
OPTIONAL_KINDS = frozenset({"MultiNetworkPolicy"})


@dataclass
class Outcome:
    """What one reconcile did, for logs, metrics and tests."""

    state: str = "unknown"  # ready | not_ready | invalid
    applied: list[str] = field(default_factory=list)
    deleted: list[str] = field(default_factory=list)
    status_written: bool = False
    #: The PDCluster as the status write returned it (so the next resync compares against it).
    written: Obj | None = None
    events: list[str] = field(default_factory=list)
    #: When the next reconcile is due sooner than the resync (a rotation phase ends), epoch seconds.
    requeue_at: float | None = None
    #: What was done to the Secrets (created, adopted, completed, rotation phases).
    secrets: list[str] = field(default_factory=list)

    @property
    def writes(self) -> int:
        return len(self.applied) + len(self.deleted) + int(self.status_written) + len(self.events) + len(self.secrets)


def adopt(obj: Obj, body: Obj) -> Obj:
    obj["metadata"]["ownerReferences"] = [owner_reference(body)]
    return obj


def stamp(obj: Obj) -> Obj:
    """Record the intent's hash on the child (see constants.APPLIED_HASH_ANNOTATION)."""
    digest = hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:20]
    obj["metadata"].setdefault("annotations", {})[constants.APPLIED_HASH_ANNOTATION] = digest
    return obj


def contains(actual: Any, desired: Any) -> bool:
    """Whether `actual` already holds everything in `desired` (server defaults may add more).

    Scalars compare as text too, because the API server canonicalises quantities (8 -> "8").
    """
    if isinstance(desired, dict):
        return isinstance(actual, dict) and all(k in actual and contains(actual[k], v) for k, v in desired.items())
    if isinstance(desired, list):
        return isinstance(actual, list) and len(actual) == len(desired) and all(contains(a, d) for a, d in zip(actual, desired, strict=True))
    return bool(actual == desired or str(actual) == str(desired))


def _owned_by(obj: Obj, uid: str) -> bool:
    return any(ref.get("uid") == uid for ref in obj.get("metadata", {}).get("ownerReferences") or [])


def _key(obj: Obj) -> str:
    return f"{obj['kind']}/{obj['metadata']['name']}"


async def _event(api: Client, body: Obj, cond: status.Condition, out: Outcome) -> None:
    await _post_event(api, body, ok=cond["status"] == "True", reason=cond["reason"],
                      message=f"{cond['type']}={cond['status']}: {cond['message']}", out=out,
                      tag=f"{cond['type']}={cond['status']}")


async def _post_event(api: Client, body: Obj, *, ok: bool, reason: str, message: str, out: Outcome, tag: str) -> None:
    meta = body["metadata"]
    event = {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"generateName": f"{meta['name']}.", "namespace": meta["namespace"]},
        "involvedObject": {
            "apiVersion": constants.API_VERSION, "kind": constants.KIND, "name": meta["name"],
            "namespace": meta["namespace"], "uid": meta["uid"],
        },
        "type": "Normal" if ok else "Warning",
        "reason": reason,
        "message": message[:1000],
        "source": {"component": constants.FIELD_MANAGER},
        "firstTimestamp": status.now(),
        "lastTimestamp": status.now(),
        "count": 1,
    }  # fmt: skip
    await api.create(event)
    out.events.append(tag)


async def _write_status(api: Client, body: Obj, new: dict[str, Any], out: Outcome) -> None:
    old = body.get("status") or {}
    if status.same(new, old):
        return
    meta = body["metadata"]
    out.written = await api.patch_status(constants.KIND, meta["namespace"], meta["name"], new)
    out.status_written = True
    for cond in status.transitions(new["conditions"], old.get("conditions") or []):
        await _event(api, body, cond, out)


async def _list_children(api: Client, kind: str, ns: str, selector: str) -> list[Obj] | int:
    """The children of one kind; for an optional kind the API server does not serve (404) or does not
    let the operator list (403, a ClusterRole older than the operator), that status instead."""
    try:
        return await api.list(kind, ns, selector)
    except ApiError as e:
        if e.status in (403, 404) and kind in OPTIONAL_KINDS:
            return e.status
        raise


async def reconcile(api: Client, body: Obj, *, rotation_grace_s: float = credentials.DEFAULT_GRACE_S,
                    now: float | None = None) -> Outcome:
    out = Outcome()
    meta = body["metadata"]
    cluster, ns, generation = meta["name"], meta["namespace"], meta.get("generation")
    if meta.get("deletionTimestamp"):
        return out  # ownerReferences let the garbage collector remove the children
    spec, problems = validation.validate(body.get("spec") or {}, cluster)
    if spec is None or problems:
        out.state = "invalid"
        await _write_status(api, body, status.build(generation=generation, conditions_=status.invalid(problems), old=body.get("status") or {}), out)
        return out

    now = time.time() if now is None else now
    handoff = await credentials.ensure_handoff(api, body)
    node_api = await credentials.ensure_node_api(api, body)
    not_owned = [s.problem for s in (handoff, node_api) if s.problem]
    for s in (handoff, node_api):
        out.secrets += [f"{s.name}: {a}" for a in s.actions]
        # Creation is the normal path; adopting or completing someone's Secret is worth an Event.
        for a in s.actions:
            if a != "created":
                await _post_event(api, body, ok=True, reason="SecretAdopted" if a == "adopted" else "SecretCompleted",
                                  message=f"Secret {s.name}: {a}", out=out, tag=f"{s.name}: {a}")
    if not_owned:
        out.state = "not_ready"
        await _write_status(api, body, status.build(generation=generation, conditions_=status.secrets_not_owned(not_owned),
                                                    old=body.get("status") or {}), out)
        return out
    # Each phase change is a *Rotating condition's transition, so it gets its Event with the status write.
    rotation = await credentials.rotate(api, body, handoff, now=now, grace_s=rotation_grace_s)
    token_rotation = await credentials.rotate(api, body, node_api, now=now, grace_s=rotation_grace_s,
                                              scheme=credentials.NODE_API)
    for s in (handoff, node_api):
        out.secrets += [f"{s.name}: {a}" for a in s.actions if a.startswith("rotation")]
    due = [t for t in (rotation.due(rotation_grace_s), token_rotation.due(rotation_grace_s)) if t is not None]
    out.requeue_at = min(due) if due else None

    selector = f"{constants.LABEL_CLUSTER}={cluster}"
    pods = await api.list("Pod", ns, selector)
    nodes, unwired = observe.tilert_nodes(spec, pods)
    pools = observe.pool_states(spec, pods)

    desired = {_key(o): stamp(adopt(o, body)) for o in render.children(spec, cluster, ns, nodes)}
    #: Per kind: 200, or the 403/404 an optional kind answered.
    served: dict[str, int] = {}
    for kind in CHILD_KINDS:
        listed = await _list_children(api, kind, ns, selector)
        served[kind] = listed if isinstance(listed, int) else 200
        if isinstance(listed, int):
            continue  # not served or not allowed: nothing to compare, apply or delete (status says so if wanted)
        actual = {_key(o | {"kind": kind}): o for o in listed if _owned_by(o, meta["uid"])}
        for key, want in desired.items():
            # List items carry no apiVersion/kind on a real API server: compare the rest.
            body_only = {k: v for k, v in want.items() if k not in ("apiVersion", "kind")}
            if want["kind"] == kind and not contains(actual.get(key), body_only):
                await api.apply(want)
                out.applied.append(key)
        for key, have in actual.items():
            if key not in desired:
                await api.delete(kind, ns, have["metadata"]["name"])
                out.deleted.append(key)

    rdma = spec.transfer.rdma
    wants_mnp = any(o["kind"] == "MultiNetworkPolicy" for o in desired.values())
    security = [
        status.rotation(cluster, credentials.HANDOFF, rotation.status(rotation_grace_s)),
        status.rotation(cluster, credentials.NODE_API, token_rotation.status(rotation_grace_s)),
        status.data_plane(rdma.networks, rdma.host_network, spec.network_policies.enabled,
                          served["MultiNetworkPolicy"] if wants_mnp else None),
    ]
    conds = status.conditions(cluster, pools, nodes, unwired, [status.secrets_owned([handoff.name, node_api.name]), *security])
    ready = next(c for c in conds if c["type"] == "Ready")
    out.state = "ready" if ready["status"] == "True" else "not_ready"
    new = status.build(generation=generation, conditions_=conds, old=body.get("status") or {}, pools=pools, endpoints=nodes,
                       rotations={"handoffSecret": rotation.status(rotation_grace_s),
                                  "nodeApiToken": token_rotation.status(rotation_grace_s)})
    await _write_status(api, body, new, out)
    if out.applied or out.deleted:
        log.info("[%s/%s] applied %s, deleted %s", ns, cluster, out.applied, out.deleted)
    return out
