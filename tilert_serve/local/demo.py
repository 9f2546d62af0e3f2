"""`make demo`: the whole PD stack on this machine's CPU, requests through both decode paths.

Starts examples/tiny-cpu.yaml with `tilert-pd local up` (router, vLLM prefill with TileRTConnector,
two TileRT decode nodes on the reference engine, a native vLLM decode), streams a few completions
and a chat turn through the router with `x-pd-route: tilert` and `x-pd-route: native`, prints each
output with its timings (TTFT and TPOT as the client sees them; handoff time and MTP acceptance as
the decode node measured them), and stops the stack. `--json` prints the same as JSON lines.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from tilert_operator import constants
from tilert_serve.local import cli as local_cli

PROMPTS = [
    "The quick brown fox",
    "Once upon a time, in a data center far away,",
    "Prefill is compute-bound; decode is bound by memory bandwidth, so",
]
# Most clients speak chat: one chat request per route (the tiny model's tokenizer has a template).
CHAT = "What does a decode node do?"
ROUTE_HEADER = "x-pd-route"
# The decode nodes' samples a request's handoff time, MTP acceptance and TPOT are read from.
NODE_SAMPLES = (
    "tilert_decode_handoff_seconds_sum",
    "tilert_decode_handoff_seconds_count",
    "tilert_decode_mtp_drafted_tokens_total",
    "tilert_decode_mtp_accepted_tokens_total",
    "tilert_decode_tpot_seconds_sum",
    "tilert_decode_tpot_seconds_count",
)


def _metrics(urls: list[str]) -> dict[str, float]:
    """Sum of the decode nodes' handoff and MTP counters (to attribute a request's share)."""
    total: dict[str, float] = {}
    for url in urls:
        with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
            for family in text_string_to_metric_families(r.read().decode()):
                for sample in family.samples:
                    if sample.name in NODE_SAMPLES:
                        total[sample.name] = total.get(sample.name, 0.0) + sample.value
    return total


def complete(
    router: str, model: str, prompt: str, route: str, max_tokens: int, chat: bool = False
) -> dict[str, Any]:
    """One streamed request through the router: a completion, or a chat turn with `prompt` as the
    user's message."""
    body: dict[str, Any] = {"model": model, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    endpoint = "chat/completions" if chat else "completions"
    req = urllib.request.Request(
        f"{router}/v1/{endpoint}",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", ROUTE_HEADER: route},
    )
    t0 = time.perf_counter()
    arrivals: list[float] = []
    text = ""
    with urllib.request.urlopen(req, timeout=300) as r:
        request_id = r.headers.get("x-request-id", "")
        # The path the router took; it differs from the one asked when that pool could not serve.
        served_by = r.headers.get("x-pd-route", "")
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"{route} request failed mid-stream: {chunk['error']}")
            choice = chunk["choices"][0] if chunk.get("choices") else {}
            delta = ((choice.get("delta") or {}).get("content") if chat else choice.get("text")) or ""
            if delta:
                arrivals.append(time.perf_counter() - t0)
                text += delta
    total = time.perf_counter() - t0
    ttft = arrivals[0] if arrivals else total
    tpot = (arrivals[-1] - arrivals[0]) / (len(arrivals) - 1) if len(arrivals) > 1 else 0.0
    return {
        "route": route,
        "served_by": served_by,
        "api": "chat" if chat else "completions",
        "prompt": prompt,
        "text": text,
        "chunks": len(arrivals),
        "ttft_ms": ttft * 1e3,
        "tpot_ms": tpot * 1e3,
        "total_ms": total * 1e3,
        "request_id": request_id,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="make demo", description=__doc__.splitlines()[0])
    ap.add_argument("-f", "--filename", default="examples/tiny-cpu.yaml")
    ap.add_argument("--json", action="store_true", help="print JSON lines instead of a table")
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--home", type=Path, default=local_cli.DEFAULT_HOME)
    ap.add_argument("--router-port", type=int, default=8000)
    ap.add_argument("--keep", action="store_true", help="leave the stack running afterwards")
    ap.add_argument(
        "--runtime",
        choices=("process", "docker"),
        default="process",
        help="docker: the pods of the rendered manifests as containers of the images (`make images`)",
    )
    args = ap.parse_args(argv)
    out = (lambda obj: print(json.dumps(obj), flush=True)) if args.json else None
    up_args = argparse.Namespace(
        action="up",
        filename=args.filename,
        router_port=args.router_port,
        timeout=900.0,
        home=args.home,
        runtime=args.runtime,
    )
    if local_cli.run(up_args) != 0:
        return 1
    try:
        name, spec = local_cli.load_spec(args.filename)
        router, nodes = local_cli.endpoints((args.home / name).resolve(), constants.TILERT)
        results = []
        for route in ("tilert", "native"):
            for prompt, chat in [*((p, False) for p in PROMPTS), (CHAT, True)]:
                before = _metrics(nodes)
                res = complete(router, spec.model.name, prompt, route, args.max_tokens, chat)
                after = _metrics(nodes)
                d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
                if res["served_by"] == "tilert" and d.get("tilert_decode_handoff_seconds_count"):
                    res["handoff_ms"] = (
                        1e3
                        * d["tilert_decode_handoff_seconds_sum"]
                        / d["tilert_decode_handoff_seconds_count"]
                    )
                    drafted = d.get("tilert_decode_mtp_drafted_tokens_total", 0.0)
                    res["mtp_acceptance"] = (
                        d.get("tilert_decode_mtp_accepted_tokens_total", 0.0) / drafted if drafted else 0.0
                    )
                    if d.get("tilert_decode_tpot_seconds_count"):
                        res["node_tpot_ms"] = (
                            1e3 * d["tilert_decode_tpot_seconds_sum"] / d["tilert_decode_tpot_seconds_count"]
                        )
                results.append(res)
                if out:
                    out(res)
        if not out:
            _print_table(results, name)
        else:
            out({"summary": True, "requests": len(results), "cluster": name})
    finally:
        if not args.keep:
            local_cli.run(argparse.Namespace(action="down", home=args.home))
    return 0


def _print_table(results: list[dict[str, Any]], cluster: str) -> None:
    print(
        f"\n{cluster}: {len(results)} requests through the router (greedy, tiny random model: the text is "
        "noise, the paths are real)\n"
    )
    print(
        f"{'path':<7} {'api':<5} {'TTFT ms':>8} {'TPOT ms':>8} {'handoff ms':>10} {'MTP acc':>7}  prompt -> output"
    )
    for r in results:
        path = r["served_by"] if r["served_by"] == r["route"] else f"{r['route']}->{r['served_by']}"
        handoff = f"{r['handoff_ms']:.1f}" if "handoff_ms" in r else "-"
        mtp = f"{r['mtp_acceptance']:.2f}" if "mtp_acceptance" in r else "-"
        api = "chat" if r["api"] == "chat" else "text"
        print(
            f"{path:<7} {api:<5} {r['ttft_ms']:>8.1f} {r['tpot_ms']:>8.1f} {handoff:>10} {mtp:>7}  "
            f"{r['prompt'][:28]!r} -> {r['text'][:40]!r}"
        )
    print(
        "\nTTFT/TPOT: seen by the client (router in front). handoff: prefill -> decode node state transfer "
        "(Mooncake over TCP). MTP acc: draft tokens the decode node accepted."
    )


if __name__ == "__main__":
    sys.exit(main())
