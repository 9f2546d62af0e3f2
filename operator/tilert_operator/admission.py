"""The validating admission check (the cross-field rules and what the API server would refuse in the
children, answered as a kopf AdmissionError), its optional server-side dry run, and the HTTPS server
that serves it with a certificate reloaded when its files change.

Which check runs where:

- offline, in the webhook and in the operator's reconcile alike (SpecValid=False without the
  webhook): the spec's rules (validation.py) and the rendered children against the Kubernetes
  schemas and the API server's own rules (childcheck.py);
- only in the webhook, when it can reach the API server: a server-side dry-run apply (dryRun=All) of
  each child in the PDCluster's namespace, which also sees what the offline check cannot (the
  cluster's own admission policies, its Kubernetes version's fields, live objects' immutable fields).
  Nothing is stored. An answer other than a refusal of the child (403, a timeout, a kind the cluster
  does not serve) judges nothing: the offline check has already passed.

Only a spec that changes is judged. An update that leaves the spec as it was (a finalizer removed, a
label fixed, kopf's own annotations) passes whatever the stored spec is, so a PDCluster stored
before the webhook (or before a stricter operator) can still be relabelled and deleted: a foreground
delete waits for finalizers that are removed with such updates. Deletion itself is never sent here
(the chart registers CREATE and UPDATE only).
"""

from __future__ import annotations

import asyncio
import logging
import os
import ssl
import time
from typing import Any

import kopf

from tilert_operator import constants, kubeapi, render, validation
from tilert_operator import spec as specmod

log = logging.getLogger(__name__)

#: Seconds the whole dry run may take: inside the webhook's timeoutSeconds (10 in the chart), with
#: room for the offline checks. Children not answered by then are not judged by it.
DRY_RUN_BUDGET_S = 5.0
#: TILERT_PD_WEBHOOK_DRY_RUN=0 turns the dry run off (the offline checks stay).
DRY_RUN_ENV = "TILERT_PD_WEBHOOK_DRY_RUN"


def dry_run_enabled() -> bool:
    return os.environ.get(DRY_RUN_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def check(spec: dict[str, Any], name: str, old_spec: dict[str, Any] | None = None) -> None:
    """Raise kopf.AdmissionError listing every problem (field and fix); return when the spec is valid
    or unchanged (see the module docstring)."""
    if old_spec is not None and spec == old_spec:
        return
    _, problems = validation.validate(spec, name)
    if old_spec is not None:
        problems += immutability(spec, old_spec)
    if problems:
        raise kopf.AdmissionError("; ".join(str(p) for p in problems), code=422)


async def review(
    spec: dict[str, Any],
    name: str,
    namespace: str | None,
    old_spec: dict[str, Any] | None = None,
    *,
    api: kubeapi.Client | None = None,
    budget_s: float = DRY_RUN_BUDGET_S,
) -> None:
    """`check`, then, with an API client, the server-side dry run of every child."""
    check(spec, name, old_spec)
    if api is None or not namespace or (old_spec is not None and spec == old_spec):
        return
    problems = await dry_run(api, spec, name, namespace, budget_s=budget_s)
    if problems:
        raise kopf.AdmissionError("; ".join(str(p) for p in problems), code=422)


async def dry_run(
    api: kubeapi.Client,
    raw_spec: dict[str, Any],
    name: str,
    namespace: str,
    *,
    budget_s: float = DRY_RUN_BUDGET_S,
) -> list[validation.Problem]:
    """Server-side apply each child with dryRun=All: the API server's refusals, each named by the
    PDCluster field the child's field comes from. [] when it answers none within `budget_s`."""
    parsed = specmod.parse(raw_spec)
    children = [c for c in render.children(parsed, name, namespace) if c["kind"] in kubeapi.KINDS]

    async def one(obj: dict[str, Any]) -> list[validation.Problem]:
        meta = obj["metadata"]
        params = {"fieldManager": constants.FIELD_MANAGER, "force": "true", "dryRun": "All"}
        try:
            await api.request(
                "dry-run",
                "PATCH",
                kubeapi.object_path(obj["kind"], namespace, meta["name"]),
                body=obj,
                params=params,
                content_type="application/apply-patch+yaml",
            )
        except kubeapi.ApiError as e:
            if e.status in (400, 422):
                return refusal(parsed, obj, e)
            log.info("dry run of %s %s/%s judged nothing (%s)", obj["kind"], namespace, meta["name"], e)
        return []

    try:
        answers = await asyncio.wait_for(asyncio.gather(*(one(c) for c in children)), budget_s)
    except TimeoutError:
        log.warning(
            "the dry run of %s/%s's children took over %.0f s; admitted on the offline checks",
            namespace,
            name,
            budget_s,
        )
        return []
    out: list[validation.Problem] = []
    for problems in answers:
        out += [p for p in problems if p not in out]
    return out


def refusal(
    spec: specmod.PDClusterSpec, obj: dict[str, Any], error: kubeapi.ApiError
) -> list[validation.Problem]:
    """The API server's refusal of a child as Problems: one per cause, on the field it comes from."""
    body = error.body or {}
    causes = ((body.get("details") or {}).get("causes") or []) or [
        {"message": body.get("message") or str(error)}
    ]
    pool = validation.POOL_FIELDS.get(
        (obj["metadata"].get("labels") or {}).get(constants.LABEL_COMPONENT, ""), "spec"
    )
    overrides = (
        " (or the pool's overrides, which are applied over it)"
        if pool != "spec" and _overridden(spec, pool)
        else ""
    )
    out = []
    for cause in causes:
        where = str(cause.get("field") or "")
        field = validation.source_field(spec, obj, where) if where else pool
        out.append(
            validation.Problem(
                field,
                f"the API server refused {obj['kind']} {obj['metadata']['name']} (dry run): "
                f"{where + ': ' if where else ''}{cause.get('message')}; fix {field}{overrides}",
            )
        )
    return out


def _overridden(spec: specmod.PDClusterSpec, pool: str) -> bool:
    node: Any = spec
    for part in pool.split(".")[1:]:
        node = getattr(node, part, None)
    return bool(getattr(node, "overrides", None))


def immutability(spec: dict[str, Any], old_spec: dict[str, Any]) -> list[validation.Problem]:
    new, old = spec.get("model") or {}, old_spec.get("model") or {}
    return [
        validation.Problem(
            f"spec.model.{key}",
            f"is immutable ({old.get(key)!r} -> {new.get(key)!r}); create a new PDCluster to serve another model",
        )
        for key in ("name", "tilertModel")
        if new.get(key) != old.get(key)
    ]


class CertReloader:
    """The webhook's certificate, following its files (cert-manager renews the Secret, the kubelet
    swaps the mounted files) without a restart.

    Installed as the listening context's SNI callback, which OpenSSL calls in every ClientHello: at
    most every `check_interval_s` it stats the two files (device, inode, mtime, size; the kubelet's
    `..data` symlink swap changes the inode). When they changed, a fresh SSLContext is built from them
    and this handshake and every later one use it; connections already open keep theirs. A pair that
    does not load (a key that does not match, a half-written file) is logged once and the previous
    certificate keeps serving until the files change again.
    """

    def __init__(
        self,
        certfile: str,
        keyfile: str,
        password: str | None = None,
        *,
        check_interval_s: float = 2.0,
        template: ssl.SSLContext | None = None,
    ) -> None:
        self.certfile, self.keyfile, self.password = certfile, keyfile, password
        self.check_interval_s = check_interval_s
        self._template = template
        self._sig = self._signature()
        self._failed_sig: tuple[Any, ...] | None = None
        self._checked = time.monotonic()
        self.context = self._build()
        #: Certificates loaded since start (the first not counted), and pairs refused.
        self.reloads = 0
        self.failures = 0

    def _signature(self) -> tuple[Any, ...]:
        sig: list[Any] = []
        for path in (self.certfile, self.keyfile):
            try:
                st = os.stat(path)
                sig.append((st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size))
            except OSError:
                sig.append(None)
        return tuple(sig)

    def _build(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context(purpose=ssl.Purpose.CLIENT_AUTH)
        if self._template is not None:
            ctx.verify_mode = self._template.verify_mode
        ctx.load_cert_chain(self.certfile, self.keyfile, self.password)
        return ctx

    def current(self) -> ssl.SSLContext:
        """The context for a new connection: reloaded first if the files changed."""
        now = time.monotonic()
        if now - self._checked < self.check_interval_s:
            return self.context
        self._checked = now
        sig = self._signature()
        if sig == self._sig or sig == self._failed_sig:
            return self.context
        try:
            ctx = self._build()
        except (OSError, ssl.SSLError, ValueError) as e:
            self._failed_sig = sig
            self.failures += 1
            log.warning(
                "webhook certificate %s / %s does not load (%s); still serving the previous one",
                self.certfile,
                self.keyfile,
                e,
            )
            return self.context
        self.context, self._sig, self._failed_sig = ctx, sig, None
        self.reloads += 1
        log.info("webhook certificate reloaded from %s", self.certfile)
        return ctx

    def sni_callback(
        self, conn: ssl.SSLObject | ssl.SSLSocket, server_name: str | None, ctx: ssl.SSLContext
    ) -> None:
        latest = self.current()
        if latest is not ctx:
            conn.context = latest


class WebhookServer(kopf.WebhookServer):
    """kopf's HTTPS webhook server with a certificate that reloads in place (CertReloader).

    kopf itself re-reads the files every `file_check_interval` and then restarts the listener (a gap
    with no listener, and a new pair that does not load stops the webhook server); its check is set
    to never fire here, and the SNI callback does the reloading instead.
    """

    def __init__(self, *, check_interval_s: float = 2.0, **kwargs: Any) -> None:
        super().__init__(file_check_interval=float(10**9), **kwargs)
        self.check_interval_s = check_interval_s
        self.reloader: CertReloader | None = None

    def _build_ssl(self) -> tuple[bytes | None, ssl.SSLContext | None]:
        cadata, context = super()._build_ssl()
        if context is not None and self.certfile is not None and self.pkeyfile is not None:
            self.reloader = CertReloader(
                str(self.certfile),
                str(self.pkeyfile),
                self.password,
                check_interval_s=self.check_interval_s,
                template=context,
            )
            context.sni_callback = self.reloader.sni_callback
        return cadata, context
