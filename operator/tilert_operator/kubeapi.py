"""A small async Kubernetes API client for the operator's own calls (children, pods, status, events).

kopf watches and dispatches; it "is not a Kubernetes client library", so the reconcile talks to the
API through this module: one aiohttp session, server-side apply with one fixed field manager, and
retries with backoff on 409, 429, 5xx, timeouts and connection errors. Every call is counted by verb
(the operator's /metrics) and none happens anywhere else, which keeps the ClusterRole checkable.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import ssl
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp

from tilert_operator import constants

log = logging.getLogger(__name__)

Obj = dict[str, Any]

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
    "MultiNetworkPolicy": ("/apis/k8s.cni.cncf.io/v1beta1", "multi-networkpolicies"),
    constants.KIND: (f"/apis/{constants.API_VERSION}", constants.PLURAL),
}


class ApiError(Exception):
    """An API call failed for good (after retries, or with a status that retrying cannot fix)."""

    def __init__(self, status: int, method: str, path: str, message: str) -> None:
        super().__init__(f"{method} {path}: HTTP {status}: {message[:300]}")
        self.status = status


@dataclass(frozen=True)
class Connection:
    server: str
    ca_path: str | None = None
    insecure: bool = False
    token: str | None = None
    scheme: str | None = None
    cert_path: str | None = None
    key_path: str | None = None


def load_connection() -> Connection:
    """In-cluster service account, else the kubeconfig named by $KUBECONFIG (read now, not at import)."""
    import kubernetes.client
    import kubernetes.config

    cfg = kubernetes.client.Configuration()
    try:
        kubernetes.config.load_incluster_config(client_configuration=cfg)  # type: ignore[no-untyped-call]
    except kubernetes.config.ConfigException:
        kubernetes.config.load_kube_config(config_file=os.environ.get("KUBECONFIG"), client_configuration=cfg)  # type: ignore[no-untyped-call]
    header = cfg.get_api_key_with_prefix("BearerToken") or cfg.get_api_key_with_prefix("authorization")
    parts = header.split(" ", 1) if header else []
    scheme, token = (None, None) if not parts else (None, parts[0]) if len(parts) == 1 else (parts[0], parts[1])
    return Connection(
        server=cfg.host.rstrip("/"),
        ca_path=cfg.ssl_ca_cert or None,
        insecure=not cfg.verify_ssl,
        token=token,
        scheme=scheme,
        cert_path=cfg.cert_file or None,
        key_path=cfg.key_file or None,
    )


@dataclass(frozen=True)
class Retry:
    attempts: int = 6
    first_delay: float = 0.1
    max_delay: float = 2.0
    timeout: float = 30.0


RETRYABLE = frozenset({409, 429, 500, 502, 503, 504})


def object_path(kind: str, namespace: str, name: str | None = None, subresource: str | None = None) -> str:
    prefix, plural = KINDS[kind]
    path = f"{prefix}/namespaces/{namespace}/{plural}"
    if name:
        path += f"/{name}"
    if subresource:
        path += f"/{subresource}"
    return path


class Client:
    def __init__(self, conn: Connection, *, retry: Retry = Retry(), user_agent: str = constants.FIELD_MANAGER) -> None:
        self.conn = conn
        self.retry = retry
        self.calls: Counter[str] = Counter()
        self._user_agent = user_agent
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _session_get(self) -> aiohttp.ClientSession:
        if self._session is None:
            ctx: ssl.SSLContext | bool = False
            if self.conn.server.startswith("https"):
                ctx = ssl.create_default_context(cafile=self.conn.ca_path)
                if self.conn.insecure:
                    ctx.check_hostname = False
                    ctx.verify_mode = ssl.CERT_NONE
                if self.conn.cert_path and self.conn.key_path:
                    ctx.load_cert_chain(self.conn.cert_path, self.conn.key_path)
            headers = {"User-Agent": self._user_agent, "Accept": "application/json"}
            if self.conn.token:
                headers["Authorization"] = f"{self.conn.scheme or 'Bearer'} {self.conn.token}"
            self._session = aiohttp.ClientSession(
                headers=headers,
                connector=aiohttp.TCPConnector(ssl=ctx, limit=64),
                timeout=aiohttp.ClientTimeout(total=self.retry.timeout),
            )
        return self._session

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
        """One call with retries. Returns (status, body); a status in ok_statuses is returned, not raised."""
        delay = self.retry.first_delay
        last = ""
        for attempt in range(1, self.retry.attempts + 1):
            self.calls[verb] += 1
            try:
                async with self._session_get().request(
                    method,
                    self.conn.server + path,
                    params=params,
                    data=None if body is None else json.dumps(body),
                    headers={"Content-Type": content_type},
                ) as resp:
                    text = await resp.text()
                    if resp.status < 300 or resp.status in ok_statuses:
                        return resp.status, (json.loads(text) if text else None)
                    if resp.status not in RETRYABLE:
                        raise ApiError(resp.status, method, path, text)
                    last = f"HTTP {resp.status}: {text[:200]}"
            except (TimeoutError, aiohttp.ClientConnectionError) as e:
                last = f"{type(e).__name__}: {e}"
            log.info("%s %s failed (%s); attempt %d/%d, retrying in %.1fs", method, path, last, attempt, self.retry.attempts, delay)
            await asyncio.sleep(delay)
            delay = min(delay * 2, self.retry.max_delay)
        raise ApiError(0, method, path, f"gave up after {self.retry.attempts} attempts; last: {last}")

    async def get(self, kind: str, namespace: str, name: str) -> Obj | None:
        status, obj = await self.request("get", "GET", object_path(kind, namespace, name), ok_statuses=frozenset({404}))
        return None if status == 404 else obj

    async def list(self, kind: str, namespace: str, label_selector: str) -> list[Obj]:
        _, obj = await self.request("list", "GET", object_path(kind, namespace), params={"labelSelector": label_selector})
        return list((obj or {}).get("items") or [])

    async def apply(self, obj: Obj) -> Obj:
        """Server-side apply of a whole object with the operator's field manager, forcing conflicts
        (the operator owns what it applies; Kubernetes recommends force for controllers)."""
        meta = obj["metadata"]
        path = object_path(obj["kind"], meta["namespace"], meta["name"])
        params = {"fieldManager": constants.FIELD_MANAGER, "force": "true"}
        _, out = await self.request("patch", "PATCH", path, body=obj, params=params, content_type="application/apply-patch+yaml")
        return out or {}

    async def create(self, obj: Obj) -> Obj | None:
        """Create; None when it already exists (409 AlreadyExists is an answer here, not a conflict)."""
        meta = obj["metadata"]
        status, out = await self.request(
            "create", "POST", object_path(obj["kind"], meta["namespace"]), body=obj, ok_statuses=frozenset({409})
        )
        return None if status == 409 else out

    async def delete(self, kind: str, namespace: str, name: str) -> None:
        await self.request(
            "delete", "DELETE", object_path(kind, namespace, name),
            body={"kind": "DeleteOptions", "apiVersion": "v1", "propagationPolicy": "Background"},
            ok_statuses=frozenset({404}),
        )  # fmt: skip

    async def patch_status(self, kind: str, namespace: str, name: str, status: Obj) -> Obj:
        _, out = await self.request(
            "patch", "PATCH", object_path(kind, namespace, name, "status"),
            body={"status": status}, content_type="application/merge-patch+json",
        )  # fmt: skip
        return out or {}
