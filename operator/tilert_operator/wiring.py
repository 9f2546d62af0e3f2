"""kopf registration and settings only; the logic lives in controller, reconcile and admission.

Run: `kopf run -m tilert_operator.wiring --all-namespaces --standalone
      --liveness=http://0.0.0.0:8081/healthz`
Environment: TILERT_PD_RESYNC_S (default 30), TILERT_PD_CONCURRENCY (16), TILERT_PD_METRICS_PORT
(8080; 0 = off), TILERT_PD_API_TIMEOUT_S (30, per API call), TILERT_PD_SECRET_ROTATION_GRACE_S (180, each
phase of a handoff-secret rotation; above the kubelets' Secret propagation), TILERT_PD_WEBHOOK_PORT with TILERT_PD_WEBHOOK_CERT/KEY (admission webhook; unset =
off, the CRD's CEL rules still apply and the operator reports SpecValid=False; the certificate is
re-read when its files change, checked at most every TILERT_PD_WEBHOOK_CERT_CHECK_S, default 2),
TILERT_PD_DRIFT_DEBOUNCE_S (0.1) and TILERT_PD_DRIFT_MIN_INTERVAL_S (1; see controller.py),
TILERT_PD_WATCH_CHILDREN (1; 0 = no watch caches: every reconcile reads the API server and drift is
repaired at the resync only, as the benchmark's baseline does), TILERT_PD_WATCH_TIMEOUT_S (300, how
long one watch lasts before it is resumed).

kopf watches the PDClusters. The children and the pods are watched by the operator's own informers
(cache.py, owned by the Controller), per namespace that holds a PDCluster and selected by the cluster
label on the API server: the reconcile reads them from that cache (an idle PDCluster costs no API
call), a child deleted or edited by someone else is repaired within seconds, a pod's change and a
workload controller's rollout report reach the status at once (controller.Controller.child_event).
With TILERT_PD_WATCH_CHILDREN=0 kopf's pod watch kicks the reconciles, and a rollout's end is read at
the next pod event or resync.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import kopf
from aiohttp import web

from tilert_operator import admission, constants, credentials, kubeapi
from tilert_operator.cache import OPTIONAL_KINDS, CacheSettings
from tilert_operator.controller import Controller, Settings
from tilert_operator.metrics import CONTENT_TYPE, Metrics

log = logging.getLogger(__name__)


def _env_float(name: str, default: float) -> float:
    raw = os.environ.get(name)
    try:
        return float(raw) if raw else default
    except ValueError as e:
        raise kopf.PermanentError(f"{name}={raw!r} is not a number; set it to seconds, e.g. 30") from e


MANAGED = f"{constants.LABEL_MANAGED_BY}={constants.MANAGED_BY}"
WATCH_CHILDREN = os.environ.get("TILERT_PD_WATCH_CHILDREN", "1") != "0"


@kopf.on.login()
def login(**_: Any) -> kopf.ConnectionInfo:
    # Run again by kopf after a 401 and when the expiration passes: the token is read anew.
    c = kubeapi.load_connection()
    return kopf.ConnectionInfo(
        server=c.server, ca_path=c.ca_path, insecure=c.insecure, scheme=c.scheme, token=c.token,
        certificate_path=c.cert_path, private_key_path=c.key_path, expiration=c.expiration(),
    )  # fmt: skip


@kopf.on.startup()
async def startup(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    # Our own prefixes, so another kopf operator in the cluster never reads or writes our marks.
    settings.persistence.finalizer = f"{constants.GROUP}/finalizer"
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=constants.GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=constants.GROUP, key="last-handled-configuration"
    )
    # Watch only our pods, filtered by the API server (a handler's labels= filters client-side, after
    # every pod in the cluster has crossed the wire).
    settings.watching.label_selectors["", "v1", "pods"] = MANAGED
    settings.posting.enabled = False  # we post our own Events, on condition transitions
    settings.networking.request_timeout = 60
    settings.watching.server_timeout = int(_env_float("TILERT_PD_WATCH_TIMEOUT_S", 300))
    settings.watching.client_timeout = settings.watching.server_timeout + 30
    port = os.environ.get("TILERT_PD_WEBHOOK_PORT")
    if port:
        settings.admission.server = admission.WebhookServer(
            port=int(port), certfile=os.environ.get("TILERT_PD_WEBHOOK_CERT"), pkeyfile=os.environ.get("TILERT_PD_WEBHOOK_KEY"),
            check_interval_s=_env_float("TILERT_PD_WEBHOOK_CERT_CHECK_S", 2.0),
        )  # fmt: skip
        settings.admission.managed = None  # the chart owns the ValidatingWebhookConfiguration

    api = kubeapi.Client(
        kubeapi.load_connection(),
        retry=kubeapi.Retry(timeout=_env_float("TILERT_PD_API_TIMEOUT_S", 30.0)),
        refresh=kubeapi.load_connection,
    )
    memo.api = api
    memo.controller = Controller(
        api,
        Settings(
            resync_s=_env_float("TILERT_PD_RESYNC_S", 30.0),
            concurrency=int(_env_float("TILERT_PD_CONCURRENCY", 16)),
            rotation_grace_s=_env_float("TILERT_PD_SECRET_ROTATION_GRACE_S", credentials.DEFAULT_GRACE_S),
            drift_debounce_s=_env_float("TILERT_PD_DRIFT_DEBOUNCE_S", 0.1),
            drift_min_interval_s=_env_float("TILERT_PD_DRIFT_MIN_INTERVAL_S", 1.0),
            watch_cache=WATCH_CHILDREN,
            cache=CacheSettings(
                watch_timeout_s=_env_float("TILERT_PD_WATCH_TIMEOUT_S", 300),
                forbidden_retry_s=_env_float("TILERT_PD_RESYNC_S", 30.0),
            ),
        ),
    )
    metrics_port = int(_env_float("TILERT_PD_METRICS_PORT", 8080))
    memo.metrics_runner = (
        await _serve_metrics(memo.controller.metrics, metrics_port) if metrics_port else None
    )


async def _serve_metrics(metrics: Metrics, port: int) -> web.AppRunner:
    async def scrape(_: web.Request) -> web.Response:
        return web.Response(body=metrics.render(), headers={"Content-Type": CONTENT_TYPE})

    app = web.Application()
    app.router.add_get("/metrics", scrape)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, host=os.environ.get("TILERT_PD_METRICS_HOST", "0.0.0.0"), port=port).start()
    return runner


@kopf.on.cleanup()
async def cleanup(memo: kopf.Memo, **_: Any) -> None:
    await memo.controller.stop()
    if memo.metrics_runner is not None:
        await memo.metrics_runner.cleanup()
    await memo.api.close()


@kopf.on.event(constants.GROUP, constants.VERSION, constants.PLURAL)
async def pdcluster_event(event: kopf.RawEvent, memo: kopf.Memo, **_: Any) -> None:
    body = event["object"]
    memo.controller.observe(dict(body), deleted=event["type"] == "DELETED")


@kopf.on.event("", "v1", "pods", labels={constants.LABEL_MANAGED_BY: constants.MANAGED_BY})
async def pod_event(labels: kopf.Labels, namespace: str | None, memo: kopf.Memo, **_: Any) -> None:
    # With the watch caches their pod informer kicks, after its store holds the change (a kick from
    # here could reach a reconcile that still reads the pod as it was). This watch then only stands
    # by for TILERT_PD_WATCH_CHILDREN=0; see docs/operator-internals.md.
    cluster = labels.get(constants.LABEL_CLUSTER)
    if cluster and namespace and memo.controller.cache is None:
        memo.controller.kick(namespace, cluster)


#: CRD name -> the optional kind it serves (kubeapi.KINDS), e.g. multi-networkpolicies.k8s.cni.cncf.io.
OPTIONAL_CRDS = {
    f"{kubeapi.group_resource(kind)[1]}.{kubeapi.group_resource(kind)[0]}": kind for kind in OPTIONAL_KINDS
}


@kopf.on.event(
    "apiextensions.k8s.io", "v1", "customresourcedefinitions", when=lambda name, **_: name in OPTIONAL_CRDS
)
async def crd_event(name: str, memo: kopf.Memo, **_: Any) -> None:
    # kopf watches CRDs anyway (to start watches when one appears); an optional kind's CRD arriving
    # makes the watch caches list it now rather than at their next try (cache.Cache.served).
    cache = memo.controller.cache if "controller" in memo else None
    if cache is not None:
        cache.served(OPTIONAL_CRDS[name])


async def validate(
    spec: kopf.Spec, name: str, namespace: str | None, memo: kopf.Memo, old: kopf.Body | None = None, **_: Any
) -> None:
    # With the operator's API client (startup) the webhook also dry-runs each child's apply
    # (admission.py); TILERT_PD_WEBHOOK_DRY_RUN=0 leaves the offline checks alone.
    api = memo.get("api") if admission.dry_run_enabled() else None
    await admission.review(dict(spec), name, namespace, dict(old.get("spec") or {}) if old else None, api=api)


# kopf refuses to start with admission handlers but no webhook server: register the handler only
# where the webhook is configured (the chart sets the port and the certificate).
if os.environ.get("TILERT_PD_WEBHOOK_PORT"):
    kopf.on.validate(constants.GROUP, constants.VERSION, constants.PLURAL, id="validate-pdcluster")(validate)
