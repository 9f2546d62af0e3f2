"""Shared by the benchmarks: timing (device events on CUDA, wall clock on CPU), the device's copy
bandwidth measured in the same run, the table printer, and `record`, which writes a benchmark's own
section of bench/RESULTS.md (table, machine, date, commit, command) so every result can be traced to
the code that produced it and re-run.

torch is imported inside the functions that need it: the router and operator benchmarks use only
`record` and `table`, and should not pay torch's import in their load generator.

    python -m bench.common merge OTHER.md   # copy the generated sections of OTHER.md into RESULTS.md

Only a clean tree records: `record` refuses to write RESULTS.md when the benchmarked code (CODE_PATHS)
differs from the checked-out commit, and when BENCH_COMMIT names a commit whose benchmarked code is not
the checked-out one's; `merge` refuses a block that ran on other code than the checkout's, or "+dirty". BENCH_DRAFT=1
(or `merge --draft`) says the run is a draft: it is written, its commit marked "(draft)". A refused
record still prints its block, so the run's numbers are not lost.
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


#: Marks a draft's commit in RESULTS.md.
DRAFT = " (draft)"


class RecordRefused(SystemExit):
    """RESULTS.md is not written: the message says why and what to do."""


def draft() -> bool:
    return os.environ.get("BENCH_DRAFT", "") not in ("", "0")


def _checkout(root: Path) -> tuple[str, bool] | None:
    """(short HEAD, whether the benchmarked code differs from it); None without a git checkout."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", *CODE_PATHS],
            cwd=root,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return head, bool(dirty)


def same_commit(a: str, b: str) -> bool:
    """Two abbreviations of one commit (short hashes may differ in length)."""
    return bool(a) and bool(b) and (a.startswith(b) or b.startswith(a))


def same_code(ran: str, head: str, root: Path) -> bool:
    """The benchmarked code at commit `ran` is the code at `head` (the same commit, or later commits
    that changed none of CODE_PATHS: docs, RESULTS.md itself)."""
    if same_commit(ran, head):
        return True
    if not re.fullmatch(r"[0-9a-f]{7,40}", ran):
        return False
    try:
        diff = subprocess.run(
            ["git", "diff", "--quiet", ran, "HEAD", "--", *CODE_PATHS], cwd=root, capture_output=True
        )
    except OSError:
        return False
    return diff.returncode == 0


def commit(root: Path | None = None) -> str:
    """Short hash of HEAD, "+dirty" when the benchmarked code differs from it. BENCH_COMMIT overrides
    (a borrowed machine gets a copy of the tree without .git; the caller states the commit it sent)."""
    if os.environ.get("BENCH_COMMIT"):
        return os.environ["BENCH_COMMIT"]
    found = _checkout(root or ROOT)
    if found is None:
        return "unknown (no git checkout)"
    head, dirty = found
    return head + ("+dirty" if dirty else "")


def recordable_commit(root: Path | None = None) -> str:
    """The commit to record, or RecordRefused: see the module docstring."""
    root = root or ROOT
    found = _checkout(root)
    stated = os.environ.get("BENCH_COMMIT")
    problem = None
    if found is not None:
        head, dirty = found
        if stated and not same_code(stated, head, root):
            problem = f"BENCH_COMMIT={stated} but the checked-out commit is {head}: the numbers would name code they did not run"
        elif dirty:
            problem = (
                f"the benchmarked code ({', '.join(p for p in CODE_PATHS if not p.startswith(':'))}) differs from {head}: "
                "commit it first, or set BENCH_DRAFT=1 to record a draft"
            )
    name = commit(root)
    if problem is None:
        return name
    if draft():
        return name + DRAFT
    raise RecordRefused(f"bench/common.py: not writing {RESULTS}: {problem}")


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
    try:
        name = recordable_commit()
    except RecordRefused:
        print(f"\n{body.strip()}\n{notes.strip()}")  # the run's numbers, not lost
        raise
    draft_mark = DRAFT if name.endswith(DRAFT) else ""
    meta = f"Machine: {machine(device)}. Date: {when}. Commit: `{name.removesuffix(DRAFT)}`{draft_mark}.\nCommand: `{command()}`"
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


def merge(
    other: Path,
    keys: list[str] | None = None,
    into: Path = RESULTS,
    *,
    allow_draft: bool = False,
    root: Path | None = None,
) -> list[str]:
    """Copy the generated blocks of `other` (those named in `keys`, or all) into `into`, replacing blocks
    of the same key; returns the keys. A block run at a commit other than the checked-out one, or on a
    dirty tree, is refused (RecordRefused, nothing written) unless `allow_draft`, which marks it."""
    src = other.read_text()
    text = into.read_text()
    found_keys = re.findall(re.escape("<!-- bench:") + r"(\S+)" + re.escape(" begin (generated"), src)
    keys = [k for k in found_keys if keys is None or k in keys]
    root = root or ROOT
    checkout = _checkout(root)
    head = checkout[0] if checkout is not None else ""
    for key in keys:
        begin, end = _markers(key)
        pattern = re.compile(re.escape(begin) + r".*?" + re.escape(end), re.S)
        found = pattern.search(src)
        assert found is not None
        block = found.group(0)
        stated = re.search(r"Commit: `([^`]*)`", block)
        ran = stated.group(1) if stated else ""
        if DRAFT not in block and (ran.endswith("+dirty") or not same_code(ran, head, root)):
            why = (
                f"block {key!r} of {other} ran at {ran or 'no stated commit'}, and the checked-out commit "
                f"{head or '(none)'} has other benchmarked code: merge at the commit it ran at, or pass --draft"
            )
            if not allow_draft:
                raise RecordRefused(f"bench/common.py merge: nothing written: {why}")
            block = block.replace(f"Commit: `{ran}`.", f"Commit: `{ran}`{DRAFT}.", 1)
        if pattern.search(text):
            text = pattern.sub(lambda _m: block, text, count=1)  # noqa: B023 (used at once, in this iteration)
        else:
            # New here: under the `## title` heading `record` wrote above it in `other`.
            heading = re.search(r"^## [^\n]*\n\n(?=" + re.escape(begin) + ")", src, re.M)
            text = text.rstrip("\n") + f"\n\n{heading.group(0) if heading else ''}{block}\n"
    into.write_text(text)
    return keys


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a != "--draft"]
    if len(args) < 2 or args[0] != "merge":
        raise SystemExit("usage: python -m bench.common merge [--draft] OTHER.md [KEY ...]")
    print("merged:", ", ".join(merge(Path(args[1]), args[2:] or None, allow_draft="--draft" in sys.argv)))
