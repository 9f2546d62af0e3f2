"""The operator's async Kubernetes API client (children, pods, status, events, watches).

kopf watches PDClusters and dispatches; it "is not a Kubernetes client library", so the reconcile
talks to the API through this module: one aiohttp session, server-side apply with one fixed field
manager, list and watch for the informers (cache.py), and retries with backoff on 409, 429, 5xx,
timeouts and connection errors, honouring a Retry-After. Every call is counted by verb (the
operator's /metrics) and none happens anywhere else, which keeps the ClusterRole checkable. A read
(`get`, `list`) is answered from the watch cache when one is attached (`Client.cache`) and holds the
object; a write tells the cache what the API server answered, so the next read sees it.

Credentials are not read once. A token that lives in a file (the in-cluster service-account token,
which the kubelet rotates about hourly; a kubeconfig's tokenFile) is re-read when the file changes
(one stat per request). A token with an expiry (an exec plugin's expirationTimestamp) is renewed
through `refresh` shortly before it expires. A 401 re-reads the credentials (the file, or `refresh`)
and, when they changed, retries the call once. Loading uses only the public API of the `kubernetes`
package (its kubeconfig merger and loader, its exec-plugin runner): no private attribute is read.

Why this module and not a maintained async client (checked against kubernetes_asyncio 36.1.0 and
lightkube 1.0.1, the current releases; see docs/operator-internals.md for the whole comparison):
- Neither retries an ordinary call on 429 or 5xx, let alone with Retry-After: lightkube's only retry
  is the `on_error` hook of watch/list streams; kubernetes_asyncio's `Configuration.retries` is
  never read by its aiohttp REST client. That policy would stay here either way.
- Neither renews an exec plugin's token before its `expirationTimestamp`: lightkube 1.0.1's
  `ExecAuth` runs the plugin again only after a 401 and refuses `client.authentication.k8s.io/v1`
  (the current exec API; it accepts v1alpha1 and v1beta1 only); lightkube re-reads a token file only
  after a 401 too (`BearerTokenFileAuth`). The operator's kopf login (wiring.py) needs the expiry as
  well, so the loading would stay here.
- An informer needs list-then-watch with a relist on 410 Gone. lightkube's watch answers a 410 by
  watching again from "now" (`reset_version`), so objects deleted in the gap stay in a store;
  kubernetes_asyncio 36.1.0's `Watch` reconnects once with the same expired resourceVersion and then
  raises. Either way cache.py keeps its own loop over list and watch.
- lightkube works on typed models (a plain dict is applied through a generic resource per kind) and
  brings httpx2, msgspec and lightkube-models into an image that already has aiohttp (kopf's);
  kubernetes_asyncio's generated API is untyped for mypy --strict and brings urllib3, six and
  python-dateutil beside aiohttp.
What the operator uses (server-side apply with field manager and force, dryRun=All, watch with
bookmarks and resourceVersion) is a query parameter each, which this module sets directly.
Retries stay a loop here rather than a retry library: none is a dependency (tenacity is not;
aiohttp-retry comes only through `kubernetes` and retries by status alone), and the loop needs the
401 re-authentication, the Retry-After and the per-attempt call count in the same place.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import json
import logging
import os
import ssl
import time
from collections import Counter, OrderedDict
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import aiohttp

from tilert_operator import constants

log = logging.getLogger(__name__)

Obj = dict[str, Any]
Objs = list[Obj]

# kind -> (API prefix, plural). Only the kinds the operator touches: the RBAC test holds the role to
# exactly these.
KINDS: Mapping[str, tuple[str, str]] = {
    "Pod": ("/api/v1", "pods"),
    "Service": ("/api/v1", "services"),
    "ConfigMap": ("/api/v1", "configmaps"),
    "Secret": ("/api/v1", "secrets"),
    "Event": ("/api/v1", "events"),
    "Deployment": ("/apis/apps/v1", "deployments"),
    "StatefulSet": ("/apis/apps/v1", "statefulsets"),
    "NetworkPolicy": ("/apis/networking.k8s.io/v1", "networkpolicies"),
    "PodDisruptionBudget": ("/apis/policy/v1", "poddisruptionbudgets"),
    "HorizontalPodAutoscaler": ("/apis/autoscaling/v2", "horizontalpodautoscalers"),
    "MultiNetworkPolicy": ("/apis/k8s.cni.cncf.io/v1beta1", "multi-networkpolicies"),
    constants.KIND: (f"/apis/{constants.API_VERSION}", constants.PLURAL),
}


class ApiError(Exception):
    """An API call failed for good (after retries, or with a status that retrying cannot fix)."""

    def __init__(self, status: int, method: str, path: str, message: str) -> None:
        super().__init__(f"{method} {path}: HTTP {status}: {message[:300]}")
        self.status = status
        #: The API server's Status object when it answered one: its whole message (the text above is
        #: cut), its reason and details (a 403's resource and group), which reports quote and classify.
        self.body: Obj | None = _status_object(message)


def _status_object(text: str) -> Obj | None:
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    return obj if isinstance(obj, dict) and obj.get("kind") == "Status" else None


def group_resource(kind: str) -> tuple[str, str]:
    """(API group, plural) of a kind the operator touches: what RBAC rules name."""
    prefix, plural = KINDS[kind]
    parts = prefix.strip("/").split("/")
    return (parts[1] if parts[0] == "apis" else ""), plural


@dataclass(frozen=True)
class Connection:
    server: str
    ca_path: str | None = None
    insecure: bool = False
    token: str | None = None
    scheme: str | None = None
    cert_path: str | None = None
    key_path: str | None = None
    #: Where the token is re-read from when the file changes (service account, kubeconfig tokenFile).
    token_file: str | None = None
    #: When the token expires (an exec plugin's expirationTimestamp), epoch seconds.
    expires_at: float | None = None

    def expiration(self) -> datetime.datetime | None:
        return (
            None
            if self.expires_at is None
            else datetime.datetime.fromtimestamp(self.expires_at, datetime.UTC)
        )


#: Marks a delete in Client.own (a DELETED event carries the last resourceVersion, not ours).
DELETED = "<deleted>"


def load_connection() -> Connection:
    """In-cluster service account, else the kubeconfig named by $KUBECONFIG (read now, not at import).

    Each call reads everything again: the token file, and an exec plugin is run anew. Only the
    `kubernetes` package's public API is used: the kubeconfig is merged by its KubeConfigMerger and
    read here as plain data (the current context's user), an exec plugin is run by its ExecProvider
    (which returns the expirationTimestamp), and its token then handed to KubeConfigLoader as a plain
    token, so the loader neither runs the plugin a second time nor keeps a refresh hook of its own.
    """
    import kubernetes.client
    import kubernetes.config
    from kubernetes.config import incluster_config, kube_config
    from kubernetes.config.exec_provider import ExecProvider

    cfg = kubernetes.client.Configuration()
    token_file: str | None = None
    expires_at: float | None = None
    try:
        kubernetes.config.load_incluster_config(client_configuration=cfg, try_refresh_token=False)  # type: ignore[no-untyped-call]
        token_file = incluster_config.SERVICE_TOKEN_FILENAME
    except kubernetes.config.ConfigException:
        path = os.environ.get("KUBECONFIG") or os.path.expanduser(kube_config.KUBE_CONFIG_DEFAULT_LOCATION)
        merged = kube_config.KubeConfigMerger(path)  # type: ignore[no-untyped-call]
        if merged.config is None:
            raise kubernetes.config.ConfigException(f"no kubeconfig found at {path}") from None
        base = os.path.dirname(os.path.abspath(path.split(os.pathsep)[0]))
        doc: Obj = _plain(merged.config, kube_config.ConfigNode)
        context = _named(doc, "contexts", doc.get("current-context"), path)
        user_name = context.get("user")
        user: Obj = dict(_named(doc, "users", user_name, path)) if user_name else {}
        if "exec" in user:
            cluster = _named(doc, "clusters", context.get("cluster"), path)
            status = ExecProvider(  # type: ignore[no-untyped-call]
                kube_config.ConfigNode("exec", user["exec"], path),  # type: ignore[no-untyped-call]
                base,
                cluster=kube_config.ConfigNode("cluster", cluster, path),  # type: ignore[no-untyped-call]
            ).run()
            user = {k: v for k, v in user.items() if k != "exec"}
            if status.get("token"):
                user["token"] = status["token"]
            for ours, theirs in (
                ("client-certificate-data", "clientCertificateData"),
                ("client-key-data", "clientKeyData"),
            ):
                if status.get(theirs):
                    user[ours] = _b64(status[theirs])
            stamp = status.get("expirationTimestamp")
            if stamp:
                expires_at = datetime.datetime.fromisoformat(str(stamp).replace("Z", "+00:00")).timestamp()
            doc["users"] = [
                u if u.get("name") != user_name else {"name": user_name, "user": user}
                for u in doc.get("users") or []
            ]
        elif user.get("tokenFile") and not user.get("token"):
            token_file = os.path.join(base, user["tokenFile"])
        loader = kube_config.KubeConfigLoader(config_dict=doc, config_base_path=base)  # type: ignore[no-untyped-call]
        loader.load_and_set(cfg)  # type: ignore[no-untyped-call]
        cfg.refresh_api_key_hook = None  # the client renews on its own schedule (see Client)
    header = cfg.get_api_key_with_prefix("BearerToken") or cfg.get_api_key_with_prefix("authorization")
    parts = header.split(" ", 1) if header else []
    scheme, token = (
        (None, None) if not parts else (None, parts[0]) if len(parts) == 1 else (parts[0], parts[1])
    )
    return Connection(
        server=cfg.host.rstrip("/"),
        ca_path=cfg.ssl_ca_cert or None,
        insecure=not cfg.verify_ssl,
        token=token,
        scheme=scheme,
        cert_path=cfg.cert_file or None,
        key_path=cfg.key_file or None,
        token_file=token_file,
        expires_at=expires_at,
    )


def _named(doc: Obj, section: str, name: Any, path: str) -> Obj:
    """The entry `name` of a kubeconfig's `section` (contexts, users, clusters), as plain data."""
    for entry in doc.get(section) or []:
        if entry.get("name") == name:
            return dict(entry.get(section[:-1]) or {})
    raise kubernetes_config_error(
        f"kubeconfig {path}: no {section[:-1]} named {name!r}; check its current-context and {section}"
    )


def _plain(node: Any, config_node: Any) -> Any:
    """The merged kubeconfig as plain dicts and lists (the merger keeps each file's entries wrapped)."""
    if isinstance(node, config_node):
        return _plain(node.value, config_node)
    if isinstance(node, dict):
        return {k: _plain(v, config_node) for k, v in node.items()}
    if isinstance(node, list):
        return [_plain(v, config_node) for v in node]
    return node


def kubernetes_config_error(message: str) -> Exception:
    import kubernetes.config

    return kubernetes.config.ConfigException(message)


def _b64(text: str) -> str:
    import base64

    return base64.standard_b64encode(text.encode()).decode()


def _file_sig(path: str) -> tuple[int, int, int, int] | None:
    """Identity of a file's current content; follows the kubelet's ..data symlink swap."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size)


def _tls(conn: Connection) -> tuple[Any, ...]:
    return (conn.server, conn.ca_path, conn.insecure, conn.cert_path, conn.key_path)


@dataclass(frozen=True)
class Retry:
    attempts: int = 6
    first_delay: float = 0.1
    max_delay: float = 2.0
    timeout: float = 30.0


RETRYABLE = frozenset({409, 429, 500, 502, 503, 504})


def retry_after(value: str | None) -> float | None:
    """Seconds from a Retry-After header (the API server sends whole seconds); None when absent or a date."""
    try:
        return max(0.0, float(value)) if value else None
    except ValueError:
        return None


def object_path(kind: str, namespace: str, name: str | None = None, subresource: str | None = None) -> str:
    prefix, plural = KINDS[kind]
    path = f"{prefix}/namespaces/{namespace}/{plural}"
    if name:
        path += f"/{name}"
    if subresource:
        path += f"/{subresource}"
    return path


#: Seconds before a failed credential refresh (an exec plugin that failed) is tried again.
REFRESH_RETRY_S = 5.0
#: How many of its own writes the client remembers (by object) to recognise their watch echoes.
OWN_WRITES = 4096
#: How many Events the client remembers to aggregate repeats into (client-go's recorder keeps 4096).
EVENT_CACHE = 4096
#: Similar Events (one object, type and reason, any message) within this many seconds...
EVENT_SIMILAR_WINDOW_S = 600.0
#: ...beyond this many distinct messages become one Event, as client-go's EventAggregator does.
EVENT_SIMILAR_MAX = 10
#: The prefix client-go gives the message of such an Event.
COMBINED = "(combined from similar events): "


def similar_key(event: Obj) -> tuple[str, ...]:
    """Events of one object with one type and reason (client-go's aggregate key: the message aside)."""
    inv = event.get("involvedObject") or {}
    return (
        str(event["metadata"].get("namespace")),
        str(inv.get("uid") or inv.get("name")),
        str(event.get("type")),
        str(event.get("reason")),
    )


def event_key(event: Obj) -> tuple[str, ...]:
    """What makes two Events the same occurrence again (client-go's getEventKey): the object, the
    related object, type, reason and message."""
    rel = event.get("related") or {}
    return (*similar_key(event), str(rel.get("kind")), str(rel.get("name")), str(event.get("message")))


class ReadCache(Protocol):
    """What the client asks of a watch cache (cache.Cache): reads it can answer, writes it must see."""

    def lookup(self, kind: str, namespace: str, name: str) -> Obj | None:
        """The object as the watch last showed it; None when the cache cannot say (then the API is asked)."""

    def select(self, kind: str, namespace: str, label_selector: str) -> list[Obj] | None:
        """The objects matching the selector; None when the cache cannot say. May raise the ApiError
        the kind's list last answered (an optional kind not served or not allowed)."""

    def wrote(self, kind: str, namespace: str, name: str, obj: Obj | None) -> None:
        """The API server's answer to a write (None: deleted), so a read after it sees it."""


class Client:
    def __init__(
        self,
        conn: Connection,
        *,
        retry: Retry = Retry(),
        user_agent: str = constants.FIELD_MANAGER,
        refresh: Callable[[], Connection] | None = None,
    ) -> None:
        """`refresh` reads the credentials again (wiring passes load_connection): called before a
        token with an expiry runs out and after a 401. Without it, only a token_file is re-read."""
        self.conn = conn
        self.retry = retry
        self.calls: Counter[str] = Counter()
        #: Credential reloads done (after a 401, before expiry, a changed token file).
        self.reauths: Counter[str] = Counter()
        self._user_agent = user_agent
        self._refresh = refresh
        self._session: aiohttp.ClientSession | None = None
        #: Watches hold their connection for minutes: their own pool, so that they never take the
        #: connections the calls need (one informer per kind and namespace outnumbers any fixed limit).
        self._watch_session: aiohttp.ClientSession | None = None
        #: Sessions being closed after new credentials (kept referenced until done).
        self._closing: set[asyncio.Future[None]] = set()
        self._lock = asyncio.Lock()
        self._issued_at = time.time()
        self._refresh_after = 0.0
        self._token_sig = _file_sig(conn.token_file) if conn.token_file else None
        self._own: OrderedDict[tuple[str, str, str], str] = OrderedDict()
        #: event_key -> (the Event's name, its count) of the Events this client posted.
        self._events: OrderedDict[tuple[str, ...], tuple[str, int]] = OrderedDict()
        #: similar_key -> (when its window began, monotonic seconds; the messages seen in it).
        self._similar: OrderedDict[tuple[str, ...], tuple[float, set[str]]] = OrderedDict()
        #: The watch cache reads are answered from when it holds the object (controller.py attaches it).
        self.cache: ReadCache | None = None

    def own(self, kind: str, namespace: str, name: str) -> str | None:
        """The resourceVersion our last write of this object got (DELETED after our delete), if any."""
        return self._own.get((kind, namespace, name))

    def _wrote(self, kind: str, namespace: str, name: str, rv: str | None, obj: Obj | None = None) -> None:
        if self.cache is not None:
            self.cache.wrote(kind, namespace, name, None if rv == DELETED else obj)
        key = (kind, namespace, name)
        self._own.pop(key, None)
        if rv:
            self._own[key] = rv
            while len(self._own) > OWN_WRITES:
                self._own.popitem(last=False)

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        for session in (self._session, self._watch_session):
            if session is not None:
                await session.close()
        self._session = self._watch_session = None

    # -- credentials --------------------------------------------------------------------------

    def _authorization(self) -> str | None:
        c = self.conn
        return f"{c.scheme or 'Bearer'} {c.token}" if c.token else None

    def _expiring(self) -> bool:
        exp = self.conn.expires_at
        if exp is None:
            return False
        # Renew a little early: a tenth of the token's life, at most a minute.
        skew = min(60.0, max(0.0, exp - self._issued_at) / 10)
        return time.time() >= exp - skew

    async def _credentials(self, *, force: bool = False) -> None:
        """Bring the credentials up to date: see the module docstring."""
        if self._refresh is not None and (
            force or (self._expiring() and time.monotonic() >= self._refresh_after)
        ):
            seen = self.conn
            async with self._lock:
                if self.conn is seen:  # nobody renewed them while we waited
                    try:
                        new = await asyncio.to_thread(self._refresh)
                    except Exception as e:
                        # Keep what we have (it may still be valid); try again in a few seconds, not per call.
                        self._refresh_after = time.monotonic() + REFRESH_RETRY_S
                        self.reauths["failed"] += 1
                        log.warning("re-reading the API credentials failed (%s); keeping the current ones", e)
                        return
                    self._adopt(new, "after 401" if force else "before expiry")
            return
        path = self.conn.token_file
        if path:
            sig = _file_sig(path)
            if force or sig != self._token_sig:
                self._token_sig = sig
                try:
                    with open(path) as f:
                        token = f.read().strip()
                except OSError as e:
                    log.warning("cannot re-read the API token from %s (%s); keeping the one we have", path, e)
                    return
                if token and token != self.conn.token:
                    self.conn = dataclasses.replace(self.conn, token=token)
                    self.reauths["token file"] += 1
                    log.info("API token re-read from %s", path)

    def _adopt(self, new: Connection, why: str) -> None:
        old, self.conn = self.conn, new
        self._issued_at = time.time()
        self._token_sig = _file_sig(new.token_file) if new.token_file else None
        self.reauths[why] += 1
        log.info(
            "API credentials re-read (%s)%s",
            why,
            f"; token valid until {new.expiration():%H:%M:%S}Z" if new.expires_at else "",
        )
        if _tls(old) != _tls(new):
            # A new client certificate (or server): new connections, and the old sessions close once
            # requests already on them are done (a watch on the old one ends at its timeout or then).
            stale = [x for x in (self._session, self._watch_session) if x is not None]
            self._session = self._watch_session = None

            def close_stale() -> None:
                for x in stale:
                    task = asyncio.ensure_future(x.close())
                    self._closing.add(task)
                    task.add_done_callback(self._closing.discard)

            if stale:
                asyncio.get_running_loop().call_later(self.retry.timeout + 1, close_stale)

    def _session_get(self, *, watch: bool = False) -> aiohttp.ClientSession:
        session = self._watch_session if watch else self._session
        if session is None:
            ctx: ssl.SSLContext | bool = False
            if self.conn.server.startswith("https"):
                ctx = ssl.create_default_context(cafile=self.conn.ca_path)
                if self.conn.insecure:
                    ctx.check_hostname = False
                    ctx.verify_mode = ssl.CERT_NONE
                if self.conn.cert_path and self.conn.key_path:
                    ctx.load_cert_chain(self.conn.cert_path, self.conn.key_path)
            headers = {"User-Agent": self._user_agent, "Accept": "application/json"}
            session = aiohttp.ClientSession(
                headers=headers,
                # Calls: at most 64 at once. Watches: one per informer, no limit (their number is
                # the kinds times the namespaces with PDClusters).
                connector=aiohttp.TCPConnector(ssl=ctx, limit=0 if watch else 64),
                timeout=aiohttp.ClientTimeout(total=self.retry.timeout),
            )
            if watch:
                self._watch_session = session
            else:
                self._session = session
        return session

    async def request(
        self,
        verb: str,
        method: str,
        path: str,
        *,
        body: Any = None,
        params: Mapping[str, str] | None = None,
        content_type: str = "application/json",
        ok_statuses: frozenset[int] = frozenset(),
    ) -> tuple[int, Obj | None]:
        """One call with retries. Returns (status, body); a status in ok_statuses is returned, not raised.

        A 401 re-reads the credentials and, if they changed, tries once more at once."""
        delay = self.retry.first_delay
        last = ""
        reauthed = False
        for attempt in range(1, self.retry.attempts + 1):
            self.calls[verb] += 1
            await self._credentials()
            headers = {"Content-Type": content_type}
            auth = self._authorization()
            if auth:
                headers["Authorization"] = auth
            try:
                async with self._session_get().request(
                    method,
                    self.conn.server + path,
                    params=params,
                    data=None if body is None else json.dumps(body),
                    headers=headers,
                ) as resp:
                    text = await resp.text()
                    if resp.status < 300 or resp.status in ok_statuses:
                        return resp.status, (json.loads(text) if text else None)
                    if resp.status == 401 and not reauthed:
                        reauthed = True
                        before = (auth, _tls(self.conn))
                        await self._credentials(force=True)
                        if (self._authorization(), _tls(self.conn)) != before:
                            log.info(
                                "%s %s: HTTP 401; retrying with the credentials read again", method, path
                            )
                            continue
                    if resp.status not in RETRYABLE:
                        raise ApiError(resp.status, method, path, text)
                    last = f"HTTP {resp.status}: {text[:200]}"
                    # The server says when to come back (a 429 of API Priority and Fairness, a 503):
                    # not sooner than that, and not past one call's timeout.
                    after = retry_after(resp.headers.get("Retry-After"))
                    if after is not None:
                        delay = min(max(delay, after), self.retry.timeout)
            except (TimeoutError, aiohttp.ClientConnectionError) as e:
                last = f"{type(e).__name__}: {e}"
            log.info(
                "%s %s failed (%s); attempt %d/%d, retrying in %.1fs",
                method,
                path,
                last,
                attempt,
                self.retry.attempts,
                delay,
            )
            await asyncio.sleep(delay)
            delay = min(delay * 2, self.retry.max_delay)
        raise ApiError(0, method, path, f"gave up after {self.retry.attempts} attempts; last: {last}")

    async def get(self, kind: str, namespace: str, name: str) -> Obj | None:
        """The object, or None when absent. From the watch cache when it holds it; an object the cache
        does not hold (not labelled as the operator's, or absent) is asked of the API server."""
        if self.cache is not None:
            cached = self.cache.lookup(kind, namespace, name)
            if cached is not None:
                return cached
        status, obj = await self.request(
            "get", "GET", object_path(kind, namespace, name), ok_statuses=frozenset({404})
        )
        return None if status == 404 else obj

    async def list(self, kind: str, namespace: str, label_selector: str) -> list[Obj]:
        """The objects matching the selector: from the watch cache once it has listed the kind in that
        namespace, else from the API server."""
        if self.cache is not None:
            cached = self.cache.select(kind, namespace, label_selector)
            if cached is not None:
                return cached
        items, _ = await self.list_versioned(kind, namespace, label_selector)
        return items

    async def list_versioned(self, kind: str, namespace: str, label_selector: str) -> tuple[Objs, str]:
        """A list from the API server and the resourceVersion it was taken at (a watch starts there)."""
        _, obj = await self.request(
            "list", "GET", object_path(kind, namespace), params={"labelSelector": label_selector}
        )
        rv = str(((obj or {}).get("metadata") or {}).get("resourceVersion") or "")
        return list((obj or {}).get("items") or []), rv

    async def watch(
        self, kind: str, namespace: str, label_selector: str, resource_version: str, *, timeout_s: float
    ) -> AsyncIterator[Obj]:
        """One watch from `resource_version`, with bookmarks, until the server ends it (timeoutSeconds).
        Yields the events as the API server sends them (ADDED, MODIFIED, DELETED, BOOKMARK, ERROR);
        raises ApiError when the server refuses the watch. One call counts as one `watch`."""
        self.calls["watch"] += 1
        await self._credentials()
        path = object_path(kind, namespace)
        params = {
            "watch": "true",
            "allowWatchBookmarks": "true",
            "labelSelector": label_selector,
            "resourceVersion": resource_version,
            "timeoutSeconds": str(max(1, int(timeout_s))),
        }
        headers = {"Authorization": auth} if (auth := self._authorization()) else {}
        # A watch is long: no total timeout, only one for silence past the server's own end.
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.retry.timeout, sock_read=timeout_s + 30)
        async with self._session_get(watch=True).get(
            self.conn.server + path, params=params, headers=headers, timeout=timeout
        ) as resp:
            if resp.status >= 300:
                text = await resp.text()
                if resp.status == 401:
                    await self._credentials(force=True)  # the next watch goes with what was re-read
                raise ApiError(resp.status, "WATCH", path, text)
            buf = b""
            async for chunk in resp.content.iter_any():
                buf += chunk
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    if line.strip():
                        yield json.loads(line)

    async def apply(self, obj: Obj) -> Obj:
        """Server-side apply of a whole object with the operator's field manager, forcing conflicts
        (the operator owns what it applies; Kubernetes recommends force for controllers)."""
        meta = obj["metadata"]
        path = object_path(obj["kind"], meta["namespace"], meta["name"])
        params = {"fieldManager": constants.FIELD_MANAGER, "force": "true"}
        _, out = await self.request(
            "patch", "PATCH", path, body=obj, params=params, content_type="application/apply-patch+yaml"
        )
        self._wrote(
            obj["kind"],
            meta["namespace"],
            meta["name"],
            ((out or {}).get("metadata") or {}).get("resourceVersion"),
            out,
        )
        return out or {}

    async def create(self, obj: Obj) -> Obj | None:
        """Create; None when it already exists (409 AlreadyExists is an answer here, not a conflict)."""
        meta = obj["metadata"]
        status, out = await self.request(
            "create",
            "POST",
            object_path(obj["kind"], meta["namespace"]),
            body=obj,
            ok_statuses=frozenset({409}),
        )
        if status != 409 and out and meta.get("name"):
            self._wrote(
                obj["kind"],
                meta["namespace"],
                meta["name"],
                (out.get("metadata") or {}).get("resourceVersion"),
                out,
            )
        return None if status == 409 else out

    async def event(self, event: Obj) -> Obj | None:
        """Post an Event the way client-go's recorder does: the first occurrence is created, a repeat
        of the same one (event_key) bumps its `count` and `lastTimestamp` with a patch, so a condition
        that keeps coming back is one Event with a count, not one Event each time. An Event gone
        meanwhile (they expire after an hour) is created again. Beyond EVENT_SIMILAR_MAX distinct
        messages of one object, type and reason within EVENT_SIMILAR_WINDOW_S, the rest are one Event
        (message prefixed COMBINED, the latest message; its count grows): one reason of one object
        cannot flood the namespace's Events."""
        event, key = self._aggregate(event)
        known = self._events.pop(key, None)
        ns = event["metadata"]["namespace"]
        if known is not None:
            name, count = known
            status, out = await self.request(
                "patch", "PATCH", object_path("Event", ns, name),
                body={"count": count + 1, "lastTimestamp": event.get("lastTimestamp"), "message": event.get("message")},
                content_type="application/merge-patch+json", ok_statuses=frozenset({404}),
            )  # fmt: skip
            if status != 404 and out:
                self._remember_event(key, name, count + 1)
                return out
        out = await self.create(event)
        if out and (out.get("metadata") or {}).get("name"):
            self._remember_event(key, out["metadata"]["name"], int(out.get("count") or 1))
        return out

    def _aggregate(self, event: Obj) -> tuple[Obj, tuple[str, ...]]:
        """The Event to post and the key its repeats share."""
        skey, now = similar_key(event), time.monotonic()
        since, messages = self._similar.pop(skey, (now, set()))
        if now - since > EVENT_SIMILAR_WINDOW_S:
            since, messages = now, set()
        messages.add(str(event.get("message")))
        self._similar[skey] = (since, messages)
        while len(self._similar) > EVENT_CACHE:
            self._similar.popitem(last=False)
        if len(messages) <= EVENT_SIMILAR_MAX:
            return event, event_key(event)
        # One Event for the rest: keyed without the message (and the related object), the latest one shown.
        combined = {k: v for k, v in event.items() if k != "related"}
        combined["message"] = (COMBINED + str(event.get("message")))[:1000]
        return combined, (*skey, COMBINED)

    def _remember_event(self, key: tuple[str, ...], name: str, count: int) -> None:
        self._events[key] = (name, count)
        while len(self._events) > EVENT_CACHE:
            self._events.popitem(last=False)

    async def delete(self, kind: str, namespace: str, name: str) -> None:
        await self.request(
            "delete", "DELETE", object_path(kind, namespace, name),
            body={"kind": "DeleteOptions", "apiVersion": "v1", "propagationPolicy": "Background"},
            ok_statuses=frozenset({404}),
        )  # fmt: skip
        self._wrote(kind, namespace, name, DELETED)

    async def patch_status(self, kind: str, namespace: str, name: str, status: Obj) -> Obj:
        _, out = await self.request(
            "patch", "PATCH", object_path(kind, namespace, name, "status"),
            body={"status": status}, content_type="application/merge-patch+json",
        )  # fmt: skip
        return out or {}
