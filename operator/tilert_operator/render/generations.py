"""Compatibility generations as the renderers see them: the fingerprint of a spec, and where each live
generation's data-plane workloads are (their slot).

A prefill and a decode server of two generations cannot pair (`tilert_serve.compat`): a change of the
served model's weights (`spec.model.revision`), of the handoff layout (KV-cache dtype, the MTP layer
the prefill's MTP setting adds) or of the protocol makes every mixed pair fail its handoff. Kubernetes'
own rolling update of the three data-plane workloads cannot keep a compatible pair for every route
throughout (a Deployment has no partition, a StatefulSet cannot surge, and the three roll
independently), so a change of fingerprint is not a rolling update: the operator brings the new
generation up beside the old one under a second set of workload names (a *slot*), lists both in the
router with their fingerprints, and removes the old one once the new one is ready (rollout.py decides
when; docs/operator.md says why this design). A change that keeps the fingerprint (an image, resources,
replicas) stays in its slot and rolls as before.

Slot a keeps the names a PDCluster has always had (`<cluster>-prefill`, ...), so a cluster that never
changed generation looks as it did; slot b (`<cluster>-prefill-b`, `<cluster>-tilert-b`,
`<cluster>-native-b`) holds the next generation while both run, and serves on its own afterwards
until the next change moves back to slot a. The router, its ConfigMap and Service, the
NetworkPolicies and the PodDisruptionBudgets are one per cluster and span both slots.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from tilert_operator import constants
from tilert_operator.spec import PDClusterSpec, parse
from tilert_serve.compat import Compat
from tilert_serve.layouts import registry
from tilert_serve.router.config import TileRTNode

#: Main layers of the tiny checkpoint `tilert-pd tiny-model` writes (tilert_serve.tinymodel's
#: TinySpec.layers; that module needs torch, which the operator never imports). A test checks that the
#: two agree.
TINY_MAIN_LAYERS = 2

#: The data-plane pools, each rendered once per live generation.
DATA_PLANE = (constants.PREFILL, constants.TILERT, constants.NATIVE)


def layout_fingerprint(spec: PDClusterSpec) -> str | None:
    """The handoff layout's fingerprint as the prefill and the nodes compute theirs
    (`tilert_serve.layouts.registry`); None when it depends on a checkpoint the operator cannot read
    (an `mla` model from a volume: its layer count is in the checkpoint's config.json).

    The DSA models have a fixed depth (their MTP layer included). For `mla` the prefill registers the
    drafter's KV cache only with MTP on, so the prefill's MTP setting decides the MTP layer count."""
    m = spec.model
    dtype = m.resolved_kv_cache_dtype
    if m.tilert_model in registry.DSA_MODELS:
        return registry.get(m.tilert_model, dtype).fingerprint
    if not m.weights.tiny:
        return None
    mtp = 1 if spec.prefill.mtp.enabled else 0
    return registry.get("mla", dtype, num_layers=TINY_MAIN_LAYERS + mtp, num_mtp_layers=mtp).fingerprint


@dataclass(frozen=True)
class Generation:
    """A spec's compatibility generation."""

    #: 12 hex digits naming the generation (labels, status): equal for two specs whose prefills and
    #: decodes can pair.
    fingerprint: str
    #: What this generation's servers advertise (Compat.fingerprint), for the router's endpoint list;
    #: None when the operator cannot compute the layout (then the router pairs by the servers' own
    #: advertisements and the handshake's layout check).
    compat: str | None


def generation(spec: PDClusterSpec) -> Generation:
    layout = layout_fingerprint(spec)
    if layout is not None:
        fp = Compat(model=spec.model.name, revision=spec.model.revision, layout=layout).fingerprint
        return Generation(fp, fp)
    # Not the layout's bytes, but every spec field that decides them: still a new generation whenever
    # the servers' fingerprint changes.
    m = spec.model
    described = (
        f"{m.tilert_model}:{m.resolved_kv_cache_dtype}:mtp={int(spec.prefill.mtp.enabled)}:{m.model_dir}"
    )
    fp = Compat(model=m.name, revision=m.revision, layout=described).fingerprint
    return Generation(fp, None)


#: The spec sections a generation's data-plane children are rendered from: what its prefill Deployment
#: records. The router's and the policies' sections are left out, so a change of those (which follow
#: the current spec alone) writes no data-plane workload.
RECORDED_SECTIONS = ("model", "transfer", "prefill", "decode")


def spec_json(spec: PDClusterSpec) -> str:
    """The spec as recorded on its generation's prefill Deployment (GENERATION_SPEC_ANNOTATION)."""
    data = spec.model_dump(mode="json", by_alias=True, include=set(RECORDED_SECTIONS))
    return json.dumps(data, sort_keys=True, separators=(",", ":"))


def recorded_spec(workload: dict[str, Any]) -> PDClusterSpec | None:
    """The data-plane spec a live prefill Deployment's generation was rendered from (the router's and
    the policies' sections at their defaults); None when it has none (a workload an operator without
    generations made) or it no longer parses."""
    raw = ((workload.get("metadata") or {}).get("annotations") or {}).get(
        constants.GENERATION_SPEC_ANNOTATION
    )
    return spec_from_json(raw) if raw else None


def spec_from_json(raw: str) -> PDClusterSpec | None:
    """A spec recorded by `spec_json` (on a prefill Deployment, or in a local run's state); None when it
    no longer parses."""
    try:
        return parse(json.loads(raw))
    except ValueError:
        return None


@dataclass(frozen=True)
class Live:
    """One generation to render: its spec, its slot, and the TileRT nodes of its pods."""

    spec: PDClusterSpec
    slot: str = constants.SLOT_A
    tilert_nodes: tuple[TileRTNode, ...] = ()
    #: Whether another generation's pods run beside this one's: then slot a's Services select by slot
    #: too (slot a's pods from before generations carry no slot label, so they cannot always).
    shared: bool = False

    @cached_property
    def generation(self) -> Generation:
        return generation(self.spec)

    def name(self, cluster: str, component: str) -> str:
        return constants.slot_child_name(cluster, component, self.slot)

    def pod_labels(self) -> dict[str, str]:
        """Labels the generation's pods and workloads carry beside the component's."""
        return {constants.LABEL_GENERATION: self.generation.fingerprint, constants.LABEL_SLOT: self.slot}

    def workload_selector(self) -> dict[str, str]:
        """What a workload's selector adds to the component's (immutable once created: slot a's stays
        what it always was, and only slot b's pods are told apart by it)."""
        return {} if self.slot == constants.SLOT_A else {constants.LABEL_SLOT: self.slot}

    def service_selector(self) -> dict[str, str]:
        """What a Service's selector adds to the component's: its slot, whenever the pods of the other
        slot could match (a Service's selector may change; a workload's may not)."""
        if self.slot == constants.SLOT_A and not self.shared:
            return {}
        return {constants.LABEL_SLOT: self.slot}

    def annotations(self, component: str) -> dict[str, str]:
        """The prefill Deployment (every generation has one) records the generation's spec."""
        if component != constants.PREFILL:
            return {}
        return {constants.GENERATION_SPEC_ANNOTATION: spec_json(self.spec)}


def as_live(spec: PDClusterSpec | Live) -> Live:
    """A renderer's argument as a generation: a bare spec is a cluster's only generation, in slot a."""
    return spec if isinstance(spec, Live) else Live(spec)


def single(spec: PDClusterSpec, tilert_nodes: Sequence[TileRTNode] = ()) -> list[Live]:
    """A cluster with one generation in slot a (what `tilert-pd render` and local runs show)."""
    return [Live(spec, constants.SLOT_A, tuple(tilert_nodes))]


def surge_gpus(spec: PDClusterSpec) -> int:
    """GPUs a generation's data-plane pools hold: what a blue/green rollout adds beside the old one."""
    n = spec.decode
    return (
        spec.prefill.replicas * spec.prefill.gpus
        + n.tilert.replicas * n.tilert.gpus
        + n.native.replicas * n.native.gpus
    )
