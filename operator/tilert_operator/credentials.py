"""The stack's Secrets: created once, adopted only when owned, and the handoff secret rotated in phases.

Two Secrets per PDCluster, each created by the operator with a random token:

- `<cluster>-handoff`: `secret` (senders sign with it, nodes accept it) and `accept` (further
  secrets nodes accept, one a line; empty outside a rotation), mounted on prefill and TileRT pods.
- `<cluster>-node-api`: `token`, the router's credential on the decode nodes' HTTP API (one token a
  line: the router sends the first, the nodes accept any), mounted on TileRT decode and router pods.

Ownership. The operator uses a Secret with the expected name only if it owns it: an ownerReference to
this PDCluster (what it creates carries one), or, to adopt a Secret made by someone else, the
operator's labels for this cluster (`pd.tilert.ai/cluster: <cluster>`, `app.kubernetes.io/managed-by:
tilert-pd-operator`) plus the annotation `pd.tilert.ai/adopt: "true"`; it then adds its
ownerReference. Any other Secret of that name is left untouched, and the PDCluster reports
`SecretsOwned=False` and deploys nothing that would mount it (whoever made the Secret would know the
token the pods trust).

Rotation, on request: `kubectl annotate pdc NAME pd.tilert.ai/rotate-handoff-secret=<any new
value> --overwrite` (or `pd.tilert.ai/rotate-node-api-token`). Kubelets update a mounted Secret at
different times (up to their sync period plus their cache TTL, about a minute or two), and every
reader (node and sender; node and router) re-reads the files when they change, so the new value is
phased in (the handoff secret's phases; the token's are AcceptingNewToken, SendingNewToken):

  1. AcceptingNewSecret: `accept` = new. Nodes accept old and new; senders still sign with old.
     (token: `old\nnew`: nodes accept both, the router sends old.)
  2. SigningWithNewSecret (after the grace period): `secret` = new, `accept` = old. Senders sign
     with new; nodes that still see phase 1 accept it (it is in their `accept`), nodes that see
     phase 2 accept old from senders that still see phase 1. (token: `new\nold`.)
  3. Idle (after another grace period): `accept` emptied (token: `new`); the old value is refused.

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
TOKEN_ACCEPTING: Final = "AcceptingNewToken"
TOKEN_SENDING: Final = "SendingNewToken"


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


def not_owned_message(
    obj: Obj,
    body: Obj,
    kind: str = "Secret",
    consequence: str = "deploys nothing that mounts it",
    adopting: str = "",
) -> str:
    """Why an object with a name the operator needs is left alone, and the two ways out. Secrets and
    children share it: one adoption mark for every kind."""
    meta, cluster = obj["metadata"], body["metadata"]["name"]
    owners = (
        ", ".join(f"{r.get('kind')}/{r.get('name')}" for r in meta.get("ownerReferences") or []) or "none"
    )
    return (
        f"{kind} {meta['namespace']}/{meta['name']} exists but is not this PDCluster's (owners: {owners}); "
        f"the operator leaves it untouched and {consequence}. Delete or rename it and the operator "
        f"creates its own, or adopt it on purpose{adopting}: label it {constants.LABEL_CLUSTER}={cluster} and "
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
            raise ApiError(
                409,
                "POST",
                f"secrets/{name}",
                "create answered AlreadyExists but the Secret is absent; retrying",
            )
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


def _lines(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if line.strip()]


@dataclass(frozen=True)
class Scheme:
    """How one Secret rotates: the PDCluster annotation that asks for it, the names of its phases,
    and what its data is in each phase (pure functions of the decoded data)."""

    #: For messages: "handoff secret", "node API token".
    what: str
    request_annotation: str
    #: Phase 1 (readers accept the new value too) and phase 2 (users send the new value).
    accepting: str
    switched: str

    @property
    def phases(self) -> tuple[str, str, str]:
        return (IDLE, self.accepting, self.switched)

    def accept_new(self, data: dict[str, str], new: str) -> dict[str, str]:
        raise NotImplementedError

    def switch(self, data: dict[str, str]) -> dict[str, str] | None:
        """Phase 2's data from phase 1's; None when the new value is gone (someone edited the Secret)."""
        raise NotImplementedError

    def drop_old(self, data: dict[str, str]) -> dict[str, str]:
        raise NotImplementedError


class _HandoffScheme(Scheme):
    """`secret` signs and is accepted; `accept` holds further accepted secrets."""

    def accept_new(self, data: dict[str, str], new: str) -> dict[str, str]:
        return data | {constants.HANDOFF_ACCEPT_KEY: new}

    def switch(self, data: dict[str, str]) -> dict[str, str] | None:
        new = next(iter(_lines(data.get(constants.HANDOFF_ACCEPT_KEY, ""))), None)
        if new is None:
            return None
        return data | {
            constants.HANDOFF_SECRET_KEY: new,
            constants.HANDOFF_ACCEPT_KEY: data.get(constants.HANDOFF_SECRET_KEY, ""),
        }

    def drop_old(self, data: dict[str, str]) -> dict[str, str]:
        return data | {constants.HANDOFF_ACCEPT_KEY: ""}


class _TokenLinesScheme(Scheme):
    """`token`: one token a line; the router sends the first, the nodes accept any (tilert_serve/bearer.py)."""

    def accept_new(self, data: dict[str, str], new: str) -> dict[str, str]:
        current = _lines(data.get(constants.NODE_API_TOKEN_KEY, ""))[:1]
        return data | {constants.NODE_API_TOKEN_KEY: "\n".join([*current, new]) + "\n"}

    def switch(self, data: dict[str, str]) -> dict[str, str] | None:
        lines = _lines(data.get(constants.NODE_API_TOKEN_KEY, ""))
        if len(lines) < 2:
            return None
        return data | {constants.NODE_API_TOKEN_KEY: f"{lines[1]}\n{lines[0]}\n"}

    def drop_old(self, data: dict[str, str]) -> dict[str, str]:
        first = _lines(data.get(constants.NODE_API_TOKEN_KEY, ""))[:1]
        return data | {constants.NODE_API_TOKEN_KEY: "".join(f"{t}\n" for t in first)}


HANDOFF: Final[Scheme] = _HandoffScheme(
    "handoff secret", constants.ROTATE_HANDOFF_SECRET_ANNOTATION, ACCEPTING, SIGNING
)
NODE_API: Final[Scheme] = _TokenLinesScheme(
    "node API token", constants.ROTATE_NODE_API_TOKEN_ANNOTATION, TOKEN_ACCEPTING, TOKEN_SENDING
)


@dataclass(frozen=True)
class Rotation:
    """A Secret's rotation state, read from its annotations."""

    phase: str = IDLE
    #: The request (the PDCluster annotation's value) being served, or the last one served.
    request: str | None = None
    #: When the current phase began (epoch seconds).
    since: float | None = None
    #: When the last rotation completed.
    rotated_at: float | None = None

    @classmethod
    def of(cls, secret: Obj, scheme: Scheme = HANDOFF) -> Rotation:
        ann = secret.get("metadata", {}).get("annotations") or {}
        phase = ann.get(constants.ROTATION_PHASE_ANNOTATION) or IDLE
        return cls(
            phase=phase if phase in scheme.phases else IDLE,
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
        """status.handoffSecret / status.nodeApiToken."""
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


def step(
    data: dict[str, str],
    rot: Rotation,
    requested: str | None,
    now: float,
    grace_s: float,
    token: str,
    scheme: Scheme = HANDOFF,
) -> tuple[dict[str, str], Rotation] | None:
    """One step of a rotation, pure: the Secret's new data and state, or None when nothing is due.

    `data` holds the Secret's decoded keys; `requested` is the PDCluster's annotation; `token` is the
    new value a rotation starts with (used only then).
    """
    if rot.phase == IDLE:
        if not requested or requested == rot.request:
            return None
        return scheme.accept_new(data, token), Rotation(scheme.accepting, requested, now, rot.rotated_at)
    if now < (rot.since or 0.0) + grace_s:
        return None
    if rot.phase == scheme.accepting:
        switched = scheme.switch(data)
        if switched is None:  # the new value was lost (someone edited the Secret): start over
            return scheme.accept_new(data, token), Rotation(
                scheme.accepting, rot.request, now, rot.rotated_at
            )
        return switched, Rotation(scheme.switched, rot.request, now, rot.rotated_at)
    return scheme.drop_old(data), Rotation(IDLE, rot.request, now, now)


async def rotate(
    api: Client, body: Obj, state: SecretState, *, now: float, grace_s: float, scheme: Scheme = HANDOFF
) -> Rotation:
    """Advance a Secret's rotation when a phase is due; returns the state it is in."""
    assert state.secret is not None
    secret = state.secret
    rot = Rotation.of(secret, scheme)
    requested = (body["metadata"].get("annotations") or {}).get(scheme.request_annotation)
    data = {k: _decode(secret, k) for k in (secret.get("data") or {})}
    nxt = step(data, rot, requested, now, grace_s, new_token(), scheme)
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
    return await ensure(
        api, body, make, {constants.HANDOFF_SECRET_KEY: new_token(), constants.HANDOFF_ACCEPT_KEY: ""}
    )


async def ensure_node_api(api: Client, body: Obj) -> SecretState:
    meta = body["metadata"]
    make = network.node_api_secret(meta["name"], meta["namespace"], new_token(), new_token())
    # The metrics-only token is added to a Secret made before it existed (the autoscaler reads the
    # router's /metrics with it; it opens nothing else, so it is not rotated with the node token).
    return await ensure(
        api, body, make, {constants.NODE_API_TOKEN_KEY: new_token(), constants.METRICS_TOKEN_KEY: new_token()}
    )


def metrics_token(secret: Obj | None) -> str | None:
    """The router's metrics-only token from the node-API Secret; None when it has none yet."""
    token = _decode(secret, constants.METRICS_TOKEN_KEY).strip() if secret else ""
    return token or None
