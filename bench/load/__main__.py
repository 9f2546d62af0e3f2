"""Steady load through the router on the tiny CPU stack, each route, against vLLM alone in the same run.

    .venv/bin/python -m bench.load [--seconds 15] [--min-requests 12] [--probe-seconds 8] [--rates 0.25,0.5,1,2] [--seed 0]
                                   [--references FILE] [--no-record]

Starts examples/tiny-cpu.yaml as `tilert-pd local up` does, and vLLM alone beside it (the native
pool's command without a connector); collects vLLM alone's greedy text for the prompt set (cached in
--references when given); climbs the ladder of rates with a mix of every route, streamed and not,
completions and chat, and keeps the highest rate served with no failure and no queue (rate.py); then
sends the same seeded load at that rate through the router with each route (`x-pd-route: tilert`,
`native`, `auto`) and to vLLM alone, one after the other, and prints each with its ratio to vLLM alone.
Every greedy output is compared with vLLM alone's. The table goes to bench/RESULTS.md (section `load`)
through bench/common.py, which marks a run from a tree with uncommitted code `+dirty`.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from pathlib import Path

from bench.common import table
from bench.load import references, report
from bench.load.harness import Load
from bench.load.plan import ROUTES, LoadPlan, Mix, PromptSet
from bench.load.rate import Queue, Verdict, pick, verdict
from bench.load.stack import EXAMPLE, TinyStack, tiny_stack
from bench.load.summary import Stats

#: A probe lasts long enough for about this many requests (a verdict on two requests is noise).
MIN_PROBE_REQUESTS = 9


def say(msg: str) -> None:
    print(msg, flush=True)


async def run_load(stack: TinyStack, plan: LoadPlan, refs: references.References, plain: bool) -> Load:
    target = stack.plain if plain else stack.router
    async with Load(target, plan, references=refs, progress=say, progress_every_s=5) as load:
        await load.finished()
    return load


async def measure(stack: TinyStack, a: argparse.Namespace) -> tuple[str, str]:
    prompts = PromptSet(seed=a.seed)
    t0 = time.monotonic()
    say("references: vLLM alone's greedy texts for the prompt set")
    refs = await references.cached(a.references, stack.plain, prompts, progress=say)
    say(f"  {len(refs.texts)} references in {time.monotonic() - t0:.0f} s")

    verdicts: list[Verdict] = []
    lowest: Stats | None = None
    for rate in a.rates:
        probe_s = max(a.probe_seconds, MIN_PROBE_REQUESTS / rate)
        say(f"probe: {rate:g} req/s for {probe_s:g} s, every route")
        plan = LoadPlan(rate=rate, duration_s=probe_s, seed=a.seed, prompts=prompts)
        load = await run_load(stack, plan, refs, plain=False)
        stats = load.summary().total
        v = verdict(rate, stats, Queue.of(load.records), lowest)
        lowest = lowest or stats
        verdicts.append(v)
        say(f"  {'sustained' if v.sustained else 'not sustained'}: {v.why}")
        if not v.sustained:
            break
    rate, sustained = pick(verdicts)

    # At a low rate the rows last longer, so that each has about --min-requests requests.
    seconds = max(a.seconds, a.min_requests / rate)
    runs: dict[str, Stats] = {}
    elsewhere: list[str] = []
    for route in ROUTES:
        say(f"steady: {rate:g} req/s for {seconds:g} s through the router, route {route}")
        plan = LoadPlan(rate=rate, duration_s=seconds, seed=a.seed, prompts=prompts, mix=Mix.only(route))
        load = await run_load(stack, plan, refs, plain=False)
        runs[f"router, {route}"] = load.summary().total
        moved = [r for r in load.records if r.ok and route != "auto" and r.route_served != route]
        if moved:
            elsewhere.append(
                f"{len(moved)} of the requests asking for {route} were served by "
                f"{', '.join(sorted({str(r.route_served) for r in moved}))} (the router's fallback; its log says why)."
            )
    say(f"baseline: the same load on vLLM alone ({rate:g} req/s for {seconds:g} s)")
    plan = LoadPlan(rate=rate, duration_s=seconds, seed=a.seed, prompts=prompts, mix=Mix.only("auto"))
    runs["vLLM alone"] = (await run_load(stack, plan, refs, plain=True)).summary().total

    body = report.comparison_table(runs, "vLLM alone")
    probes = table(
        ["probe req/s", "sustained", "why"],
        [[f"{v.rate:g}", "yes" if v.sustained else "no", v.why] for v in verdicts],
    )
    note = (
        f"Rate {rate:g} req/s ({'the highest sustained' if sustained else 'NOT sustained: the lowest probed'}), "
        f"Poisson arrivals, {seconds:g} s per row, seed {a.seed}: {len(prompts.prompts)} prompts of "
        f"{prompts.words[0]}-{prompts.words[1]} words, {prompts.max_tokens[0]}-{prompts.max_tokens[1]} tokens "
        "each, half streamed, half chat, all greedy and compared with vLLM alone's text. TTFT and TPOT "
        "from the streamed half; latency from all. Load average (1 min) at the end: "
        f"{os.getloadavg()[0]:.1f}. {' '.join(elsewhere)}\n\nRate ladder:\n\n{probes}"
    )
    return body, note


def cli() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--file", type=Path, default=EXAMPLE, help="the PDCluster to start (default %(default)s)")
    p.add_argument("--seconds", type=float, default=15.0, help="steady load per route and for vLLM alone")
    p.add_argument(
        "--min-requests", type=int, default=12, help="rows last long enough for about this many requests"
    )
    p.add_argument("--probe-seconds", type=float, default=8.0, help="each step of the rate ladder")
    p.add_argument(
        "--rates",
        type=lambda s: [float(x) for x in s.split(",")],
        default=[0.25, 0.5, 1.0, 2.0],
        help="the rate ladder, req/s, lowest first (default 0.25,0.5,1,2)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--references", type=Path, help="cache of vLLM alone's texts (JSON; collected when stale)")
    p.add_argument("--no-record", action="store_true", help="print only; leave bench/RESULTS.md alone")
    a = p.parse_args()
    if a.rates != sorted(a.rates) or not all(r > 0 for r in a.rates):
        p.error(f"--rates must be positive and lowest first; got {a.rates}")
    t0 = time.monotonic()
    say(f"bench.load: starting {a.file} and vLLM alone (a few minutes on a 2-core box)")
    with tiny_stack(a.file, say=say) as stack:
        say(f"  stack up in {time.monotonic() - t0:.0f} s")
        body, note = asyncio.run(measure(stack, a))
    print()
    print(body)
    print()
    print(note)
    say(f"\ntotal {time.monotonic() - t0:.0f} s")
    if not a.no_record:
        report.write("load", "Load through the router, tiny stack (`bench/load`, CPU box)", body, notes=note)


if __name__ == "__main__":
    cli()
