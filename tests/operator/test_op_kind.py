"""The operator against a real cluster (kind): skipped unless TILERT_PD_KIND=1 and KUBECONFIG points
at a disposable cluster. Checks what the test server cannot prove: real schema validation and CEL,
real server-side apply and garbage collection. Images need not exist: pods are not expected ready."""

from __future__ import annotations

import json
import os
import subprocess
import time
import uuid
from pathlib import Path

import pdc_harness as h
import pdc_helpers as helpers
import pytest
import yaml
from kopf.testing import KopfRunner

pytestmark = [
    pytest.mark.kind,
    pytest.mark.skipif(
        os.environ.get("TILERT_PD_KIND") != "1",
        reason="needs a kind cluster: TILERT_PD_KIND=1 and KUBECONFIG",
    ),
]
CRD = Path(__file__).resolve().parents[2] / "crds" / "pdcluster.yaml"


def kubectl(*args: str, stdin: str | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
    out = subprocess.run(["kubectl", *args], input=stdin, capture_output=True, text=True, timeout=60)
    if check:
        assert out.returncode == 0, out.stderr
    return out


def test_kind_lifecycle(monkeypatch: pytest.MonkeyPatch) -> None:
    context = kubectl("config", "current-context").stdout.strip()
    assert context.startswith("kind-"), f"refusing to run against context {context!r}: use a kind cluster"
    monkeypatch.setenv("TILERT_PD_RESYNC_S", "2")
    monkeypatch.setenv("TILERT_PD_METRICS_PORT", "0")
    ns = f"tilert-pd-test-{uuid.uuid4().hex[:6]}"
    kubectl("apply", "--server-side", "-f", str(CRD))
    kubectl("wait", "--for=condition=Established", "crd/pdclusters.pd.tilert.ai", "--timeout=60s")
    kubectl("create", "namespace", ns)
    try:
        # Real CEL: a bad spec is refused by the API server itself.
        bad = helpers.cr(helpers.minimal(decode={"tilert": {"replicas": 0}}), name="bad") | {
            "metadata": {"name": "bad", "namespace": ns}
        }
        refused = kubectl("apply", "-f", "-", stdin=yaml.safe_dump(bad), check=False)
        assert refused.returncode != 0 and "at least one decode replica" in refused.stderr
        with KopfRunner(h.ARGS, timeout=60) as runner:
            doc = h.pdc(helpers.example("tiny-cpu"), ns)
            kubectl("apply", "-f", "-", stdin=yaml.safe_dump(doc))
            for kind, name in [
                ("deployment", "tiny-prefill"),
                ("statefulset", "tiny-tilert-decode"),
                ("configmap", "tiny-router"),
                ("secret", "tiny-handoff"),
                ("secret", "tiny-node-api"),
            ]:
                h.wait_for(
                    f"{kind}/{name}",
                    lambda k=kind, n=name: kubectl("get", "-n", ns, k, n, check=False).returncode == 0,
                    timeout=60,
                    interval=1,
                )
            status = h.wait_for(
                "status",
                lambda: json.loads(kubectl("get", "-n", ns, "pdc", "tiny", "-o", "json").stdout).get(
                    "status"
                ),
                timeout=60,
                interval=1,
            )
            assert any(c["type"] == "SpecValid" and c["status"] == "True" for c in status["conditions"])
            # Real SSA on a Secret the operator created by POST: a rotation's first phase applies.
            kubectl("annotate", "-n", ns, "pdc", "tiny", "pd.tilert.ai/rotate-handoff-secret=kind-1")
            h.wait_for(
                "rotation phase 1",
                lambda: (
                    json.loads(kubectl("get", "-n", ns, "pdc", "tiny", "-o", "json").stdout)
                    .get("status", {})
                    .get("handoffSecret", {})
                    .get("phase")
                    == "AcceptingNewSecret"
                ),
                timeout=60,
                interval=1,
            )
            assert kubectl("get", "-n", ns, "pdc").stdout.split()[:7] == [
                "NAME",
                "READY",
                "PREFILL",
                "TILERT",
                "NATIVE",
                "ROUTER",
                "AGE",
            ]
            kubectl("delete", "-n", ns, "pdc", "tiny", "--wait=true")
            h.wait_for(
                "GC",
                lambda: kubectl("get", "-n", ns, "deployment", "tiny-prefill", check=False).returncode != 0,
                timeout=60,
                interval=1,
            )
            time.sleep(1)
        assert runner.exception is None
    finally:
        kubectl("delete", "namespace", ns, "--wait=false", check=False)
