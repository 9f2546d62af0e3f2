"""Changes under steady load through the router, on the tiny CPU stack: rolling updates of each pool,
scale steps, a generation change, a SIGKILL of each component and the router restarted. One table,
one row per change, judged against one bar (judge.py).

    .venv/bin/python -m bench.change [--rate 0.5] [--steady 40] [--settle 6] [--only NAME,...]
                                     [--references FILE] [--no-record] [--seed 0]

Starts examples/tiny-cpu.yaml with short termination settings (scenarios.base_doc) as `tilert-pd local
up` does, and vLLM alone beside it for the greedy references; then sends Poisson load (every route,
streamed and not, completions and chat, all greedy) through the router for the whole run while each
change is made in turn with `tilert-pd local apply` (or a SIGKILL of the pod's process group followed
by the same apply, which brings the pod back). About half an hour on a 2-core box: each vLLM boot a
change needs costs a minute of both cores. The table goes to bench/RESULTS.md (section `change`).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import tempfile
import time
from pathlib import Path

import yaml

from bench.change import judge, leaks, scenarios
from bench.common import table
from bench.load import references, report
from bench.load.harness import Load
from bench.load.plan import LoadPlan, PromptSet
from bench.load.stack import EXAMPLE, TinyStack, tiny_stack
from tilert_serve.local import cli as local_cli
from tilert_serve.local import runner

#: The load outlasts any run; it is stopped when the last change has settled.
LOAD_BOUND_S = 4 * 3600.0
#: A change's apply may take this long (vLLM boots under load on two cores).
APPLY_TIMEOUT_S = 900.0


def say(msg: str) -> None:
    print(msg, flush=True)


def write_spec(home: Path, doc: scenarios.Doc, n: int) -> Path:
    path = home / "specs" / f"{n:02d}.yaml"
    path.parent.mkdir(exist_ok=True)
    path.write_text(yaml.safe_dump(doc))
    return path


def apply(home: Path, path: Path) -> int:
    return local_cli.run(
        argparse.Namespace(action="apply", filename=str(path), home=home, timeout=APPLY_TIMEOUT_S)
    )


def kill(state_dir: Path, component: str) -> str:
    """SIGKILL the process group of the newest running pod of `component` (a container killed with
    everything in it: vLLM's engine process too); its name."""
    _, procs = runner.load(state_dir)
    pods = [p for p in procs if p.kind == component and runner.running(p)]
    if not pods:
        raise RuntimeError(f"no running {component} pod to kill in {state_dir}")
    victim = max(pods, key=lambda p: p.ordinal)
    os.killpg(victim.pid, signal.SIGKILL)
    # The kill is done when the group is gone: an apply that still saw it would wait for it to be
    # ready (a kubelet restarts a killed container in place; the local runtime has no such loop).
    deadline = time.monotonic() + 30
    while runner.running(victim) and time.monotonic() < deadline:
        time.sleep(0.05)
    return victim.name


async def run(
    stack: TinyStack, doc: scenarios.Doc, chosen: list[scenarios.Scenario], a: argparse.Namespace
) -> tuple[list[judge.Row], str, list[str]]:
    prompts = PromptSet(seed=a.seed)
    refs = await references.cached(a.references, stack.plain, prompts, progress=say)
    state_dir = stack.local.state_dir
    plan = LoadPlan(rate=a.rate, duration_s=LOAD_BOUND_S, seed=a.seed, prompts=prompts)
    done: list[scenarios.Scenario] = []
    stopped = ""
    async with Load(
        stack.router, plan, references=refs, progress=say, progress_every_s=20, drain_s=120
    ) as load:
        say(f"steady: waiting for {a.steady} requests to succeed at {a.rate:g} req/s")
        await load.completed(a.steady, ok=True, timeout=600)
        for n, sc in enumerate(chosen, 1):
            say(f"\n[{n}/{len(chosen)}] {sc.name}: {sc.what}")
            load.mark(sc.name)
            if sc.planned:
                doc = sc.apply_to(doc)
            else:
                say(f"  SIGKILL {kill(state_dir, sc.kill or '')}; the same spec applied again brings it back")
            rc = await asyncio.to_thread(apply, stack.home, write_spec(stack.home, doc, n))
            load.mark(judge.after(sc.name))
            done.append(sc)
            if rc != 0:
                stopped = (
                    f"`tilert-pd local apply` failed during {sc.name!r} (exit {rc}); the run stopped there."
                )
                say(stopped)
                break
            await load.completed(a.settle, after=judge.after(sc.name), timeout=600)
    steady = load.summary().phase(judge.STEADY)
    rows = [judge.row(load.records, load.marks, sc, steady) for sc in done]
    # Every request has ended (the load drained): whatever is still held now leaked.
    still = await asyncio.to_thread(leaks.held, state_dir)
    say(
        "leaks: "
        + ("; ".join(still) if still else "none (every TileRT slot free, nothing in flight in the router)")
    )
    return rows, stopped, still


def _sec(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def render(rows: list[judge.Row]) -> str:
    body = []
    for r in rows:
        s = r.stats
        body.append(
            [
                r.scenario.name,
                f"{r.took_s:.0f}",
                str(s.requests),
                report.failures(s),
                str(s.retried),
                f"{s.mismatches} / {s.compared}",
                report.ratio(r.ttft_ratio, 1.0) if r.ttft_ratio is not None else "-",
                "-" if r.in_flight_failed is None else f"{r.in_flight_failed} ({r.in_flight_clean} clean)",
                _sec(r.served_again_s),
                "met" if r.met else "NOT met: " + "; ".join(r.problems),
            ]
        )
    return table(
        [
            "change",
            "took (s)",
            "requests",
            "failed (by class)",
            "retried",
            "greedy mismatches / compared",
            "TTFT p99 of requests in flight while it ran vs steady",
            "failed in flight at the kill",
            "all served again after (s)",
            "bar",
        ],
        body,
    )


def cli() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rate", type=float, default=0.5, help="Poisson arrivals, req/s (default %(default)s)")
    p.add_argument("--steady", type=int, default=40, help="successful requests before the first change")
    p.add_argument(
        "--settle", type=int, default=6, help="requests answered after each change before the next"
    )
    p.add_argument(
        "--only", type=lambda s: [x.strip() for x in s.split(",")], help="run only these changes (names)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--references", type=Path, help="cache of vLLM alone's texts (JSON; collected when stale)")
    p.add_argument("--no-record", action="store_true", help="print only; leave bench/RESULTS.md alone")
    a = p.parse_args()
    every = scenarios.sequence()
    chosen = every if not a.only else [s for s in every if s.name in a.only]
    unknown = set(a.only or ()) - {s.name for s in every}
    if unknown:
        p.error(
            f"--only names unknown changes {sorted(unknown)}; the changes: {', '.join(s.name for s in every)}"
        )
    t0 = time.monotonic()
    home = Path(tempfile.mkdtemp(prefix="bench-change-"))  # mkdtemp: owner-only
    doc = scenarios.base_doc(EXAMPLE)
    say(f"bench.change: starting the tiny stack and vLLM alone under {home} (a few minutes)")
    with tiny_stack(write_spec(home, doc, 0), home=home, say=say) as stack:
        say(f"  up in {time.monotonic() - t0:.0f} s")
        rows, stopped, still = asyncio.run(run(stack, doc, chosen, a))
    body = render(rows)
    met = sum(r.met for r in rows)
    note = (
        f"{met} of {len(rows)} changes met the bar. Load: {a.rate:g} req/s Poisson through the router for the "
        "whole run, a third each asking for `tilert`, `native` and `auto`, half streamed, half chat, all "
        "greedy and compared with vLLM alone's text. Each row counts the requests sent from its change's "
        f"start until the next change (the settle window: {a.settle} answered). TTFT while a change ran is over the streamed "
        "requests in flight at some time between its start and its apply's end; ratios are against the "
        f"{a.steady} steady requests before the first change. Pods a change creates boot at idle CPU priority "
        "until ready (docs/local.md), as a cluster boots them on CPUs of their own. Once the native pool is at zero, requests "
        "asking for `native` get 503 `no_native_pool` by design and are left out. A kill's in-flight "
        "failures count every request in flight at the kill that failed, whatever it was on. Load average "
        f"(1 min) at the end: {os.getloadavg()[0]:.1f}. Total {time.monotonic() - t0:.0f} s. {stopped}\n\n"
        "Held once every request had ended (TileRT slots not free, router in-flight and slot gauges): "
        + ("; ".join(still) if still else "nothing.")
    )
    print()
    print(body)
    print()
    print(note)
    if not a.no_record:
        report.write("change", "Changes under load, tiny stack (`bench/change`, CPU box)", body, notes=note)


if __name__ == "__main__":
    cli()
