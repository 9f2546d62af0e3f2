"""Both byte movers, for real, between two processes over TCP on loopback."""

import hashlib
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from tilert_serve import transfer

PEER = Path(__file__).with_name("peer.py")
TARGET_BYTES = 8 << 20
ENV = {**os.environ, "UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo", "UCX_MODULES": "^ib", "MC_LOG_LEVEL": "ERROR"}


class Target:
    def __init__(self, engine: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(PEER), engine, str(TARGET_BYTES)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=ENV,
        )
        assert self.proc.stdout is not None
        info = json.loads(self._line("PEER "))
        self.peer, self.addr = info["peer"], info["addr"]

    def ask(self, line: str) -> str:
        assert self.proc.stdin and self.proc.stdout
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        return self._line("R ")

    def _line(self, prefix: str) -> str:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(prefix):
                return line[len(prefix) :].strip()
        raise AssertionError(f"target exited (rc {self.proc.wait()}) before answering")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.ask_quit()
        self.proc.wait(timeout=10)

    def ask_quit(self) -> None:
        assert self.proc.stdin
        self.proc.stdin.write("quit\n")
        self.proc.stdin.flush()


def sender(engine_name: str, src: np.ndarray, target: Target) -> tuple[transfer.TransferEngine, str]:
    """An engine of this process with `src` registered, connected to the target: (engine, peer handle)."""
    engine = transfer.create(engine_name, host="127.0.0.1", protocol="tcp", role="sender")
    engine.register(src.ctypes.data, src.nbytes)
    return engine, engine.connect(target.peer)


@pytest.fixture(params=transfer.ENGINES)
def engine_name(request, monkeypatch):
    for key in ("UCX_TLS", "UCX_NET_DEVICES", "UCX_MODULES"):
        monkeypatch.setenv(key, ENV[key])
    return request.param


def test_one_sided_write_lands_exactly(engine_name):
    target = Target(engine_name)
    try:
        src = np.random.default_rng(0).integers(0, 256, 4 << 20, dtype=np.uint8)
        engine, handle = sender(engine_name, src, target)
        # Three ranges, scattered on both sides, as a layer-by-layer handoff writes them.
        ops = [
            transfer.WriteOp(src.ctypes.data + s, target.addr + d, n)
            for s, d, n in [(0, 0, 1 << 20), (1 << 20, 3 << 20, 2 << 20), (3 << 20, 6 << 20, 12345)]
        ]
        engine.write(handle, ops)
        assert target.ask(f"md5 0 {1 << 20}") == hashlib.md5(src[: 1 << 20].tobytes()).hexdigest()
        assert (
            target.ask(f"md5 {3 << 20} {2 << 20}")
            == hashlib.md5(src[1 << 20 : 3 << 20].tobytes()).hexdigest()
        )
        assert (
            target.ask(f"md5 {6 << 20} 12345")
            == hashlib.md5(src[3 << 20 : (3 << 20) + 12345].tobytes()).hexdigest()
        )
        # Nothing beyond the ranges was touched.
        assert target.ask(f"zeros {1 << 20} {2 << 20}") == "yes"
        assert target.ask(f"zeros {(6 << 20) + 12345} 4096") == "yes"
    finally:
        target.close()


def test_concurrent_writes_from_several_threads_all_land(engine_name):
    """The connector's sender threads share one engine and write to the same node at once."""
    target = Target(engine_name)
    try:
        src = np.random.default_rng(1).integers(0, 256, 4 << 20, dtype=np.uint8)
        engine, handle = sender(engine_name, src, target)
        part = 1 << 20
        errors: list[BaseException] = []

        def write(i: int) -> None:
            try:  # 16 writes of 64 KiB each, interleaved with the other threads'
                for k in range(16):
                    off = i * part + k * (part // 16)
                    engine.write(
                        handle, [transfer.WriteOp(src.ctypes.data + off, target.addr + off, part // 16)]
                    )
            except BaseException as exc:  # reported below, in the test thread
                errors.append(exc)

        threads = [threading.Thread(target=write, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert not errors
        assert target.ask(f"md5 0 {4 * part}") == hashlib.md5(src.tobytes()).hexdigest()
    finally:
        target.close()


def test_write_outside_the_registration_fails_cleanly(engine_name):
    target = Target(engine_name)
    try:
        src = np.ones(1 << 20, dtype=np.uint8)
        engine, handle = sender(engine_name, src, target)
        with pytest.raises(transfer.TransferError, match=engine_name.capitalize().replace("Nixl", "NIXL")):
            engine.write(handle, [transfer.WriteOp(src.ctypes.data, target.addr + TARGET_BYTES - 100, 4096)])
        # The target is unharmed and still accepts a valid write.
        engine.write(handle, [transfer.WriteOp(src.ctypes.data, target.addr, 4096)])
        assert target.ask("zeros 0 4096") == "no"
    finally:
        target.close()


def test_unknown_engine_is_named():
    with pytest.raises(transfer.TransferError, match="unknown transfer engine 'rdma'"):
        transfer.create("rdma", host="127.0.0.1")
