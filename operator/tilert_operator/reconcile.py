"""One idempotent reconcile of one PDCluster: validate, observe, render, apply what differs, report.

Reads: the handoff and node API Secrets, the cluster's pods, and its children of each kind (by
label). Writes only what differs from the rendered intent (a resync with nothing to change writes
nothing): the Secrets when created, adopted or rotated (credentials.py), server-side apply of changed
or missing children, deletion of children the spec no longer wants, the status when it changed, and
an Event per condition transition. A Secret with the expected name that is not this PDCluster's
stops the reconcile before anything is applied (SecretsOwned=False). A child is never taken over
either: before its first apply, an object of its name without this PDCluster's ownerReference is
read, and left untouched unless marked for adoption like a Secret (credentials.adoptable); otherwise
ChildrenOwned=False, Reconciled=False and Ready=False (ChildNotOwned) name it and say what to do, and
the garbage collector never deletes it with the PDCluster. MultiNetworkPolicies are
applied only when the API server serves them; otherwise DataPlaneProtected says so and the rest of
the stack is reconciled as usual.

Failures are visible, not only logged: a child the API server refuses (or that cannot be written
after the client's retries) is reported in the same reconcile as `Reconciled=False` (reason
ApplyRejected, the child and the API server's message) with a Warning Event naming the child; the
other children are still applied, and the reconcile is retried after FAILED_RETRY_S. Any other
failure of a reconcile (a list, a Secret) writes `Reconciled=False` (ReconcileError) before the
controller backs off. A refusal by the operator's own role (403) is neither: reason Forbidden, and
the message names the verb and the resource the role lacks and sends the reader to the chart's RBAC,
not to the spec. The next reconcile that applies everything sets `Reconciled=True` again.
Until then the generation is not observed: status.observedGeneration stays the last one applied, and
Ready is False (NotApplied). An applied generation is Ready only once its workloads report it rolled
out (observe.rollout reads their own status; the old pods do not count as the new generation's).
Which compatibility generations are rendered is decided before anything is applied (_plan,
rollout.py), from the workloads and pods as listed: the spec's generation, and while it is not ready
the one that served before it, each in its slot (render/generations.py); the old one's children go in
the reconcile that finds the new one ready. Ready and the pool conditions follow the generation that
serves; Progressing and status.generations say where a rollout stands (docs/operator.md).
Children are compared with what the server holds by meaning: quantities (`0.5` and `500m`) by value,
keyed lists by the keys server-side apply merges them by (someone else's env var or port is no
difference), an empty map as absent. An Event that repeats is one Event with a count (kubeapi.Client.event).
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import time
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

from tilert_operator import constants, credentials, kubeapi, render, rollout, status, validation
from tilert_operator import handoff as handoff_check
from tilert_operator.credentials import owner_reference
from tilert_operator.kubeapi import ApiError, Client, Obj
from tilert_operator.render.generations import Live
from tilert_operator.render.generations import generation as generation_of
from tilert_operator.spec import PDClusterSpec

log = logging.getLogger(__name__)

#: Kinds the operator applies as children (the Secrets are created apart, once).
CHILD_KINDS = (
    "Deployment",
    "StatefulSet",
    "Service",
    "ConfigMap",
    "NetworkPolicy",
    "MultiNetworkPolicy",
    "PodDisruptionBudget",
)
API_VERSIONS = {
    "Deployment": "apps/v1",
    "StatefulSet": "apps/v1",
    "Service": "v1",
    "ConfigMap": "v1",
    "PodDisruptionBudget": "policy/v1",
    "NetworkPolicy": "networking.k8s.io/v1",
    "MultiNetworkPolicy": constants.MULTI_NETWORK_POLICY_API_VERSION,
}
#: Kinds served by an optional CRD: a 404 on listing them means "not installed", not a failure.
OPTIONAL_KINDS = frozenset({"MultiNetworkPolicy"})
#: Seconds until a reconcile that could not apply a child runs again (a spec change runs it sooner).
FAILED_RETRY_S = 10.0
RECONCILED = "Reconciled"
CHILDREN_OWNED = "ChildrenOwned"
CHILD_NOT_OWNED = "ChildNotOwned"
FORBIDDEN = "Forbidden"
APPLY_REJECTED = "ApplyRejected"
RECONCILE_ERROR = "ReconcileError"
#: Ready's reason while the current generation could not be applied (Reconciled=False says why).
NOT_APPLIED = "NotApplied"
#: Reasons of a Failure, most pressing first: Reconciled takes the first that any failure has (each
#: failure's own Event keeps its own reason).
SEVERITY = (CHILD_NOT_OWNED, FORBIDDEN, APPLY_REJECTED, RECONCILE_ERROR)
#: What to do about a 403: the role comes from the chart, and an older chart lacks newer rules.
RBAC_FIX = "fix the chart's RBAC or install the chart's current version"


class Failure(NamedTuple):
    """A child (or the reconcile) that could not be made what the spec says."""

    key: str  # Kind/name, or "reconcile"
    message: str
    reason: str = APPLY_REJECTED


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
    #: Children the API server refused, that could not be written, or that are someone else's.
    failed: list[Failure] = field(default_factory=list)
    #: Children taken over because they were marked for adoption (Kind/name).
    adopted: list[str] = field(default_factory=list)

    @property
    def writes(self) -> int:
        return (
            len(self.applied)
            + len(self.deleted)
            + int(self.status_written)
            + len(self.events)
            + len(self.secrets)
        )


def adopt(obj: Obj, body: Obj) -> Obj:
    obj["metadata"]["ownerReferences"] = [owner_reference(body)]
    return obj


def stamp(obj: Obj) -> Obj:
    """Record the intent's hash on the child (see constants.APPLIED_HASH_ANNOTATION)."""
    digest = hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:20]
    obj["metadata"].setdefault("annotations", {})[constants.APPLIED_HASH_ANNOTATION] = digest
    return obj


#: Lists the built-in kinds' schemas merge by key (x-kubernetes-list-type: map), with their keys:
#: server-side apply keeps someone else's entries beside ours, so the live list may hold more, in
#: any order. Every other list is atomic: compared whole, in order.
LIST_MAP_KEYS: dict[str, tuple[str, ...]] = {
    "containers": ("name",),
    "initContainers": ("name",),
    "ephemeralContainers": ("name",),
    "env": ("name",),
    "volumes": ("name",),
    "volumeMounts": ("mountPath",),
    "imagePullSecrets": ("name",),
    "ports": ("containerPort", "protocol"),
}


def list_keys(path: tuple[str, ...], items: list[Any]) -> tuple[str, ...] | None:
    """The merge keys of a list at `path` (keys of a built-in object, lists as "[]"); None when atomic."""
    field = path[-1] if path else ""
    if not items or field not in LIST_MAP_KEYS or not all(isinstance(i, dict) for i in items):
        return None
    if field == "ports" and not all("containerPort" in i for i in items):
        # A Service's ports are a map by port and protocol; a NetworkPolicy rule's are atomic.
        return ("port", "protocol") if path == ("spec", "ports") else None
    return LIST_MAP_KEYS[field]


def _item_key(keys: tuple[str, ...], item: dict[str, Any]) -> tuple[Any, ...]:
    # The API server defaults a port's protocol to TCP: an entry without one is the TCP entry.
    return tuple(str(item.get(k, "TCP" if k == "protocol" else None)) for k in keys)


def contains(actual: Any, desired: Any, path: tuple[str, ...] = ()) -> bool:
    """Whether `actual` already holds everything in `desired` (server defaults and other managers'
    fields may add more), so that a resync at rest applies nothing.

    Compared by meaning where the API server normalises: a quantity (resources' requests and limits,
    an emptyDir's sizeLimit, pod overhead) is stored canonical (`0.5` -> `500m`, `1.5Gi` -> `1536Mi`,
    8 -> "8"), so quantities compare by value; other scalars compare as text too (8 and "8"); an empty
    string, list or map the server omits on read (an env var's `value: ""`, `limits: {}`) matches its
    absence. Keyed lists (containers and env by name, ports by containerPort and protocol, volumes by
    name: LIST_MAP_KEYS) are matched by key as server-side apply merges them, so an entry someone
    else added is no difference; an entry of ours that differs or is missing is.
    """
    if isinstance(desired, dict):
        return isinstance(actual, dict) and all(
            contains(actual[k], v, (*path, k)) if k in actual else _omitted(v) for k, v in desired.items()
        )
    if isinstance(desired, list):
        if not isinstance(actual, list):
            return False
        keys = list_keys(path, desired)
        if keys is not None:
            live = {_item_key(keys, a): a for a in actual if isinstance(a, dict)}
            return all(contains(live.get(_item_key(keys, d)), d, (*path, "[]")) for d in desired)
        return len(actual) == len(desired) and all(
            contains(a, d, (*path, "[]")) for a, d in zip(actual, desired, strict=True)
        )
    if actual == desired or str(actual) == str(desired):
        return True
    if is_quantity(path):
        try:
            return validation.parse_quantity(actual) == validation.parse_quantity(desired)
        except ValueError:
            return False
    return False


def _omitted(value: Any) -> bool:
    """An empty string, list or map the API server does not return (its types mark them omitempty)."""
    return bool(value == "" or value == [] or value == {})


def is_quantity(path: tuple[str, ...]) -> bool:
    """Whether a field of a built-in object (its path of keys, lists as "[]") holds a quantity."""
    return (
        (len(path) >= 3 and path[-3] == "resources" and path[-2] in ("requests", "limits"))
        or (len(path) >= 2 and path[-2] == "emptyDir" and path[-1] == "sizeLimit")
        or (len(path) >= 2 and path[-2] == "overhead")
    )


def api_message(error: ApiError) -> str:
    """The API server's own message in a failed call (its Status's `message`, after the HTTP status),
    else the error's text."""
    for attr in ("message", "body", "text"):  # a richer ApiError keeps the whole answer
        value = getattr(error, attr, None)
        if isinstance(value, dict) and isinstance(value.get("message"), str):
            code = getattr(error, "status", None)
            return (f"HTTP {code}: " if code else "") + str(value["message"])
        if isinstance(value, str):
            found = _message_in(value)
            if found:
                return found
    return _message_in(str(error)) or str(error)


def _message_in(text: str) -> str | None:
    m = re.search(r'"message":\s*"((?:[^"\\]|\\.)*)("?)', text)
    if m is None:
        return None
    raw, closed = m.groups()
    try:
        message = str(json.loads(f'"{raw}"'))
    except ValueError:
        message = raw
    code = re.search(r"HTTP (\d{3})", text)
    prefix = f"HTTP {code.group(1)}: " if code else ""
    return prefix + message + ("" if closed else "...")


def forbidden(error: ApiError, *, verb: str | None = None, kind: str | None = None) -> str | None:
    """For a 403, what the operator's role lacks and what to do; None for any other error.

    A refusal by the authorization filter names the verb and the resource; OwnerReferencesPermission-
    Enforcement's names what it checks in words; a create refused inside a server-side apply names
    neither (the RBAC authorizer gives no reason), so `verb` and `kind` (the call that failed: "create"
    for an apply that creates) stand in for what the answer leaves out."""
    if error.status != 403:
        return None
    text = api_message(error)
    details = (error.body or {}).get("details") or {}
    group, resource = kubeapi.group_resource(kind) if kind is not None and kind in kubeapi.KINDS else ("", "")
    if details.get("kind"):
        group, resource = str(details.get("group") or ""), str(details["kind"])
    said = re.search(r'cannot (\S+) resource "([^"]+)" in API group "([^"]*)"', text)
    if said:
        verb, resource, group = said.groups()
    elif "can't set finalizers on" in text:  # blockOwnerDeletion: the owner's finalizers subresource
        verb, resource, group = "update", f"{constants.PLURAL}/finalizers", constants.GROUP
    elif "on a resource you can't delete" in text:  # changing an object's ownerReferences
        verb = "delete"
    where = f' in API group "{group}"' if group else ""
    lacks = (
        f"{verb} on {resource or 'a resource'}{where}"
        if verb
        else f"a permission on {resource or 'a resource'}{where}"
    )
    return f"forbidden: the operator's role lacks {lacks} ({RBAC_FIX}); the API server said: {text}"


def failure(
    key: str,
    error: ApiError,
    *,
    verb: str | None = None,
    kind: str | None = None,
    otherwise: str = APPLY_REJECTED,
    prefix: str = "",
) -> Failure:
    """A failed call as a Failure: Forbidden when the role refused it, else `otherwise`."""
    lacking = forbidden(error, verb=verb, kind=kind)
    if lacking is not None:
        return Failure(key, prefix + lacking, FORBIDDEN)
    return Failure(key, prefix + api_message(error), otherwise)


def _earlier_owner(obj: Obj, body: Obj) -> bool:
    """Whether a PDCluster of this name but another uid (deleted, then created again) controls `obj`."""
    meta = body["metadata"]
    return any(
        r.get("kind") == constants.KIND
        and r.get("apiVersion", "").startswith(f"{constants.GROUP}/")
        and r.get("name") == meta["name"]
        and r.get("uid") != meta["uid"]
        and r.get("controller")
        for r in obj.get("metadata", {}).get("ownerReferences") or []
    )


def _owned_by(obj: Obj, uid: str) -> bool:
    return any(ref.get("uid") == uid for ref in obj.get("metadata", {}).get("ownerReferences") or [])


def _key(obj: Obj) -> str:
    return f"{obj['kind']}/{obj['metadata']['name']}"


async def _event(api: Client, body: Obj, cond: status.Condition, out: Outcome) -> None:
    await _post_event(
        api,
        body,
        ok=not status.is_fault(cond),
        reason=cond["reason"],
        message=f"{cond['type']}={cond['status']}: {cond['message']}",
        out=out,
        tag=f"{cond['type']}={cond['status']}",
    )


async def _post_event(
    api: Client,
    body: Obj,
    *,
    ok: bool,
    reason: str,
    message: str,
    out: Outcome,
    tag: str,
    related: Obj | None = None,
) -> None:
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
    if related is not None:
        event["related"] = related
    await api.event(event)
    out.events.append(tag)


async def _write_status(api: Client, body: Obj, new: dict[str, Any], out: Outcome) -> None:
    old = body.get("status") or {}
    if status.same(new, old):
        return
    meta = body["metadata"]
    # A merge patch keeps what it does not name: a key the status no longer has (a finished
    # rotation's nextPhaseAt) is removed explicitly, or every resync would find it and write again.
    out.written = await api.patch_status(
        constants.KIND, meta["namespace"], meta["name"], status.merge_patch(old, new)
    )
    out.status_written = True
    for cond in status.transitions(new["conditions"], old.get("conditions") or []):
        if cond["type"] != RECONCILED:  # its Events name each child (_failure_events)
            await _event(api, body, cond, out)


def _old_condition(body: Obj, type_: str) -> Obj:
    return next((c for c in (body.get("status") or {}).get("conditions") or [] if c.get("type") == type_), {})


def reconciled(failed: list[Failure]) -> status.Condition:
    """Reconciled: whether every child the spec wants is what the API server holds. Only a refusal
    of what the spec rendered (ApplyRejected) sends the reader to the spec."""
    if not failed:
        return {
            "type": RECONCILED,
            "status": "True",
            "reason": "Applied",
            "message": "every child matches the spec",
        }
    reason = next(r for r in SEVERITY if any(f.reason == r for f in failed))
    listed = "; ".join(f"{f.key}: {f.message}" for f in failed)
    spec_fix = (
        "; fix the spec field that renders it" if any(f.reason == APPLY_REJECTED for f in failed) else ""
    )
    return {
        "type": RECONCILED,
        "status": "False",
        "reason": reason,
        "message": f"{listed} (retried every {FAILED_RETRY_S:.0f}s and on every spec change{spec_fix}; see the Events)",
    }


def children_owned(failed: list[Failure]) -> status.Condition:
    """ChildrenOwned: no object the stack needs is someone else's under the child's name."""
    foreign = [f for f in failed if f.reason == CHILD_NOT_OWNED]
    if not foreign:
        return {
            "type": CHILDREN_OWNED,
            "status": "True",
            "reason": "Owned",
            "message": "every child is this PDCluster's",
        }
    return {
        "type": CHILDREN_OWNED,
        "status": "False",
        "reason": CHILD_NOT_OWNED,
        "message": "; ".join(f.message for f in foreign),
    }


async def _failure_events(api: Client, body: Obj, cond: status.Condition, out: Outcome, ns: str) -> None:
    """A Warning Event per refused child when the failures change; a Normal one when they are gone."""
    old = _old_condition(body, RECONCILED)
    if cond["status"] == "True":
        if old.get("status") == "False":
            await _post_event(
                api,
                body,
                ok=True,
                reason="Reconciled",
                message=f"{RECONCILED}=True: {cond['message']}",
                out=out,
                tag=f"{RECONCILED}=True",
            )
        return
    if (old.get("status"), old.get("reason"), old.get("message")) == (
        cond["status"],
        cond["reason"],
        cond["message"],
    ):
        return
    for f in out.failed:
        kind, _, name = f.key.partition("/")
        related = (
            {"apiVersion": API_VERSIONS.get(kind, "v1"), "kind": kind, "name": name, "namespace": ns}
            if name
            else None
        )
        await _post_event(
            api,
            body,
            ok=False,
            reason=f.reason,
            message=f"{f.key}: {f.message}",
            out=out,
            tag=f"{f.reason} {f.key}",
            related=related,
        )


async def _list_children(api: Client, kind: str, ns: str, selector: str) -> list[Obj] | int:
    """The children of one kind; for an optional kind the API server does not serve (404) or does not
    let the operator list (403, a ClusterRole older than the operator), that status instead."""
    try:
        return await api.list(kind, ns, selector)
    except ApiError as e:
        if e.status in (403, 404) and kind in OPTIONAL_KINDS:
            return e.status
        raise


async def reconcile(
    api: Client, body: Obj, *, rotation_grace_s: float = credentials.DEFAULT_GRACE_S, now: float | None = None
) -> Outcome:
    out = Outcome()
    try:
        return await _reconcile(api, body, out, rotation_grace_s=rotation_grace_s, now=now)
    except Exception as e:
        # Visible before the controller backs off: the condition and an Event say what failed.
        try:
            if body["metadata"].get("uid") and not body["metadata"].get("deletionTimestamp"):
                await _report_error(api, body, e, out)
        except Exception as report:  # the API server may be what failed: the log has both
            log.warning(
                "[%s/%s] could not report the failure (%s)",
                body["metadata"].get("namespace"),
                body["metadata"].get("name"),
                report,
            )
        raise


async def _report_error(api: Client, body: Obj, error: Exception, out: Outcome) -> None:
    if isinstance(error, ApiError):
        failed = failure("reconcile", error, otherwise=RECONCILE_ERROR)
    else:
        failed = Failure("reconcile", f"{type(error).__name__}: {error}", RECONCILE_ERROR)
    cond = reconciled([failed._replace(message=failed.message[:800])])
    old = body.get("status") or {}
    conds = [c for c in old.get("conditions") or [] if c.get("type") != RECONCILED]
    conds = status.with_transition_times(
        [*conds, cond], old.get("conditions") or [], body["metadata"].get("generation")
    )
    meta = body["metadata"]
    before = _old_condition(body, RECONCILED)
    if (before.get("status"), before.get("reason"), before.get("message")) == (
        cond["status"],
        cond["reason"],
        cond["message"],
    ):
        return
    out.written = await api.patch_status(
        constants.KIND, meta["namespace"], meta["name"], {"conditions": conds}
    )
    await _post_event(
        api,
        body,
        ok=False,
        reason=cond["reason"],
        message=f"reconcile failed: {failed.message}",
        out=out,
        tag=cond["reason"],
    )


async def _not_applied(
    api: Client, body: Obj, out: Outcome, state: str, conditions: list[status.Condition]
) -> Outcome:
    """End a reconcile that applies nothing (a spec or Secrets it cannot use): the status says why and
    keeps the last applied generation."""
    out.state = state
    built = status.build(
        generation=body["metadata"].get("generation"),
        conditions_=conditions,
        old=body.get("status") or {},
        applied=False,
    )
    await _write_status(api, body, built, out)
    return out


async def _reconcile(
    api: Client, body: Obj, out: Outcome, *, rotation_grace_s: float, now: float | None
) -> Outcome:
    meta = body["metadata"]
    cluster, ns, generation = meta["name"], meta["namespace"], meta.get("generation")
    if meta.get("deletionTimestamp"):
        return out  # ownerReferences let the garbage collector remove the children
    spec, problems = validation.validate(body.get("spec") or {}, cluster)
    if spec is None or problems:
        return await _not_applied(api, body, out, "invalid", status.invalid(problems))

    now = time.time() if now is None else now
    handoff = await credentials.ensure_handoff(api, body)
    node_api = await credentials.ensure_node_api(api, body)
    not_owned = [s.problem for s in (handoff, node_api) if s.problem]
    for s in (handoff, node_api):
        out.secrets += [f"{s.name}: {a}" for a in s.actions]
        # Creation is the normal path; adopting or completing someone's Secret is worth an Event.
        for a in s.actions:
            if a != "created":
                await _post_event(
                    api,
                    body,
                    ok=True,
                    reason="SecretAdopted" if a == "adopted" else "SecretCompleted",
                    message=f"Secret {s.name}: {a}",
                    out=out,
                    tag=f"{s.name}: {a}",
                )
    if not_owned:
        return await _not_applied(api, body, out, "not_ready", status.secrets_not_owned(not_owned))
    # Each phase change is a *Rotating condition's transition, so it gets its Event with the status write.
    rotation = await credentials.rotate(api, body, handoff, now=now, grace_s=rotation_grace_s)
    token_rotation = await credentials.rotate(
        api, body, node_api, now=now, grace_s=rotation_grace_s, scheme=credentials.NODE_API
    )
    for s in (handoff, node_api):
        out.secrets += [f"{s.name}: {a}" for a in s.actions if a.startswith("rotation")]
    due = [t for t in (rotation.due(rotation_grace_s), token_rotation.due(rotation_grace_s)) if t is not None]
    out.requeue_at = min(due) if due else None

    selector = f"{constants.LABEL_CLUSTER}={cluster}"
    pods = await api.list("Pod", ns, selector)
    #: Per kind: 200, or the 403/404 an optional kind answered.
    served: dict[str, int] = {}
    #: Per kind served: the children this PDCluster owns (Kind/name -> object).
    owned: dict[str, dict[str, Obj]] = {}
    # Every kind is listed before anything is rendered: which generations run is read from the workloads.
    for kind in CHILD_KINDS:
        listed = await _list_children(api, kind, ns, selector)
        served[kind] = listed if isinstance(listed, int) else 200
        if not isinstance(listed, int):  # else not served or not allowed: nothing to compare, apply or delete
            owned[kind] = {_key(o | {"kind": kind}): o for o in listed if _owned_by(o, meta["uid"])}
    #: The workloads as the API server holds them after this reconcile's applies (Kind/name -> object).
    live: dict[str, Obj] = {k: o for objs in owned.values() for k, o in objs.items()}

    plan = await _plan(spec, cluster, pods, live, body, node_api.secret, now)
    desired = {_key(o): stamp(adopt(o, body)) for o in render.children(spec, cluster, ns, lives=plan.lives)}
    for kind, actual in owned.items():
        for key, want in desired.items():
            # List items carry no apiVersion/kind on a real API server: compare the rest.
            body_only = {k: v for k, v in want.items() if k not in ("apiVersion", "kind")}
            if want["kind"] == kind and not contains(actual.get(key), body_only):
                written = await _apply_child(api, body, want, key, owned=key in actual, out=out)
                if written is not None:
                    live[key] = written
        for key, have in actual.items():
            if key not in desired:
                try:
                    await api.delete(kind, ns, have["metadata"]["name"])
                except ApiError as e:
                    log.warning("[%s/%s] deleting %s failed: %s", ns, cluster, key, e)
                    out.failed.append(
                        failure(key, e, verb="delete", kind=kind, prefix="could not delete it: ")
                    )
                    continue
                out.deleted.append(key)
                live.pop(key, None)
    if out.failed:
        retry = (time.time() if now is None else now) + FAILED_RETRY_S
        out.requeue_at = retry if out.requeue_at is None else min(out.requeue_at, retry)

    # Ready counts and rollouts from the workloads' own status (what the apply answered, when applied).
    views = {g.slot: rollout.observe_view(g, cluster, pods, live) for g in plan.lives}
    current = views[plan.lives[-1].slot]
    serving = views[plan.lives[0].slot]  # the old generation while the new one is not ready
    pools = current.pools
    nodes = [n for v in views.values() for n in v.nodes]

    rdma = spec.transfer.rdma
    wants_mnp = any(o["kind"] == "MultiNetworkPolicy" for o in desired.values())
    security = [
        status.rotation(cluster, credentials.HANDOFF, rotation.status(rotation_grace_s)),
        status.rotation(cluster, credentials.NODE_API, token_rotation.status(rotation_grace_s)),
        status.data_plane(
            rdma.networks,
            rdma.host_network,
            spec.network_policies.enabled,
            served["MultiNetworkPolicy"] if wants_mnp else None,
        ),
    ]
    applied = reconciled(out.failed)
    owned_cond = children_owned(out.failed)
    # HandoffReady (issue 11): each wired TileRT node's own record of the handoffs that reached it
    # (polled once per reconcile, in _plan), for the generation that serves.
    reports = plan.reports_of(serving.nodes)
    progressing = plan.progressing()
    conds = status.conditions(
        cluster,
        serving.pools,
        serving.nodes,
        serving.unwired,
        [status.secrets_owned([handoff.name, node_api.name]), owned_cond, *security, applied],
        handoff=status.handoff_ready(serving.live.spec.decode.tilert.replicas, serving.nodes, reports),
        handoff_working=status.any_handoff_working(reports),
        progressing=progressing,
    )
    if serving is not current:
        # Ready says whether the stack serves: it does, from the old generation, while the new one comes up.
        conds = [
            c
            if c["type"] != "Ready"
            else c | {"message": f"{c['message']} (generation {serving.live.generation.fingerprint}; "
                      f"generation {current.live.generation.fingerprint} is coming up: see Progressing)"}
            for c in conds
        ]  # fmt: skip
    if owned_cond["status"] == "False":
        # What serves under a child's name is not what this PDCluster describes: not Ready, whatever the pods say.
        conds = [
            c
            if c["type"] != "Ready"
            else {
                "type": "Ready",
                "status": "False",
                "reason": CHILD_NOT_OWNED,
                "message": "an object with a child's name is not this PDCluster's (see ChildrenOwned)",
            }
            for c in conds
        ]
    elif out.failed:
        # This generation is not what runs: whatever the pods say, it is not Ready.
        before = (body.get("status") or {}).get("observedGeneration")
        running = (
            f"generation {before} is what runs"
            if before is not None
            else "no generation of it was applied yet"
        )
        conds = [
            c
            if c["type"] != "Ready"
            else {
                "type": "Ready",
                "status": "False",
                "reason": NOT_APPLIED,
                "message": (
                    f"generation {generation} of the spec is not applied ({running}): see Reconciled for what the API server "
                    "refused and what to do"
                ),
            }
            for c in conds
        ]
    ready = next(c for c in conds if c["type"] == "Ready")
    out.state = "ready" if ready["status"] == "True" else "not_ready"
    new = status.build(
        generation=generation,
        conditions_=conds,
        old=body.get("status") or {},
        pools=pools,
        endpoints=nodes,
        rotations={
            "handoffSecret": rotation.status(rotation_grace_s),
            "nodeApiToken": token_rotation.status(rotation_grace_s),
        },
        applied=not out.failed,
        generations=plan.generations(views, progressing),
    )
    await _write_status(api, body, new, out)
    await _failure_events(api, body, applied, out, ns)
    for key in out.adopted:
        await _post_event(
            api,
            body,
            ok=True,
            reason="ChildAdopted",
            out=out,
            tag=f"adopted {key}",
            message=f"{key}: adopted (marked {constants.ADOPT_ANNOTATION}=true); it now follows the spec "
            "and is deleted with the PDCluster",
        )
    if out.applied or out.deleted:
        log.info("[%s/%s] applied %s, deleted %s", ns, cluster, out.applied, out.deleted)
    return out


async def _plan(
    spec: PDClusterSpec,
    cluster: str,
    pods: list[Obj],
    live: dict[str, Obj],
    body: Obj,
    node_api_secret: Obj | None,
    now: float,
) -> rollout.Plan:
    """Which generations to render (rollout.py), from the workloads and pods as listed: the spec's, and
    the one that served before it until the spec's is ready. The TileRT nodes of both are polled once
    here (HandoffReady, and the new generation's readiness)."""
    occupied = rollout.slots(cluster, live)
    choice = rollout.choose(spec, generation_of(spec).fingerprint, occupied)
    current = rollout.observe_view(Live(spec, choice.current), cluster, pods, live)
    old = (
        rollout.observe_view(Live(choice.old[1], choice.old[0]), cluster, pods, live) if choice.old else None
    )
    polled = [*current.nodes, *(old.nodes if old else [])]
    reports = (
        {r.pod: r for r in await handoff_check.poll(polled, node_api_secret)}
        if handoff_check.enabled()
        else None
    )
    handoff = (
        None
        if reports is None
        else [(n.name, status.node_handoff(reports[n.name])[0]) for n in current.nodes if n.name in reports]
    )
    readiness = rollout.readiness(current.pools, handoff)
    keep_old = old is not None and not readiness.ready
    kept = {choice.current} | ({old.live.slot} if keep_old and old else set())
    leftover = rollout.leftover_pods(pods, kept)
    shared = keep_old or bool(leftover)
    lives = [
        replace(g, tilert_nodes=tuple((current if g.slot == choice.current else old or current).nodes))
        for g in rollout.lives(choice, spec, readiness.ready, shared)
    ]
    return rollout.Plan(
        spec=spec,
        choice=choice,
        lives=lives,
        current=current,
        readiness=readiness,
        old=old,
        leftover=leftover,
        reports=reports,
        previous=_old_condition(body, "Progressing"),
        now=now,
    )


async def _apply_child(
    api: Client, body: Obj, want: Obj, key: str, *, owned: bool, out: Outcome
) -> Obj | None:
    """Apply one child; before its first apply, make sure the name is free, ours or marked for adoption.
    Returns the child as the API server answered the apply; None when it was not applied.

    A failure is recorded in `out.failed` and the reconcile carries on with the other children."""
    meta = body["metadata"]
    kind, ns, name = want["kind"], meta["namespace"], want["metadata"]["name"]
    creating = adopting = False
    if not owned:
        # The list holds only labelled objects: someone else's with this name may carry no labels.
        try:
            found = await api.get(kind, ns, name)
        except ApiError as e:
            out.failed.append(failure(key, e, verb="get", kind=kind, prefix="could not read it: "))
            return None
        creating = found is None
        if found is not None and not _owned_by(found, meta["uid"]):
            if _earlier_owner(found, body):
                out.failed.append(
                    Failure(
                        key,
                        (
                            f"{kind} {ns}/{name} still belongs to an earlier PDCluster {ns}/{meta['name']}, which was deleted; the "
                            "garbage collector deletes it shortly and the operator then creates its own (if it stays, check "
                            "the garbage collector)"
                        ),
                        CHILD_NOT_OWNED,
                    )
                )
                return None
            if not credentials.adoptable(found, body):
                out.failed.append(
                    Failure(
                        key,
                        credentials.not_owned_message(
                            found,
                            body,
                            kind,
                            "applies nothing under its name; the PDCluster is not Ready until it is resolved",
                            " (the operator then rewrites it to the spec and the garbage collector deletes it with the PDCluster)",
                        ),
                        CHILD_NOT_OWNED,
                    )
                )
                return None
            adopting = True
    try:
        written = await api.apply(want)
    except ApiError as e:
        # Refused or not writable: report it and carry on with the other children.
        log.warning("[%s/%s] applying %s failed: %s", ns, meta["name"], key, e)
        out.failed.append(failure(key, e, verb="create" if creating else "patch", kind=kind))
        return None
    out.applied.append(key)
    if adopting:
        out.adopted.append(key)
    return written
