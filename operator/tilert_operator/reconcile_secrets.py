"""The reconcile's first step: the cluster's two Secrets (the handoff secret and the node API token),
then their rotations.

`ensure` creates each Secret when absent, adopts one marked for adoption, completes one of ours that
lacks a key (credentials.ensure), and says which are someone else's: then nothing else is applied
(SecretsOwned=False). `rotate` advances each rotation whose phase is due (credentials.rotate) and says
when the next phase is, so the reconcile runs again then rather than at the next resync.
"""

from __future__ import annotations

from dataclasses import dataclass

from tilert_operator import credentials, reconcile_events
from tilert_operator.credentials import Rotation, SecretState
from tilert_operator.kubeapi import Client, Obj
from tilert_operator.reconcile_events import Note


@dataclass(frozen=True)
class Secrets:
    """The two Secrets as `ensure` left them."""

    handoff: SecretState
    node_api: SecretState
    #: What was done to them ("name: action"), for Outcome.secrets.
    actions: list[str]
    #: The Events to post about them (adopted, completed).
    notes: list[Note]

    @property
    def not_owned(self) -> list[str]:
        """Why each Secret that is someone else's cannot be used; empty when both are ours."""
        return [s.problem for s in (self.handoff, self.node_api) if s.problem]

    @property
    def names(self) -> list[str]:
        return [self.handoff.name, self.node_api.name]


@dataclass(frozen=True)
class Rotations:
    """Where each Secret's rotation stands after `rotate`."""

    handoff: Rotation
    node_api: Rotation
    grace_s: float
    #: The phases entered this reconcile ("name: rotation <phase>"), for Outcome.secrets.
    actions: list[str]

    @property
    def due(self) -> float | None:
        """When the next phase of either rotation is due, epoch seconds; None when neither is under way."""
        due = [t for t in (self.handoff.due(self.grace_s), self.node_api.due(self.grace_s)) if t is not None]
        return min(due) if due else None

    def status(self) -> dict[str, Obj]:
        """status.rotations."""
        return {
            "handoffSecret": self.handoff.status(self.grace_s),
            "nodeApiToken": self.node_api.status(self.grace_s),
        }


async def ensure(api: Client, body: Obj) -> Secrets:
    handoff = await credentials.ensure_handoff(api, body)
    node_api = await credentials.ensure_node_api(api, body)
    states = (handoff, node_api)
    return Secrets(
        handoff=handoff,
        node_api=node_api,
        actions=[f"{s.name}: {a}" for s in states for a in s.actions],
        notes=[n for s in states for n in reconcile_events.secret_actions(s.name, s.actions)],
    )


async def rotate(api: Client, body: Obj, secrets: Secrets, *, now: float, grace_s: float) -> Rotations:
    """Advance both rotations. Each phase change is a *Rotating condition's transition, so its Event
    comes with the status write, not from here."""
    handoff = await credentials.rotate(api, body, secrets.handoff, now=now, grace_s=grace_s)
    node_api = await credentials.rotate(
        api, body, secrets.node_api, now=now, grace_s=grace_s, scheme=credentials.NODE_API
    )
    return Rotations(
        handoff=handoff,
        node_api=node_api,
        grace_s=grace_s,
        actions=[
            f"{s.name}: {a}"
            for s in (secrets.handoff, secrets.node_api)
            for a in s.actions
            if a.startswith("rotation")
        ],
    )
