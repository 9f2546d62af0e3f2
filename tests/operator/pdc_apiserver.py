"""A Kubernetes API test server: kmock 0.8's KubernetesEmulator (HTTP server, request parsing,
discovery, bundled built-in resources) plus the compatibility layer an operator test needs.

Added, each something a real kube-apiserver does:
uid / resourceVersion / creationTimestamp / generation; generateName; 409 on duplicate create and on
stale resourceVersion preconditions; 422 on a failed JSON-patch test; the status subresource kept
apart from the main endpoint; server-side apply that creates a missing object and merges into a
live one as a real one does (the applier's fields set, the fields it applied before and dropped
removed, everyone else's kept, keyed lists such as env and ports merged by key, selectors atomic;
custom resources' applied top-level fields replace; metadata labels/annotations merge); PUT; lists with
kind/apiVersion and label/field selectors; watches as JSON lines with replay from a
resourceVersion, selectors and timeoutSeconds, subscribed under the writers' lock (no lost events);
background cascading deletion by ownerReferences; a CRD becomes a served resource with
Established=True; /version says v1.32; Table output with the CRD's printer columns for kubectl.
Admission: a per-resource validator hook; the tests install the CRD's schema + CEL validator
(pdc_crd_validator.py), so PDCluster writes, status included, are defaulted and rejected (422).
For tests: a log of every call (RBAC coverage), fault injection (409/500, or a late answer for
client timeouts, on chosen calls), and direct object writes (a test plays the controllers that
would create and ready pods).

Strictness of a real kube-apiserver for built-in kinds (pdc_k8s_semantics.py; `strict`, on by
default): object names (DNS-1123 subdomain; DNS-1035 label for Services), label keys and values,
env names, selectors that match their templates, NetworkPolicy peers, quantities parsed (400) and
stored canonical (`0.5` -> `500m`), empty strings, lists and maps not stored (omitempty), 422 Invalid with the Status details and causes a real server
returns; server-side apply's typed conversion against the kinds' OpenAPI schemas (kubernetes-
validate's, v1.32): unknown fields and duplicate list keys answered 500 as a real server does; and,
standing in for the StatefulSet controller this server does not run, StatefulSet names over 52
characters refused (their pods' controller-revision-hash label could not fit).

RBAC, when a test installs roles (`rbac`, pdc_rbac.Rbac, e.g. the ones the chart renders) and says
who each bearer token is (`users`): every resource request authorized by the RBAC authorizer's rules,
a server-side apply that creates authorized again as `create`, and, with the switch
`owner_references_permission_enforcement`, that admission plugin's checks (`delete` on an object whose
ownerReferences change, `update` on the owner's `finalizers` for blockOwnerDeletion); a refusal is the
403 Status a real server answers, and every decision is logged (`checks`). See pdc_rbac.py.

Watches as a real server serves them to an informer: `allowWatchBookmarks=true` gets a BOOKMARK with
the current resourceVersion before the server ends the watch (timeoutSeconds) and whenever a test
calls `bookmark()`; a watch from a resourceVersion older than the last compaction (`compact()`, or the
event log's own trimming) gets the ERROR event with a 410 Expired Status a real one sends, so the
client must list again. Per-verb request counts by client: `counts()`.

Not emulated (not proven by tests on this server): pruning,
Kubernetes CEL extension libraries, admission webhooks, SSA conflicts between managers and the
managedFields a real server shows, strategic-merge list merging, controllers (no pod
is ever created from a Deployment: a test creates them, and each is stamped with the revision of the
template it was made from), dryRun, a list's resourceVersion and continue parameters (a list is
always of now).
Played: the Deployment and StatefulSet controllers' status (observedGeneration, replica counts by
revision, currentRevision/updateRevision, the Progressing reason) from the pods a test created, at
every change of a workload or its pods; `workload_controllers` off holds it back.
"""

from __future__ import annotations

import asyncio
import copy
import datetime
import hashlib
import json
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp.web
import kmock
import pdc_k8s_semantics as sem
import yaml
from kmock._internal import parsing, rendering
from pdc_rbac import Attributes, Check, Rbac, User, forbidden_message, qualified

Res = tuple[str, str, str]  # group, version, plural
Key = tuple[Res, str | None, str]  # resource, namespace, name
Obj = dict[str, Any]
#: The bearer token of the kubeconfig the tests give the operator (kubeconfig()).
TOKEN = "test-token"


@dataclass(frozen=True)
class Call:
    verb: str
    group: str
    resource: str  # plural or plural/subresource
    namespace: str | None
    user_agent: str
    label_selector: str | None = None
    #: When the call arrived (monotonic seconds), and the object it named, for benchmarks.
    at: float = field(default_factory=time.monotonic)
    name: str | None = None


@dataclass
class Fault:
    status: int
    times: int
    verb: str | None = None
    resource: str | None = None
    user_agent: str | None = "tilert-pd-operator"
    #: Answer late instead of failing (status is then ignored): a client-side timeout.
    delay: float = 0.0


POD: Res = ("", "v1", "pods")
WORKLOADS_BY_KIND: dict[str, Res] = {
    "Deployment": ("apps", "v1", "deployments"),
    "StatefulSet": ("apps", "v1", "statefulsets"),
}
WORKLOADS = frozenset(WORKLOADS_BY_KIND.values())
#: The label that names the template revision a pod was made from.
REVISION_LABEL: dict[Res, str] = {
    WORKLOADS_BY_KIND["Deployment"]: "pod-template-hash",
    WORKLOADS_BY_KIND["StatefulSet"]: "controller-revision-hash",
}


def revision(res: Res, workload: Obj) -> str:
    """The current template's revision as its controller names it: a hash of the pod template (a
    Deployment's pod-template-hash; a StatefulSet's ControllerRevision, `<name>-<hash>`)."""
    template = (workload.get("spec") or {}).get("template") or {}
    digest = hashlib.sha256(json.dumps(template, sort_keys=True).encode()).hexdigest()[:10]
    return f"{workload['metadata']['name']}-{digest}" if res == WORKLOADS_BY_KIND["StatefulSet"] else digest


def _selects(workload: Obj, pod: Obj) -> bool:
    want = (((workload.get("spec") or {}).get("selector") or {}).get("matchLabels")) or {}
    labels = pod["metadata"].get("labels") or {}
    return bool(want) and all(labels.get(k) == v for k, v in want.items())


def _pod_ready(pod: Obj) -> bool:
    status = pod.get("status") or {}
    return bool(status.get("podIP")) and any(
        c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or []
    )


_kmock_parse_path = parsing.parse_path


def _parse_path(path: str) -> Any:
    """kmock 0.8 reads `/api/v1/namespaces[/NAME]` as a namespace prefix with no resource (and fails
    on the list): Namespaces are the one resource whose plural is that prefix."""
    parts = path.strip("/").split("/")
    if parts[:3] == ["api", "v1", "namespaces"] and (
        len(parts) <= 4 or (len(parts) == 5 and parts[4] in ("status", "finalize"))
    ):
        return parsing.ParsedPath(
            "",
            "v1",
            "namespaces",
            None,
            parts[3] if len(parts) > 3 else None,
            parts[4] if len(parts) > 4 else None,
        )
    return _kmock_parse_path(path)


parsing.parse_path = _parse_path  # rendering calls it through the module


def _retry(fn: Callable[[], Any]) -> Any:
    """Tests read the store from their own thread; a write in between can resize a dict under them."""
    for _ in range(20):
        try:
            return fn()
        except RuntimeError:  # dictionary changed size during iteration
            time.sleep(0.001)
    return fn()


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _status(code: int, reason: str, message: str, details: Obj | None = None) -> Obj:
    out = {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }
    if details:
        out["details"] = details
    return out


class ApiServer(kmock.KubernetesEmulator):
    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        self.resources.load_bundled()
        self.store: dict[Key, Obj] = {}
        #: The same objects by resource, so a list scans one resource, not the whole store.
        self.by_res: dict[Res, dict[Key, Obj]] = defaultdict(dict)
        self.rv = 0
        self.events: list[tuple[int, Res, Obj]] = []
        #: A watch from a resourceVersion below this one is answered 410 Expired (compact()).
        self.compacted = 0
        self.subs: dict[Res, set[asyncio.Queue[Obj]]] = defaultdict(set)
        self.calls: list[Call] = []
        self.faults: list[Fault] = []
        self.crds: dict[Res, Obj] = {}
        self.wlock = asyncio.Lock()
        #: Per-resource admission: (object, old or None) -> (defaulted object, errors). Tests install
        #: the CRD's schema + CEL validator for PDClusters, so the server defaults and rejects like a
        #: real one would, for spec and status writes alike.
        self.validators: dict[Res, Any] = {}
        #: When each object was first created (monotonic seconds), for the benchmark.
        self.added_at: dict[Key, float] = {}
        #: A real API server's strictness for built-in kinds (pdc_k8s_semantics): names, labels and
        #: env names validated, quantities stored canonical, 422 Invalid with causes, server-side
        #: apply's typed conversion (unknown fields, duplicate keys: 500), decoding errors (400).
        self.strict = True
        #: Set while a server-side apply's body has passed the typed conversion (no second schema pass).
        self._converted = False
        #: Called with (resource, event type, object) for every change, under the writers' lock
        #: (benchmarks timestamp what they wait for without polling).
        self.on_change: list[Callable[[Res, str, Obj], None]] = []
        #: RBAC: None lets every request through; set, requests are authorized like a real server's.
        self.rbac: Rbac | None = None
        #: Bearer token -> user (a token not listed is system:anonymous).
        self.users: dict[str, User] = {}
        #: The OwnerReferencesPermissionEnforcement admission plugin (OpenShift turns it on).
        self.owner_references_permission_enforcement = False
        #: Every authorization decision made while `rbac` is set.
        self.checks: list[Check] = []
        #: Per object, per field manager: the fields its last server-side apply set (what a real server
        #: keeps in managedFields), so an apply removes only what the same manager stops applying.
        self.managed: dict[Key, dict[str, Obj]] = {}
        #: The Deployment and StatefulSet controllers' status writes (_play_controllers); off, a
        #: workload's status stays as it was, as while kube-controller-manager has not caught up.
        self.workload_controllers = True
        self._playing = False
        #: Who sent the write being handled (under the writers' lock), for admission's own checks.
        self._user: User | None = None

    # ---- discovery / version -------------------------------------------------------------------

    async def _serve_server_version(self, request: rendering.Request) -> rendering.Payload:
        return {"major": "1", "minor": "32", "gitVersion": "v1.32.0", "platform": "linux/amd64"}

    async def _serve_version(self, request: rendering.Request) -> rendering.Payload:
        # kmock spells the core group's groupVersion "/v1"; kubectl then finds no core resources.
        payload = await super()._serve_version(request)
        if isinstance(payload, dict) and payload.get("groupVersion") == "/v1":
            payload["groupVersion"] = "v1"
        return payload

    def info(self, res: Res) -> Any:
        for r in self.resources:
            if (r.group, r.version, r.plural) == res:
                return self.resources[r]
        return None

    def kind_of(self, res: Res) -> str:
        info = self.info(res)
        if info is None or not info.kind:
            raise sem.ApiError(404, "NotFound", f"the server could not find the requested resource {res}")
        return str(info.kind)

    def api_version(self, res: Res) -> str:
        return f"{res[0]}/{res[1]}" if res[0] else res[1]

    def has_status(self, res: Res) -> bool:
        info = self.info(res)
        return bool(info is not None and "status" in info.subresources)

    # ---- test helpers ------------------------------------------------------------------------

    def fail(
        self,
        status: int,
        times: int = 1,
        *,
        verb: str | None = None,
        resource: str | None = None,
        delay: float = 0.0,
    ) -> None:
        """The next `times` matching operator calls answer `status` (409 Conflict or 5xx), or, with
        a delay, answer normally but that late."""
        self.faults.append(Fault(status, times, verb, resource, delay=delay))

    def counts(self, user_agent: str, since: int = 0) -> Counter[tuple[str, str]]:
        """(verb, resource) -> requests made by clients whose User-Agent starts with `user_agent`,
        among the calls from index `since` of the log on (`len(calls)` taken before a phase)."""
        return Counter(
            (c.verb, c.resource) for c in self.calls[since:] if c.user_agent.startswith(user_agent)
        )

    async def compact(self) -> None:
        """Forget the event log, as etcd's compaction does: a watch from a resourceVersion before the
        current one is answered 410 Expired, and watches open now end with that error."""
        async with self.wlock:
            self.compacted = self.rv
            self.events.clear()
            gone = {"type": "ERROR", "object": _status(410, "Expired", "too old resource version")}
            for queues in self.subs.values():
                for q in queues:
                    q.put_nowait(gone)

    async def bookmark(self) -> None:
        """Send every open watch that asked for bookmarks one with the current resourceVersion."""
        async with self.wlock:
            for res, queues in self.subs.items():
                for q in queues:
                    q.put_nowait(self._bookmark(res))

    def _bookmark(self, res: Res) -> Obj:
        return {
            "type": "BOOKMARK",
            "object": {
                "kind": self.kind_of(res),
                "apiVersion": self.api_version(res),
                "metadata": {"resourceVersion": str(self.rv)},
            },
        }

    def objects(self, plural: str, namespace: str | None = None) -> list[Obj]:
        return _retry(
            lambda: [
                copy.deepcopy(o)
                for (res, ns, _), o in list(self.store.items())
                if res[2] == plural and (namespace is None or ns == namespace)
            ]
        )

    def get(self, plural: str, namespace: str | None, name: str) -> Obj | None:
        """One object, read from a test's thread while the server's may be writing."""

        def find() -> Obj | None:
            for res in list(self.by_res):
                if res[2] == plural:
                    o = self.by_res[res].get((res, namespace, name))
                    if o is not None:
                        return copy.deepcopy(o)
            return None

        return _retry(find)

    async def put(self, res: Res, obj: Obj) -> Obj:
        """Create or replace an object directly, status included (tests playing controllers)."""
        async with self.wlock:
            meta = obj["metadata"]
            key = (res, meta.get("namespace"), meta["name"])
            old = self.store.get(key)
            new = copy.deepcopy(obj)
            new.setdefault("apiVersion", self.api_version(res))
            new.setdefault("kind", self.kind_of(res))
            if old is None:
                self._stamp_new(new)
                return self._commit(res, key, new, "ADDED")
            new["metadata"] = old["metadata"] | {
                k: v for k, v in new["metadata"].items() if k not in ("uid", "creationTimestamp")
            }
            return self._commit(res, key, new, "MODIFIED")

    async def remove(self, res: Res, namespace: str | None, name: str) -> None:
        async with self.wlock:
            self._delete((res, namespace, name))

    # ---- core ----------------------------------------------------------------------------------

    def _stamp_new(self, obj: Obj) -> None:
        meta = obj["metadata"]
        meta["uid"] = str(uuid.uuid4())
        meta["creationTimestamp"] = _now()
        meta["generation"] = 1

    def _commit(self, res: Res, key: Key, obj: Obj, kind: str) -> Obj:
        if res == POD:
            self._stamp_revision(key, obj)
        out = self._store(res, key, obj, kind)
        if res == POD or res in WORKLOADS:
            self._play_controllers(res, obj)
        return out

    def _store(self, res: Res, key: Key, obj: Obj, kind: str) -> Obj:
        self.rv += 1
        obj["metadata"]["resourceVersion"] = str(self.rv)
        self.store[key] = obj
        self.by_res[res][key] = obj
        if kind == "ADDED":
            self.added_at[key] = time.monotonic()
        self._emit(res, kind, obj)
        return copy.deepcopy(obj)

    def _emit(self, res: Res, kind: str, obj: Obj) -> None:
        event = {"type": kind, "object": copy.deepcopy(obj)}
        self.events.append((self.rv, res, event))
        if len(self.events) > 200_000:
            self.compacted = self.events[100_000][0]
            del self.events[:100_000]
        for q in self.subs[res]:
            q.put_nowait(event)
        for fn in self.on_change:
            fn(res, kind, obj)

    # ---- the workload controllers' part (Deployment and StatefulSet status) -----------------------

    def _workloads_of(self, pod: Obj) -> list[tuple[Res, Key, Obj]]:
        """The Deployments and StatefulSets a pod belongs to: its controller by ownerReference, else
        those whose selector matches it (a ReplicaSet adopts matching orphans)."""
        meta = pod["metadata"]
        owners = {r.get("uid") for r in meta.get("ownerReferences") or [] if r.get("controller")}
        out = []
        for res in WORKLOADS:
            for key, w in list(self.by_res[res].items()):
                if key[1] != meta.get("namespace"):
                    continue
                if w["metadata"]["uid"] in owners or (not owners and _selects(w, pod)):
                    out.append((res, key, w))
        return out

    def _stamp_revision(self, key: Key, pod: Obj) -> None:
        """A pod carries the revision of the template it was made from (pod-template-hash for a
        Deployment's, controller-revision-hash for a StatefulSet's). A new pod is made from the
        current template; an update (the kubelet reporting status) keeps the pod's revision."""
        labels = pod["metadata"].setdefault("labels", {})
        old_labels = ((self.store.get(key) or {}).get("metadata") or {}).get("labels") or {}
        for res, _, w in self._workloads_of(pod):
            label = REVISION_LABEL[res]
            if label in labels:
                continue
            labels[label] = old_labels[label] if label in old_labels else revision(res, w)

    def _play_controllers(self, res: Res, obj: Obj) -> None:
        """What the Deployment and StatefulSet controllers write to a workload's status after a change
        of it or of its pods (kube-controller-manager's: observedGeneration, replica counts by revision,
        a StatefulSet's currentRevision once every pod is updated and ready, a Deployment's Progressing
        reason). `workload_controllers` False stands for a controller that has not caught up."""
        if not self.workload_controllers or self._playing:
            return
        self._playing = True
        try:
            if res == POD:
                targets = self._workloads_of(obj)
            else:
                key = (res, obj["metadata"].get("namespace"), obj["metadata"]["name"])
                targets = [(res, key, self.store[key])] if key in self.store else []
            for wres, wkey, w in targets:
                status = self._workload_status(wres, w)
                if status != w.get("status"):
                    self._store(wres, wkey, copy.deepcopy(w) | {"status": status}, "MODIFIED")
        finally:
            self._playing = False

    def play_controllers(self) -> None:
        """Let the workload controllers catch up with every workload (after `workload_controllers` was off)."""
        for res in WORKLOADS:
            for _, w in list(self.by_res[res].items()):
                self._play_controllers(res, w)

    def _workload_status(self, res: Res, w: Obj) -> Obj:
        ns = w["metadata"].get("namespace")
        pods = [
            p
            for (_, pns, _), p in self.by_res[POD].items()
            if pns == ns
            and not p["metadata"].get("deletionTimestamp")
            and any(t[1][2] == w["metadata"]["name"] and t[0] == res for t in self._workloads_of(p))
        ]
        want = int((w.get("spec") or {}).get("replicas", 1))
        rev = revision(res, w)
        updated = [p for p in pods if (p["metadata"].get("labels") or {}).get(REVISION_LABEL[res]) == rev]
        ready = [p for p in pods if _pod_ready(p)]
        old = w.get("status") or {}
        complete = len(updated) == len(pods) == want and len(ready) == want
        status: Obj = {
            "observedGeneration": w["metadata"].get("generation", 1),
            "replicas": len(pods),
            "updatedReplicas": len(updated),
            "readyReplicas": len(ready),
            "availableReplicas": len(ready),
        }
        if res == WORKLOADS_BY_KIND["StatefulSet"]:
            # completeRollingUpdate: the update revision becomes the current one once every pod is
            # updated and ready; until then the current revision is the one the pods came from.
            current = rev if complete or not old.get("currentRevision") else old["currentRevision"]
            status |= {
                "currentRevision": current,
                "updateRevision": rev,
                "currentReplicas": sum(
                    1 for p in pods if (p["metadata"].get("labels") or {}).get(REVISION_LABEL[res]) == current
                ),
            }
        else:
            before = next(
                (c.get("reason") for c in old.get("conditions") or [] if c.get("type") == "Progressing"), None
            )
            steady = len(updated) == len(pods) == want
            reason = (
                "NewReplicaSetAvailable"
                if complete or (steady and before == "NewReplicaSetAvailable")
                else "ReplicaSetUpdated"
            )
            status |= {
                "unavailableReplicas": max(0, want - len(ready)),
                "conditions": [
                    {
                        "type": "Progressing",
                        "status": "True",
                        "reason": reason,
                        "message": f'ReplicaSet "{w["metadata"]["name"]}-{rev}" '
                        + (
                            "has successfully progressed."
                            if reason == "NewReplicaSetAvailable"
                            else "is progressing."
                        ),
                    }
                ],
            }
        # The API omits zero counts (omitempty).
        return {k: v for k, v in status.items() if v != 0}

    def _delete(self, key: Key) -> Obj:
        obj = self.store.get(key)
        if obj is None:
            raise sem.ApiError(404, "NotFound", f'{key[0][2]} "{key[2]}" not found')
        if obj["metadata"].get("finalizers"):
            if not obj["metadata"].get("deletionTimestamp"):
                obj = copy.deepcopy(obj)
                obj["metadata"]["deletionTimestamp"] = _now()
                return self._commit(key[0], key, obj, "MODIFIED")
            return copy.deepcopy(obj)
        del self.store[key]
        self.by_res[key[0]].pop(key, None)
        self.managed.pop(key, None)
        self.rv += 1
        obj["metadata"]["resourceVersion"] = str(self.rv)
        self._emit(key[0], "DELETED", obj)
        if key[0] == POD:
            self._play_controllers(POD, obj)
        self._collect(obj["metadata"]["uid"])
        return copy.deepcopy(obj)

    def _collect(self, uid: str) -> None:
        """Background cascading deletion: dependents go when their owner goes."""
        for key, obj in list(self.store.items()):  # every resource: owners and dependents differ in kind
            refs = obj["metadata"].get("ownerReferences") or []
            if key in self.store and any(r.get("uid") == uid for r in refs):
                self._delete(key)

    def _admit(self, res: Res, obj: Obj, old: Obj | None) -> Obj:
        kind, name = self.kind_of(res), obj["metadata"].get("name") or ""
        if self.strict and res not in self.crds:
            error = None if self._converted else sem.decode_error(kind, self.api_version(res), obj)
            if error is not None:
                raise error
            causes = sem.canonicalise(kind, obj) + sem.builtin_causes(kind, obj)
            if causes:
                raise sem.InvalidError(kind, res[0], name, causes)
            obj = {
                k: (sem.drop_empty(v) if k not in ("metadata", "data", "stringData", "binaryData") else v)
                for k, v in obj.items()
            }
        elif self.strict:
            causes = [sem.Cause("metadata.name", "Invalid", m, name) for m in sem.dns1123_subdomain(name)]
            if causes:
                raise sem.InvalidError(kind, res[0], name, causes)
        validator = self.validators.get(res)
        if validator is None:
            return obj
        defaulted, errors = validator(obj, old)
        if errors:
            error = sem.ApiError(422, "Invalid", f'{kind}.{res[0]} "{name}" is invalid: ' + "; ".join(errors))
            error.details = {
                "name": name,
                "group": res[0],
                "kind": kind,
                "causes": [
                    {
                        "reason": "FieldValueInvalid",
                        "message": e.partition(": ")[2],
                        "field": e.partition(": ")[0].lstrip("."),
                    }
                    for e in errors
                ],
            }
            raise error
        return dict(defaulted)

    def _changed(self, old: Obj, new: Obj) -> bool:
        def strip(o: Obj) -> Obj:
            meta = {k: v for k, v in o["metadata"].items() if k != "resourceVersion"}
            return {k: v for k, v in o.items() if k != "metadata"} | {"metadata": meta}

        return bool(strip(old) != strip(new))

    def _update(self, res: Res, key: Key, old: Obj, new: Obj, *, subresource: str | None) -> Obj:
        new["apiVersion"], new["kind"] = old["apiVersion"], old["kind"]
        for k in ("uid", "creationTimestamp", "generation", "deletionTimestamp", "resourceVersion"):
            if k in old["metadata"]:
                new["metadata"][k] = old["metadata"][k]
            else:
                new["metadata"].pop(k, None)
        new["metadata"]["name"], new["metadata"]["namespace"] = (
            old["metadata"]["name"],
            old["metadata"].get("namespace"),
        )
        if key[1] is None:
            new["metadata"].pop("namespace", None)
        if self.has_status(res):
            if subresource == "status":
                new = copy.deepcopy(old) | {"status": new.get("status")}
            elif "status" in old:
                new["status"] = old["status"]
            else:
                new.pop("status", None)
        new = self._admit(res, new, old)
        self._admit_owner_references(res, new, old)
        body_old = {k: v for k, v in old.items() if k not in ("metadata", "status")}
        body_new = {k: v for k, v in new.items() if k not in ("metadata", "status")}
        if body_old != body_new:
            new["metadata"]["generation"] = old["metadata"].get("generation", 1) + 1
        if not self._changed(old, new):
            return copy.deepcopy(old)
        if new["metadata"].get("deletionTimestamp") and not new["metadata"].get("finalizers"):
            self.store[key] = self.by_res[res][key] = new
            return self._delete(key)
        return self._commit(res, key, new, "MODIFIED")

    # ---- request handling --------------------------------------------------------------------

    @staticmethod
    def _verb(request: rendering.Request) -> str:
        method = str(request.method.value if hasattr(request.method, "value") else request.method).upper()
        if method == "GET":
            if request.name:
                return "get"
            return "watch" if request.params.get("watch") in ("true", "1") else "list"
        return {
            "POST": "create",
            "PATCH": "patch",
            "PUT": "update",
            "DELETE": "delete" if request.name else "deletecollection",
        }.get(method, method.lower())

    def _record(self, request: rendering.Request, res: Res, verb: str) -> float:
        """Log the call; apply an injected fault. Returns a delay to wait before answering."""
        plural = res[2] + (f"/{request.subresource}" if request.subresource else "")
        ua = request.headers.get("User-Agent", "")
        self.calls.append(
            Call(
                verb,
                res[0],
                plural,
                request.namespace,
                ua,
                request.params.get("labelSelector"),
                name=request.name,
            )
        )
        for f in self.faults:
            if (
                f.times > 0
                and (f.verb in (None, verb))
                and (f.resource in (None, plural))
                and ua.startswith(f.user_agent or "")
            ):
                f.times -= 1
                if f.delay:
                    return f.delay
                reason = "Conflict" if f.status == 409 else "InternalError"
                raise sem.ApiError(f.status, reason, f"injected {f.status} for {verb} {plural}")
        return 0.0

    async def _handle(self, request: rendering.Request) -> aiohttp.web.StreamResponse:
        if request.resource is None or request.action is None or not request.resource.plural:
            return await super()._handle(request)  # discovery, /version and non-API paths
        r = request.resource
        res: Res = (r.group or "", r.version or "", r.plural or "")
        verb = self._verb(request)
        try:
            delay = self._record(request, res, verb)
            user = self._authorize(request, res, verb)
            if delay:
                await asyncio.sleep(delay)
            if verb == "watch":
                return await self._watch(request, res)
            if verb in ("get", "list"):
                return await self._read(request, res, verb)
            async with self.wlock:
                self._user = user
                try:
                    obj, code = self._write(request, res, verb)
                finally:
                    self._converted = False
                    self._user = None
            return aiohttp.web.json_response(obj, status=code)
        except sem.ApiError as e:
            return aiohttp.web.json_response(
                _status(e.code, e.reason, e.message, getattr(e, "details", None)), status=e.code
            )

    # ---- authorization -------------------------------------------------------------------------

    def _allowed(self, user: User, a: Attributes, *, probe: bool = False) -> bool:
        assert self.rbac is not None
        ok = self.rbac.allows(user, a)
        self.checks.append(Check(user, a, ok, probe))
        return ok

    @staticmethod
    def _forbidden(a: Attributes, message: str) -> sem.ApiError:
        error = sem.ApiError(403, "Forbidden", message)
        error.details = {k: v for k, v in (("name", a.name), ("group", a.group), ("kind", a.resource)) if v}
        return error

    def _authorize(self, request: rendering.Request, res: Res, verb: str) -> User | None:
        """The authorization filter: every resource request, before any handler sees it."""
        if self.rbac is None:
            return None
        scheme, _, token = (request.headers.get("Authorization") or "").partition(" ")
        user = self.users.get(token) if scheme.lower() == "bearer" else None
        user = user or User("system:anonymous", ("system:unauthenticated",))
        a = Attributes(verb, res[0], res[2], request.subresource or "", request.namespace, request.name or "")
        if not self._allowed(user, a):
            raise self._forbidden(a, forbidden_message(user, a))
        return user

    def _authorize_create_on_apply(self, res: Res, ns: str | None, name: str) -> None:
        """An apply that finds nothing to patch creates: the handler checks `create` too. The RBAC
        authorizer gives no reason, so the message names neither the verb nor the user."""
        if self.rbac is None or self._user is None:
            return
        a = Attributes("create", res[0], res[2], "", ns, name)
        if not self._allowed(self._user, a):
            raise self._forbidden(a, f'{qualified(res[0], res[2])} "{name}" is forbidden: ')

    def _admit_owner_references(self, res: Res, obj: Obj, old: Obj | None) -> None:
        """OwnerReferencesPermissionEnforcement: who changes ownerReferences must be able to delete the
        object; who sets blockOwnerDeletion must be able to update the owner's finalizers."""
        if self.rbac is None or self._user is None or not self.owner_references_permission_enforcement:
            return
        meta = obj["metadata"]
        refs = meta.get("ownerReferences") or []
        old_refs = ((old or {}).get("metadata") or {}).get("ownerReferences") or []
        if (refs == old_refs) if old is not None else not refs:
            return
        name, ns = meta.get("name") or "", meta.get("namespace")
        target = f'{qualified(res[0], res[2])} "{name}" is forbidden: '
        if old is not None:
            a = Attributes("delete", res[0], res[2], "", ns, name)
            if not self._allowed(self._user, a):
                raise self._forbidden(
                    a, target + "cannot set an ownerRef on a resource you can't delete: , <nil>"
                )
        was_blocking = {r.get("uid") for r in old_refs if r.get("blockOwnerDeletion")}
        blocking = [r for r in refs if r.get("blockOwnerDeletion") and r.get("uid") not in was_blocking]
        if not blocking or self._allowed(
            self._user, Attributes("update", "*", "*", "finalizers", ns), probe=True
        ):
            return
        for ref in blocking:
            group = ref.get("apiVersion", "").rpartition("/")[0]
            plural = self._plural(ref.get("apiVersion", ""), ref.get("kind", ""))
            if plural is None:
                raise self._forbidden(
                    Attributes("update", group, "", "finalizers", ns, name),
                    target
                    + (
                        f"cannot set blockOwnerDeletion in this case because cannot find RESTMapping for APIVersion "
                        f"{ref.get('apiVersion')} Kind {ref.get('kind')}"
                    ),
                )
            a = Attributes("update", group, plural, "finalizers", ns, ref.get("name") or "")
            if not self._allowed(self._user, a):
                raise self._forbidden(
                    Attributes("update", res[0], res[2], "", ns, name),
                    target
                    + (
                        "cannot set blockOwnerDeletion if an ownerReference refers to a resource you can't set finalizers on: , <nil>"
                    ),
                )

    def _plural(self, api_version: str, kind: str) -> str | None:
        group, _, version = api_version.rpartition("/")
        for r in self.resources:
            if (
                (r.group or "", r.version) == (group, version)
                and self.resources[r].kind == kind
                and "/" not in (r.plural or "/")
            ):
                return str(r.plural)
        return None

    def _body(self, request: rendering.Request) -> Any:
        if (
            request.data is not None
            and not isinstance(request.data, (str, bytes))
            and hasattr(request.data, "keys")
        ) or isinstance(request.data, list):
            return (
                copy.deepcopy(request.data) if isinstance(request.data, (dict, list)) else dict(request.data)
            )
        try:
            return yaml.safe_load(request.text) if request.text else None
        except yaml.YAMLError as e:
            raise sem.ApiError(400, "BadRequest", f"cannot parse the body: {e}") from e

    async def _read(self, request: rendering.Request, res: Res, verb: str) -> aiohttp.web.StreamResponse:
        kind = self.kind_of(res)
        if verb == "get":
            obj = self.store.get((res, request.namespace, request.name or ""))
            if obj is None:
                raise sem.ApiError(404, "NotFound", f'{res[2]} "{request.name}" not found')
            return aiohttp.web.json_response(obj)
        items = [
            copy.deepcopy(o)
            for (_, ns, _), o in self.by_res[res].items()
            if (request.namespace is None or ns == request.namespace)
            and sem.label_match(request.params.get("labelSelector"), o["metadata"].get("labels") or {})
            and sem.field_match(request.params.get("fieldSelector"), o)
        ]
        items.sort(key=lambda o: (o["metadata"].get("namespace") or "", o["metadata"]["name"]))
        if "as=Table" in request.headers.get("Accept", ""):
            return aiohttp.web.json_response(self._table(res, items))
        for item in items:
            item.pop("apiVersion", None), item.pop("kind", None)  # like a real list
        return aiohttp.web.json_response({
            "kind": f"{kind}List", "apiVersion": self.api_version(res),
            "metadata": {"resourceVersion": str(self.rv)}, "items": items,
        })  # fmt: skip

    def _table(self, res: Res, items: list[Obj]) -> Obj:
        crd = self.crds.get(res)
        cols = (
            (crd["spec"]["versions"][0].get("additionalPrinterColumns") or [])
            if crd
            else [{"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"}]
        )
        defs = [{"name": "Name", "type": "string", "format": "name", "description": "", "priority": 0}]
        defs += [
            {
                "name": c["name"],
                "type": c["type"],
                "format": "",
                "description": c.get("description", ""),
                "priority": 0,
            }
            for c in cols
        ]

        def cell(item: Obj, col: Obj) -> Any:
            value = sem.jsonpath(item, col["jsonPath"])
            if col["type"] == "date" and value:
                created = datetime.datetime.strptime(value, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=datetime.UTC)
                secs = int((datetime.datetime.now(datetime.UTC) - created).total_seconds())
                return f"{secs}s" if secs < 120 else f"{secs // 60}m"
            return "" if value is None else value

        rows = [
            {
                "cells": [i["metadata"]["name"], *[cell(i, c) for c in cols]],
                "object": {
                    "kind": "PartialObjectMetadata",
                    "apiVersion": "meta.k8s.io/v1",
                    "metadata": i["metadata"],
                },
            }
            for i in items
        ]
        return {
            "kind": "Table",
            "apiVersion": "meta.k8s.io/v1",
            "metadata": {"resourceVersion": str(self.rv)},
            "columnDefinitions": defs,
            "rows": rows,
        }

    def _write(self, request: rendering.Request, res: Res, verb: str) -> tuple[Obj, int]:
        ns, name, sub = request.namespace, request.name, request.subresource
        if verb == "create":
            obj = self._body(request)
            if not isinstance(obj, dict):
                raise sem.ApiError(400, "BadRequest", "the body must be an object")
            meta = obj.setdefault("metadata", {})
            if not meta.get("name"):
                if not meta.get("generateName"):
                    raise sem.ApiError(422, "Invalid", "metadata.name or metadata.generateName is required")
                meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
            if ns is not None:
                meta["namespace"] = ns
            key = (res, ns, meta["name"])
            if key in self.store:
                raise sem.ApiError(409, "AlreadyExists", f'{res[2]} "{meta["name"]}" already exists')
            obj["apiVersion"], obj["kind"] = self.api_version(res), self.kind_of(res)
            if self.has_status(res):
                obj.pop("status", None)
            for k in ("uid", "resourceVersion", "deletionTimestamp"):
                meta.pop(k, None)
            obj = self._admit(res, obj, None)
            self._admit_owner_references(res, obj, None)
            self._stamp_new(obj)
            if res == ("apiextensions.k8s.io", "v1", "customresourcedefinitions"):
                self._serve_crd(obj)
            return self._commit(res, key, obj, "ADDED"), 201
        key = (res, ns, name or "")
        if verb == "delete":
            return self._delete(key), 200
        if verb not in ("patch", "update"):
            raise sem.ApiError(405, "MethodNotAllowed", f"{verb} is not supported by this test server")
        ctype = request.headers.get("Content-Type", "").split(";")[0].strip()
        body = self._body(request)
        old = self.store.get(key)
        if verb == "patch" and ctype == "application/apply-patch+yaml":
            if old is None:
                if sub:
                    raise sem.ApiError(404, "NotFound", f'{res[2]} "{name}" not found')
                body.setdefault("metadata", {})["name"] = name
                if ns is not None:
                    body["metadata"]["namespace"] = ns
                body["apiVersion"], body["kind"] = self.api_version(res), self.kind_of(res)
                if self.has_status(res):
                    body.pop("status", None)
                self._authorize_create_on_apply(res, ns, name or "")
                self._typed(res, body, ns, name or "")
                body = self._admit(res, body, None)
                self._admit_owner_references(res, body, None)
                self._stamp_new(body)
                self._remember_apply(key, request.params.get("fieldManager") or "", body)
                return self._commit(res, key, body, "ADDED"), 201
            self._typed(res, body, ns, name or "")
            new = copy.deepcopy(old)
            manager = request.params.get("fieldManager") or ""
            if res in self.crds:  # a custom resource's lists are atomic: the applied top-level fields replace
                for k, v in body.items():
                    if k != "metadata":
                        new[k] = copy.deepcopy(v)
            else:  # built-in kinds: merged as server-side apply merges (keyed lists by key)
                content = {
                    k: v for k, v in body.items() if k not in ("metadata", "apiVersion", "kind", "status")
                }
                previous = self.managed.get(key, {}).get(manager)
                merged = sem.apply_merge(
                    {k: v for k, v in old.items() if k not in ("metadata", "apiVersion", "kind", "status")},
                    content,
                    previous,
                )
                new = {
                    k: v for k, v in old.items() if k in ("metadata", "apiVersion", "kind", "status")
                } | merged
                new = copy.deepcopy(new)
            for k, v in (body.get("metadata") or {}).items():
                if k in ("labels", "annotations") and isinstance(v, dict):
                    new["metadata"][k] = (new["metadata"].get(k) or {}) | v
                elif k not in ("resourceVersion", "uid"):
                    new["metadata"][k] = copy.deepcopy(v)
            out = self._update(res, key, old, new, subresource=sub)
            self._remember_apply(key, manager, body)
            return out, 200
        if old is None:
            raise sem.ApiError(404, "NotFound", f'{res[2]} "{name}" not found')
        want_rv = (body or {}).get("metadata", {}).get("resourceVersion") if isinstance(body, dict) else None
        if want_rv and want_rv != old["metadata"]["resourceVersion"]:
            raise sem.ApiError(
                409,
                "Conflict",
                "the object has been modified; please apply your changes to the latest version and try again",
            )
        if verb == "update":
            return self._update(res, key, old, copy.deepcopy(body), subresource=sub), 200
        if ctype == "application/json-patch+json":
            new = sem.json_patch(old, body)
        else:  # merge and strategic-merge patches (strategic handled as merge)
            new = sem.merge(old, body)
        return self._update(res, key, old, new, subresource=sub), 200

    def _remember_apply(self, key: Key, manager: str, body: Obj) -> None:
        """The fields a manager applied: what its next apply may remove (managedFields, in short)."""
        self.managed.setdefault(key, {})[manager] = {
            k: copy.deepcopy(v)
            for k, v in body.items()
            if k not in ("metadata", "apiVersion", "kind", "status")
        }

    def _typed(self, res: Res, body: Obj, ns: str | None, name: str) -> None:
        """Server-side apply's conversion of the applied object to its kind's schema (built-in kinds)."""
        if self.strict and res not in self.crds:
            error = sem.typed_patch_error(self.kind_of(res), self.api_version(res), ns, name, body)
            if error is not None:
                raise error
            self._converted = True

    def _serve_crd(self, crd: Obj) -> None:
        spec, names = crd["spec"], crd["spec"]["names"]
        for v in spec["versions"]:
            res: Res = (spec["group"], v["name"], names["plural"])
            self.resources[f"{spec['group']}/{v['name']}/{names['plural']}"] = kmock.ResourceInfo(
                kind=names["kind"], namespaced=spec.get("scope") == "Namespaced", singular=names.get("singular"),
                shortnames=set(names.get("shortNames") or []), categories=set(names.get("categories") or []),
                subresources=set((v.get("subresources") or {}).keys()),
                verbs={"get", "list", "watch", "create", "update", "patch", "delete"},
            )  # fmt: skip
            self.crds[res] = crd
        crd["status"] = {
            "acceptedNames": names,
            "conditions": [
                {"type": "NamesAccepted", "status": "True", "reason": "NoConflicts"},
                {"type": "Established", "status": "True", "reason": "InitialNamesAccepted"},
            ],
        }

    async def _watch(self, request: rendering.Request, res: Res) -> aiohttp.web.StreamResponse:
        raw = request._raw_request
        assert raw is not None
        self.kind_of(res)
        queue: asyncio.Queue[Obj] = asyncio.Queue()
        since = int(request.params.get("resourceVersion") or 0)
        bookmarks = request.params.get("allowWatchBookmarks") in ("true", "1")
        expired = False
        async with self.wlock:  # subscribe and snapshot atomically: no event falls in between
            self.subs[res].add(queue)
            if since and since < self.compacted:
                expired, backlog = True, []
            elif since:
                backlog = [e for rv, r, e in self.events if r == res and rv > since]
            else:
                backlog = [{"type": "ADDED", "object": copy.deepcopy(o)} for o in self.by_res[res].values()]
        timeout = float(request.params.get("timeoutSeconds") or 3600)
        labels, fields = request.params.get("labelSelector"), request.params.get("fieldSelector")

        def wanted(event: Obj) -> bool:
            if event["type"] in ("ERROR", "BOOKMARK"):
                return event["type"] == "ERROR" or bookmarks
            o = event["object"]
            return (
                (request.namespace is None or o["metadata"].get("namespace") == request.namespace)
                and sem.label_match(labels, o["metadata"].get("labels") or {})
                and sem.field_match(fields, o)
            )

        resp = aiohttp.web.StreamResponse(status=200, headers={"Content-Type": "application/json"})
        try:
            await resp.prepare(raw)
            if expired:
                gone = {
                    "type": "ERROR",
                    "object": _status(410, "Expired", f"too old resource version: {since}"),
                }
                await resp.write(json.dumps(gone).encode() + b"\n")
                await resp.write_eof()
                return resp
            for event in backlog:
                if wanted(event):
                    await resp.write(json.dumps(event).encode() + b"\n")
            loop = asyncio.get_running_loop()
            deadline = loop.time() + timeout
            timed_out = False
            while not timed_out:
                try:
                    # In slices: a client that went away (an operator stopped) is noticed within one,
                    # so no handler outlives it until its timeoutSeconds and holds the server's shutdown.
                    event = await asyncio.wait_for(
                        queue.get(), timeout=max(0.0, min(1.0, deadline - loop.time()))
                    )
                except TimeoutError:
                    transport = raw.transport
                    if transport is None or transport.is_closing():
                        break
                    timed_out = loop.time() >= deadline
                    continue
                if wanted(event):
                    await resp.write(json.dumps(event).encode() + b"\n")
                if event["type"] == "ERROR":
                    break
            if timed_out and bookmarks:  # a real server bookmarks shortly before it ends a watch
                await resp.write(json.dumps(self._bookmark(res)).encode() + b"\n")
            await resp.write_eof()
        except (ConnectionResetError, asyncio.CancelledError):
            pass
        finally:
            self.subs[res].discard(queue)
        return resp


async def serve() -> tuple[ApiServer, Any]:
    """Start the server on a free loopback port; returns (server, kmock Server) — exit both to stop."""
    handler = ApiServer()
    await handler.__aenter__()
    srv = kmock.Server(handler)
    await srv.__aenter__()
    return handler, srv


def kubeconfig(url: str) -> str:
    return yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "test",
        "clusters": [{"name": "test", "cluster": {"server": url.rstrip("/")}}],
        "users": [{"name": "test", "user": {"token": TOKEN}}],
        "contexts": [{"name": "test", "context": {"cluster": "test", "user": "test", "namespace": "default"}}],
    })  # fmt: skip
