"""The handoff gap on the tiny CPU stack, per stage, with and without layer-wise overlap in one run.

    .venv/bin/python -m bench.gap.run [--lengths 16,64,256,1024,max] [--rounds 6] [--no-projection]

THE GAP: from the moment the prefill's answer (the first token) is available to the router, to the
moment the decode node's first decoded token is. The bench starts `examples/tiny-cpu.yaml` with
`tilert-pd local` (the same rendered commands as pods get), reshaped to two prefills, one TileRT node
(reference engine) and no native pool: prefill-0 with the connector's `tilert_layerwise` false, prefill-1
with it true (when the connector knows the key; otherwise both run today's path and the output says so).
It then drives the prefill and the node directly, as the router does (tilert_serve/router/tilert_path.py:
admit on the node, prefill with kv_transfer_params {tilert_host, tilert_ctrl_port, tilert_ticket},
/v1/generate with the ticket and the first token), with both configurations alternating request by
request so that load from other work on the box falls on both alike.

Per stage, from three sources:
- client timestamps: gap = first decoded token's SSE line read - prefill answer read (median, p90);
- the node's /v1/generate done event `timings` (per request): wire_wait (accept of the sender's
  request to its done), digest check, conversion, injection, and decode_ms, which with max_tokens=1
  is the first decode step alone; any other numeric keys the node adds are reported as they come;
- the prefill's connector counters on its /metrics (vllm:tilert_extract_seconds,
  vllm:tilert_handoff_seconds = handshake + writes + done/ack, bytes): per-request means over each
  batch (the counters are cumulative, reported through vLLM's stats on the next engine step, so the
  bench runs one request without a ticket to flush them).

Extraction runs inside the prefill's step (wait_for_save), before the answer leaves the prefill: it
delays the first token and is not inside the client-measured gap; the "forward end -> first decoded
token" column adds it back. The sender's handshake and writes start right after the step, so part of
the wire overlaps the answer's way back to the router; "after answer" = gap - (digest + convert +
inject + first step) is what of the wire and of the /v1/generate call remains on the critical path.
"""

from __future__ import annotations

import argparse
import http.client
import json
import math
import os
import random
import statistics
import subprocess
import tempfile
import time
import urllib.parse
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from prometheus_client.parser import text_string_to_metric_families

from bench.common import record, table

SPEC = "examples/tiny-cpu.yaml"
KEY = "tilert_layerwise"
#: (name, tilert_layerwise) of the two prefills, in the order they are started.
CONFIGS = (("serial", False), ("layerwise", True))
#: Node timings keys in stage order; others the node reports are appended after these.
NODE_KEYS = ("wire_wait_ms", "digest_ms", "convert_ms", "inject_ms", "decode_ms")
NOT_STAGES = {"tpot_ms", "mtp_acceptance"}


# -- the stack ---------------------------------------------------------------------------------------


def layerwise_known() -> bool:
    """Whether the connector's config accepts `tilert_layerwise` (it refuses unknown keys)."""
    from tilert_serve.pd_vllm.config import ConnectorConfig

    return KEY in {f.alias or name for name, f in ConnectorConfig.model_fields.items()}


def with_connector_key(argv: list[str], key: str, value: object) -> list[str]:
    """`argv` with `key` set in the TileRTConnector's kv_connector_extra_config (MultiConnector or not)."""
    i = argv.index("--kv-transfer-config")
    cfg = json.loads(argv[i + 1])
    conns = cfg.get("kv_connector_extra_config", {}).get("connectors") or [cfg]
    found = [c for c in conns if c.get("kv_connector") == "TileRTConnector"]
    if not found:
        raise ValueError("no TileRTConnector in the rendered --kv-transfer-config")
    for c in found:
        c.setdefault("kv_connector_extra_config", {})[key] = value
    return [*argv[: i + 1], json.dumps(cfg, separators=(",", ":")), *argv[i + 2 :]]


@dataclass
class Stack:
    prefills: dict[str, str]
    node: str
    node_token: str
    model: str
    vocab: int
    max_seq_len: int
    layerwise: bool


@contextmanager
def stack(home: Path, configs: list[tuple[str, bool]]) -> Iterator[Stack]:
    """Start the reshaped tiny stack from its rendered plan (tilert_serve.local.plan, what `tilert-pd local`
    runs) without the router, which this bench stands in for; stop it at the end."""
    from tilert_operator import constants, validation
    from tilert_serve.local import plan as planmod
    from tilert_serve.local import runner

    doc = yaml.safe_load(Path(SPEC).read_text())
    name = str(doc["metadata"]["name"]) + "-gap"
    raw = doc["spec"]
    raw["prefill"]["replicas"] = len(configs)
    raw["decode"]["tilert"]["replicas"] = 1
    raw["decode"]["native"]["replicas"] = 0
    spec, problems = validation.validate(raw, name)
    if problems or spec is None:
        raise SystemExit(f"the reshaped {SPEC} is not valid: {problems}")
    known = layerwise_known()
    state_dir = (home / name).resolve()
    state_dir.mkdir(parents=True)
    secret, token = runner.write_secrets(state_dir)
    model_dir = home / "tiny"
    ports = planmod.Ports(
        router=runner.free_port(),
        prefill=[runner.free_port() for _ in configs],
        native=[],
        tilert=[(runner.free_port(), runner.free_port())],
    )
    p = planmod.plan(
        spec,
        ports=ports,
        model_dir=str(model_dir),
        secret_file=str(secret),
        router_config_file=str(state_dir / "router.yaml"),
        api_token_file=str(token),
    )
    if p.tiny_model is not None:
        subprocess.run(p.tiny_model, check=True, stdout=subprocess.DEVNULL)
    comps = []
    for c in p.components:
        if c.kind == constants.PREFILL:
            argv = c.argv
            if known:
                argv = with_connector_key(argv, KEY, configs[int(c.name.rsplit("-", 1)[1])][1])
            # Each vLLM on one host needs its own NIXL side-channel port (as `tilert-pd local` gives it).
            env = {**c.env, "VLLM_NIXL_SIDE_CHANNEL_PORT": str(runner.free_port())}
            comps.append(planmod.Component(c.name, c.kind, argv, env, c.url, c.ready_url, c.ctrl_port))
        elif c.kind == constants.TILERT:
            comps.append(c)
    started: list[Any] = []
    try:
        for c in comps:
            print(f"  start  {c.name:<10} {c.url}", flush=True)
            started.append(runner.start(c, state_dir))
        runner.wait_ready(started, 900.0, lambda m: print(m, flush=True))
        prefills = [c for c in comps if c.kind == constants.PREFILL]
        node = next(c for c in comps if c.kind == constants.TILERT)
        hf = json.loads((model_dir / "config.json").read_text())
        yield Stack(
            {cfg: c.url for (cfg, _), c in zip(configs, prefills, strict=True)},
            node.url,
            token.read_text().strip(),
            spec.model.name,
            int(hf["vocab_size"]),
            spec.model.max_seq_len,
            known,
        )
    finally:
        runner.stop(started)


# -- HTTP, as the router speaks it (kept-alive connections) -------------------------------------------


class Conn:
    def __init__(self, url: str, headers: dict[str, str] | None = None) -> None:
        u = urllib.parse.urlsplit(url)
        self.host, self.port = u.hostname or "127.0.0.1", u.port or 80
        self.headers = {"Content-Type": "application/json", **(headers or {})}
        self.c = http.client.HTTPConnection(self.host, self.port, timeout=120)

    def _send(self, method: str, path: str, body: dict[str, Any] | None) -> http.client.HTTPResponse:
        data = json.dumps(body).encode() if body is not None else None
        for attempt in (0, 1):
            try:
                self.c.request(method, path, body=data, headers=self.headers)
                return self.c.getresponse()
            except (http.client.RemoteDisconnected, ConnectionError, http.client.CannotSendRequest):
                self.c.close()
                self.c = http.client.HTTPConnection(self.host, self.port, timeout=120)
                if attempt:
                    raise
        raise AssertionError("unreachable")

    def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        r = self._send("POST", path, body)
        raw = r.read()
        if r.status != 200:
            raise RuntimeError(f"POST {path} -> {r.status}: {raw[:300]!r}")
        out: dict[str, Any] = json.loads(raw)
        return out

    def get(self, path: str) -> str:
        r = self._send("GET", path, None)
        return r.read().decode()

    def stream(self, path: str, body: dict[str, Any]) -> list[tuple[float, dict[str, Any]]]:
        """POST and read an SSE stream to its end: (arrival time, event) per data line."""
        r = self._send("POST", path, body)
        if r.status != 200:
            raise RuntimeError(f"POST {path} -> {r.status}: {r.read()[:300]!r}")
        out = []
        while line := r.readline():
            if line.startswith(b"data: "):
                out.append((time.perf_counter(), json.loads(line[6:])))
        return out


def counters(conn: Conn) -> dict[str, float]:
    """The prefill's TileRT connector counters (summed over label values; handoffs by outcome)."""
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(conn.get("/metrics")):
        for s in fam.samples:
            if s.name.startswith("vllm:tilert_") and s.name.endswith("_total"):
                key = s.name.removeprefix("vllm:tilert_").removesuffix("_total")
                if "outcome" in s.labels:
                    key += ":" + s.labels["outcome"]
                out[key] = out.get(key, 0.0) + s.value
    return out


# -- one request ---------------------------------------------------------------------------------------


@dataclass
class Sample:
    gap_ms: float
    node: dict[str, float]
    prefill_ms: float


@dataclass
class Batch:
    samples: list[Sample] = field(default_factory=list)
    #: per-request means from the prefill's counters: extract_ms, send_ms, bytes
    prefill: dict[str, float] = field(default_factory=dict)


def one(st: Stack, prefill: Conn, node: Conn, prompt: list[int], rid: str) -> Sample:
    adm = node.post("/v1/admit", {"request_id": rid, "prompt_tokens": None, "max_tokens": 1})
    body = {
        "model": st.model,
        "prompt": prompt,
        "max_tokens": 1,
        "temperature": 0.0,
        "stream": False,
        "ignore_eos": True,
        "kv_transfer_params": {
            "tilert_host": adm["ctrl_host"],
            "tilert_ctrl_port": adm["ctrl_port"],
            "tilert_ticket": adm["ticket"],
        },
    }
    t0 = time.perf_counter()
    pj = prefill.post("/v1/completions", body)
    t_answer = time.perf_counter()
    kvp = pj.get("kv_transfer_params") or {}
    if kvp.get("tilert_status") != "queued" or not isinstance(kvp.get("tilert_first_token"), int):
        node.post("/v1/cancel", {"ticket": adm["ticket"]})
        raise RuntimeError(f"the prefill did not queue the handoff: {kvp}")
    gen = {
        "ticket": adm["ticket"],
        "request_id": rid,
        "first_token": kvp["tilert_first_token"],
        "max_tokens": 1,
        "sampling": {"temperature": 0.0, "top_p": 1.0, "top_k": -1, "seed": None},
        "stop_token_ids": [],
        "ignore_eos": True,
    }
    events = node.stream("/v1/generate", gen)
    firsts = [t for t, ev in events if ev.get("token_ids")]
    done = [ev for _t, ev in events if ev.get("done")]
    if not firsts or not done:
        raise RuntimeError(f"the node's stream had no token or no done event: {[ev for _t, ev in events]}")
    timings = {k: float(v) for k, v in (done[-1].get("timings") or {}).items() if isinstance(v, (int, float))}
    return Sample((firsts[0] - t_answer) * 1e3, timings, (t_answer - t0) * 1e3)


def flush(st: Stack, prefill: Conn) -> None:
    """One engine step without a ticket: vLLM takes the connector's stats on a step."""
    prefill.post(
        "/v1/completions", {"model": st.model, "prompt": [11, 12, 13], "max_tokens": 1, "temperature": 0.0}
    )


def prefill_means(st: Stack, prefill: Conn, before: dict[str, float], n: int) -> dict[str, float]:
    after: dict[str, float] = {}
    for _ in range(20):
        flush(st, prefill)
        after = counters(prefill)
        if after.get("handoffs:ok", 0) - before.get("handoffs:ok", 0) >= n:
            break
        time.sleep(0.2)
    got = after.get("handoffs:ok", 0) - before.get("handoffs:ok", 0)
    if got < 1:
        return {}

    def d(k: str) -> float:
        return (after.get(k, 0.0) - before.get(k, 0.0)) / got

    out = {
        "extract_ms": d("extract_seconds") * 1e3,
        "send_ms": d("handoff_seconds") * 1e3,
        "bytes": d("handoff_bytes"),
        "handoffs": got,
    }
    # Counters the connector adds later (per-layer sends, ack time, ...): per-request means too.
    known = {"extract_seconds", "handoff_seconds", "handoff_bytes"}
    for k in sorted(set(after) - known):
        if not k.startswith("handoffs"):
            out["prefill " + (k.removesuffix("_seconds") + "_ms" if k.endswith("_seconds") else k)] = d(k) * (
                1e3 if k.endswith("_seconds") else 1
            )
    return out


# -- the run -------------------------------------------------------------------------------------------


def pct(xs: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100)."""
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(q / 100 * len(s)) - 1))]


def measure(
    st: Stack, lengths: list[int], rounds: int, configs: list[str], seed: int = 0
) -> dict[tuple[int, str], Batch]:
    rng = random.Random(seed)
    token = {"Authorization": f"Bearer {st.node_token}"}
    node = Conn(st.node, token)
    pre = {c: Conn(st.prefills[c]) for c in configs}
    ids = iter(range(10**9))

    def prompt(n: int) -> list[int]:
        # Fresh random tokens every request: no prefix-cache hits, every prompt fully computed.
        return [rng.randrange(100, st.vocab - 100) for _ in range(n)]

    # Warm-up, not recorded: the first requests of a process allocate and compile what later ones reuse.
    for c in configs:
        for n in (16, lengths[-1], 16):
            one(st, pre[c], node, prompt(n), f"warm-{next(ids)}")
    out: dict[tuple[int, str], Batch] = {}
    for n in lengths:
        before = {c: counters(pre[c]) for c in configs}
        for c in configs:
            out[(n, c)] = Batch()
        for r in range(rounds):
            order = configs if r % 2 == 0 else configs[::-1]
            for c in order:
                out[(n, c)].samples.append(one(st, pre[c], node, prompt(n), f"gap-{n}-{c}-{next(ids)}"))
        for c in configs:
            out[(n, c)].prefill = prefill_means(st, pre[c], before[c], rounds)
        g = {c: statistics.median(s.gap_ms for s in out[(n, c)].samples) for c in configs}
        print(
            f"  {n:>5} tokens: gap median " + ", ".join(f"{c} {v:.2f} ms" for c, v in g.items()), flush=True
        )
    return out


def stage_keys(batches: dict[tuple[int, str], Batch]) -> tuple[list[str], list[str]]:
    """(millisecond keys of the node's timings: the stages in order, then any others the node adds, such
    as time it hid; other numeric keys: flags and counts), each as seen in some request."""
    seen = {k for b in batches.values() for s in b.samples for k in s.node} - NOT_STAGES
    ms = [k for k in NODE_KEYS if k in seen] + sorted(k for k in seen - set(NODE_KEYS) if k.endswith("_ms"))
    return ms, sorted(k for k in seen if not k.endswith("_ms"))


def summarize(b: Batch, keys: list[str]) -> dict[str, float]:
    """Medians of the per-request figures (p90 for the gap), the prefill's per-request means."""
    s = b.samples
    out = {"gap": statistics.median(x.gap_ms for x in s), "gap_p90": pct([x.gap_ms for x in s], 90)}
    for k in keys:
        out[k] = statistics.median(x.node.get(k, 0.0) for x in s)
    node_part = ("digest_ms", "convert_ms", "inject_ms", "decode_ms")
    out["after_answer"] = statistics.median(x.gap_ms - sum(x.node.get(k, 0.0) for k in node_part) for x in s)
    out["extract_ms"] = b.prefill.get("extract_ms", float("nan"))
    out["send_ms"] = b.prefill.get("send_ms", float("nan"))
    out["bytes"] = b.prefill.get("bytes", float("nan"))
    for k, v in b.prefill.items():
        if k.startswith("prefill "):
            out[k] = v
    out["critical"] = out["extract_ms"] + out["gap"]
    out["prefill_http"] = statistics.median(x.prefill_ms for x in s)
    return out


LABELS = {
    "wire_wait_ms": "wire (node: accept->done; layer-wise, the accept comes with the first layer)",
    "digest_ms": "digest check",
    "convert_ms": "conversion",
    "inject_ms": "injection",
    "decode_ms": "first decode step",
}


def tables(batches: dict[tuple[int, str], Batch], lengths: list[int], configs: list[str]) -> tuple[str, str]:
    keys, info = stage_keys(batches)
    info += sorted({k for b in batches.values() for k in b.prefill if k.startswith("prefill ")})
    header = [
        "prompt tokens",
        "config",
        "n",
        "state KB",
        "gap ms median / p90",
        "forward end -> first decoded",
        "extraction (prefill, mean)",
        "wire (prefill: handshake+writes+done/ack, mean)",
        *[LABELS.get(k, k.removesuffix("_ms")) for k in keys],
        "after answer (wire tail + generate call)",
        *info,
    ]
    rows = []
    summ = {(n, c): summarize(batches[(n, c)], keys + info) for n in lengths for c in configs}
    for n in lengths:
        for c in configs:
            s = summ[(n, c)]
            rows.append(
                [
                    str(n),
                    c,
                    str(len(batches[(n, c)].samples)),
                    f"{s['bytes'] / 1e3:.0f}",
                    f"{s['gap']:.2f} / {s['gap_p90']:.2f}",
                    f"{s['critical']:.2f}",
                    f"{s['extract_ms']:.2f}",
                    f"{s['send_ms']:.2f}",
                    *[f"{s[k]:.2f}" for k in keys],
                    f"{s['after_answer']:.2f}",
                    *[f"{s[k]:.3g}" for k in info],
                ]
            )
    main = table(header, rows)
    if len(configs) < 2:
        return main, ""
    a, b = configs[0], configs[1]
    rkeys = ["gap", "critical", "extract_ms", "send_ms", *keys, "after_answer"]
    rheader = [
        "prompt tokens",
        "gap",
        "forward end -> first decoded",
        "extraction",
        "wire (prefill)",
        *[LABELS.get(k, k.removesuffix("_ms")) for k in keys],
        "after answer",
    ]

    def ratio(x: float, y: float) -> str:
        return f"{y / x:.2f}x" if x > 0 else "-"

    ratios = table(
        rheader, [[str(n), *[ratio(summ[(n, a)][k], summ[(n, b)][k]) for k in rkeys]] for n in lengths]
    )
    return main, ratios


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--lengths",
        default="16,64,256,1024,max",
        help="prompt lengths; 'max' = the stack's max_seq_len - 2 (one prefill token, one decoded)",
    )
    ap.add_argument("--rounds", type=int, default=6, help="requests per prompt length and configuration")
    ap.add_argument(
        "--configs", default="serial,layerwise", help="which prefills to start: serial, layerwise"
    )
    ap.add_argument("--no-projection", action="store_true", help="skip the GLM-5 projection")
    ap.add_argument("--no-record", action="store_true", help="print only; leave RESULTS.md alone")
    args = ap.parse_args()
    wanted = args.configs.split(",")
    configs = [c for c in CONFIGS if c[0] in wanted]
    home = Path(tempfile.mkdtemp(prefix="bench-gap-"))
    print(f"starting the stack under {home} (prefills: {', '.join(c for c, _ in configs)}) ...", flush=True)
    with stack(home, configs) as st:
        lengths = [st.max_seq_len - 2 if x == "max" else int(x) for x in args.lengths.split(",")]
        names = [c for c, _ in configs]
        load0 = os.getloadavg()[0]
        batches = measure(st, lengths, args.rounds, names)
        load = os.getloadavg()[0]
    main_t, ratio_t = tables(batches, lengths, names)
    how = (
        f"`{KEY}` set in each prefill's connector config (false / true)"
        if st.layerwise
        else f"the connector does not know `{KEY}` yet (tilert_serve/pd_vllm/config.py): BOTH prefills run "
        "today's serial path, so the two configurations measure the same thing and their ratio is noise"
    )
    notes = (
        f"Tiny CPU stack ({SPEC}, reshaped: {len(names)} prefill(s), 1 TileRT node on the reference engine, "
        f"float32, Mooncake over TCP on loopback); {args.rounds} requests per length and configuration, the "
        f"configurations alternating request by request; load average (1 min) {load0:.1f} at the start of the requests, {load:.1f} at the end. Layer-wise: {how}. "
        "Gap = the node's first decoded token read by the client - the prefill's answer read (median / p90). "
        "Node stages are medians of the done event's timings (decode_ms with max_tokens=1 = the first decode "
        "step); extraction and the sender's wire time are per-request means of the prefill's "
        "vllm:tilert_* counters. Extraction runs in the prefill's step, before its answer: forward end -> "
        "first decoded = extraction + gap. After answer = gap - (digest + conversion + injection + first "
        "step): the wire's tail past the answer plus the /v1/generate call."
    )
    body = main_t + (
        "\n\nRatio layerwise / serial (medians; < 1 = overlap shortens it):\n\n" + ratio_t if ratio_t else ""
    )
    print()
    print(body)
    print()
    print(notes)
    if not args.no_record:
        record("gap-cpu", "The handoff gap (`bench/gap/run.py`, CPU box)", body, notes=notes)
    if not args.no_projection:
        from bench.gap import projection

        projection.main(["--no-record"] if args.no_record else [])


if __name__ == "__main__":
    main()
