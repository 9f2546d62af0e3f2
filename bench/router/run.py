"""Router benchmark against scripted upstreams on loopback, the router pinned to one core, with two
baselines measured in the same run: vLLM's toy PD proxy rebuilt on its own stack (toy_relay.py:
FastAPI + uvicorn + httpx, clients made once in the lifespan, as upstream) and the same flow on
aiohttp with one ClientSession (aiohttp_relay.py).

    .venv/bin/python -m bench.router.run [--seconds 5] [--repeats 3] [--runs 2]

Processes: the router (or a relay) alone on core 0; the scripted upstreams and this load generator
on the other cores. "direct" = the load generator itself calls the upstream's prefill then its decode
over pooled connections: the same two calls the router makes, without the router, so router - direct
is what the router adds. `--runs` repeats the whole measurement with fresh processes; the table has
one column per run, so a quiet run and a disturbed one are read side by side. The table goes to
bench/RESULTS.md through bench/common.py's `record`.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from bench.common import record, table
from bench.router.load import Target, closed_loop, open_loop
from tilert_serve.local.runner import free_port

ROOT = Path(__file__).resolve().parents[2]
CORES = sorted(os.sched_getaffinity(0))
ROUTER_CORE = {CORES[0]}
OTHER_CORES = set(CORES[1:]) or ROUTER_CORE


LOGS = Path(tempfile.mkdtemp(prefix="router-bench-logs-"))


def spawn(args: list[str], cores: set[int]) -> subprocess.Popen[bytes]:
    # Output goes to a file: a pipe nobody reads would block a process that logs a lot.
    log = open(LOGS / f"{args[0]}-{len(list(LOGS.iterdir()))}.log", "wb")
    p = subprocess.Popen([sys.executable, "-m", *args], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    os.sched_setaffinity(p.pid, cores)
    return p


def wait_up(url: str, proc: subprocess.Popen[bytes]) -> None:
    for _ in range(200):
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: exited with {proc.returncode}; logs in {LOGS}")
        try:
            urllib.request.urlopen(url, timeout=1)
            return
        except urllib.error.HTTPError:
            return  # it answers
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"{url} did not come up")


def cpu_seconds(pid: int) -> float:
    f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def router_config(path: Path, upstream: str) -> None:
    path.write_text(f"""model: tiny
prefill: ["{upstream}"]
native: ["{upstream}"]
tilert:
  - {{name: t0, http_url: "{upstream}", ctrl_host: 127.0.0.1, slots: 100000}}
limits: {{native_max_inflight: 100000}}
health: {{interval_s: 5}}
""")


class Proc:
    def __init__(self, args: list[str], cores: set[int], probe: str) -> None:
        self.p = spawn(args, cores)
        wait_up(probe, self.p)

    def stop(self) -> None:
        self.p.terminate()
        try:
            self.p.wait(10)
        except subprocess.TimeoutExpired:
            self.p.kill()


async def saturate(t: Target, pid: int, seconds: float, conc: int, tokens: int) -> tuple[float, float, float]:
    """One closed-loop run. Returns (req/s, core use, req per CPU-second) of the process `pid`, CPU
    counted over the timed window only (the warm-up requests are in neither the rate nor the CPU)."""
    rps, res = await closed_loop(t, conc, seconds, tokens, cpu=lambda: cpu_seconds(pid))
    if res.failed:
        print(f"  ! {t.name}: {res.failed} failed")
    elapsed = res.ok / rps if rps else 0.0
    core = res.cpu_s / elapsed if elapsed else 0.0
    return rps, core, (res.ok / res.cpu_s if res.cpu_s else float("nan"))


async def rss_at(t: Target, pid: int, streams: int, tokens: int) -> tuple[float, float, int]:
    """Open `streams` slow streams at once; peak RSS while they are open, and how many finished."""
    from bench.router.load import Result, one, session

    res = Result()
    base = rss_mb(pid)
    peak = base
    async with session(0) as http:
        tasks = [asyncio.ensure_future(one(http, t, tokens, res, False)) for _ in range(streams)]
        while not all(x.done() for x in tasks):
            peak = max(peak, rss_mb(pid))
            await asyncio.sleep(0.1)
    return base, peak, res.ok


RELAYS = {
    "toy proxy": "bench.router.toy_relay",  # FastAPI + uvicorn + httpx, clients made once (as upstream)
    "aiohttp relay": "bench.router.aiohttp_relay",  # the same flow on aiohttp, one ClientSession
}


class Stage:
    """One upstream (with a given inter-token gap) and, in front of it, the router and both relays,
    each pinned alone... on the router core (idle ones cost nothing), so runs can be interleaved."""

    def __init__(self, tmp: Path, itl_ms: float) -> None:
        self.procs: list[Proc] = []
        up = free_port()
        self.upstream = f"http://127.0.0.1:{up}"
        self.procs.append(
            Proc(
                ["bench.router.upstream", "--port", str(up), "--itl-ms", str(itl_ms)],
                OTHER_CORES,
                self.upstream + "/health",
            )
        )
        cfg = tmp / f"router-{up}.yaml"
        router_config(cfg, self.upstream)
        rp = free_port()
        self.router_url = f"http://127.0.0.1:{rp}"
        self.router = Proc(
            [
                "tilert_serve.router.cli",
                "--config",
                str(cfg),
                "--host",
                "127.0.0.1",
                "--port",
                str(rp),
                "--log-level",
                "WARNING",
            ],
            ROUTER_CORE,
            self.router_url + "/health",
        )
        self.procs.append(self.router)
        self.relays: dict[str, tuple[str, int]] = {}
        for name, module in RELAYS.items():
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            pr = Proc([module, "--port", str(port), "--upstream", self.upstream], ROUTER_CORE, url + "/")
            self.procs.append(pr)
            self.relays[name] = (url, pr.p.pid)

    def targets(self) -> list[tuple[Target, int]]:
        pid = self.router.p.pid
        out = [
            (Target("router native", self.router_url, {"x-pd-route": "native"}), pid),
            (Target("router TileRT", self.router_url, {"x-pd-route": "tilert"}), pid),
        ]
        out += [(Target(name, url), rpid) for name, (url, rpid) in self.relays.items()]
        return out

    def stop(self) -> None:
        for p in self.procs:
            p.stop()


def ms(x: float) -> str:
    return f"{x * 1e3:.2f}"


def both(rate: tuple[float, float, float], base: tuple[float, float, float]) -> str:
    return f"{rate[0] / base[0]:.2f}x; {rate[2] / base[2]:.2f}x"


async def measure(a: argparse.Namespace, tmp: Path) -> list[tuple[str, str]]:
    """One whole run (fresh processes per phase); rows of (measure, value)."""
    rows: list[tuple[str, str]] = []
    secs, conc, toks = a.seconds, a.concurrency, 64

    # 1. Saturation: streamed 64-token requests (tokens coalesced), closed loop; best of N interleaved runs.
    st = Stage(tmp, 0)
    try:
        print(
            f"saturation: closed loop, concurrency {conc}, {secs:.0f} s x {a.repeats}, {toks} tokens",
            flush=True,
        )
        best: dict[str, tuple[float, float, float]] = {}
        for _ in range(a.repeats):
            for t, pid in st.targets():
                r = await saturate(t, pid, secs, conc, toks)
                if r[0] > best.get(t.name, (0.0,))[0]:
                    best[t.name] = r
        for name, (rps, core, _eff) in best.items():
            rows.append((f"streamed req/s, {name} (core use)", f"{rps:,.0f} ({core:.2f})"))
        rows.append(
            (
                "req per CPU-second: " + " / ".join(best),
                " / ".join(f"{eff:,.0f}" for _rps, _core, eff in best.values()),
            )
        )
        for base in RELAYS:
            for path in ("router native", "router TileRT"):
                rows.append((f"ratio {path} / {base}: req/s; per CPU-second", both(best[path], best[base])))
        rows.append(
            (
                "ratio aiohttp relay / toy proxy: req/s; per CPU-second",
                both(best["aiohttp relay"], best["toy proxy"]),
            )
        )
    finally:
        st.stop()

    st = Stage(tmp, 0)  # fresh processes: the latency phase does not inherit the saturation's state
    try:
        # 2. Added TTFT at half of the router's saturation rate (open loop), against direct calls.
        #    Targets take turns in short slices, round after round, so that bursts of other work on
        #    this shared box fall on all of them alike.
        rate = max(best["router native"][0] / 2, 1.0)
        slice_s = a.slice_seconds
        rounds = max(int(secs * a.repeats / slice_s), 1)
        print(
            f"TTFT: open loop at {rate:.0f} req/s (half of saturation), {rounds} rounds of {slice_s:.1f} s slices",
            flush=True,
        )
        targets = [(Target("direct", st.upstream, direct=True), st.procs[0].p.pid)]
        # A baseline whose capacity is below the rate would only measure its own queue.
        targets += [(t, pid) for t, pid in st.targets() if best[t.name][0] > rate * 1.2]
        ttfts: dict[str, list[float]] = {t.name: [] for t, _ in targets}
        cores: dict[str, list[float]] = {t.name: [] for t, _ in targets}
        failed = dict.fromkeys(ttfts, 0)
        for _ in range(rounds):
            for t, pid in targets:
                c0, w0 = cpu_seconds(pid), time.monotonic()
                r = await open_loop(t, rate, slice_s, toks)
                cores[t.name].append((cpu_seconds(pid) - c0) / (time.monotonic() - w0))
                ttfts[t.name] += r.ttft
                failed[t.name] += r.failed
        d50, d99 = pct(ttfts["direct"], 0.5), pct(ttfts["direct"], 0.99)
        rows.append(("TTFT p50 / p99, direct (ms)", f"{ms(d50)} / {ms(d99)}"))
        for t, _pid in targets[1:]:
            x = ttfts[t.name]
            fail = f"; {failed[t.name]} failed" if failed[t.name] else ""
            rows.append(
                (
                    f"added TTFT p50 / p99, {t.name} (ms)",
                    f"{ms(pct(x, 0.5) - d50)} / {ms(pct(x, 0.99) - d99)} (TTFT {ms(pct(x, 0.5))} / "
                    f"{ms(pct(x, 0.99))}; core use {statistics.median(cores[t.name]):.2f}{fail})",
                )
            )
        skipped = [t.name for t, _ in st.targets() if t.name not in ttfts]
        if skipped:
            rows.append(
                (
                    "added TTFT, " + ", ".join(skipped),
                    f"not measured: saturates below {rate * 1.2:,.0f} req/s",
                )
            )
    finally:
        st.stop()

    # 3. Added per-token latency: tokens written 5 ms apart, each stamped with its send time.
    st = Stage(tmp, 5)
    try:
        trate = a.token_rate
        print(f"per-token latency: ITL 5 ms, open loop {trate:.0f} req/s, interleaved slices", flush=True)
        targets = [(Target("direct", st.upstream, direct=True), 0), *st.targets()]
        lat: dict[str, list[float]] = {t.name: [] for t, _ in targets}
        for _ in range(max(int(secs * a.repeats / a.slice_seconds), 1)):
            for t, _pid in targets:
                lat[t.name] += (await open_loop(t, trate, a.slice_seconds, toks, per_token=True)).token_lat
        d50, d99 = pct(lat["direct"], 0.5), pct(lat["direct"], 0.99)
        rows.append(("per-token latency p50 / p99, direct (ms)", f"{d50 * 1e3:.3f} / {d99 * 1e3:.3f}"))
        for t, _pid in targets[1:]:
            x = lat[t.name]
            rows.append(
                (
                    f"added per-token latency p50 / p99, {t.name} (ms)",
                    f"{(pct(x, 0.5) - d50) * 1e3:.3f} / {(pct(x, 0.99) - d99) * 1e3:.3f}",
                )
            )
    finally:
        st.stop()

    # 4. RSS with N concurrent streams (16 tokens 200 ms apart: each stream stays open ~3.2 s).
    st = Stage(tmp, 200)
    try:
        print(f"RSS: {a.streams} concurrent streams", flush=True)
        for t, pid in st.targets():
            base, peak, ok = await rss_at(t, pid, a.streams, 16)
            rows.append(
                (
                    f"RSS idle -> peak at {a.streams:,} streams, {t.name} (MB)",
                    f"{base:.0f} -> {peak:.0f} ({ok:,} of {a.streams:,} ok)",
                )
            )
    finally:
        st.stop()
    return rows


async def main(a: argparse.Namespace) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="router-bench-"))
    os.sched_setaffinity(0, OTHER_CORES)
    runs: list[dict[str, str]] = []
    loads: list[str] = []
    for i in range(a.runs):
        print(f"run {i + 1} of {a.runs}", flush=True)
        before = os.getloadavg()[0]
        runs.append(dict(await measure(a, tmp)))
        loads.append(f"{before:.1f} -> {os.getloadavg()[0]:.1f}")
    names = list(runs[0])
    header = ["measure", *(f"run {i + 1}" for i in range(a.runs))]
    body = table(header, [[k, *(r.get(k, "-") for r in runs)] for k in names])
    note = (
        f"Router (or relay) pinned to core {sorted(ROUTER_CORE)}, load generator and upstreams on "
        f"{sorted(OTHER_CORES)}; closed loop {a.concurrency} concurrent, {a.seconds:g} s x {a.repeats} "
        f"interleaved, best kept; load average during each run (1 min): {'; '.join(loads)}."
    )
    print()
    print(body)
    print(note)
    record("router", "Router (`bench/router/run.py`, CPU box)", body, notes=note)


def cli() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--token-rate", type=float, default=20.0)
    p.add_argument("--streams", type=int, default=1000)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--slice-seconds", type=float, default=1.0)
    p.add_argument("--runs", type=int, default=2, help="whole runs, one table column each")
    a = p.parse_args()
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    asyncio.run(main(a))


if __name__ == "__main__":
    cli()
