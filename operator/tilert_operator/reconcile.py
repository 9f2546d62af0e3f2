"""One idempotent reconcile of one PDCluster: validate, observe, render, apply what differs, report.

Reads: the handoff Secret, the cluster's pods, and its children of each kind (by label). Writes only
what differs from the rendered intent (a resync with nothing to change writes nothing): server-side
apply of changed or missing children, deletion of children the spec no longer wants, the status
when it changed, and an Event per condition transition.
"""

from __future__ import annotations

import hashlib
import json
import logging
import secrets
from dataclasses import dataclass, field
from typing import Any

from tilert_operator import constants, observe, render, status, validation
from tilert_operator.kubeapi import ApiError, Client, Obj
from tilert_operator.render import network

log = logging.getLogger(__name__)

#: Kinds the operator applies as children (the handoff Secret is created apart, once).
CHILD_KINDS = ("Deployment", "StatefulSet", "Service", "ConfigMap", "NetworkPolicy")
API_VERSIONS = {"Deployment": "apps/v1", "StatefulSet": "apps/v1", "Service": "v1", "ConfigMap": "v1", "NetworkPolicy": "networking.k8s.io/v1"}


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

    @property
    def writes(self) -> int:
        return len(self.applied) + len(self.deleted) + int(self.status_written) + len(self.events)


def owner_reference(body: Obj) -> Obj:
    return {
        "apiVersion": constants.API_VERSION,
        "kind": constants.KIND,
        "name": body["metadata"]["name"],
        "uid": body["metadata"]["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }


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
    meta = body["metadata"]
    ok = cond["status"] == "True"
    event = {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"generateName": f"{meta['name']}.", "namespace": meta["namespace"]},
        "involvedObject": {
            "apiVersion": constants.API_VERSION, "kind": constants.KIND, "name": meta["name"],
            "namespace": meta["namespace"], "uid": meta["uid"],
        },
        "type": "Normal" if ok else "Warning",
        "reason": cond["reason"],
        "message": f"{cond['type']}={cond['status']}: {cond['message']}"[:1000],
        "source": {"component": constants.FIELD_MANAGER},
        "firstTimestamp": status.now(),
        "lastTimestamp": status.now(),
        "count": 1,
    }  # fmt: skip
    await api.create(event)
    out.events.append(f"{cond['type']}={cond['status']}")


async def _write_status(api: Client, body: Obj, new: dict[str, Any], out: Outcome) -> None:
    old = body.get("status") or {}
    if status.same(new, old):
        return
    meta = body["metadata"]
    out.written = await api.patch_status(constants.KIND, meta["namespace"], meta["name"], new)
    out.status_written = True
    for cond in status.transitions(new["conditions"], old.get("conditions") or []):
        await _event(api, body, cond, out)


async def ensure_secret(api: Client, body: Obj) -> Obj:
    """The handoff Secret, created with a fresh token when absent (never re-applied: the token must
    not change under running pods)."""
    meta = body["metadata"]
    name = constants.handoff_secret_name(meta["name"])
    existing = await api.get("Secret", meta["namespace"], name)
    if existing is not None:
        return existing
    secret = adopt(network.handoff_secret(meta["name"], meta["namespace"], secrets.token_urlsafe(32)), body)
    created = await api.create(secret) or await api.get("Secret", meta["namespace"], name)
    if created is None:
        raise ApiError(409, "POST", f"secrets/{name}", "create answered AlreadyExists but the Secret is absent; retrying")
    return created


async def reconcile(api: Client, body: Obj) -> Outcome:
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

    version = network.secret_version_of(await ensure_secret(api, body))
    selector = f"{constants.LABEL_CLUSTER}={cluster}"
    pods = await api.list("Pod", ns, selector)
    nodes, unwired = observe.tilert_nodes(spec, pods)
    pools = observe.pool_states(spec, pods)

    desired = {_key(o): stamp(adopt(o, body)) for o in render.children(spec, cluster, ns, nodes, version)}
    for kind in CHILD_KINDS:
        actual = {_key(o | {"kind": kind}): o for o in await api.list(kind, ns, selector) if _owned_by(o, meta["uid"])}
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

    conds = status.conditions(cluster, pools, nodes, unwired)
    ready = next(c for c in conds if c["type"] == "Ready")
    out.state = "ready" if ready["status"] == "True" else "not_ready"
    new = status.build(generation=generation, conditions_=conds, old=body.get("status") or {}, pools=pools, endpoints=nodes)
    await _write_status(api, body, new, out)
    if out.applied or out.deleted:
        log.info("[%s/%s] applied %s, deleted %s", ns, cluster, out.applied, out.deleted)
    return out
