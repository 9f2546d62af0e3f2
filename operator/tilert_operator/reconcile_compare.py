"""Whether a child the API server holds already is what the spec renders, so a resync at rest
applies nothing; and the hash of the intent each applied child carries.

Pure: compares two objects, calls nothing.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from tilert_operator import constants, validation
from tilert_operator.kubeapi import Obj


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
