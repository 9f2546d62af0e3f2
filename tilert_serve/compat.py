"""Compatibility generations: which prefill may hand a request's state to which decode server.

A prefill and a decode server (a TileRT node or a native vLLM decode) can be paired only when they
agree on everything that decides the bytes of the KV state and how those bytes travel: the served
model and the revision of its weights, the handoff layout (model family, KV-cache dtype, MTP layers:
`Layout.fingerprint`) and the handoff protocol version. A rollout that changes none of these (a new
image of the same release line, new resources) stays in its generation; a change of any of them starts
a new one, and the router never pairs servers of two generations.

Every party derives the fingerprint from the same `Compat`: the operator from the PDCluster's spec,
each server from its own arguments (which it advertises), so the two differ only when a server runs
something other than what its spec says.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass

from tilert_serve.defaults import HANDOFF_PROTOCOL_VERSION


@dataclass(frozen=True)
class Compat:
    #: The model name clients send (vLLM's --served-model-name).
    model: str
    #: What identifies the weights: a volume's sub-path, a checkpoint revision, "tiny" for the
    #: generated model. Two revisions under one name are two generations.
    revision: str
    #: `Layout.fingerprint` of the handoff layout both sides use.
    layout: str
    protocol: int = HANDOFF_PROTOCOL_VERSION

    @property
    def fingerprint(self) -> str:
        """12 hex digits, stable across processes and releases for equal fields; short enough for a
        Kubernetes label value and a workload name's suffix."""
        blob = json.dumps(asdict(self), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:12]


def compatible(a: str | None, b: str | None) -> bool:
    """Whether two advertised fingerprints may be paired; None (not advertised: a hand-written
    endpoint list, a server of an older release) pairs with anything, as before generations existed."""
    return a is None or b is None or a == b
