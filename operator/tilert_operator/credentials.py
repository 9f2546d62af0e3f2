"""The stack's Secrets: created once, adopted only when owned, and the handoff secret rotated in phases.

Two Secrets per PDCluster, each created by the operator with a random token:

- `<cluster>-handoff`: `secret` (senders sign with it, nodes accept it) and `accept` (further
  secrets nodes accept, one a line; empty outside a rotation), mounted on prefill and TileRT pods.
- `<cluster>-node-api`: `token`, the router's credential on the decode nodes' HTTP API, mounted on
  TileRT decode and router pods. It is not rotated; deleting it makes a new one and rolls both.

Ownership. The operator uses a Secret with the expected name only if it owns it: an ownerReference to
this PDCluster (what it creates carries one), or, to adopt a Secret made by someone else, the
operator's labels for this cluster (`pd.tilert.ai/cluster: <cluster>`, `app.kubernetes.io/managed-by:
tilert-pd-operator`) plus the annotation `pd.tilert.ai/adopt: "true"`; it then adds its
ownerReference. Any other Secret of that name is left untouched, and the PDCluster reports
`SecretsOwned=False` and deploys nothing that would mount it (whoever made the Secret would know the
token the pods trust).

Rotation of the handoff secret, on request: `kubectl annotate pdc NAME
pd.tilert.ai/rotate-handoff-secret=<any new value> --overwrite`. Kubelets update a mounted Secret at
different times (up to their sync period plus their cache TTL, about a minute or two), and the node
and the sender re-read the files when they change, so the new secret is phased in:

  1. AcceptingNewSecret: `accept` = new. Nodes accept old and new; senders still sign with old.
  2. SigningWithNewSecret (after the grace period): `secret` = new, `accept` = old. Senders sign
     with new; nodes that still see phase 1 accept it (it is in their `accept`), nodes that see
     phase 2 accept old from senders that still see phase 1.
  3. Idle (after another grace period): `accept` emptied; the old secret is refused from then on.

The grace period (TILERT_PD_SECRET_ROTATION_GRACE_S, default 180 s) must exceed the time a Secret
update takes to reach every pod's files and be re-read. The phase, the request it serves and when it
began are annotations on the Secret, so a restarted operator resumes where it left off. A request
made during a rotation starts once the current one completes. No pod template changes: no restart.
"""

from __future__ import annotations

import base64
import datetime
import secrets
from dataclasses import dataclass, field
from typing import Final

from tilert_operator import constants
from tilert_operator.kubeapi import ApiError, Client, Obj
from tilert_operator.render import network

#: Seconds each rotation phase lasts by default: above a kubelet's Secret propagation (its sync
#: period, 60 s, plus its cache TTL) and the readers' re-read interval.
DEFAULT_GRACE_S: Final = 180.0

IDLE: Final = "Idle"
ACCEPTING: Final = "AcceptingNewSecret"
SIGNING: Final = "SigningWithNewSecret"
PHASES: Final = (IDLE, ACCEPTING, SIGNING)


def new_token() -> str:
    return secrets.token_urlsafe(32)


def _decode(secret: Obj, key: str) -> str:
    raw = (secret.get("data") or {}).get(key)
    # surrogateescape: a Secret adopted with arbitrary bytes round-trips unchanged through _intent.
    return base64.b64decode(raw).decode("utf-8", "surrogateescape") if raw else ""


def _ts(t: float) -> str:
    return datetime.datetime.fromtimestamp(t, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _parse_ts(text: str | None) -> float | None:
    if not text:
        return None
    try:
        return datetime.datetime.strptime(text, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=datetime.UTC).timestamp()
    except ValueError:
        return None


# ---- ownership -----------------------------------------------------------------------------------


def owned(secret: Obj, body: Obj) -> bool:
    """Whether this PDCluster owns the Secret (an ownerReference with its uid)."""
    uid = body["metadata"]["uid"]
    return any(ref.get("uid") == uid for ref in secret.get("metadata", {}).get("ownerReferences") or [])


def adoptable(secret: Obj, body: Obj) -> bool:
    """A Secret someone else made, marked for adoption by this cluster (labels plus annotation)."""
    meta = secret.get("metadata", {})
    labels, annotations = meta.get("labels") or {}, meta.get("annotations") or {}
    return (
        labels.get(constants.LABEL_CLUSTER) == body["metadata"]["name"]
        and labels.get(constants.LABEL_MANAGED_BY) == constants.MANAGED_BY
        and annotations.get(constants.ADOPT_ANNOTATION) == "true"
        and not any(ref.get("controller") for ref in meta.get("ownerReferences") or [])
    )


def not_owned_message(secret: Obj, body: Obj) -> str:
    meta, cluster = secret["metadata"], body["metadata"]["name"]
    owners = ", ".join(f"{r.get('kind')}/{r.get('name')}" for r in meta.get("ownerReferences") or []) or "none"
    return (
        f"Secret {meta['namespace']}/{meta['name']} exists but is not this PDCluster's (owners: {owners}); "
        "the operator leaves it untouched and deploys nothing that mounts it. Delete it and the operator "
        f"creates its own, or adopt it on purpose: label it {constants.LABEL_CLUSTER}={cluster} and "
        f"{constants.LABEL_MANAGED_BY}={constants.MANAGED_BY} and annotate it {constants.ADOPT_ANNOTATION}=true"
    )


def owner_reference(body: Obj) -> Obj:
    """The PDCluster as the controlling owner of a child (the garbage collector removes it with it)."""
    return {
        "apiVersion": constants.API_VERSION, "kind": constants.KIND, "name": body["metadata"]["name"],
        "uid": body["metadata"]["uid"], "controller": True, "blockOwnerDeletion": True,
    }  # fmt: skip


def _intent(secret: Obj, body: Obj, data: dict[str, str], annotations: dict[str, str]) -> Obj:
    """The whole Secret as the operator wants it (server-side apply), from the one it read."""
    meta = secret["metadata"]
    want_meta: Obj = {
        "name": meta["name"],
        "namespace": meta["namespace"],
        "labels": dict(meta.get("labels") or {}),
        "ownerReferences": [owner_reference(body)],
    }
    kept = {k: v for k, v in (meta.get("annotations") or {}).items() if k != constants.ADOPT_ANNOTATION}
    merged = {k: v for k, v in (kept | annotations).items() if v is not None}
    if merged:
        want_meta["annotations"] = merged
    return {
        "apiVersion": "v1", "kind": "Secret", "metadata": want_meta, "type": secret.get("type") or "Opaque",
        "data": {k: base64.b64encode(v.encode("utf-8", "surrogateescape")).decode() for k, v in data.items()},
    }  # fmt: skip


@dataclass
class SecretState:
    """One of the cluster's Secrets as the reconcile found (and left) it."""

    name: str
    secret: Obj | None = None
    #: Why it cannot be used (not owned), for status; None when it is ours.
    problem: str | None = None
    #: What the operator did to it this reconcile (created, adopted, added accept, rotation phase).
    actions: list[str] = field(default_factory=list)


async def ensure(api: Client, body: Obj, make: Obj, required_keys: dict[str, str]) -> SecretState:
    """The Secret `make` describes: created when absent, adopted when marked for adoption, completed
    with the keys it lacks (`required_keys`: key -> value to add) when ours, left alone otherwise."""
    ns, name = body["metadata"]["namespace"], make["metadata"]["name"]
    state = SecretState(name)
    existing = await api.get("Secret", ns, name)
    if existing is None:
        make["metadata"]["ownerReferences"] = [owner_reference(body)]
        existing = await api.create(make) or await api.get("Secret", ns, name)
        if existing is None:
            raise ApiError(409, "POST", f"secrets/{name}", "create answered AlreadyExists but the Secret is absent; retrying")
        state.actions.append("created")
    if owned(existing, body):
        adopting = False
    elif adoptable(existing, body):
        adopting = True
    else:
        state.problem = not_owned_message(existing, body)
        return state
    data = {k: _decode(existing, k) for k in (existing.get("data") or {})}
    missing = {k: v for k, v in required_keys.items() if k not in data or (not data[k] and v)}
    if adopting or missing:
        existing = await api.apply(_intent(existing, body, data | missing, {}))
        state.actions.append("adopted" if adopting else f"added {', '.join(sorted(missing))}")
    state.secret = existing
    return state


# ---- rotation ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Rotation:
    """The handoff secret's rotation state, read from its Secret's annotations."""

    phase: str = IDLE
    #: The request (the PDCluster annotation's value) being served, or the last one served.
    request: str | None = None
    #: When the current phase began (epoch seconds).
    since: float | None = None
    #: When the last rotation completed.
    rotated_at: float | None = None

    @classmethod
    def of(cls, secret: Obj) -> Rotation:
        ann = secret.get("metadata", {}).get("annotations") or {}
        phase = ann.get(constants.ROTATION_PHASE_ANNOTATION) or IDLE
        return cls(
            phase=phase if phase in PHASES else IDLE,
            request=ann.get(constants.ROTATION_REQUEST_ANNOTATION),
            since=_parse_ts(ann.get(constants.ROTATION_SINCE_ANNOTATION)),
            rotated_at=_parse_ts(ann.get(constants.ROTATED_AT_ANNOTATION)),
        )

    def annotations(self) -> dict[str, str]:
        out = {constants.ROTATION_PHASE_ANNOTATION: self.phase}
        if self.request is not None:
            out[constants.ROTATION_REQUEST_ANNOTATION] = self.request
        if self.since is not None:
            out[constants.ROTATION_SINCE_ANNOTATION] = _ts(self.since)
        if self.rotated_at is not None:
            out[constants.ROTATED_AT_ANNOTATION] = _ts(self.rotated_at)
        return out

    def due(self, grace_s: float) -> float | None:
        """When the current phase ends (epoch seconds); None when idle."""
        if self.phase == IDLE:
            return None
        return (self.since or 0.0) + grace_s

    def status(self, grace_s: float) -> Obj:
        """status.handoffSecret."""
        out: Obj = {"phase": self.phase}
        if self.request is not None:
            out["request"] = self.request
        if self.since is not None:
            out["phaseSince"] = _ts(self.since)
        due = self.due(grace_s)
        if due is not None:
            out["nextPhaseAt"] = _ts(due)
        if self.rotated_at is not None:
            out["lastRotated"] = _ts(self.rotated_at)
        return out


def step(data: dict[str, str], rot: Rotation, requested: str | None, now: float, grace_s: float,
         token: str) -> tuple[dict[str, str], Rotation] | None:
    """One step of the rotation, pure: the Secret's new data and state, or None when nothing is due.

    `data` holds the decoded keys `secret` and `accept`; `requested` is the PDCluster's annotation;
    `token` is the new secret a rotation starts with (used only then).
    """
    s_key, a_key = constants.HANDOFF_SECRET_KEY, constants.HANDOFF_ACCEPT_KEY
    current, accept = data.get(s_key, ""), data.get(a_key, "")
    if rot.phase == IDLE:
        if not requested or requested == rot.request:
            return None
        return data | {a_key: token}, Rotation(ACCEPTING, requested, now, rot.rotated_at)
    if now < (rot.since or 0.0) + grace_s:
        return None
    if rot.phase == ACCEPTING:
        new = next((line for line in accept.splitlines() if line.strip()), "")
        if not new:  # the new secret was lost (someone edited the Secret): start over
            return data | {a_key: token}, Rotation(ACCEPTING, rot.request, now, rot.rotated_at)
        return data | {s_key: new, a_key: current}, Rotation(SIGNING, rot.request, now, rot.rotated_at)
    return data | {a_key: ""}, Rotation(IDLE, rot.request, now, now)


async def rotate(api: Client, body: Obj, state: SecretState, *, now: float, grace_s: float) -> Rotation:
    """Advance the handoff secret's rotation when a phase is due; returns the state it is in."""
    assert state.secret is not None
    secret = state.secret
    rot = Rotation.of(secret)
    requested = (body["metadata"].get("annotations") or {}).get(constants.ROTATE_HANDOFF_SECRET_ANNOTATION)
    data = {k: _decode(secret, k) for k in (secret.get("data") or {})}
    nxt = step(data, rot, requested, now, grace_s, new_token())
    if nxt is None:
        return rot
    new_data, new_rot = nxt
    state.secret = await api.apply(_intent(secret, body, new_data, new_rot.annotations()))
    state.actions.append(f"rotation {new_rot.phase}")
    return new_rot


async def ensure_handoff(api: Client, body: Obj) -> SecretState:
    meta = body["metadata"]
    make = network.handoff_secret(meta["name"], meta["namespace"], new_token())
    # An empty `secret` is refilled; a missing `accept` (a Secret made before rotation existed) is added.
    return await ensure(api, body, make, {constants.HANDOFF_SECRET_KEY: new_token(), constants.HANDOFF_ACCEPT_KEY: ""})


async def ensure_node_api(api: Client, body: Obj) -> SecretState:
    meta = body["metadata"]
    make = network.node_api_secret(meta["name"], meta["namespace"], new_token())
    return await ensure(api, body, make, {constants.NODE_API_TOKEN_KEY: new_token()})
