"""How fast a refused child becomes visible: the operator against the strict API test server.

    .venv/bin/python -m bench.operator.failures [--n 20] [--resync 30]

N PDClusters whose router override carries a label value the API server refuses (a 422 the spec's
validation cannot predict), created at once, then fixed. Measured per PDCluster, from the server's
own timestamps (its call log and a change hook, no polling): creation to Reconciled=False; the refused
apply to Reconciled=False on the PDCluster and to the Warning Event; the fix (spec changed) to
Reconciled=True. Baseline, in the same run: N good PDClusters, creation to their first status write
(what a reconcile that applies everything takes to report). The operator's resync period is long
(default 30 s), so none of it waits for a resync.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time
from typing import Any

import yaml

from bench.common import record, table
from bench.operator.run import PDC, ROOT, _pct, api_server, start_operator, stop
from tilert_serve.local.runner import free_port

BAD_LABELS = {"spec": {"template": {"metadata": {"labels": {"team": "-ml-"}}}}}


def _reconciled(obj: dict[str, Any]) -> str | None:
    for c in (obj.get("status") or {}).get("conditions") or []:
        if c.get("type") == "Reconciled":
            return str(c.get("status"))
    return None


def measure(n: int, resync: float, timeout: float) -> dict[str, list[float]]:
    st, cfg = api_server("bench-failures-")
    srv = st.server
    seen: dict[tuple[str, str], float] = {}  # (what, cluster) -> first time

    def hook(res: Any, kind: str, obj: dict[str, Any]) -> None:
        now, name = time.monotonic(), obj["metadata"].get("name", "")
        if res == PDC:
            state = _reconciled(obj)
            if state is not None:
                seen.setdefault((f"reconciled={state}:{obj['metadata'].get('generation')}", name), now)
            if obj.get("status"):
                seen.setdefault(("status", name), now)
        elif res[2] == "events" and obj.get("reason") == "ApplyRejected":
            seen.setdefault(("event", obj["involvedObject"]["name"]), now)

    srv.on_change.append(hook)
    op = start_operator(st, cfg, resync, free_port())
    try:
        base = yaml.safe_load((ROOT / "examples" / "tiny-cpu.yaml").read_text())
        docs = []
        for i in range(2 * n):
            d = copy.deepcopy(base)
            d["metadata"] = {"name": f"{'bad' if i < n else 'good'}-{i:03d}", "namespace": "default"}
            if i < n:
                d["spec"].setdefault("router", {})["overrides"] = BAD_LABELS
            docs.append(d)
        created: dict[str, float] = {}

        async def create() -> None:
            for d in docs:
                created[d["metadata"]["name"]] = time.monotonic()
                await srv.put(PDC, d)

        st.call(create(), timeout=60)
        bad = [d["metadata"]["name"] for d in docs[:n]]
        good = [d["metadata"]["name"] for d in docs[n:]]

        def wait(keys: list[tuple[str, str]]) -> None:
            end = time.monotonic() + timeout
            while not all(k in seen for k in keys):
                if time.monotonic() > end:
                    raise RuntimeError(f"missing after {timeout}s: {[k for k in keys if k not in seen][:5]}")
                time.sleep(0.05)

        wait(
            [("reconciled=False:1", b) for b in bad]
            + [("event", b) for b in bad]
            + [("status", g) for g in good]
        )
        refused = {}
        for c in srv.calls:  # the first apply of each bad PDCluster's router: refused (it never exists)
            if (
                c.verb == "patch"
                and c.resource == "deployments"
                and c.user_agent.startswith("tilert-pd")
                and c.name
            ):
                refused.setdefault(c.name.removesuffix("-router"), c.at)
        fixed: dict[str, float] = {}

        async def fix() -> None:
            for b in bad:
                obj = srv.get("pdclusters", "default", b)
                assert obj is not None
                obj["spec"]["router"]["overrides"] = {}
                obj["metadata"]["generation"] = obj["metadata"].get("generation", 1) + 1
                fixed[b] = time.monotonic()
                await srv.put(PDC, obj)

        st.call(fix(), timeout=60)
        wait([("reconciled=True:2", b) for b in bad])
        return {
            "creation_to_condition": [seen[("reconciled=False:1", b)] - created[b] for b in bad],
            "refused_to_condition": [seen[("reconciled=False:1", b)] - refused[b] for b in bad],
            "condition_to_event": [seen[("event", b)] - seen[("reconciled=False:1", b)] for b in bad],
            "creation_to_event": [seen[("event", b)] - created[b] for b in bad],
            "fix_to_cleared": [seen[("reconciled=True:2", b)] - fixed[b] for b in bad],
            "baseline": [seen[("status", g)] - created[g] for g in good],
        }
    finally:
        stop(op, st)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=20)
    p.add_argument("--resync", type=float, default=30.0)
    p.add_argument("--timeout", type=float, default=120.0)
    args = p.parse_args(argv)
    r = measure(args.n, args.resync, args.timeout)
    base50 = _pct(r["baseline"], 0.5)
    rows = [
        ("good PDCluster: creation to first status (baseline)", "baseline"),
        ("refused child: creation to Reconciled=False", "creation_to_condition"),
        ("refused apply (422) to Reconciled=False", "refused_to_condition"),
        ("refused child: creation to the Warning Event", "creation_to_event"),
        ("Reconciled=False to the Warning Event", "condition_to_event"),
        ("spec fixed to Reconciled=True", "fix_to_cleared"),
    ]
    cells = [
        [
            label,
            f"{_pct(r[key], 0.5) * 1000:.0f}",
            f"{_pct(r[key], 0.99) * 1000:.0f}",
            f"{_pct(r[key], 0.5) / base50:.2f}x" if base50 else "-",
        ]
        for label, key in rows
    ]
    body = table(["interval", "p50 (ms)", "p99 (ms)", "p50 / baseline p50"], cells)
    print(body)
    record(
        "operator-failures",
        "Operator: refused children made visible (`bench/operator/failures.py`, CPU box)",
        body,
        notes=f"{args.n} PDClusters with a router the API test server refuses (422, a label value) and {args.n} good ones, "
        f"created at once; resync period {args.resync:g} s (nothing waits for it). The Event is posted after the status "
        f"write of the same reconcile. Load average (1 min) at the end {os.getloadavg()[0]:.1f}.",
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
