"""Shared by the benchmarks: timing (device events on CUDA, wall clock on CPU), the device's copy
bandwidth measured in the same run, the table printer, and `record`, which writes a benchmark's own
section of bench/RESULTS.md (table, machine, date, commit, command) so every result can be traced to
the code that produced it and re-run.

torch is imported inside the functions that need it: the router and operator benchmarks use only
`record` and `table`, and should not pay torch's import in their load generator.

    python -m bench.common merge OTHER.md   # copy the generated sections of OTHER.md into RESULTS.md
"""

from __future__ import annotations

import datetime
import os
import platform
import re
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

ROOT = Path(__file__).resolve().parents[1]
#: Where `record` writes. A run on a borrowed machine points this at a copy it brings back, then
#: `merge` carries the sections over (the machine has no git checkout to commit from).
RESULTS = Path(os.environ.get("BENCH_RESULTS", ROOT / "bench" / "RESULTS.md"))
#: Paths whose state decides "+dirty": the code a benchmark runs. Other files (docs, RESULTS.md itself)
#: changing beside a run do not change what it measured.
CODE_PATHS = ("bench", "tilert_serve", "operator", "pyproject.toml", ":(exclude)bench/RESULTS.md")


def median_ms(fn: Callable[[], object], device: torch.device, reps: int = 50, warmup: int = 10) -> float:
    import torch

    for _ in range(warmup):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        times = []
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        return statistics.median(times)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def copy_bandwidth(device: torch.device, nbytes: int = 4 << 30) -> float:
    """Device-to-device copy, GB/s counting bytes read plus bytes written (1 GB = 1e9 B)."""
    import torch

    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src), device)
    return 2 * nbytes / ms / 1e6


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def commit() -> str:
    """Short hash of HEAD, "+dirty" when the benchmarked code differs from it. BENCH_COMMIT overrides
    (a borrowed machine gets a copy of the tree without .git; the caller states the commit it sent)."""
    if os.environ.get("BENCH_COMMIT"):
        return os.environ["BENCH_COMMIT"]
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", *CODE_PATHS],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown (no git checkout)"
    return head + ("+dirty" if dirty else "")


def machine(device: torch.device | None = None) -> str:
    """CPU model, usable cores, memory; GPU, torch and Triton versions when the run used CUDA."""
    cpu = platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    # os.cpu_count, not the affinity: the router benchmark pins itself to part of the box before recording.
    out = f"{os.cpu_count()} cores of {cpu}, {mem:.0f} GiB, python {platform.python_version()}"
    if device is not None and device.type == "cuda":
        import torch
        import triton

        out = (
            f"{torch.cuda.get_device_name(device)} ({torch.cuda.get_device_properties(device).total_memory / 2**30:.0f}"
            f" GiB), torch {torch.__version__}, Triton {triton.__version__}; host: {out}"
        )
    return out


def command() -> str:
    """The command line as typed (interpreter included), run from the repository root."""
    argv = list(getattr(sys, "orig_argv", [sys.executable, *sys.argv]))
    exe = Path(argv[0])
    if exe.is_absolute():
        argv[0] = str(exe.relative_to(ROOT)) if exe.is_relative_to(ROOT) else exe.name
    return shlex.join(argv)


def _markers(key: str) -> tuple[str, str]:
    return (
        f"<!-- bench:{key} begin (generated by bench/common.py record; do not edit) -->",
        f"<!-- bench:{key} end -->",
    )


def record(key: str, title: str, body: str, *, device: torch.device | None = None, notes: str = "") -> str:
    """Replace the generated block `key` of RESULTS.md with `body` (usually a table) under a line that
    says where, when, at which commit and with which command it ran; returns the block.

    A block that does not exist yet is appended under `## title`. Prose around a block (methods,
    reading) is left alone, so it is written once by hand and stays next to the numbers it explains.
    """
    begin, end = _markers(key)
    when = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    meta = f"Machine: {machine(device)}. Date: {when}. Commit: `{commit()}`.\nCommand: `{command()}`"
    block = "\n".join([begin, meta, "", body.strip(), *(["", notes.strip()] if notes.strip() else []), end])
    text = RESULTS.read_text() if RESULTS.exists() else "# Benchmark results\n"
    pattern = re.compile(re.escape(begin) + r".*?" + re.escape(end), re.S)
    if pattern.search(text):
        text = pattern.sub(lambda _m: block, text, count=1)
    else:
        text = text.rstrip("\n") + f"\n\n## {title}\n\n{block}\n"
    RESULTS.write_text(text)
    print(f"\nwrote section {key!r} of {RESULTS}")
    return block


def merge(other: Path, keys: list[str] | None = None, into: Path = RESULTS) -> list[str]:
    """Copy the generated blocks of `other` (those named in `keys`, or all) into `into`, replacing blocks
    of the same key; returns the keys."""
    src = other.read_text()
    text = into.read_text()
    found_keys = re.findall(re.escape("<!-- bench:") + r"(\S+)" + re.escape(" begin (generated"), src)
    keys = [k for k in found_keys if keys is None or k in keys]
    for key in keys:
        begin, end = _markers(key)
        pattern = re.compile(re.escape(begin) + r".*?" + re.escape(end), re.S)
        found = pattern.search(src)
        assert found is not None
        block = found.group(0)
        if pattern.search(text):
            text = pattern.sub(lambda _m: block, text, count=1)  # noqa: B023 (used at once, in this iteration)
        else:
            text = text.rstrip("\n") + f"\n\n{block}\n"
    into.write_text(text)
    return keys


if __name__ == "__main__":
    if len(sys.argv) < 3 or sys.argv[1] != "merge":
        raise SystemExit("usage: python -m bench.common merge OTHER.md [KEY ...]")
    print("merged:", ", ".join(merge(Path(sys.argv[2]), sys.argv[3:] or None)))
