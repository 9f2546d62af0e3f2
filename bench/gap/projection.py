"""The handoff gap projected to GLM-5 on 8xB200 with RDMA, without and with layer-wise overlap.

    .venv/bin/python -m bench.gap.projection [--prefill-tok-s 30000] [--nic-gbit 400] [--no-record]

Pure model (no I/O but `measured_from_results`, which parses bench/RESULTS.md at run time, and `main`).
Every figure is either MEASURED (kernel times on one H200: extraction, conversion and the digest,
parsed from the `extract`, `convert` and `digest-gpu` sections of RESULTS.md (`digest-cuda`, the
pinned-host hashing, where no `digest-gpu` section exists), which their benches rewrite) or ASSUMED (a `Assumptions` field, printed with the tables). State sizes
come from the layout registry (tilert_serve.layouts: Placement.total_nbytes, Plane.nbytes), not from
constants here.

The model, from the end of the prefill's forward (the step that samples the first token, MTP drafter
included) to the node's first decoded token:

- 8 TP ranks send round-robin by layer (layouts.senders_layers), each over its own NIC; the node's
  receive buffer is sharded the same way over its 8 GPUs, each converting its shard. A stage's time is
  that of the busiest rank (the one with ceil(79/8) = 10 layers).
- A kernel's time on B200 = bytes x (ms per byte measured on the H200 at the nearest measured size,
  interpolated in log(bytes) and clamped at the ends) / (B200 HBM bandwidth / H200 HBM bandwidth).
  Per-rank sizes below the smallest measured one take its rate (optimistic: launch overheads grow in
  weight), plus a fixed per-launch floor.
- Wire = handshake (a few control-channel round trips) + the busiest rank's bytes / one NIC's goodput
  + done/ack (one round trip).
- Digest (on by default): the sender hashes its staging before the write and the node checks each rank
  before conversion, each on its own GPU (handoff/blake3_gpu.py; bound by 32-bit integer issue, not
  HBM: scaled by `int_ratio`, not `hbm_ratio`), or through pinned host copies when only the host
  path was measured (PCIe-bound; same rate assumed on B200 hosts).
  The stage also holds the two device copies that keep the check meaningful, digests on or off: the
  prefill gathers into private memory and copies it into registered staging, the node copies what
  landed out of its registered receive buffer into a snapshot; each at the B200's copy bandwidth.
- Injection: one device copy of the converted bf16 tensors per GPU (not measured anywhere; assumed at
  the B200's copy bandwidth). First step: TileRT's measured TPOT without MTP (upstream's chart, 8xB200),
  interpolated in log(context) between 1K and 192K.
- Serial (today): extraction + wire + digest + conversion + injection + first step.
- Layer-wise overlap: main layer L is extracted, written and converted while layers > L compute. It
  hides only if each rank keeps up: a rank gets a layer every 8 forward layers, so the per-layer
  pipeline stage (max of extract, wire, convert for one layer) must not exceed 8 x the forward's time per
  layer; the forward's time per layer comes from an ASSUMED prefill throughput. What remains after the
  forward's end: any backlog (when the transfer is the bottleneck), the last main layer's and the MTP
  layer's extract + wire + convert (the MTP layer's KV exists only after the drafter; counted one after
  the other, conservatively), done/ack, the digest of those last layers (digests per layer, pipelined
  like the bytes: an assumption about the overlap's design; the "digest at end" column keeps today's
  whole-state digest after the last byte), injection of the whole state (today's engine API takes one
  state), and the first step.
"""

from __future__ import annotations

import argparse
import itertools
import math
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

from bench.common import RESULTS, record, table
from tilert_serve import layouts
from tilert_serve.layouts import Layout, Placement

#: Prompt lengths projected (tokens).
LENGTHS = (1024, 2048, 8192, 32768, 131072)


@dataclass(frozen=True)
class Assumptions:
    """Everything not measured in this project. Defaults and where they come from are in SOURCES."""

    ranks: int = 8
    #: B200 / H200 HBM bandwidth (datasheets: 8.0 TB/s vs 4.8 TB/s); kernels keep the H200's % of copy.
    hbm_ratio: float = 8.0 / 4.8
    #: per NIC: ConnectX-7 400 Gb/s, one per GPU.
    nic_gbit: float = 400.0
    #: RDMA WRITE goodput / line rate (vLLM 1P1D over Mooncake on 8 ConnectX-7: 71 %; Mooncake: 47.5 % of 8x400G).
    nic_efficiency: float = 0.7
    #: control-channel round trip between prefill and decode hosts (TCP in one data centre), ms.
    rtt_ms: float = 0.05
    #: round trips before the first write: TCP connect, hello, request/accept.
    handshake_rtts: float = 2.5
    #: fixed cost per kernel launch sequence (extract, convert, inject) on a rank, ms.
    launch_floor_ms: float = 0.01
    #: prefill throughput of one 8xB200 instance on GLM-5, tokens/s (sets the forward's time per layer).
    prefill_tok_s: float = 30000.0
    #: TileRT decode TPOT without MTP at (context tokens, ms), 8xB200
    #: (docs/reference/tilert-api.md, "Published decode speed").
    tpot_points: tuple[tuple[int, float], ...] = ((1024, 1000 / 301), (196608, 1000 / 169))
    #: the converted state's element size on the node (bf16).
    engine_itemsize: int = 2
    #: digests on (the default of tilert_handoff_digest / --handoff-digest).
    digest: bool = True
    #: tokens a chunked prefill computes per step (vLLM's max_num_batched_tokens).
    chunk_tokens: int = 16384
    #: B200 / H200 32-bit integer throughput, which bounds the GPU digest.
    int_ratio: float = 1.0


SOURCES = {
    "hbm_ratio": "NVIDIA datasheets, B200 8 TB/s vs H200 4.8 TB/s HBM3e",
    "nic_gbit": "8x ConnectX-7 400 Gb/s, one per GPU (docs/reference/transfer-engines.md, Production RDMA)",
    "nic_efficiency": (
        "vLLM 1P1D peak over Mooncake's connector 71 % of 8 ConnectX-7; Mooncake 47.5 % of 8x400G "
        "(docs/reference/transfer-engines.md, Production RDMA)"
    ),
    "rtt_ms": "assumed intra-DC TCP round trip",
    "prefill_tok_s": "assumed; not measured here (no B200, no GLM-5 weights)",
    "tpot_points": (
        "TileRT v0.1.5 chart, GLM-5.1-FP8 on 8xB200, no MTP: 301 UTPS at 1K, 169 at 192K "
        "(docs/reference/tilert-api.md, Published decode speed)"
    ),
    "launch_floor_ms": "assumed",
    "chunk_tokens": (
        "vLLM 0.32's default max_num_batched_tokens for its API server on GPUs of >= 160 GB (B200; "
        "engine/arg_utils.py), one prompt alone in its steps"
    ),
    "digest": (
        "the 8 ranks' digests each at the single-H200 rate, side by side: each on its own GPU with the GPU "
        "digest (nothing shared); with the host path, optimistic (8 at once ask ~350 GB/s of host copies and "
        "BLAKE3 of each host)"
    ),
    "int_ratio": (
        "assumed equal: B200 has 148 SMs to the H200's 132 at similar clocks, but its 32-bit integer rate "
        "per SM is not in the datasheets; the GPU digest is bound by it, not by HBM"
    ),
    "ranks": "TP=8 prefill, each rank sends its layers over its own NIC (layouts.senders_layers); the node's "
    "receive buffer sharded the same way over its 8 GPUs",
}


@dataclass(frozen=True)
class Measured:
    """H200 kernel times for the whole GLM-5 state: tokens -> ms (a caller's view: the call timed)."""

    extract: dict[int, float]
    convert: dict[int, float]
    digest: dict[int, float]
    #: the H200's device copy bandwidth (read + write, GB/s) measured in the same runs.
    copy_gbs: float
    #: where each came from (section, date, commit line), for the output.
    provenance: dict[str, str] = field(default_factory=dict)
    #: ms per ONE layer's call at that many tokens, where the benches measured the per-layer variant the
    #: overlap uses (empty: the model splits the whole-state time evenly over the layers instead).
    extract_layer: dict[int, float] = field(default_factory=dict)
    convert_layer: dict[int, float] = field(default_factory=dict)
    #: the digest of one layer (a LayersDone's) where measured, ms per call at that many tokens.
    digest_layer: dict[int, float] = field(default_factory=dict)
    #: where `digest` ran: "gpu" (in place, handoff/blake3_gpu.py) or "host" (pinned copies + host BLAKE3).
    digest_on: str = "host"


# -- sizes: the layout registry is the one source ----------------------------------------------------


def glm5() -> Layout:
    return layouts.get("glm5", "fp8_ds_mla")


def state_bytes(layout: Layout, tokens: int) -> int:
    return Placement(layout, max_tokens=tokens).total_nbytes()


def layer_bytes(layout: Layout, tokens: int) -> int:
    return sum(p.nbytes(tokens) for p in layout.planes)


def converted_layer_bytes(layout: Layout, tokens: int, itemsize: int) -> int:
    """kv [n, kv_lora_rank], pe [n, rope_dim], ki [n, index_head_dim] in the engine's dtype."""
    return tokens * (layout.kv_lora_rank + layout.rope_dim + layout.index_head_dim) * itemsize


def busiest_rank_layers(layout: Layout, ranks: int) -> int:
    return max(len(layouts.senders_layers(layout, r, ranks)) for r in range(ranks))


# -- scaling measured kernel times -------------------------------------------------------------------


def ms_per_byte(points: dict[int, float], layout: Layout, nbytes: float, *, per_layer: bool = False) -> float:
    """ms per byte at `nbytes`, from the H200 points (tokens -> ms for the whole state, or for one layer
    with `per_layer`), interpolated in log(bytes), clamped to the measured range."""
    size = (lambda n: layer_bytes(layout, n)) if per_layer else (lambda n: state_bytes(layout, n))
    xs = sorted((size(n), ms / size(n)) for n, ms in points.items())
    if not xs:
        raise ValueError("no measured points")
    if nbytes <= xs[0][0]:
        return xs[0][1]
    if nbytes >= xs[-1][0]:
        return xs[-1][1]
    for (b0, r0), (b1, r1) in itertools.pairwise(xs):
        if b0 <= nbytes <= b1:
            f = (math.log(nbytes) - math.log(b0)) / (math.log(b1) - math.log(b0))
            return r0 + f * (r1 - r0)
    raise AssertionError("unreachable")


def kernel_ms(
    points: dict[int, float], layout: Layout, nbytes: float, speedup: float, floor_ms: float
) -> float:
    """A kernel measured on the H200 (`points`) run over `nbytes` on a GPU `speedup` x faster."""
    if nbytes <= 0:
        return 0.0
    return floor_ms + nbytes * ms_per_byte(points, layout, nbytes) / speedup


def nic_gb_s(a: Assumptions) -> float:
    return a.nic_gbit / 8 * a.nic_efficiency


def wire_ms(nbytes: float, a: Assumptions) -> float:
    """Bytes over one NIC (GB = 1e9 B), no round trips."""
    return nbytes / (nic_gb_s(a) * 1e9) * 1e3


def first_step_ms(tokens: int, a: Assumptions) -> float:
    (x0, y0), (x1, y1) = a.tpot_points[0], a.tpot_points[-1]
    t = min(max(tokens, x0), x1)
    f = (math.log(t) - math.log(x0)) / (math.log(x1) - math.log(x0))
    return y0 + f * (y1 - y0)


# -- the two paths -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Serial:
    tokens: int
    state_gb: float
    extract: float
    wire: float
    digest: float
    convert: float
    inject: float
    first_step: float

    @property
    def total(self) -> float:
        return self.extract + self.wire + self.digest + self.convert + self.inject + self.first_step


@dataclass(frozen=True)
class Overlap:
    tokens: int
    #: forward time of one main layer (from the assumed prefill throughput), ms
    forward_per_layer: float
    #: the slowest per-layer pipeline stage (extract, wire or convert of one layer, digests included), ms
    stage_per_layer: float
    #: prefill throughput above which the transfer can no longer keep up with the forward, tokens/s
    break_even_tok_s: float
    #: extract / wire / convert still running after the forward's end (the last layers, the MTP layer,
    #: and any backlog when the transfer is the bottleneck), ms
    in_flight: float
    #: what of `in_flight` is backlog: the pipeline's finish beyond what an infinitely fast transfer of the
    #: last main layer and the MTP layer would need, ms
    backlog: float
    done_ack: float
    #: digest left after the last byte (0 when digests are per layer: then they are in `in_flight`), ms
    digest: float
    inject: float
    first_step: float

    @property
    def transfer_bound(self) -> bool:
        return self.stage_per_layer > 0 and self.backlog > 1e-9

    @property
    def total(self) -> float:
        return self.in_flight + self.done_ack + self.digest + self.inject + self.first_step


def _rank_costs(layout: Layout, m: Measured, a: Assumptions, tokens: int, layers: int) -> dict[str, float]:
    """extract / wire / digest (sender + node) / convert / inject for `layers` layers on one rank."""
    nbytes = layers * layer_bytes(layout, tokens)
    out_bytes = layers * converted_layer_bytes(layout, tokens, a.engine_itemsize)
    b200_copy = m.copy_gbs * a.hbm_ratio  # read + write GB/s
    speedup = a.int_ratio if m.digest_on == "gpu" else 1.0  # the host path is PCIe-bound on either GPU
    digest_one = kernel_ms(m.digest, layout, nbytes, speedup, 0.0) if a.digest else 0.0
    copy_one = 2 * nbytes / (b200_copy * 1e9) * 1e3  # one side's copy between private and registered memory
    return {
        "extract": kernel_ms(m.extract, layout, nbytes, a.hbm_ratio, a.launch_floor_ms),
        "wire": wire_ms(nbytes, a),
        "digest": 2 * (digest_one + copy_one),
        "convert": kernel_ms(m.convert, layout, nbytes, a.hbm_ratio, a.launch_floor_ms),
        "inject": a.launch_floor_ms + 2 * out_bytes / (b200_copy * 1e9) * 1e3,
    }


def serial(layout: Layout, m: Measured, a: Assumptions, tokens: int) -> Serial:
    c = _rank_costs(layout, m, a, tokens, busiest_rank_layers(layout, a.ranks))
    wire = (a.handshake_rtts + 1) * a.rtt_ms + c["wire"]
    return Serial(
        tokens,
        state_bytes(layout, tokens) / 1e9,
        c["extract"],
        wire,
        c["digest"],
        c["convert"],
        c["inject"],
        first_step_ms(tokens, a),
    )


def _pipeline(avail: list[float], e: float, w: float, c: float, wire_from: float) -> float:
    """Finish time of one rank's layers through extract -> wire -> convert, each stage one at a time,
    layers in order, each starting as early as it can (layer i's state exists at avail[i])."""
    e_free = w_free = c_free = 0.0
    for t in avail:
        e_free = max(t, e_free) + e
        w_free = max(e_free, w_free, wire_from) + w
        c_free = max(w_free, c_free) + c
    return c_free


def overlap(
    layout: Layout,
    m: Measured,
    a: Assumptions,
    tokens: int,
    *,
    digest_per_layer: bool = True,
    step_tokens: int | None = None,
    moved_tokens: int | None = None,
    backlog_ms: float | None = None,
) -> Overlap:
    """Layer-wise overlap: the forward computes main layer i during [i*f, (i+1)*f], the MTP drafter one
    more layer's time after the last; the forward ends at F = (main + 1) * f. Each rank pipelines its
    layers (senders_layers) through extract, wire (after the handshake, started with the forward) and
    convert. Per-layer extract and convert costs are the per-layer calls measured on the H200 where the
    benches measured them (`Measured.extract_layer` / `convert_layer`), else the rank's whole-state costs
    split evenly over its layers; with the even split the same work is done as in the serial path, so the
    overlap can only be shorter; measured per-layer calls carry their own launch overhead, and with a
    forward too short to hide it the overlap can lose (then it should be off). Digests per layer ride in
    wire (sender) and convert (node); with `digest_per_layer` off the whole-state digest runs after the
    last byte, as today.

    A chunked prefill's last step (`chunked`): the forward computes only `step_tokens` tokens (f shrinks
    with them), `moved_tokens` of each layer are extracted and written in it (every token when the
    handoff is layer-wise in the last step only, the last chunk's when it is chunk-wise), each layer is
    still hashed and converted whole, and with `backlog_ms` (chunk-wise: connected in an earlier step)
    the wire is free only that long after the step starts (what earlier chunks left), not after a
    handshake."""
    n_busy = busiest_rank_layers(layout, a.ranks)
    moved = tokens if moved_tokens is None else moved_tokens
    whole = _rank_costs(layout, m, a, tokens, n_busy)
    part = _rank_costs(layout, m, a, moved, n_busy)
    dig = whole["digest"] / 2 / n_busy if digest_per_layer else 0.0  # one side's copy and hash of one layer
    if digest_per_layer and a.digest and m.digest_layer:  # the one-layer hash call as measured, and the copy
        lb = layer_bytes(layout, tokens)
        dig = (
            lb * ms_per_byte(m.digest_layer, layout, lb, per_layer=True) / a.int_ratio
            + 2 * lb / (m.copy_gbs * a.hbm_ratio * 1e9) * 1e3
        )
    e, c = part["extract"] / n_busy, whole["convert"] / n_busy
    if m.extract_layer:  # the per-layer call as measured (launch overhead and all), scaled like the rest
        lb = layer_bytes(layout, moved)
        e = lb * ms_per_byte(m.extract_layer, layout, lb, per_layer=True) / a.hbm_ratio
    if m.convert_layer:
        lb = layer_bytes(layout, tokens)
        c = lb * ms_per_byte(m.convert_layer, layout, lb, per_layer=True) / a.hbm_ratio
    w, c = part["wire"] / n_busy + dig, c + dig
    main = layout.num_layers - layout.num_mtp_layers
    step = tokens if step_tokens is None else step_tokens
    f = step / a.prefill_tok_s / (main + layout.num_mtp_layers) * 1e3
    end = (main + layout.num_mtp_layers) * f
    wire_from = a.handshake_rtts * a.rtt_ms if backlog_ms is None else backlog_ms

    def avail(lid: int) -> float:
        return (lid + 1) * f if lid < main else end

    def finish(e: float, w: float, c: float) -> float:
        return max(
            _pipeline([avail(lid) for lid in layouts.senders_layers(layout, r, a.ranks)], e, w, c, wire_from)
            for r in range(a.ranks)
        )

    in_flight = max(0.0, finish(e, w, c) - end)
    # The same pipeline with the transfer infinitely fast except for the last main and the MTP layer
    # would still leave those two: the rest is backlog.
    last = max(
        0.0, max(max(avail(lid), wire_from) for lid in range(main - 1, layout.num_layers)) - end
    ) + max(e + w + c, 0.0)
    stage = max(e, w, c)
    break_even = a.ranks * step * 1e3 / (main * stage) if stage > 0 else math.inf
    backlog = max(0.0, in_flight - last) if stage > a.ranks * f or wire_from > end else 0.0
    return Overlap(
        tokens,
        f,
        stage,
        break_even,
        in_flight,
        backlog,
        a.rtt_ms,
        0.0 if digest_per_layer else whole["digest"],
        whole["inject"],
        first_step_ms(tokens, a),
    )


@dataclass(frozen=True)
class Chunked:
    """A prompt prefilled in steps of `Assumptions.chunk_tokens`: the gap with the handoff layer-wise in
    the prompt's last step only, and chunk-wise (every step's tokens sent during that step)."""

    tokens: int
    steps: int
    last_step_tokens: int
    #: wire time the earlier chunks left for the last step (their bytes outran their steps), ms
    carried_ms: float
    last_step: Overlap
    chunkwise: Overlap


def chunked(layout: Layout, m: Measured, a: Assumptions, tokens: int) -> Chunked:
    """Earlier chunks: step k's tokens leave during step k on each rank's NIC; whatever the link could
    not move while those steps ran is carried into the last step (`carried_ms`), which then moves its
    own chunk's tokens (and the page a chunk boundary split, neglected: one 64-token page) and converts
    every layer whole. Layer-wise in the last step only, every token moves in the last step."""
    c = a.chunk_tokens
    steps = max(1, math.ceil(tokens / c))
    last = tokens - (steps - 1) * c
    earlier = tokens - last
    n_busy = busiest_rank_layers(layout, a.ranks)
    carried = max(0.0, wire_ms(n_busy * layer_bytes(layout, earlier), a) - earlier / a.prefill_tok_s * 1e3)
    return Chunked(
        tokens,
        steps,
        last,
        carried,
        overlap(layout, m, a, tokens, step_tokens=last),
        overlap(
            layout,
            m,
            a,
            tokens,
            step_tokens=last,
            moved_tokens=last,
            backlog_ms=carried if steps > 1 else None,
        ),
    )


# -- measured numbers from RESULTS.md ----------------------------------------------------------------


def _block(text: str, key: str) -> str:
    found = re.search(
        rf"<!-- bench:{re.escape(key)} begin.*?-->(.*?)<!-- bench:{re.escape(key)} end -->", text, re.S
    )
    if not found:
        raise ValueError(f"bench/RESULTS.md has no generated section {key!r}; run its bench first")
    return found.group(1)


def _rows(block: str) -> list[dict[str, str]]:
    lines = [ln.strip() for ln in block.splitlines() if ln.strip().startswith("|")]
    header = [h.strip() for h in lines[0].strip("|").split("|")]
    return [
        dict(zip(header, [c.strip() for c in ln.strip("|").split("|")], strict=False)) for ln in lines[2:]
    ]


def _tokens(cell: str) -> int | None:
    found = re.search(r"(\d+)\s*k\b", cell)
    return int(found.group(1)) * 1024 if found else None


def _num(cell: str) -> float | None:
    found = re.match(r"\s*([\d,]*\.?\d+)", cell)
    return float(found.group(1).replace(",", "")) if found else None


def _column(rows: list[dict[str, str]], *want: str) -> str:
    """The first header that contains every word in `want` (case-insensitive)."""
    for h in rows[0]:
        if all(w.lower() in h.lower() for w in want):
            return h
    raise ValueError(f"no column with {want} in {list(rows[0])}")


def _points(block: str, *want: str, what: str | None = None) -> dict[int, float]:
    """tokens (the row's first cell: 8k, 32k, ...) -> the number under the column matching `want`. Tables
    with `what` / `timing` columns (one row per variant) give the rows of `what` timed as a `call`."""
    rows = _rows(block)
    col = _column(rows, *want)
    if "what" in rows[0] and what is not None:
        rows = [r for r in rows if r.get("what") == what and r.get("timing", "call") == "call"]
    out = {}
    for r in rows:
        n, ms = _tokens(next(iter(r.values()), "")), _num(r.get(col, ""))
        if n is not None and ms is not None:
            out[n] = ms
    if not out:
        raise ValueError(f"no numbers under {col!r}" + (f" for {what!r} calls" if what else ""))
    return out


def _meta(block: str) -> str:
    found = re.search(r"Date: ([^.]+)\. Commit: `([^`]+)`", block)
    return f"{found.group(1)}, commit {found.group(2)}" if found else "unknown run"


def measured_from_results(text: str) -> Measured:
    """H200 kernel times from RESULTS.md's extract, convert and digest sections, whatever run last
    wrote them: the fused extraction (its fastest run where several are given) and conversion as a
    caller times them, their per-layer calls where measured; the GPU digest (whole state and one
    layer, as calls) from `digest-gpu`, else the pipelined host-path blake3 from `digest-cuda`."""
    ex, cv = _block(text, "extract"), _block(text, "convert")
    extract = _points(ex, "fused", "fastest") if "fastest" in ex else _points(ex, "fused", "ms", what="whole")
    convert = _points(cv, "fused", "ms", what="whole")
    per_layer = {}
    for name, block in (("extract", ex), ("convert", cv)):
        try:
            per_layer[name] = _points(block, "fused", "ms", what="per layer")
        except ValueError:
            per_layer[name] = {}
    if "what" not in _rows(ex)[0]:
        per_layer["extract"] = {}
    if "what" not in _rows(cv)[0]:
        per_layer["convert"] = {}
    try:
        dg, key, on = _block(text, "digest-gpu"), "digest-gpu", "gpu"
        digest = _points(dg, "gpu digest", "ms", what="whole")
        digest_layer = _points(dg, "gpu digest", "ms", what="per layer")
    except ValueError:
        dg, key, on = _block(text, "digest-cuda"), "digest-cuda", "host"
        digest, digest_layer = _points(dg, "of_ranges"), {}
    copies = [float(x.replace(",", "")) for x in re.findall(r"Copy bandwidth ([\d,.]+) GB/s", ex + cv)]
    if not copies:
        raise ValueError("no 'Copy bandwidth ... GB/s' line in the extract/convert sections")
    return Measured(
        extract,
        convert,
        digest,
        sum(copies) / len(copies),
        {"extract": _meta(ex), "convert": _meta(cv), key: _meta(dg)},
        per_layer["extract"],
        per_layer["convert"],
        digest_layer,
        on,
    )


# -- output -------------------------------------------------------------------------------------------


def _k(n: int) -> str:
    return f"{n // 1024}k"


def report(m: Measured, a: Assumptions, lengths: tuple[int, ...] = LENGTHS) -> str:
    layout = glm5()
    ser = [serial(layout, m, a, n) for n in lengths]
    ovl = [overlap(layout, m, a, n) for n in lengths]
    t1 = table(
        [
            "prompt",
            "state GB",
            "extract",
            "wire",
            "digest",
            "convert",
            "inject",
            "first step",
            "gap ms (serial)",
        ],
        [
            [
                _k(s.tokens),
                f"{s.state_gb:.3f}",
                *[
                    f"{x:.2f}"
                    for x in (s.extract, s.wire, s.digest, s.convert, s.inject, s.first_step, s.total)
                ],
            ]
            for s in ser
        ],
    )
    end = [overlap(layout, m, a, n, digest_per_layer=False) for n in lengths]
    t2 = table(
        [
            "prompt",
            "forward ms / layer (assumed)",
            "slowest stage ms / layer",
            "break-even prefill tok/s",
            "transfer-bound",
            "extract+wire+convert in flight after forward end",
            "of which backlog",
            "done/ack",
            "inject",
            "first step",
            "gap ms (overlap)",
        ],
        [
            [
                _k(o.tokens),
                f"{o.forward_per_layer:.3f}",
                f"{o.stage_per_layer:.3f}",
                f"{o.break_even_tok_s:,.0f}",
                "yes" if o.transfer_bound else "no",
                *[f"{x:.2f}" for x in (o.in_flight, o.backlog, o.done_ack, o.inject, o.first_step, o.total)],
            ]
            for o in ovl
        ],
    )
    t3 = table(
        [
            "prompt",
            "serial ms",
            "overlap ms",
            "overlap / serial",
            "overlap, digest at end ms",
            "serial in TileRT steps",
            "overlap in TileRT steps",
        ],
        [
            [
                _k(s.tokens),
                f"{s.total:.2f}",
                f"{o.total:.2f}",
                f"{o.total / s.total:.2f}x",
                f"{d.total:.2f}",
                f"{s.total / s.first_step:.1f}",
                f"{o.total / o.first_step:.1f}",
            ]
            for s, o, d in zip(ser, ovl, end, strict=True)
        ],
    )
    chk = [chunked(layout, m, a, n) for n in lengths if n > a.chunk_tokens]
    t4 = table(
        [
            "prompt",
            "steps",
            "last step tokens",
            "serial ms",
            "layer-wise, last step only ms",
            "chunk-wise ms",
            "chunk-wise / last step only",
            "wire carried into the last step ms",
            "chunk-wise in TileRT steps",
        ],
        [
            [
                _k(c.tokens),
                str(c.steps),
                f"{c.last_step_tokens:,}",
                f"{s.total:.2f}",
                f"{c.last_step.total:.2f}",
                f"{c.chunkwise.total:.2f}",
                f"{c.chunkwise.total / c.last_step.total:.2f}x",
                f"{c.carried_ms:.2f}",
                f"{c.chunkwise.total / c.chunkwise.first_step:.1f}",
            ]
            for c, s in zip(chk, [x for x in ser if x.tokens > a.chunk_tokens], strict=True)
        ],
    )
    return (
        "Serial (today): stage ms on the busiest of 8 ranks, from the forward's end\n\n"
        + t1
        + "\n\nLayer-wise overlap: what is left after the forward's end\n\n"
        + t2
        + "\n\nGap\n\n"
        + t3
        + f"\n\nChunked prefill ({a.chunk_tokens:,} tokens a step): the gap with the handoff layer-wise in "
        "the last step only, and chunk-wise\n\n" + t4
    )


def notes(m: Measured, a: Assumptions) -> str:
    layout = glm5()
    meas = (
        f"MEASURED on one H200 (parsed from bench/RESULTS.md at run time): extraction (fused, whole state, timed as a call; the fastest run where several) "
        f"{_fmt(m.extract)} [extract: {m.provenance.get('extract')}]; conversion (fused) {_fmt(m.convert)} "
        f"[convert: {m.provenance.get('convert')}]; per-layer calls: extraction "
        f"{_fmt(m.extract_layer) if m.extract_layer else 'not measured (whole-state time split evenly)'}, "
        f"conversion {_fmt(m.convert_layer) if m.convert_layer else 'not measured (whole-state time split evenly)'}"
        " (ms per layer); "
        + (
            f"digest on the GPU (blake3, in place; calls) {_fmt(m.digest)} whole state, "
            f"{_fmt(m.digest_layer) if m.digest_layer else 'not measured (whole-state time split evenly)'} "
            f"per layer [digest-gpu: {m.provenance.get('digest-gpu')}]"
            if m.digest_on == "gpu"
            else f"digest, pinned host copies + blake3 {_fmt(m.digest)} [digest-cuda: {m.provenance.get('digest-cuda')}]"
        )
        + f"; copy bandwidth {m.copy_gbs:,.0f} GB/s (read + write)."
    )
    assumed = "ASSUMED: " + "; ".join(
        f"{k} = {v}" + (f" ({SOURCES[k]})" if k in SOURCES else "") for k, v in asdict(a).items()
    )
    sizes = (
        f"Sizes from the layout registry: {layout.describe()}, {layout.num_layers} layers "
        f"({layout.num_mtp_layers} MTP), {layer_bytes(layout, 8192) / 1e6:.2f} MB per layer at 8k; the busiest of "
        f"{a.ranks} ranks holds {busiest_rank_layers(layout, a.ranks)} layers; one NIC moves {nic_gb_s(a):.1f} GB/s."
    )
    return "\n\n".join([meas, assumed, sizes, "Model: see the docstring of bench/gap/projection.py."])


def _fmt(points: dict[int, float]) -> str:
    return " / ".join(f"{ms:g} ms at {_k(n)}" for n, ms in sorted(points.items()))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else "")
    ap.add_argument("--results", type=Path, default=RESULTS, help="where the H200 kernel times are read from")
    ap.add_argument("--prefill-tok-s", type=float, default=Assumptions.prefill_tok_s)
    ap.add_argument("--nic-gbit", type=float, default=Assumptions.nic_gbit)
    ap.add_argument("--nic-efficiency", type=float, default=Assumptions.nic_efficiency)
    ap.add_argument("--rtt-ms", type=float, default=Assumptions.rtt_ms)
    ap.add_argument("--digest", choices=("on", "off"), default="on")
    ap.add_argument("--chunk-tokens", type=int, default=Assumptions.chunk_tokens)
    ap.add_argument("--no-record", action="store_true")
    args = ap.parse_args(argv)
    m = measured_from_results(args.results.read_text())
    a = Assumptions(
        prefill_tok_s=args.prefill_tok_s,
        nic_gbit=args.nic_gbit,
        nic_efficiency=args.nic_efficiency,
        rtt_ms=args.rtt_ms,
        digest=args.digest == "on",
        chunk_tokens=args.chunk_tokens,
    )
    body, why = report(m, a), notes(m, a)
    print(body)
    print()
    print(why)
    if not args.no_record:
        record(
            "gap-glm5",
            "The handoff gap projected to GLM-5 on 8xB200 (`bench/gap/projection.py`)",
            body,
            notes=why,
        )


if __name__ == "__main__":
    main()
