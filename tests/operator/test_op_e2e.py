"""The operator end to end over HTTP: kopf's KopfRunner against the API test server (kmock 0.8 plus
the compatibility layer in pdc_apiserver.py), driven partly with kubectl. A test plays the workload
controllers and kubelet: it creates the pods and marks them ready."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from typing import Any

import pdc_harness as h
import pdc_helpers as helpers
import pytest
import yaml
from kopf.testing import KopfRunner

from tilert_operator import constants
from tilert_operator import spec as specmod
from tilert_operator.render import commands
from tilert_serve.local.runner import free_port

WRITES = ("create", "patch", "update", "delete")
#: Kinds of the operator's children that the lifecycle and watch tests list.
CHILD_PLURALS = ("deployments", "statefulsets", "services", "configmaps", "secrets", "networkpolicies")


@pytest.fixture(autouse=True)
def fast_operator(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TILERT_PD_RESYNC_S", "1")
    monkeypatch.setenv("TILERT_PD_METRICS_PORT", "0")
    monkeypatch.setenv("TILERT_PD_WATCH_TIMEOUT_S", "10")


def kubectl(apiserver: Any, *args: str, stdin: str | None = None) -> str:
    out = subprocess.run(
        ["kubectl", "--kubeconfig", apiserver.kubeconfig, *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


def patch_pdc(apiserver: Any, patch: dict[str, Any], name: str = "tiny") -> None:
    """A merge patch of PDCluster `name` through kubectl, as a user makes one."""
    kubectl(apiserver, "patch", "pdc", name, "--type=merge", "-p", json.dumps(patch))


def wait_condition(
    srv: Any, name: str, ctype: str, want: str, key: str = "status", timeout: float = 20.0
) -> None:
    """Until PDCluster `name`'s condition `ctype` has `key` (status, reason) `want`."""
    h.wait_for(
        f"{name}: {ctype} {key} {want}",
        lambda: h.condition(srv.get("pdclusters", "default", name), ctype).get(key) == want,
        timeout=timeout,
    )


def wait_spec_valid(srv: Any, name: str = "tiny") -> None:
    """Until the operator has checked PDCluster `name`'s spec and found it valid."""
    wait_condition(srv, name, "SpecValid", "True")


def decode_arg(srv: Any, cluster: str, flag: str) -> str | None:
    """The value after `flag` in the command of `cluster`'s TileRT StatefulSet (None: no such flag)."""
    pod = srv.get("statefulsets", "default", f"{cluster}-tilert-decode")["spec"]["template"]["spec"]
    command: list[str] = pod["containers"][0]["command"]
    return command[command.index(flag) + 1] if flag in command else None


def deleted_and_recreated(apiserver: Any, plural: str, name: str, timeout: float) -> None:
    """Delete the operator's child `name` through kubectl and wait until it is there again (another uid)."""
    srv = apiserver.server
    old_uid = srv.get(plural, "default", name)["metadata"]["uid"]
    kubectl(apiserver, "delete", plural, name)
    h.wait_for(
        f"{name} created again",
        lambda: (
            (srv.get(plural, "default", name) or {}).get("metadata", {}).get("uid") not in (None, old_uid)
        ),
        timeout=timeout,
    )


def operator_writes(apiserver: Any) -> list[Any]:
    return [
        c
        for c in apiserver.server.calls
        if c.user_agent.startswith(constants.FIELD_MANAGER) and c.verb in WRITES
    ]


def put_pod(apiserver: Any, obj: dict[str, Any]) -> None:
    apiserver.call(apiserver.server.put(h.POD, obj))


def router_nodes(apiserver: Any, ns: str, cluster: str) -> list[dict[str, Any]] | None:
    cm = apiserver.server.get("configmaps", ns, f"{cluster}-router")
    return None if cm is None else yaml.safe_load(cm["data"]["config.yaml"])["tilert"]


def _http(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as resp:
        return str(resp.read().decode())


def test_lifecycle(apiserver: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    srv = apiserver.server
    doc = h.pdc(helpers.example("tiny-cpu"))
    spec = specmod.parse(doc["spec"])
    first_metrics = free_port()
    monkeypatch.setenv("TILERT_PD_METRICS_PORT", str(first_metrics))
    monkeypatch.setenv("TILERT_PD_METRICS_HOST", "127.0.0.1")
    with KopfRunner(h.ARGS, timeout=30) as runner:
        kubectl(apiserver, "create", "--validate=false", "-f", "-", stdin=yaml.safe_dump(doc))
        body = h.wait_for("the PDCluster", lambda: srv.get("pdclusters", "default", "tiny"))
        uid = body["metadata"]["uid"]

        # The operator's pod informer lists and watches only PDClusters' pods, filtered by the server;
        # kopf's stand-by pod watch (for the no-cache mode) only the operator's own.
        def pod_reads(agent: str) -> list[Any]:
            return [
                c
                for c in srv.calls
                if c.resource == "pods" and c.verb in ("list", "watch") and c.user_agent.startswith(agent)
            ]

        informer = h.wait_for("the pod informer", lambda: pod_reads(constants.FIELD_MANAGER))
        assert {c.verb for c in informer} <= {"list", "watch"}
        assert all(c.label_selector == constants.LABEL_CLUSTER for c in informer), informer
        assert all(
            c.label_selector == f"{constants.LABEL_MANAGED_BY}={constants.MANAGED_BY}"
            for c in pod_reads("kopf/")
        )

        # Children appear, owned by the PDCluster, with the rendered commands.
        dep = h.wait_for("prefill Deployment", lambda: srv.get("deployments", "default", "tiny-prefill"))
        assert dep["metadata"]["ownerReferences"][0]["uid"] == uid
        assert (
            dep["spec"]["template"]["spec"]["containers"][0]["command"]
            == commands.commands(spec)[constants.PREFILL].argv
        )
        sts = h.wait_for(
            "TileRT StatefulSet", lambda: srv.get("statefulsets", "default", "tiny-tilert-decode")
        )
        assert (
            sts["spec"]["template"]["spec"]["containers"][0]["command"]
            == commands.commands(spec)[constants.TILERT].argv
        )
        for plural, name in [
            ("services", "tiny-tilert-decode"),
            ("deployments", "tiny-native-decode"),
            ("configmaps", "tiny-router"),
            ("deployments", "tiny-router"),
            ("services", "tiny-router"),
            ("secrets", "tiny-handoff"),
            ("networkpolicies", "tiny-tilert-decode"),
            ("poddisruptionbudgets", "tiny-tilert-decode"),
        ]:
            h.wait_for(f"{plural}/{name}", lambda p=plural, n=name: srv.get(p, "default", n))
        body = h.wait_for(
            "status",
            lambda: (
                h.condition(srv.get("pdclusters", "default", "tiny"), "Ready")
                and srv.get("pdclusters", "default", "tiny")
            ),
        )
        assert h.condition(body, "SpecValid")["status"] == "True"
        assert h.condition(body, "Ready")["reason"] == "NotServing"

        # Mark pods ready -> Ready, with the TileRT endpoints wired into the router's ConfigMap.
        for comp in (constants.PREFILL, constants.ROUTER, constants.NATIVE):
            put_pod(
                apiserver, h.pod("tiny", comp, 0, owner=srv.get("deployments", "default", f"tiny-{comp}"))
            )
        put_pod(apiserver, h.pod("tiny", constants.TILERT, 0, ip="10.1.0.1", owner=sts))
        put_pod(apiserver, h.pod("tiny", constants.TILERT, 1, ip="10.1.0.2", owner=sts))

        # A reconcile between the two TileRT pods' updates reports Ready=True, Degraded (one of two
        # nodes serving) on the way: wait for the state after both.
        def serving() -> dict[str, Any] | None:
            body = srv.get("pdclusters", "default", "tiny")
            ready = h.condition(body, "Ready")
            return body if (ready.get("status"), ready.get("reason")) == ("True", "Serving") else None

        body = h.wait_for("Ready, Serving", serving)
        assert h.condition(body, "EndpointsWired")["status"] == "True"
        assert body["status"]["replicas"] == {
            "prefill": "1/1",
            "tilert": "2/2",
            "native": "1/1",
            "router": "1/1",
        }
        assert [e["ctrlHost"] for e in body["status"]["endpoints"]] == ["10.1.0.1", "10.1.0.2"]
        nodes = router_nodes(apiserver, "default", "tiny")
        assert nodes is not None and [n["http_url"] for n in nodes] == [
            "http://10.1.0.1:5557",
            "http://10.1.0.2:5557",
        ]
        # The Event follows the status write that reported the transition.
        h.wait_for(
            "Serving event",
            lambda: any(
                e["reason"] == "Serving" and e["involvedObject"]["uid"] == uid
                for e in srv.objects("events", "default")
            ),
            timeout=5,
        )

        # A node goes unready -> it leaves the endpoint list within seconds; Ready stays, Degraded.
        put_pod(apiserver, h.pod("tiny", constants.TILERT, 1, ip="10.1.0.2", ready=False, owner=sts))
        h.wait_for(
            "endpoint removal", lambda: router_nodes(apiserver, "default", "tiny") == [nodes[0]], timeout=5
        )
        wait_condition(srv, "tiny", "Ready", "Degraded", key="reason")

        # `kubectl get pdc` shows the printer columns.
        table = kubectl(apiserver, "get", "pdc")
        header, row = table.splitlines()[:2]
        assert header.split() == ["NAME", "READY", "PREFILL", "TILERT", "NATIVE", "ROUTER", "ROLLOUT", "AGE"]
        assert row.split()[:7] == ["tiny", "True", "1/1", "1/2", "1/1", "1/1", "RolloutComplete"]

        # The test server applies the CRD's schema and CEL rules, like a real API server would.
        refused = subprocess.run(
            [
                "kubectl",
                "--kubeconfig",
                apiserver.kubeconfig,
                "patch",
                "pdc",
                "tiny",
                "--type=merge",
                "-p",
                '{"spec":{"decode":{"tilert":{"replicas":0},"native":{"replicas":0}}}}',
            ],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert refused.returncode != 0 and "at least one decode replica" in refused.stderr, refused.stderr

        # Edit the spec -> children change.
        patch_pdc(apiserver, {"spec": {"prefill": {"replicas": 2}, "decode": {"tilert": {"slots": 8}}}})
        h.wait_for(
            "prefill scaled",
            lambda: srv.get("deployments", "default", "tiny-prefill")["spec"]["replicas"] == 2,
        )
        h.wait_for("slots in args", lambda: decode_arg(srv, "tiny", "--slots") == "8")
        h.wait_for(
            "slots in router config", lambda: router_nodes(apiserver, "default", "tiny")[0]["slots"] == 8
        )
        # Not Ready until the new template is rolled out: play the controllers replacing the pods.
        wait_condition(srv, "tiny", "Ready", "RollingOut", key="reason")
        h.roll(apiserver, "tiny", constants.PREFILL)
        h.roll(apiserver, "tiny", constants.TILERT, ips=("10.1.0.1", "10.1.0.2"))

        # The handoff Secret is deleted -> a new token in a new Secret; no pod template changes (the
        # node and the sender re-read the mounted files; rotation is the outage-free way to change it).
        templates = {
            n: srv.get(p, "default", n)["spec"]["template"]
            for p, n in [("deployments", "tiny-prefill"), ("statefulsets", "tiny-tilert-decode")]
        }
        deleted_and_recreated(apiserver, "secrets", "tiny-handoff", timeout=5)
        # Two reconciles after the new Secret: the pods' templates are what they were (no roll).
        after_secret = h.reconciles(first_metrics)
        h.wait_for("two reconciles", lambda: h.reconciles(first_metrics) >= after_secret + 2)
        assert {
            n: srv.get(p, "default", n)["spec"]["template"]
            for p, n in [("deployments", "tiny-prefill"), ("statefulsets", "tiny-tilert-decode")]
        } == templates

        # `kubectl wait` works against the status conditions.
        kubectl(apiserver, "wait", "--for=condition=Ready", "pdc/tiny", "--timeout=10s")

        # Delete a child -> it returns; hand-edit a child -> it is put back.
        kubectl(apiserver, "delete", "configmaps", "tiny-router")
        h.wait_for("ConfigMap back", lambda: srv.get("configmaps", "default", "tiny-router"), timeout=5)
        kubectl(
            apiserver, "patch", "deployments", "tiny-router", "--type=merge", "-p", '{"spec":{"replicas":5}}'
        )
        h.wait_for(
            "replicas restored",
            lambda: srv.get("deployments", "default", "tiny-router")["spec"]["replicas"] == 1,
            timeout=5,
        )

        # Idle resyncs call nothing but the informers' watches: no read, no write. Counted over
        # reconciles the operator reports, not over a fixed time. The repairs above end in the workload
        # controllers' reports, which the status follows (a write and its Events) however late a loaded
        # machine delivers them: first wait for three full reconciles in a row that call nothing (never
        # there while every resync writes), then the next three must call nothing either.
        def operator_calls(since: int) -> list[Any]:
            return [
                c
                for c in srv.calls[since:]
                if c.user_agent.startswith(constants.FIELD_MANAGER) and c.verb != "watch"
            ]

        def three_reconciles() -> int:
            """Wait for three reconciles that start after now (the one under way may have called
            before); returns where the API server's call log stood before them."""
            before, done = len(srv.calls), h.reconciles(first_metrics)
            h.wait_for("three resyncs", lambda: h.reconciles(first_metrics) >= done + 4)
            return before

        h.wait_for(
            "three reconciles in a row that call nothing",
            lambda: not operator_calls(three_reconciles()),
            timeout=60,
            interval=0,
        )
        idle_calls = operator_calls(three_reconciles())
        assert idle_calls == [], idle_calls
        snapshot = {
            p: sorted(o["metadata"]["name"] for o in srv.objects(p)) for p in (*CHILD_PLURALS, "events")
        }
    assert runner.exception is None

    # Restart the operator: nothing duplicated, nothing rewritten, no new Events.
    before = len(operator_writes(apiserver))
    metrics_port, live_port = free_port(), free_port()
    monkeypatch.setenv("TILERT_PD_METRICS_PORT", str(metrics_port))
    monkeypatch.setenv("TILERT_PD_METRICS_HOST", "127.0.0.1")
    with KopfRunner([*h.ARGS, f"--liveness=http://127.0.0.1:{live_port}/healthz"], timeout=30) as runner:
        h.wait_for(
            "resumed resyncs",
            lambda: (
                sum(
                    1
                    for c in srv.calls[-50:]
                    if c.user_agent.startswith(constants.FIELD_MANAGER) and c.verb == "list"
                )
                >= 9  # the informers' first lists, one per cached kind
            ),
        )
        # The last 50 calls may still be the first operator's: wait for this one's first reconcile.
        h.wait_for(
            "first reconcile after the restart",
            lambda: (
                helpers.sample(
                    _try_http(f"http://127.0.0.1:{metrics_port}/metrics") or "",
                    "tilert_pd_pdclusters",
                    state="ready",
                )
                == 1
            ),
            timeout=20,
        )
        first = h.reconciles(metrics_port)
        h.wait_for("two more resyncs", lambda: h.reconciles(metrics_port) >= first + 2)
        assert operator_writes(apiserver)[before:] == []
        assert {p: sorted(o["metadata"]["name"] for o in srv.objects(p)) for p in snapshot} == snapshot
        text = _http(f"http://127.0.0.1:{metrics_port}/metrics")
        assert helpers.sample(text, "tilert_pd_pdclusters", state="ready") == 1
        ready = {
            status: helpers.sample(
                text,
                "tilert_pd_pdcluster_condition",
                pdcluster_namespace="default",
                pdcluster="tiny",
                type="Ready",
                status=status,
            )
            for status in ("True", "False")
        }
        assert ready == {"True": 1, "False": 0}, ready
        assert (helpers.sample(text, "tilert_pd_reconcile_duration_seconds_count") or 0) > 0
        assert (helpers.sample(text, "tilert_pd_api_calls_total", verb="list") or 0) > 0
        h.wait_for("liveness", lambda: _http(f"http://127.0.0.1:{live_port}/healthz"))

        # Injected 409 and 500 answers: the operator retries and converges.
        srv.fail(409, times=2, verb="patch")
        srv.fail(500, times=3, verb="patch", resource="deployments")
        srv.fail(500, times=1, verb="delete")
        patch_pdc(apiserver, {"spec": {"decode": {"native": {"replicas": 0}}, "router": {"replicas": 2}}})
        h.wait_for(
            "native pool removed",
            lambda: srv.get("deployments", "default", "tiny-native-decode") is None,
            timeout=15,
        )
        h.wait_for(
            "router scaled",
            lambda: srv.get("deployments", "default", "tiny-router")["spec"]["replicas"] == 2,
            timeout=15,
        )
        assert all(f.times == 0 for f in srv.faults), "every injected fault was hit"
        h.wait_for(
            "generation observed",
            lambda: (lambda b: b["status"].get("observedGeneration") == b["metadata"]["generation"])(
                srv.get("pdclusters", "default", "tiny")
            ),
        )

        # Delete the PDCluster: every child goes (garbage collection by ownerReferences).
        kubectl(apiserver, "delete", "pdc", "tiny")
        kinds = (*CHILD_PLURALS, "pods")
        h.wait_for("all gone", lambda: not any(srv.objects(p, "default") for p in kinds) or None, timeout=5)
        assert srv.get("pdclusters", "default", "tiny") is None
    assert runner.exception is None


def test_api_timeouts_are_retried(apiserver: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Calls that answer after the client's timeout are retried; the stack still comes up."""
    monkeypatch.setenv("TILERT_PD_API_TIMEOUT_S", "0.5")
    srv = apiserver.server
    srv.fail(0, times=2, verb="list", resource="pods", delay=1.5)
    srv.fail(0, times=1, verb="patch", resource="deployments", delay=1.5)
    with KopfRunner(h.ARGS, timeout=30) as runner:
        apiserver.call(srv.put(h.PDC, h.pdc(helpers.example("tiny-cpu"))))
        h.wait_for(
            "children",
            lambda: (
                srv.get("deployments", "default", "tiny-router")
                and srv.get("statefulsets", "default", "tiny-tilert-decode")
            ),
        )
        wait_spec_valid(srv)
        assert all(f.times == 0 for f in srv.faults)
    assert runner.exception is None
    assert "failed (TimeoutError" in runner.output or "failed (ServerTimeoutError" in runner.output, (
        "the timeouts were hit and retried"
    )


def test_operator_subcommand_starts_and_reports_liveness(apiserver: Any) -> None:
    """`tilert-pd operator` (what the chart runs) logs in, serves its liveness probe and stops on SIGTERM."""
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tilert_operator.cli_operator",
            "--liveness",
            f"http://127.0.0.1:{port}/healthz",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        h.wait_for(
            "liveness", lambda: _try_http(f"http://127.0.0.1:{port}/healthz"), timeout=30, interval=0.25
        )
    finally:
        proc.terminate()
        out = proc.communicate(timeout=30)[0]
    assert proc.returncode == 0, out[-2000:]


def _try_http(url: str) -> str | None:
    try:
        return _http(url)
    except OSError:
        return None
