"""Our NIXL settings stay on our agent. A prefill process also holds vLLM's NixlConnector agents (and
GPU nodes want those at NIXL's defaults): making our engine must not patch NIXL's classes, leave
anything in the process environment, or change what a plain `nixl_agent` gets."""

from __future__ import annotations

import gc
import importlib
import ipaddress
import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tilert_serve import transfer
from tilert_serve.transfer.nixl import NixlEngine


def _proc_net_address(hexaddr: str, family: socket.AddressFamily) -> str:
    raw = bytes.fromhex(hexaddr)
    # /proc/net/tcp* prints each 32-bit word of the address in host (little-endian) order.
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return socket.inet_ntop(family, words)


def listening() -> set[tuple[str, int]]:
    """The TCP sockets this process listens on, as (address, port)."""
    inodes: set[str] = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # closed between listing and reading
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    found: set[tuple[str, int]] = set()
    for path, family in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
        with open(path) as table:
            for row in list(table)[1:]:
                fields = row.split()
                local, state, inode = fields[1], fields[3], fields[9]
                if state == "0A" and inode in inodes:  # 0A: LISTEN
                    hexaddr, hexport = local.split(":")
                    found.add((_proc_net_address(hexaddr, family), int(hexport, 16)))
    return found


def non_loopback(sockets: set[tuple[str, int]]) -> set[tuple[str, int]]:
    return {(addr, port) for addr, port in sockets if not ipaddress.ip_address(addr).is_loopback}


def routed_interfaces() -> list[str]:
    """Interfaces other than loopback that are up with an IPv4 route (UCX's TCP transport uses them)."""
    with open("/proc/net/route") as table:
        return sorted({row.split()[0] for row in list(table)[1:] if row.split()[0] != "lo"})


@pytest.fixture
def nixl_api() -> Any:
    from nixl import _api

    return _api


@pytest.fixture
def delays(nixl_api: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, int]]:
    """Agent name -> the progress-thread delay (us) NIXL's binding was given when it made that agent."""
    binding = nixl_api.nixlBind
    real = binding.nixlAgent
    seen: dict[str, int] = {}

    def recording(name: str, config: Any) -> Any:
        seen[name] = int(config.pthrDelay)
        return real(name, config)

    monkeypatch.setattr(binding, "nixlAgent", recording)
    yield seen


def test_our_settings_stay_on_our_agent_and_a_plain_agent_gets_nixls_defaults(
    nixl_api: Any, delays: dict[str, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    for key in [k for k in os.environ if k.startswith("UCX_")]:
        monkeypatch.delenv(key)
    binding = importlib.import_module(nixl_api.__name__.rpartition(".")[0] + "._bindings")
    environ_before = dict(os.environ)
    sockets_before = listening()

    ours = transfer.create("nixl", host="127.0.0.1", protocol="tcp", role="scoped", interface="lo")
    assert isinstance(ours, NixlEngine)
    try:
        ours_listen = listening() - sockets_before
        # Nothing of ours is left for the process: not in its environment, not in NIXL's module.
        assert dict(os.environ) == environ_before
        assert nixl_api.nixlBind is binding
        assert nixl_api.nixlBind.nixlAgentConfig.__module__ == binding.__name__
        assert nixl_api.nixl_agent.__module__ == nixl_api.__name__

        # Ours: the progress thread polls, and UCX is TCP on the interface we named (loopback here).
        assert delays[ours.agent_name] >= 100
        assert ours_listen, "our UCX backend opened no TCP listener"
        assert not non_loopback(ours_listen), f"ours listens beyond loopback: {ours_listen}"

        # A plain agent, made as vLLM's NixlConnector makes its own, after ours.
        theirs_name = str(uuid.uuid4())
        theirs = nixl_api.nixl_agent(theirs_name, nixl_api.nixl_agent_config(num_threads=4))
        try:
            theirs_listen = listening() - sockets_before - ours_listen
            assert delays[theirs_name] == 0, "NIXL's default progress delay was changed for every agent"
            assert "engine_config" not in theirs.get_backend_params("UCX")
            if routed_interfaces():
                # UCX's defaults: every interface with an address, not the one we named for ours.
                assert non_loopback(theirs_listen), f"a plain agent listens on loopback only: {theirs_listen}"
        finally:
            del theirs
            gc.collect()
        assert dict(os.environ) == environ_before
    finally:
        ours.close()


def test_the_processs_own_ucx_settings_win_over_ours(monkeypatch: pytest.MonkeyPatch) -> None:
    """The spec's transfer.rdma.env reaches the pod as UCX_* variables; they decide over our defaults."""
    for key in [k for k in os.environ if k.startswith("UCX_")]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("UCX_TLS", "tcp")
    monkeypatch.setenv("UCX_NET_DEVICES", "lo")
    environ_before = dict(os.environ)
    sockets_before = listening()
    # We name a routed interface; the environment's loopback wins.
    names = routed_interfaces()
    ours = transfer.create(
        "nixl", host="127.0.0.1", protocol="tcp", role="scoped", interface=names[0] if names else "lo"
    )
    try:
        assert dict(os.environ) == environ_before
        ours_listen = listening() - sockets_before
        assert ours_listen and not non_loopback(ours_listen), ours_listen
    finally:
        ours.close()


PLAIN_AGENT = """
import importlib, os
from nixl import _api
binding = importlib.import_module(_api.__name__.rpartition(".")[0] + "._bindings")
real, seen = binding.nixlAgent, {}
binding.nixlAgent = lambda name, config: (seen.setdefault(name, int(config.pthrDelay)), real(name, config))[1]
agent = _api.nixl_agent("plain", _api.nixl_agent_config(backends=[]))
print("DELAY", seen["plain"], flush=True)
os._exit(0)  # UCX's teardown at exit is not what this checks
"""


@pytest.mark.parametrize(("opted_in", "polls"), [("1", True), (None, False)])
def test_local_processes_and_only_they_make_every_agent_poll(opted_in: str | None, polls: bool) -> None:
    """`tilert-pd local` and the CPU vLLM image opt in (site/sitecustomize.py): there vLLM's agents poll too."""
    site = Path(transfer.__file__).resolve().parents[1] / "local" / "site"
    env = {k: v for k, v in os.environ.items() if k != "TILERT_PD_PATCH_NIXL"}
    env["PYTHONPATH"] = os.pathsep.join([str(site), str(Path(transfer.__file__).resolve().parents[2])])
    if opted_in is not None:
        env["TILERT_PD_PATCH_NIXL"] = opted_in
    out = subprocess.run(
        [sys.executable, "-c", PLAIN_AGENT], env=env, capture_output=True, text=True, timeout=120
    )
    delay = next(
        (int(line.split()[1]) for line in out.stdout.splitlines() if line.startswith("DELAY ")), None
    )
    assert delay is not None, out.stdout + out.stderr
    assert (delay >= 100) == polls, delay


def test_mooncakes_write_timeout_is_the_engines_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """MC_TRANSFER_TIMEOUT is set only while our Mooncake engine is made, and still bounds its writes."""
    import numpy as np

    from tilert_serve.transfer.base import TransferError, WriteOp
    from tilert_serve.transfer.mooncake import MooncakeEngine

    monkeypatch.delenv("MC_TRANSFER_TIMEOUT", raising=False)
    nbytes = 8 << 20
    target = subprocess.Popen(
        [sys.executable, str(Path(__file__).with_name("peer.py")), "mooncake", str(nbytes)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "MC_LOG_LEVEL": "ERROR"},
    )
    try:
        assert target.stdout is not None
        line = next((line for line in target.stdout if line.startswith("PEER ")), None)
        assert line is not None, f"target exited (rc {target.wait()}) before answering"
        info = json.loads(line[len("PEER ") :])
        environ_before = dict(os.environ)
        engine = MooncakeEngine("127.0.0.1", "tcp", transfer_timeout_s=5)
        assert dict(os.environ) == environ_before
        src = np.ones(nbytes, dtype=np.uint8)
        engine.register(src.ctypes.data, nbytes)
        peer = engine.connect(info["peer"])
        engine.write(peer, [WriteOp(src.ctypes.data, info["addr"], 4096)])  # connected; the target answers
        os.kill(target.pid, signal.SIGSTOP)
        started = time.monotonic()
        with pytest.raises(TransferError):
            engine.write(peer, [WriteOp(src.ctypes.data, info["addr"], nbytes)])
        # Ours is 5 s; Mooncake's own default would be 30.
        assert time.monotonic() - started < 20
        engine.unregister(src.ctypes.data)
        engine.close()
    finally:
        target.kill()
        target.wait(timeout=30)
