"""The operator at scale: N PDClusters applied at once against the API test server.

    .venv/bin/python -m bench.operator.run [--n 200] [--resync 10]

The operator runs as its own process (`kopf run -m tilert_operator.wiring`), so its RSS is its own;
the API test server (tests/operator/pdc_apiserver.py: kmock 0.8 plus the compatibility layer) runs
in this process. Measured: time until every PDCluster has all its children, per-PDCluster time
from creation to its last child, reconcile duration quantiles (from the operator's /metrics
histogram), API calls per reconcile, writes per idle resync (must be 0), the operator's RSS.
Baseline, measured in the same run: one PDCluster alone; the table prints N's ratio to it.
"""

from __future__ import annotations

import argparse
import copy
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import yaml
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from bench.common import record, table
from tilert_serve.local.runner import free_port

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "operator"))

import pdc_apiserver  # noqa: E402
from pdc_server_thread import ServerThread  # noqa: E402  (the test server, the CRD installed)

PDC = ("pd.tilert.ai", "v1alpha1", "pdclusters")
#: Children of one tiny-cpu PDCluster: 3 Deployments, 1 StatefulSet, 4 Services, 1 ConfigMap,
#: 3 NetworkPolicies, 1 Secret.
CHILD_PLURALS = ("deployments", "statefulsets", "services", "configmaps", "networkpolicies", "secrets")
CHILDREN_PER_PDC = 13
UA = "tilert-pd-operator"


def _metrics(port: int) -> list[Sample]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        return [s for family in text_string_to_metric_families(resp.read().decode()) for s in family.samples]


def _value(samples: list[Sample], name: str) -> float:
    return sum(s.value for s in samples if s.name == name)


def _quantile(samples: list[Sample], q: float) -> float:
    """histogram_quantile as Prometheus computes it: linear within the bucket."""
    buckets = sorted(
        (float(s.labels["le"]), s.value)
        for s in samples
        if s.name == "tilert_pd_reconcile_duration_seconds_bucket"
    )
    total = buckets[-1][1]
    if not total:
        return 0.0
    rank, prev_bound, prev_count = q * total, 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if bound == float("inf"):
                return prev_bound
            return prev_bound + (bound - prev_bound) * (rank - prev_count) / max(count - prev_count, 1e-9)
        prev_bound, prev_count = bound, count
    return prev_bound


def _pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))] if s else 0.0


def _rss_kib(pid: int) -> tuple[int, int]:
    fields = dict(
        line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line
    )
    return int(fields["VmRSS"].split()[0]), int(fields["VmHWM"].split()[0])


def _op_calls(srv: Any) -> list[Any]:
    return [c for c in srv.calls if c.user_agent.startswith(UA)]


def api_server(prefix: str) -> tuple[ServerThread, Path]:
    """The operator suite's API test server (the CRD installed, its schema not checked: as these
    benchmarks have always measured) and a kubeconfig file for it, in a new temporary folder named
    `prefix`..."""
    st = ServerThread(validate=False)
    cfg = Path(tempfile.mkdtemp(prefix=prefix)) / "kubeconfig"
    cfg.write_text(pdc_apiserver.kubeconfig(st.url))
    return st, cfg


def start_operator(
    st: ServerThread, cfg: Path, resync: float, port: int, **env: str
) -> subprocess.Popen[bytes]:
    """The operator (kopf run, as the chart runs it) against `st` through the kubeconfig `cfg`,
    resyncing every `resync` s, its /metrics on 127.0.0.1:`port`, `env` added to its environment;
    returns once /metrics answers and kopf's watches have had a second to start. Its log:
    operator.log beside `cfg`. If it does not start, `st` is stopped too and RuntimeError raised."""
    log = cfg.with_name("operator.log")
    with log.open("wb") as out:
        op = subprocess.Popen(
            [str(ROOT / ".venv" / "bin" / "kopf"), "run", "-m", "tilert_operator.wiring", "--all-namespaces", "--standalone", "--quiet"],
            env=os.environ | {
                "KUBECONFIG": str(cfg), "TILERT_PD_RESYNC_S": str(resync), "TILERT_PD_METRICS_PORT": str(port),
                "TILERT_PD_METRICS_HOST": "127.0.0.1", "TILERT_PD_WATCH_TIMEOUT_S": "600", **env,
            },
            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=out,
        )  # fmt: skip
    deadline = time.monotonic() + 30
    while True:
        try:
            _metrics(port)
            break
        except OSError:
            if time.monotonic() > deadline or op.poll() is not None:
                op.kill()
                st.stop()
                raise RuntimeError(
                    f"operator did not start (its log, {log}):\n{log.read_text()[-4000:]}"
                ) from None
            time.sleep(0.2)
    time.sleep(1.0)  # let kopf's watches start
    return op


def stop(op: subprocess.Popen[bytes], st: ServerThread) -> None:
    """The operator (SIGTERM; SIGKILL if it has not exited 20 s later), then the API server."""
    op.terminate()
    try:
        op.wait(timeout=20)
    except subprocess.TimeoutExpired:
        op.kill()
    st.stop()


def run_case(n: int, resync: float, timeout: float) -> dict[str, Any]:
    st, cfg = api_server("bench-operator-")
    metrics_port = free_port()
    op = start_operator(st, cfg, resync, metrics_port)
    try:
        base = yaml.safe_load((ROOT / "examples" / "tiny-cpu.yaml").read_text())
        docs = []
        for i in range(n):
            d = copy.deepcopy(base)
            d["metadata"] = {"name": f"pdc-{i:04d}", "namespace": f"ns-{i % 10}"}
            docs.append(d)

        async def apply_all() -> float:
            t0 = time.monotonic()
            for d in docs:
                await st.server.put(PDC, d)
            return t0

        t0 = st.call(apply_all(), timeout=60)
        want = n * CHILDREN_PER_PDC
        while True:
            have = st.call(_count(st.server))
            if have >= want:
                break
            if time.monotonic() - t0 > timeout:
                raise RuntimeError(f"only {have}/{want} children after {timeout}s")
            time.sleep(0.05)
        t_all = time.monotonic() - t0
        per_pdc = st.call(_time_to_children(st.server, docs))
        # Let the status writes and events of the first reconciles settle, then measure idle resyncs.
        time.sleep(min(resync, 5.0))
        m1 = _metrics(metrics_port)
        calls1, writes1 = len(_op_calls(st.server)), _writes(st.server)
        time.sleep(resync * 2 + 1)
        m2 = _metrics(metrics_port)
        calls2, writes2 = len(_op_calls(st.server)), _writes(st.server)
        reconciles = _value(m2, "tilert_pd_reconcile_duration_seconds_count")
        idle_reconciles = reconciles - _value(m1, "tilert_pd_reconcile_duration_seconds_count")
        rss, hwm = _rss_kib(op.pid)
        return {
            "n": n,
            "t_all_children_s": t_all,
            "per_pdc_p50_s": _pct(per_pdc, 0.5),
            "per_pdc_p99_s": _pct(per_pdc, 0.99),
            "reconcile_p50_s": _quantile(m2, 0.5),
            "reconcile_p99_s": _quantile(m2, 0.99),
            "reconciles": reconciles,
            "calls_per_reconcile_idle": (calls2 - calls1) / max(idle_reconciles, 1),
            "calls_per_reconcile_all": calls2 / max(reconciles, 1),
            "idle_reconciles": idle_reconciles,
            "writes_per_idle_resync": (writes2 - writes1) / max(idle_reconciles, 1),
            "errors": _value(m2, "tilert_pd_reconcile_errors_total"),
            "rss_mib": rss / 1024,
            "peak_rss_mib": hwm / 1024,
        }
    finally:
        stop(op, st)


def _writes(srv: Any) -> int:
    return sum(1 for c in _op_calls(srv) if c.verb in ("create", "patch", "update", "delete"))


async def _count(srv: Any) -> int:
    return sum(1 for (res, _, _) in srv.store if res[2] in CHILD_PLURALS)


async def _time_to_children(srv: Any, docs: list[dict[str, Any]]) -> list[float]:
    last: dict[tuple[str, str], float] = {}
    first: dict[tuple[str, str], float] = {}
    for (res, ns, name), t in srv.added_at.items():
        if res == PDC and ns is not None:
            first[(ns, name)] = t
        elif res[2] in CHILD_PLURALS and ns is not None:
            cluster = next(
                (
                    d["metadata"]["name"]
                    for d in docs
                    if name.startswith(d["metadata"]["name"] + "-") and d["metadata"]["namespace"] == ns
                ),
                None,
            )
            if cluster:
                last[(ns, cluster)] = max(last.get((ns, cluster), 0.0), t)
    return [last[k] - first[k] for k in first if k in last]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=200)
    p.add_argument("--resync", type=float, default=10.0, help="operator resync period, seconds")
    p.add_argument("--timeout", type=float, default=240.0)
    args = p.parse_args(argv)
    base = run_case(1, args.resync, args.timeout)
    big = run_case(args.n, args.resync, args.timeout)
    rows = [
        ("time until all children applied (s)", "t_all_children_s", "{:.2f}"),
        ("per PDCluster, creation to last child p50 (s)", "per_pdc_p50_s", "{:.3f}"),
        ("per PDCluster, creation to last child p99 (s)", "per_pdc_p99_s", "{:.3f}"),
        ("reconcile duration p50 (s, from /metrics)", "reconcile_p50_s", "{:.4f}"),
        ("reconcile duration p99 (s, from /metrics)", "reconcile_p99_s", "{:.4f}"),
        ("reconciles", "reconciles", "{:.0f}"),
        ("API calls per idle reconcile", "calls_per_reconcile_idle", "{:.1f}"),
        ("API calls per reconcile, whole run", "calls_per_reconcile_all", "{:.1f}"),
        ("idle reconciles measured", "idle_reconciles", "{:.0f}"),
        ("writes per idle resync", "writes_per_idle_resync", "{:.3f}"),
        ("reconcile errors", "errors", "{:.0f}"),
        ("operator RSS (MiB)", "rss_mib", "{:.1f}"),
        ("operator peak RSS (MiB)", "peak_rss_mib", "{:.1f}"),
    ]
    cells = []
    for label, key, fmt in rows:
        a, b = base[key], big[key]
        cells.append([label, fmt.format(a), fmt.format(b), f"{b / a:.2f}x" if a else "-"])
    body = table(["metric", "1 PDCluster (baseline)", f"{args.n} PDClusters", "ratio"], cells)
    print(body)
    record(
        "operator",
        "Operator (`bench/operator/run.py`, CPU box)",
        body,
        notes=f"Resync period {args.resync:g} s; load average (1 min) at the end {os.getloadavg()[0]:.1f}.",
    )
    return 0 if big["writes_per_idle_resync"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
