"""The validating webhook: kopf's webhook server answers AdmissionReviews with the cross-field rules."""

from __future__ import annotations

import json
import time
import urllib.request
from typing import Any

import kopf
import pdc_helpers as helpers
from kopf.testing import KopfRunner

from tilert_operator import admission, constants, wiring
from tilert_serve.local.runner import free_port


def _review(spec: dict[str, Any], old: dict[str, Any] | None = None, name: str = "t") -> dict[str, Any]:
    obj = helpers.cr(spec, name) | {"metadata": {"name": name, "namespace": "default"}}
    return {
        "apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
        "request": {
            "uid": "u1", "kind": {"group": constants.GROUP, "version": constants.VERSION, "kind": constants.KIND},
            "resource": {"group": constants.GROUP, "version": constants.VERSION, "resource": constants.PLURAL},
            "operation": "UPDATE" if old else "CREATE", "name": name, "namespace": "default",
            "object": obj, "oldObject": helpers.cr(old, name) if old else None, "userInfo": {"username": "test"},
            "dryRun": False,
        },
    }  # fmt: skip


def _post(port: int, review: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/validate-pdcluster",
        data=json.dumps(review).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=5) as resp:
        return dict(json.loads(resp.read())["response"])


def test_webhook_admits_good_and_rejects_bad_specs(apiserver: Any) -> None:
    port = free_port()
    default = kopf.get_default_registry()  # kopf's CLI makes the runner's registry the default
    registry = kopf.OperatorRegistry()
    kopf.on.login(registry=registry)(wiring.login)
    kopf.on.validate(
        constants.GROUP, constants.VERSION, constants.PLURAL, id="validate-pdcluster", registry=registry
    )(wiring.validate)
    settings = kopf.OperatorSettings()
    settings.admission.server = kopf.WebhookServer(addr="127.0.0.1", port=port, insecure=True)
    settings.admission.managed = None
    try:
        _run_webhook(port, registry, settings)
    finally:
        kopf.set_default_registry(default)


def _run_webhook(port: int, registry: kopf.OperatorRegistry, settings: kopf.OperatorSettings) -> None:
    with KopfRunner(
        ["run", "--all-namespaces", "--standalone"], registry=registry, settings=settings, timeout=20
    ) as runner:
        deadline = time.monotonic() + 15
        while True:
            try:
                ok = _post(port, _review(helpers.example("tiny-cpu")["spec"]))
                break
            except OSError:
                assert time.monotonic() < deadline, "webhook server did not start"
                time.sleep(0.2)
        assert ok["allowed"] is True
        bad = _post(port, _review(helpers.minimal(prefill={"gpus": 4, "tensorParallelSize": 8})))
        assert bad["allowed"] is False
        assert (
            "spec.prefill.gpus" in bad["status"]["message"]
            and "tensorParallelSize: 4" in bad["status"]["message"]
        )
        old = helpers.minimal()
        renamed = _post(port, _review(helpers.minimal(model={"name": "other"}), old=old))
        assert renamed["allowed"] is False and "spec.model.name: is immutable" in renamed["status"]["message"]
        # A stored spec the rules now refuse: an update that leaves the spec alone (a label, a finalizer
        # removed during a foreground delete) passes; one that changes it is judged.
        stored = helpers.minimal(
            router={"termination": {"gracePeriodSeconds": 10, "preStopSleepSeconds": 30}}
        )
        assert _post(port, _review(stored, old=stored))["allowed"] is True
        changed = _post(port, _review(helpers.deep_merge(stored, {"router": {"replicas": 2}}), old=stored))
        assert (
            changed["allowed"] is False
            and "spec.router.termination.preStopSleepSeconds" in changed["status"]["message"]
        )
    assert runner.exception is None


def test_admission_check_lists_every_problem() -> None:
    try:
        admission.check(
            helpers.minimal(prefill={"mtp": {"enabled": False}}, decode={"tilert": {"httpPort": 5556}}), "t"
        )
    except kopf.AdmissionError as e:
        assert "spec.prefill.mtp.enabled" in str(e) and "spec.decode.tilert.httpPort" in str(e)
    else:
        raise AssertionError("expected a rejection")
