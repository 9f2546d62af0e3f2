"""Transfer benchmark: one-sided writes of 64 MiB to 1 GiB through Mooncake and NIXL over TCP on
loopback, against a raw TCP socket and memcpy measured in the same run (target: >= 0.7x the raw
socket). Every write is checked by md5 on the target. GB/s = 1e9 bytes/s; best and median of reps.

    .venv/bin/python -m bench.transfer.run [--sizes 64,256,1024] [--reps 3]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from bench.common import record, table

TARGET = Path(__file__).with_name("target.py")
ENV = {
    **os.environ,
    "UCX_TLS": "tcp",
    "UCX_NET_DEVICES": "lo",
    "UCX_MODULES": "^ib",
    "MC_LOG_LEVEL": "ERROR",
    "GLOG_minloglevel": "2",
}
MIB = 1 << 20


class Target:
    def __init__(self, method: str, nbytes: int) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(TARGET), method, str(nbytes)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env=ENV,
        )
        self.info = json.loads(self._line("READY "))

    def _line(self, prefix: str) -> str:
        assert self.proc.stdout
        for line in self.proc.stdout:
            if line.startswith(prefix):
                return line[len(prefix) :].strip()
        raise RuntimeError(f"target exited with {self.proc.wait()}")

    def ask(self, cmd: str) -> str:
        assert self.proc.stdin
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()
        return self._line("R ")

    def close(self) -> None:
        assert self.proc.stdin
        self.proc.stdin.write("quit\n")
        self.proc.stdin.flush()
        self.proc.wait(30)


def _measure(
    name: str, target: Target, src: np.ndarray, sizes: list[int], reps: int, write: Callable[[int], None]
) -> dict[int, list[float]]:
    """GB/s of `write(n)` into the target's zeroed buffer, each write checked by md5 there."""
    out: dict[int, list[float]] = {}
    for n in sizes:
        out[n] = []
        for _ in range(reps):
            target.ask(f"zero {n}")
            t0 = time.perf_counter()
            write(n)
            out[n].append(n / (time.perf_counter() - t0) / 1e9)
            if target.ask(f"md5 {n}") != hashlib.md5(src[:n].tobytes()).hexdigest():
                raise RuntimeError(f"{name}: bytes differ after a {n}-byte write")
    return out


def bench_engine(method: str, src: np.ndarray, sizes: list[int], reps: int) -> dict[int, list[float]]:
    from tilert_serve import transfer

    for key in ("UCX_TLS", "UCX_NET_DEVICES", "UCX_MODULES"):
        os.environ[key] = ENV[key]
    target = Target(method, max(sizes))
    engine = transfer.create(method, host="127.0.0.1", protocol="tcp", role="bench-sender")
    engine.register(src.ctypes.data, src.nbytes)
    peer = engine.connect(target.info["peer"])
    try:
        return _measure(
            method,
            target,
            src,
            sizes,
            reps,
            lambda n: engine.write(peer, [transfer.WriteOp(src.ctypes.data, target.info["addr"], n)]),
        )
    finally:
        target.close()


def bench_raw(src: np.ndarray, sizes: list[int], reps: int) -> dict[int, list[float]]:
    target = Target("raw", max(sizes))
    sock = socket.create_connection(("127.0.0.1", target.info["port"]))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def write(n: int) -> None:
        sock.sendall(n.to_bytes(8, "big"))
        sock.sendall(memoryview(src)[:n])
        if sock.recv(1) != b"k":
            raise RuntimeError("raw: the target did not acknowledge")

    try:
        return _measure("raw tcp", target, src, sizes, reps, write)
    finally:
        sock.close()
        target.close()


def bench_memcpy(src: np.ndarray, sizes: list[int], reps: int) -> dict[int, list[float]]:
    dst = np.zeros_like(src)
    np.copyto(dst, src)  # touch
    out: dict[int, list[float]] = {}
    for n in sizes:
        out[n] = []
        for _ in range(reps):
            t0 = time.perf_counter()
            np.copyto(dst[:n], src[:n])
            out[n].append(n / (time.perf_counter() - t0) / 1e9)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="64,256,1024", help="MiB, comma-separated")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    sizes = [int(s) * MIB for s in args.sizes.split(",")]
    src = np.random.default_rng(0).integers(0, 256, max(sizes), dtype=np.uint8)
    results = {"memcpy": bench_memcpy(src, sizes, args.reps), "raw tcp": bench_raw(src, sizes, args.reps)}
    for method in ("mooncake", "nixl"):
        results[method] = bench_engine(method, src, sizes, args.reps)
    raw = {n: statistics.median(v) for n, v in results["raw tcp"].items()}
    rows = []
    for method, per_size in results.items():
        cells = []
        for n, v in per_size.items():
            med = statistics.median(v)
            cells.append(f"{max(v):.2f} / {med:.2f} ({med / raw[n]:.2f}x)")
        rows.append([method, *cells])
    body = table(["method", *(f"{n // MIB} MiB" for n in sizes)], rows)
    notes = f"GB/s best / median of {args.reps}; ratio = median against the raw socket's median."
    print(body)
    print(notes)
    record("transfer", "Transfer (`bench/transfer/run.py`, CPU box)", body, notes=notes)
    os._exit(0)


if __name__ == "__main__":
    main()
