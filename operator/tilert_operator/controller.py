"""The work loop: one serialized reconcile per PDCluster, level-based.

kopf delivers watch events (PDClusters and their pods); each event stores the latest body and kicks
that PDCluster's worker. A worker reconciles on a kick or every resync period, whichever comes
first, so a deleted or hand-edited child returns within one period and a pod becoming ready rewires
the router within a reconcile. Kicks coalesce: a burst of pod events is one reconcile. Failures back
off exponentially (API errors are already retried inside the client). No finalizer is involved, so
deleting a PDCluster never waits for the operator: the garbage collector removes the children.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

from tilert_operator import constants, credentials, reconcile
from tilert_operator.kubeapi import Client, Obj
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


@dataclass
class _Worker:
    body: Obj
    kick: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task[None] | None = None
    failures: int = 0
    #: When the last reconcile asked to run again (a rotation phase ends), epoch seconds.
    requeue_at: float | None = None


class Controller:
    def __init__(self, api: Client, settings: Settings | None = None, metrics: Metrics | None = None) -> None:
        self.api = api
        self.settings = settings or Settings()
        self.metrics = metrics or Metrics(api_calls=api.calls)
        self._workers: dict[Key, _Worker] = {}
        self._slots = asyncio.Semaphore(self.settings.concurrency)

    def observe(self, body: Obj, deleted: bool = False) -> None:
        """A PDCluster event: keep the body, start or kick its worker, or stop it on deletion."""
        meta = body["metadata"]
        key = (meta["namespace"], meta["name"])
        worker = self._workers.get(key)
        if deleted:
            if worker is not None and worker.task is not None:
                worker.task.cancel()
            self._workers.pop(key, None)
            self.metrics.states.pop(key, None)
            return
        if worker is None or worker.body["metadata"].get("uid") != meta.get("uid"):
            if worker is not None and worker.task is not None:
                worker.task.cancel()
            worker = self._workers[key] = _Worker(body=body)
            worker.task = asyncio.create_task(self._run(key, worker), name=f"reconcile {key[0]}/{key[1]}")
        else:
            # Our own status writes come back as events too: only a spec change (generation) or a
            # deletion mark needs a reconcile now; the rest waits for the resync.
            before = worker.body["metadata"]
            changed = (before.get("generation") != meta.get("generation")
                       or before.get("deletionTimestamp") != meta.get("deletionTimestamp")
                       or _rotation_request(before) != _rotation_request(meta))
            worker.body = body
            if not changed:
                return
        worker.kick.set()

    def kick(self, namespace: str, name: str) -> None:
        worker = self._workers.get((namespace, name))
        if worker is not None:
            worker.kick.set()

    async def stop(self) -> None:
        tasks = [w.task for w in self._workers.values() if w.task is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._workers.clear()

    async def _run(self, key: Key, worker: _Worker) -> None:
        s = self.settings
        while True:
            wait = s.resync_s
            if worker.requeue_at is not None:
                wait = max(0.0, min(wait, worker.requeue_at - time.time()))
            try:
                await asyncio.wait_for(worker.kick.wait(), timeout=wait)
            except TimeoutError:
                pass
            worker.kick.clear()
            async with self._slots:
                started = time.perf_counter()
                try:
                    outcome = await reconcile.reconcile(self.api, worker.body, rotation_grace_s=s.rotation_grace_s)
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
            if outcome.written is not None and outcome.written.get("metadata", {}).get("uid") == worker.body["metadata"].get("uid"):
                # Compare the next resync against what we wrote, not a body the watch has not caught up to.
                worker.body = worker.body | {"status": outcome.written.get("status") or {}}


def _rotation_request(meta: Obj) -> tuple[str | None, ...]:
    """A rotation request is an annotation: it changes no generation, yet it is worth a reconcile now."""
    ann = meta.get("annotations") or {}
    return tuple(ann.get(k) for k in (constants.ROTATE_HANDOFF_SECRET_ANNOTATION, constants.ROTATE_NODE_API_TOKEN_ANNOTATION))
