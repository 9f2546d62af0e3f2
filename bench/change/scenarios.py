"""The changes `python -m bench.change` makes, in order, to one running stack.

One stack serves through all of them, so the vLLM servers boot only for what a change starts (each
boot is about a minute of the two CPUs). The order keeps every kill survivable by the bar's terms
("only the requests in flight on the killed component fail"): a pool is scaled to two before one of its
pods is killed, so the router has another to send new requests to, as a production pool would.

A planned change is a new PDCluster given to `tilert-pd local apply`; the edits accumulate. An
unplanned one is a SIGKILL of a pod's process group (a container killed with everything in it); the
same spec applied again then brings the pod back, as its controller would, and that restore is judged
like a planned change.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from bench.load.plan import Route
from tilert_operator import constants

Doc = dict[str, Any]

#: Short hooks: the default preStop sleep (5 s) and grace periods only make every change longer here,
#: where nothing has to wait for an endpoints controller across a network.
PRE_STOP_S = 1
GRACE_S = 20


#: Router replicas: two, so that one can be killed while the other serves (locally they share the
#: stack's port, as pods share a Service).
ROUTERS = 2


def base_doc(example: Path) -> Doc:
    """The example PDCluster with short termination settings on every data-plane pool, and two router
    replicas."""
    doc: Doc = yaml.safe_load(example.read_text())
    for pool in _pools(doc).values():
        pool["termination"] = {"preStopSleepSeconds": PRE_STOP_S, "gracePeriodSeconds": GRACE_S}
    doc["spec"]["router"]["replicas"] = ROUTERS
    return doc


def _pools(doc: Doc) -> dict[str, Doc]:
    s = doc["spec"]
    return {
        constants.PREFILL: s["prefill"],
        constants.TILERT: s["decode"]["tilert"],
        constants.NATIVE: s["decode"]["native"],
    }


@dataclass(frozen=True)
class Scenario:
    name: str
    #: What it does, for the table.
    what: str
    #: Planned: the edit to the current doc (in place), applied with `tilert-pd local apply`.
    edit: Callable[[Doc], None] | None = None
    #: Unplanned: the component (constants.PREFILL / TILERT / NATIVE / ROUTER) whose newest pod is
    #: SIGKILLed; then the same spec is applied again.
    kill: str | None = None
    #: Routes a client may ask for that the stack cannot serve once this change is made (the native
    #: pool scaled to zero): those requests are answered 503 by design and are not counted as lost.
    unservable: frozenset[Route] = field(default=frozenset())

    @property
    def planned(self) -> bool:
        return self.kill is None

    def apply_to(self, doc: Doc) -> Doc:
        out = copy.deepcopy(doc)
        if self.edit is not None:
            self.edit(out)
        return out


def _replicas(component: str, n: int) -> Callable[[Doc], None]:
    def edit(doc: Doc) -> None:
        _pools(doc)[component]["replicas"] = n

    return edit


def _roll(component: str) -> Callable[[Doc], None]:
    """A template change that keeps the generation: the pool's preStop sleep one second longer."""

    def edit(doc: Doc) -> None:
        _pools(doc)[component]["termination"]["preStopSleepSeconds"] += 1

    return edit


def _mtp_off(doc: Doc) -> None:
    # The prefill's MTP setting decides whether the drafter's KV cache is in the handoff: a new layout,
    # so a new compatibility generation. Greedy text does not depend on it.
    doc["spec"]["prefill"]["mtp"] = {"enabled": False}
    doc["spec"]["decode"]["tilert"]["mtp"] = False


NO_NATIVE: frozenset[Route] = frozenset({"native"})


def sequence() -> list[Scenario]:
    """Every change, in the order run. Starts from the example: 1 prefill, 2 TileRT nodes, 1 native."""
    return [
        Scenario("roll prefill", "rolling update of the prefill Deployment", edit=_roll(constants.PREFILL)),
        Scenario(
            "roll native", "rolling update of the native decode Deployment", edit=_roll(constants.NATIVE)
        ),
        Scenario("roll tilert", "rolling update of the TileRT StatefulSet", edit=_roll(constants.TILERT)),
        Scenario("tilert 2->3", "TileRT pool scaled up", edit=_replicas(constants.TILERT, 3)),
        Scenario("prefill 1->2", "prefill pool scaled up", edit=_replicas(constants.PREFILL, 2)),
        Scenario("native 1->2", "native pool scaled up", edit=_replicas(constants.NATIVE, 2)),
        Scenario("kill tilert", "SIGKILL of a TileRT node (of 3), then restored", kill=constants.TILERT),
        Scenario("kill native", "SIGKILL of a native decode (of 2), then restored", kill=constants.NATIVE),
        Scenario("kill prefill", "SIGKILL of a prefill (of 2), then restored", kill=constants.PREFILL),
        Scenario(
            "kill router",
            "SIGKILL of a router (of 2 sharing the port), then restarted",
            kill=constants.ROUTER,
        ),
        Scenario("tilert 3->1", "TileRT pool scaled down", edit=_replicas(constants.TILERT, 1)),
        Scenario("prefill 2->1", "prefill pool scaled down", edit=_replicas(constants.PREFILL, 1)),
        Scenario(
            "native 2->0",
            "native pool scaled to zero",
            edit=_replicas(constants.NATIVE, 0),
            unservable=NO_NATIVE,
        ),
        Scenario(
            "generation (MTP off)",
            "prefill MTP off: a new handoff layout, so a new generation beside the old",
            edit=_mtp_off,
            unservable=NO_NATIVE,
        ),
    ]
