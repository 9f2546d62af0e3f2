"""The work loop: one serialized reconcile per PDCluster, level-based.

kopf delivers watch events (PDClusters, their pods and their children); each event stores the latest
body and kicks that PDCluster's worker. A worker reconciles on a kick or every resync period,
whichever comes first, so a pod becoming ready rewires the router within a reconcile. Kicks coalesce:
a burst of pod events is one reconcile. Failures back off exponentially (API errors are already
retried inside the client). No finalizer is involved, so deleting a PDCluster never waits for the
operator: the garbage collector removes the children.

Drift: a child someone else deleted or edited (a NetworkPolicy removed, a Deployment scaled by hand)
kicks its PDCluster within `drift_debounce_s`, not at the next resync. Events the operator caused
itself do not: a write's echo carries the resourceVersion the write returned (kubeapi.Client.own),
and a change of `status` alone leaves the child's fingerprint as it was. A Deployment's or
StatefulSet's controller reporting its rollout (observedGeneration, replica counts, revisions) kicks a
reconcile too, outside the drift limit: Ready and the ready counts follow those reports, and a pod's
own event comes before its controller's. Drift kicks per PDCluster are at most one per
`drift_min_interval_s`, so a controller that fights the operator over a field (an autoscaler on
replicas) costs one reconcile a period, not a storm.

Quiet at rest (`Settings.watch_cache`, wiring's default): the controller owns a cache.Cache of the
children and pods of every namespace with a PDCluster, attached to the API client so that the
reconcile's reads (`Client.get`/`list`) are answered from it; its informers' events are what kick
reconciles (a pod's change at once, a child's through the drift logic above). A worker's first
reconcile waits for its namespace's first lists (at most `cache_sync_timeout_s`; the API server is
read until then). An idle PDCluster then costs no API call per resync: the reconcile compares the
cached children with the desired ones, applies nothing and patches no status when nothing changed.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from tilert_operator import constants, credentials, reconcile, reconcile_events, validation
from tilert_operator.autoscale import act, scrape
from tilert_operator.autoscale import loop as autoscale_loop
from tilert_operator.cache import Cache, CacheSettings
from tilert_operator.kubeapi import DELETED, Client, Obj
from tilert_operator.metrics import Metrics

log = logging.getLogger(__name__)
Key = tuple[str, str]


@dataclass
class Settings:
    #: Seconds between two reconciles of an object when nothing happens.
    resync_s: float = 30.0
    #: Reconciles running at once, across all PDClusters.
    concurrency: int = 16
    backoff_first_s: float = 0.5
    backoff_max_s: float = 30.0
    #: Seconds each phase of a handoff-secret rotation lasts (credentials.py).
    rotation_grace_s: float = credentials.DEFAULT_GRACE_S
    #: Seconds a child's change waits before it kicks a reconcile (a burst of edits is one reconcile;
    #: our own write's response is in by then, so its echo is recognised).
    drift_debounce_s: float = 0.1
    #: Least seconds between two drift-triggered reconciles of one PDCluster.
    drift_min_interval_s: float = 1.0
    #: Read children and pods from watch caches (cache.py) instead of the API server; their
    #: informers' events kick the reconciles.
    watch_cache: bool = False
    cache: CacheSettings = field(default_factory=CacheSettings)
    #: Longest wait for a namespace's first lists before a worker's first reconcile.
    cache_sync_timeout_s: float = 30.0
    #: How the autoscaler reads the pods' /metrics (autoscale/scrape.py; tests give their own).
    scraper: autoscale_loop.Scraper = field(default=scrape.scrape)
    #: Seconds between two planner runs instead of `spec.autoscaling.intervalSeconds` (tests).
    autoscale_interval_s: float | None = None


@dataclass
class _Worker:
    body: Obj
    kick: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task[None] | None = None
    failures: int = 0
    #: When the last reconcile asked to run again (a rotation phase ends), epoch seconds.
    requeue_at: float | None = None
    #: Child changes waiting for the debounce: (kind, namespace, name, resourceVersion, what happened).
    drift: list[tuple[str, str, str, str | None, str]] = field(default_factory=list)
    drift_timer: asyncio.TimerHandle | None = None
    #: When the last drift kick fired (monotonic seconds).
    drift_last: float = float("-inf")
    #: A kick waiting for the debounce after workloads reported rollout progress.
    report_timer: asyncio.TimerHandle | None = None
    #: The autoscaler's memory (its last scrape) and when it runs next (monotonic; None: not autoscaled).
    autoscale: autoscale_loop.State = field(default_factory=autoscale_loop.State)
    autoscale_due: float | None = None
    #: The spec generation the timer was last started or stopped for.
    autoscale_generation: int | None = None


class Controller:
    def __init__(self, api: Client, settings: Settings | None = None, metrics: Metrics | None = None) -> None:
        self.api = api
        self.settings = settings or Settings()
        self.metrics = metrics or Metrics(api_calls=api.calls)
        self._workers: dict[Key, _Worker] = {}
        self._slots = asyncio.Semaphore(self.settings.concurrency)
        #: (kind, namespace, name) -> fingerprint of each child as the watch last showed it.
        self._children: dict[tuple[str, str, str], str] = {}
        #: (kind, namespace, name) -> each workload's rollout status as the watch last showed it.
        self._rollouts: dict[tuple[str, str, str], tuple[Any, ...] | None] = {}
        #: Drift kicks fired, and the child changes that caused them (for tests and logs).
        self.drift_kicks = 0
        #: The watch caches the API client reads from (Settings.watch_cache), owned here.
        self.cache: Cache | None = None
        if self.settings.watch_cache:
            self.cache = Cache(api, self._cached_event, self.settings.cache, on_served=self._served)
            api.cache = self.cache
        self._detaching: set[asyncio.Task[None]] = set()

    def observe(self, body: Obj, deleted: bool = False) -> None:
        """A PDCluster event: keep the body, start or kick its worker, or stop it on deletion."""
        meta = body["metadata"]
        key = (meta["namespace"], meta["name"])
        worker = self._workers.get(key)
        if deleted:
            if worker is not None and worker.task is not None:
                worker.task.cancel()
            for timer in (worker.drift_timer, worker.report_timer) if worker is not None else ():
                if timer is not None:
                    timer.cancel()
            stopping = self.cache.detach(key[0], key[1]) if self.cache is not None else None
            self._workers.pop(key, None)
            if stopping is not None:
                task = asyncio.create_task(stopping)
                self._detaching.add(task)
                task.add_done_callback(self._detaching.discard)
            self.metrics.states.pop(key, None)
            self.metrics.conditions.pop(key, None)
            self.metrics.autoscale.pop(key, None)
            return
        if worker is None or worker.body["metadata"].get("uid") != meta.get("uid"):
            if worker is not None and worker.task is not None:
                worker.task.cancel()
            if self.cache is not None:
                self.cache.attach(key[0], key[1])
            worker = self._workers[key] = _Worker(body=body)
            worker.task = asyncio.create_task(self._run(key, worker), name=f"reconcile {key[0]}/{key[1]}")
        else:
            # Our own status writes come back as events too: only a spec change (generation) or a
            # deletion mark needs a reconcile now; the rest waits for the resync.
            before = worker.body["metadata"]
            changed = (
                before.get("generation") != meta.get("generation")
                or before.get("deletionTimestamp") != meta.get("deletionTimestamp")
                or _rotation_request(before) != _rotation_request(meta)
            )
            worker.body = body
            if not changed:
                return
        worker.kick.set()

    def _cached_event(self, kind: str, event_type: str | None, body: Obj) -> None:
        """An informer's event: a pod's change kicks its PDCluster (readiness rewires the router); a
        child's goes through the drift logic. The initial list kicks nothing (the first reconcile
        waits for it)."""
        if kind != "Pod":
            self.child_event(kind, event_type, body)
            return
        meta = body.get("metadata") or {}
        cluster = (meta.get("labels") or {}).get(constants.LABEL_CLUSTER)
        if event_type is not None and cluster:
            self.kick(meta.get("namespace") or "", cluster)

    def _served(self, kind: str, namespace: str) -> None:
        """An optional kind is served now: every PDCluster of the namespace may have children of it to apply."""
        log.info("%s is served in %s now; reconciling its PDClusters", kind, namespace)
        for ns, name in list(self._workers):
            if ns == namespace:
                self.kick(ns, name)

    def kick(self, namespace: str, name: str) -> None:
        worker = self._workers.get((namespace, name))
        if worker is not None:
            worker.kick.set()

    def child_event(self, kind: str, event_type: str | None, body: Obj) -> None:
        """A watch event of a child (selected by the operator's labels): a change made by someone
        else kicks the owning PDCluster's reconcile after the debounce; see the module docstring."""
        meta = body.get("metadata") or {}
        ns, name = meta.get("namespace") or "", meta.get("name") or ""
        ckey = (kind, ns, name)
        cluster: str = (meta.get("labels") or {}).get(constants.LABEL_CLUSTER) or ""
        if event_type == "DELETED":
            self._children.pop(ckey, None)
            self._rollouts.pop(ckey, None)
            what = "deleted"
        else:
            fp = _fingerprint(body)
            before = self._children.get(ckey)
            self._children[ckey] = fp
            progress = _rollout(body) if kind in ("Deployment", "StatefulSet") else None
            progressed = self._rollouts.get(ckey) != progress
            self._rollouts[ckey] = progress
            if event_type is None:
                return  # the initial listing: the first reconcile compares everything
            if before == fp:
                # Status only: a workload controller reporting its rollout is worth a reconcile (Ready
                # and the ready counts follow it), not a drift (nothing to repair: no rate limit).
                if progressed and before is not None:
                    self._report_kick((ns, cluster))
                return
            what = "created" if before is None else "changed"
        worker = self._workers.get((ns, cluster)) if cluster else None
        if worker is None:
            return
        worker.drift.append((kind, ns, name, meta.get("resourceVersion"), what))
        if worker.drift_timer is None:
            loop = asyncio.get_running_loop()
            due = max(
                self.settings.drift_debounce_s,
                worker.drift_last + self.settings.drift_min_interval_s - time.monotonic(),
            )
            worker.drift_timer = loop.call_later(due, self._drift_fire, (ns, cluster), worker)

    def _report_kick(self, key: Key) -> None:
        """Kick a reconcile after the debounce: a controller's reports come in bursts (one per pod)."""
        worker = self._workers.get(key)
        if worker is None or worker.report_timer is not None:
            return

        def fire() -> None:
            worker.report_timer = None
            if self._workers.get(key) is worker:
                worker.kick.set()

        worker.report_timer = asyncio.get_running_loop().call_later(self.settings.drift_debounce_s, fire)

    def _drift_fire(self, key: Key, worker: _Worker) -> None:
        worker.drift_timer = None
        pending, worker.drift = worker.drift, []
        if self._workers.get(key) is not worker:
            return
        # Our own writes come back through the watch too: their resourceVersion is the one our write got.
        foreign = [
            (k, n, what)
            for k, ns, n, rv, what in pending
            if self.api.own(k, ns, n) != (DELETED if what == "deleted" else rv)
        ]
        if not foreign:
            return
        worker.drift_last = time.monotonic()
        self.drift_kicks += 1
        log.info(
            "[%s/%s] drift: %s; reconciling",
            key[0],
            key[1],
            ", ".join(f"{k}/{n} {w}" for k, n, w in foreign[:5]),
        )
        worker.kick.set()

    async def stop(self) -> None:
        for w in self._workers.values():
            for timer in (w.drift_timer, w.report_timer):
                if timer is not None:
                    timer.cancel()
        tasks = [w.task for w in self._workers.values() if w.task is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._workers.clear()
        if self.cache is not None:
            await asyncio.gather(*self._detaching, return_exceptions=True)
            await self.cache.stop()

    async def _run(self, key: Key, worker: _Worker) -> None:
        s = self.settings
        if self.cache is not None and not await self.cache.wait_synced(key[0], s.cache_sync_timeout_s):
            log.warning(
                "[%s/%s] the watch caches did not list within %.0fs; reading the API server until they do",
                key[0],
                key[1],
                s.cache_sync_timeout_s,
            )
        while True:
            wait = s.resync_s
            if worker.requeue_at is not None:
                wait = max(0.0, min(wait, worker.requeue_at - time.time()))
            if worker.autoscale_due is not None:
                wait = max(0.0, min(wait, worker.autoscale_due - time.monotonic()))
            try:
                await asyncio.wait_for(worker.kick.wait(), timeout=wait)
            except TimeoutError:
                pass
            worker.kick.clear()
            if worker.autoscale_due is not None and time.monotonic() >= worker.autoscale_due:
                await self._autoscale(key, worker)
            async with self._slots:
                started = time.perf_counter()
                try:
                    outcome = await reconcile.reconcile(
                        self.api, worker.body, rotation_grace_s=s.rotation_grace_s
                    )
                except asyncio.CancelledError:
                    raise
                except Exception as e:
                    worker.failures += 1
                    self.metrics.reconcile_errors.inc()
                    delay = min(s.backoff_first_s * 2 ** (worker.failures - 1), s.backoff_max_s)
                    log.warning("[%s/%s] reconcile failed (%s); retrying in %.1fs", key[0], key[1], e, delay)
                    asyncio.get_running_loop().call_later(delay, worker.kick.set)
                    continue
                finally:
                    self.metrics.reconcile_duration.observe(time.perf_counter() - started)
            worker.failures = 0
            worker.requeue_at = outcome.requeue_at
            self.metrics.writes.inc(outcome.writes)
            self.metrics.states[key] = outcome.state
            if outcome.conditions:
                self.metrics.conditions[key] = dict(outcome.conditions)
            if outcome.written is not None and outcome.written.get("metadata", {}).get("uid") == worker.body[
                "metadata"
            ].get("uid"):
                # Compare the next resync against what we wrote, not a body the watch has not caught up to.
                worker.body = worker.body | {"status": outcome.written.get("status") or {}}
            self._schedule_autoscale(key, worker)

    def _schedule_autoscale(self, key: Key, worker: _Worker) -> None:
        """Start, keep or stop a PDCluster's planner timer after a reconcile: it runs while a pool is
        autoscaled and the operator is the actuator, every `spec.autoscaling.intervalSeconds`. Only a
        new generation of the spec can change that: an idle resync validates nothing again."""
        generation = worker.body["metadata"].get("generation")
        if generation is not None and generation == worker.autoscale_generation:
            return
        worker.autoscale_generation = generation
        spec, _ = validation.validate(worker.body.get("spec") or {}, worker.body["metadata"]["name"])
        if spec is None or not act.operator_driven(spec):
            worker.autoscale_due, worker.autoscale = None, autoscale_loop.State()
            self.metrics.autoscale.pop(key, None)  # no decision stands any more
            return
        if worker.autoscale_due is None:
            # The first run only takes the baseline scrape: the first decision comes an interval later.
            worker.autoscale_due = time.monotonic()

    async def _autoscale(self, key: Key, worker: _Worker) -> None:
        """One planner run (autoscale/loop.py), in the worker, so that it never races the reconcile
        that renders its decision; a failure is logged and the timer goes on."""
        spec, problems = validation.validate(worker.body.get("spec") or {}, key[1])
        if spec is None or problems or not act.operator_driven(spec):
            worker.autoscale_due = None
            return
        interval = self.settings.autoscale_interval_s or float(spec.autoscaling.interval_seconds)
        worker.autoscale_due = time.monotonic() + interval
        async with self._slots:
            try:
                ran = await autoscale_loop.run(
                    self.api, worker.body, spec, worker.autoscale, time.time(), self.settings.scraper
                )
            except asyncio.CancelledError:
                raise
            except Exception as e:
                log.warning(
                    "[%s/%s] autoscaling run failed (%s); next in %ds",
                    *key,
                    e,
                    spec.autoscaling.interval_seconds,
                )
                return
            if ran.written is not None and ran.written.get("metadata", {}).get("uid") == worker.body[
                "metadata"
            ].get("uid"):
                worker.body = worker.body | {"status": ran.written.get("status") or {}}
            if ran.notes:
                try:
                    await reconcile_events.post(self.api, worker.body, ran.notes)
                except Exception as e:  # an Event is worth a retry of nothing
                    log.warning("[%s/%s] autoscaling event not posted (%s)", *key, e)
        if worker.autoscale.decision is not None:
            self.metrics.autoscale[key] = (
                worker.autoscale.decision,
                worker.autoscale.observed,
                len(worker.autoscale.missing),
            )


def _fingerprint(body: Obj) -> str:
    """What the operator cares about in a child: everything but status and the server's bookkeeping."""
    meta = body.get("metadata") or {}
    kept = {k: v for k, v in body.items() if k not in ("status", "metadata")}
    kept["metadata"] = {k: meta.get(k) for k in ("labels", "annotations", "ownerReferences")}
    return hashlib.sha256(json.dumps(kept, sort_keys=True, default=str).encode()).hexdigest()


def _rollout(body: Obj) -> tuple[Any, ...]:
    """What a workload's controller reports of its rollout (what observe.rollout reads)."""
    st = body.get("status") or {}
    progressing = next(
        (c.get("reason") for c in st.get("conditions") or [] if c.get("type") == "Progressing"), None
    )
    return (
        *(
            st.get(k)
            for k in (
                "observedGeneration",
                "replicas",
                "updatedReplicas",
                "readyReplicas",
                "availableReplicas",
                "currentRevision",
                "updateRevision",
            )
        ),
        progressing,
    )


def _rotation_request(meta: Obj) -> tuple[str | None, ...]:
    """A rotation request is an annotation: it changes no generation, yet it is worth a reconcile now."""
    ann = meta.get("annotations") or {}
    return tuple(
        ann.get(k)
        for k in (constants.ROTATE_HANDOFF_SECRET_ANNOTATION, constants.ROTATE_NODE_API_TOKEN_ANNOTATION)
    )
