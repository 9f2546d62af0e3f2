"""PodDisruptionBudgets: one per pool with replicas (spec.<pool>.disruptionBudget; render/hygiene.py
says why maxUnavailable 1)."""

from __future__ import annotations

from tilert_operator import constants
from tilert_operator.render import hygiene, pods
from tilert_operator.render.pods import Manifest
from tilert_operator.spec import PDClusterSpec, Pool


def render(spec: PDClusterSpec, cluster: str, namespace: str) -> list[Manifest]:
    pools: list[tuple[Pool, int, str]] = [
        (spec.prefill, spec.prefill.replicas, constants.PREFILL),
        (spec.decode.tilert, spec.decode.tilert.replicas, constants.TILERT),
        (spec.decode.native, spec.decode.native.replicas, constants.NATIVE),
        (spec.router, spec.router.replicas, constants.ROUTER),
    ]
    out = []
    for pool, replicas, component in pools:
        pdb = hygiene.pod_disruption_budget(
            pool, replicas, pods.metadata(cluster, namespace, component), pods.selector(cluster, component)
        )
        if pdb is not None:
            out.append(pdb)
    return out
