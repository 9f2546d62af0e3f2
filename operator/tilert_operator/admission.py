"""The validating admission check (the cross-field rules, answered as a kopf AdmissionError) and the
HTTPS server that serves it with a certificate reloaded when its files change."""

from __future__ import annotations

import logging
import os
import ssl
import time
from typing import Any

import kopf

from tilert_operator import validation

log = logging.getLogger(__name__)


def check(spec: dict[str, Any], name: str, old_spec: dict[str, Any] | None = None) -> None:
    """Raise kopf.AdmissionError listing every problem (field and fix); return when the spec is valid."""
    _, problems = validation.validate(spec, name)
    if old_spec is not None:
        problems += immutability(spec, old_spec)
    if problems:
        raise kopf.AdmissionError("; ".join(str(p) for p in problems), code=422)


def immutability(spec: dict[str, Any], old_spec: dict[str, Any]) -> list[validation.Problem]:
    new, old = spec.get("model") or {}, old_spec.get("model") or {}
    return [
        validation.Problem(f"spec.model.{key}", f"is immutable ({old.get(key)!r} -> {new.get(key)!r}); create a new PDCluster to serve another model")
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

    def __init__(self, certfile: str, keyfile: str, password: str | None = None, *, check_interval_s: float = 2.0,
                 template: ssl.SSLContext | None = None) -> None:
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
            log.warning("webhook certificate %s / %s does not load (%s); still serving the previous one", self.certfile, self.keyfile, e)
            return self.context
        self.context, self._sig, self._failed_sig = ctx, sig, None
        self.reloads += 1
        log.info("webhook certificate reloaded from %s", self.certfile)
        return ctx

    def sni_callback(self, conn: ssl.SSLObject | ssl.SSLSocket, server_name: str | None, ctx: ssl.SSLContext) -> None:
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
            self.reloader = CertReloader(str(self.certfile), str(self.pkeyfile), self.password,
                                         check_interval_s=self.check_interval_s, template=context)
            context.sni_callback = self.reloader.sni_callback
        return cadata, context
