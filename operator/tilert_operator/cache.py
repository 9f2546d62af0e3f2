"""Watch-backed caches (informers) of the children and pods of the namespaces that hold PDClusters.

Why: a reconcile reads its pods, its children of eight kinds and its two Secrets. Read from the API
server, an idle PDCluster cost about ten reads per resync; read from here, none. One `Informer` per
(kind, namespace), shared by every PDCluster of that namespace, lists the kind once (selected by the
cluster label, `pd.tilert.ai/cluster`, filtered by the API server) and then watches from the list's
resourceVersion with bookmarks. A watch the server ends (its timeoutSeconds) is resumed from the last
resourceVersion seen, a bookmark's included, without a list; only a 410 Gone (the resourceVersion was
compacted away) lists again, and the new list replaces the store, objects deleted in the gap
reported as DELETED. Why our own informers rather than kopf's indexes: kopf resumes after a 410 with
a new list but does not report what vanished in the gap, it sends no allowWatchBookmarks, and an
index does not say when it is complete; see docs/operator-internals.md.

Read your own writes: the API client (kubeapi.Client) tells the cache what each of its writes
answered; the cache holds that answer until the watch shows the object at that resourceVersion or
later, so a reconcile right after a write never reads the object from before it (a Secret's rotation
phase, say). Events older than a write are still passed to the listener (the controller's drift
logic recognises its own echoes) but do not overwrite the store.

An optional kind the API server does not serve (404: the MultiNetworkPolicy CRD not installed) or the
role does not allow (403) is remembered: reads answer that status without a call, and the list is
tried again after `unserved_retry_s` (a 403: `forbidden_retry_s`), or at once when its CRD appears (`Cache.served`, called from
kopf's watch of CRDs in wiring.py); then the namespace's PDClusters are reconciled (`on_served`).

Lifecycle (one owner, the Controller): `attach(namespace)` when a PDCluster of that namespace
appears starts its informers; `detach` when the last one goes stops them; `stop` at shutdown.
An informer's states: LISTING -> WATCHING <-> (resume) -> LISTING on 410 -> ... -> STOPPED; SYNCED is
an event set after its first list, and reads go to the API server until then.
"""

from __future__ import annotations

import asyncio
import copy
import enum
import logging
import re
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from tilert_operator import constants
from tilert_operator.kubeapi import KINDS, ApiError, Client, Obj

log = logging.getLogger(__name__)

#: The kinds cached: every kind the reconcile reads besides its own PDCluster and Events.
CACHED_KINDS: tuple[str, ...] = tuple(k for k in KINDS if k not in ("Event", constants.KIND))
#: Kinds a cluster may not serve; their 403/404 is an answer, not a failure.
OPTIONAL_KINDS = frozenset({"MultiNetworkPolicy"})
#: The informers' selector: everything a PDCluster labels as its own (the reconcile's lists select a
#: subset of it by the cluster's name).
SELECTOR = constants.LABEL_CLUSTER

#: A watch that ends sooner than this is followed by a backoff before the next one.
MIN_WATCH_S = 1.0
#: (event type or None for the initial list, object) -> None; called for every change the watch shows.
Listener = Callable[[str, str | None, Obj], None]


@dataclass
class CacheSettings:
    #: Seconds a watch lasts before the server ends it and it is resumed (client-go: 5 to 10 minutes).
    watch_timeout_s: float = 300.0
    #: First and longest wait after a failed list or watch.
    backoff_first_s: float = 0.5
    backoff_max_s: float = 30.0
    #: Seconds before an optional kind that answered 404 (its CRD absent) is listed again; its CRD
    #: appearing wakes it sooner (Cache.served).
    unserved_retry_s: float = 600.0
    #: Seconds before one that answered 403 is listed again: a role being fixed makes no event the
    #: operator can watch, so this is polled (wiring sets the resync period; only in that state).
    forbidden_retry_s: float = 30.0


class State(enum.Enum):
    LISTING = "listing"
    WATCHING = "watching"
    UNSERVED = "unserved"
    STOPPED = "stopped"


class Gone(Exception):
    """The watch's resourceVersion is too old (410): list again."""


def _rv(obj: Obj) -> str:
    return str((obj.get("metadata") or {}).get("resourceVersion") or "")


def _older(rv: str, than: str) -> bool:
    """rv is from before `than`. resourceVersions are opaque to clients, but every API server on etcd
    issues increasing integers; when either is not one, nothing is assumed older (the watch wins)."""
    return rv.isdigit() and than.isdigit() and int(rv) < int(than)


@dataclass
class Informer:
    api: Client
    kind: str
    namespace: str
    listener: Listener
    settings: CacheSettings
    store: dict[str, Obj] = field(default_factory=dict)
    state: State = State.LISTING
    synced: asyncio.Event = field(default_factory=asyncio.Event)
    #: The resourceVersion the next watch starts from (the last list's, event's or bookmark's).
    resource_version: str = ""
    #: The status an optional kind answered (403/404) while UNSERVED, and the error to raise.
    unserved: ApiError | None = None
    #: name -> resourceVersion our last write got ("" with `deleted`): events older are not stored.
    pins: dict[str, tuple[str, bool]] = field(default_factory=dict)
    lists: int = 0
    watches: int = 0
    relists: int = 0
    task: asyncio.Task[None] | None = None
    #: Set to list an UNSERVED kind again now (its CRD appeared).
    recheck: asyncio.Event = field(default_factory=asyncio.Event)
    #: Called with (kind, namespace) when a kind that was UNSERVED is listed at last.
    on_served: Callable[[str, str], None] | None = None

    def start(self) -> None:
        self.task = asyncio.create_task(self._run(), name=f"informer {self.kind} {self.namespace}")

    async def stop(self) -> None:
        self.state = State.STOPPED
        if self.task is not None:
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)

    # ---- the loop ----------------------------------------------------------------------------

    async def _run(self) -> None:
        delay = self.settings.backoff_first_s
        while True:
            try:
                await self._list()
                delay = self.settings.backoff_first_s
                while True:
                    began = time.monotonic()
                    try:
                        await self._watch()
                    except Gone:
                        self.relists += 1
                        log.info(
                            "%s in %s: watch expired (410 Gone); listing again", self.kind, self.namespace
                        )
                        break
                    except ApiError as e:
                        # Some servers refuse the watch itself with 410; an optional kind the role no
                        # longer allows (or whose CRD went) is for the list to decide.
                        if e.status == 410 or (e.status in (403, 404) and self.kind in OPTIONAL_KINDS):
                            self.relists += 1
                            break
                        await self._pause(f"watch failed ({e})", delay)
                        delay = min(delay * 2, self.settings.backoff_max_s)
                    except (aiohttp.ClientError, TimeoutError, ValueError) as e:
                        await self._pause(f"watch failed ({type(e).__name__}: {e})", delay)
                        delay = min(delay * 2, self.settings.backoff_max_s)
                    else:
                        if time.monotonic() - began < MIN_WATCH_S:
                            # A server that ends watches at once would make this loop spin.
                            await self._pause("watch ended at once", delay)
                            delay = min(delay * 2, self.settings.backoff_max_s)
                        else:
                            delay = self.settings.backoff_first_s
            except asyncio.CancelledError:
                raise
            except ApiError as e:
                if e.status in (403, 404) and self.kind in OPTIONAL_KINDS:
                    self.state, self.unserved = State.UNSERVED, e
                    self.store.clear()
                    self.synced.set()
                    log.info(
                        "%s in %s: %s; reads answer that until the next try in %.0fs",
                        self.kind,
                        self.namespace,
                        "not served" if e.status == 404 else "not allowed",
                        self.settings.forbidden_retry_s
                        if e.status == 403
                        else self.settings.unserved_retry_s,
                    )
                    wait = (
                        self.settings.forbidden_retry_s if e.status == 403 else self.settings.unserved_retry_s
                    )
                    try:  # until the next try, or until its CRD is seen (Cache.served)
                        await asyncio.wait_for(self.recheck.wait(), wait)
                    except TimeoutError:
                        pass
                    self.recheck.clear()
                    continue
                log.warning("%s in %s: list failed (%s); again in %.1fs", self.kind, self.namespace, e, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, self.settings.backoff_max_s)
            except (aiohttp.ClientError, TimeoutError) as e:
                log.warning("%s in %s: list failed (%s); again in %.1fs", self.kind, self.namespace, e, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, self.settings.backoff_max_s)

    async def _pause(self, why: str, delay: float) -> None:
        log.info("%s in %s: %s; resuming in %.1fs", self.kind, self.namespace, why, delay)
        await asyncio.sleep(delay)

    async def _list(self) -> None:
        self.state = State.LISTING
        self.lists += 1
        items, rv = await self.api.list_versioned(self.kind, self.namespace, SELECTOR)
        first = not self.synced.is_set() or self.unserved is not None
        was_unserved = self.unserved is not None
        fresh = {o["metadata"]["name"]: o | {"kind": self.kind} for o in items}
        old, self.store = self.store, fresh
        self.pins.clear()  # the list is at least as new as any write we remember
        self.resource_version, self.unserved = rv, None
        self.state = State.WATCHING
        self.synced.set()
        for name, obj in fresh.items():
            if first:
                self.listener(self.kind, None, obj)
            elif name not in old:
                self.listener(self.kind, "ADDED", obj)
            elif _rv(old[name]) != _rv(obj):
                self.listener(self.kind, "MODIFIED", obj)
        for name, obj in old.items():
            if not first and name not in fresh:
                self.listener(self.kind, "DELETED", obj)
        if was_unserved and self.on_served is not None:
            self.on_served(self.kind, self.namespace)

    async def _watch(self) -> None:
        self.watches += 1
        async for event in self.api.watch(
            self.kind,
            self.namespace,
            SELECTOR,
            self.resource_version,
            timeout_s=self.settings.watch_timeout_s,
        ):
            self._apply(event)

    def _apply(self, event: Obj) -> None:
        kind_of, obj = event.get("type"), event.get("object") or {}
        if kind_of == "ERROR":
            if obj.get("code") == 410:
                raise Gone()
            raise ApiError(int(obj.get("code") or 0), "WATCH", self.kind, str(obj))
        rv = _rv(obj)
        if rv:
            self.resource_version = rv
        if kind_of == "BOOKMARK" or kind_of not in ("ADDED", "MODIFIED", "DELETED"):
            return
        obj = obj | {"kind": self.kind}
        name = obj["metadata"]["name"]
        pin = self.pins.get(name)
        if pin is not None:
            pinned_rv, deleted = pin
            if deleted and kind_of == "DELETED":
                self.pins.pop(name)
            elif _older(rv, pinned_rv) or (rv == pinned_rv and deleted):
                self.listener(self.kind, kind_of, obj)
                return  # from before our write: the store keeps what the write answered
            else:
                self.pins.pop(name)
        if kind_of == "DELETED":
            self.store.pop(name, None)
        else:
            self.store[name] = obj
        self.listener(self.kind, kind_of, obj)

    # ---- reads and writes ---------------------------------------------------------------------

    def wrote(self, name: str, obj: Obj | None) -> None:
        if not self.synced.is_set() or self.unserved is not None:
            return
        if obj is None:
            before = self.store.pop(name, None)
            self.pins[name] = (_rv(before) if before else "", True)
        elif _rv(obj):
            self.store[name] = obj | {"kind": self.kind}
            self.pins[name] = (_rv(obj), False)


async def _stop_all(informers: list[Informer]) -> None:
    await asyncio.gather(*(i.stop() for i in informers))


@dataclass
class _Namespace:
    informers: dict[str, Informer]
    users: set[str] = field(default_factory=set)


class Cache:
    """The informers of every namespace a PDCluster lives in; see the module docstring."""

    def __init__(
        self,
        api: Client,
        listener: Listener,
        settings: CacheSettings | None = None,
        on_served: Callable[[str, str], None] | None = None,
    ) -> None:
        """`on_served(kind, namespace)`: an optional kind that was not served is served now (its
        PDClusters have children to apply that they could not before)."""
        self.api = api
        self.listener = listener
        self.on_served = on_served
        self.settings = settings or CacheSettings()
        self._namespaces: dict[str, _Namespace] = {}
        #: Reads answered here, and those passed on to the API server (not synced, not held).
        self.hits = 0
        self.misses = 0

    def attach(self, namespace: str, user: str) -> None:
        """`user` (a PDCluster's name) needs the namespace cached: start its informers if first."""
        ns = self._namespaces.get(namespace)
        if ns is None:
            ns = self._namespaces[namespace] = _Namespace(
                {
                    kind: Informer(
                        self.api, kind, namespace, self.listener, self.settings, on_served=self.on_served
                    )
                    for kind in CACHED_KINDS
                }
            )
            for informer in ns.informers.values():
                informer.start()
        ns.users.add(user)

    def detach(self, namespace: str, user: str) -> Coroutine[Any, Any, None] | None:
        """`user` no longer needs the namespace. When it was the last, the namespace is forgotten now
        (an attach right after starts new informers) and the coroutine returned stops its informers."""
        ns = self._namespaces.get(namespace)
        if ns is None:
            return None
        ns.users.discard(user)
        if ns.users:
            return None
        del self._namespaces[namespace]
        return _stop_all(list(ns.informers.values()))

    async def stop(self) -> None:
        spaces, self._namespaces = list(self._namespaces.values()), {}
        await asyncio.gather(*(i.stop() for ns in spaces for i in ns.informers.values()))

    async def wait_synced(self, namespace: str, timeout_s: float) -> bool:
        """Until every informer of the namespace has listed once (False after timeout_s: reads then go
        to the API server until they have)."""
        ns = self._namespaces.get(namespace)
        if ns is None:
            return False
        try:
            await asyncio.wait_for(
                asyncio.gather(*(i.synced.wait() for i in ns.informers.values())), timeout_s
            )
        except TimeoutError:
            return False
        return True

    def served(self, kind: str) -> None:
        """The API server may serve `kind` now (its CRD was created or changed): informers that found
        it unserved list it again at once instead of at their next try."""
        for informer in self.informers():
            if informer.kind == kind and informer.unserved is not None:
                informer.recheck.set()

    def informer(self, kind: str, namespace: str) -> Informer | None:
        ns = self._namespaces.get(namespace)
        return ns.informers.get(kind) if ns is not None else None

    def informers(self) -> list[Informer]:
        return [i for ns in self._namespaces.values() for i in ns.informers.values()]

    def _ready(self, kind: str, namespace: str) -> Informer | None:
        informer = self.informer(kind, namespace)
        return informer if informer is not None and informer.synced.is_set() else None

    # ---- kubeapi.ReadCache --------------------------------------------------------------------

    def lookup(self, kind: str, namespace: str, name: str) -> Obj | None:
        informer = self._ready(kind, namespace)
        obj = informer.store.get(name) if informer is not None else None
        if obj is None:
            self.misses += 1
            return None
        self.hits += 1
        return copy.deepcopy(obj)

    def select(self, kind: str, namespace: str, label_selector: str) -> list[Obj] | None:
        informer = self._ready(kind, namespace)
        match = selector_matcher(label_selector)
        if informer is None or match is None:
            self.misses += 1
            return None
        self.hits += 1
        if informer.unserved is not None:
            raise informer.unserved
        return [copy.deepcopy(o) for o in informer.store.values() if match(o)]

    def wrote(self, kind: str, namespace: str, name: str, obj: Obj | None) -> None:
        informer = self.informer(kind, namespace)
        if informer is not None:
            informer.wrote(name, obj)


_TERM = re.compile(r"^\s*(!?)([A-Za-z0-9_./-]+)\s*(?:(==|=|!=)\s*([A-Za-z0-9_.-]*))?\s*$")


def selector_matcher(selector: str) -> Callable[[Obj], bool] | None:
    """A matcher for an equality-based label selector (`k=v`, `k!=v`, `k`, `!k`, comma-separated), or
    None for one it does not parse (set-based terms): the API server answers those."""
    terms: list[tuple[bool, str, str | None, str]] = []
    for raw in selector.split(",") if selector.strip() else []:
        m = _TERM.match(raw)
        if m is None:
            return None
        neg, key, op, value = m.groups()
        terms.append((bool(neg), key, op, value or ""))
    # Every informer holds only objects with the cluster label: a selector is answered from the store
    # only when it names that label (a reconcile's always does).
    if not any(key == SELECTOR and not neg and op in ("=", "==") for neg, key, op, _ in terms):
        return None

    def match(obj: Obj) -> bool:
        labels: dict[str, Any] = (obj.get("metadata") or {}).get("labels") or {}
        for neg, key, op, value in terms:
            if op in ("=", "=="):
                ok = labels.get(key) == value
            elif op == "!=":
                ok = labels.get(key) != value
            else:
                ok = key in labels
            if ok == neg:
                return False
        return True

    return match
