"""NIXL with the UCX backend. Peers exchange agent metadata (in Hello); writes are one-sided.

Without torch tensors, memory is registered as (addr, nbytes, device id, "") tuples with a memory
type.

Our settings are our agent's alone. A prefill process also holds vLLM's NixlConnector agents, and on
GPU nodes those keep NIXL's defaults (the lowest-latency progress for RDMA), so making an engine
patches nothing of NIXL's and leaves nothing in the process environment:
- Progress thread: `nixl_agent` hard-codes a delay of 0 between polls, which spins a whole core per
  agent (two agents saturate a 2-core box), and takes no argument for it. Our agent's constructor
  alone runs against a view of NIXL's binding that raises the delay (_polling_agent); every other
  agent is made as NIXL makes it.
- UCX_TLS, UCX_NET_DEVICES (transfer.transport_env's): given to our UCX backend as its
  `engine_config`, which NIXL applies to that backend's own UCX context and only where the process
  environment does not set the variable, so the spec's env (rendered into the pod) still decides.
- UCX_MODULES cannot be scoped: UCX reads it once per process, when NIXL first loads UCX, and loads
  its transport modules once for all contexts. It is set only while our backend is created and then
  removed. Ours first: no UCX context of the process (vLLM's included) gets the ib modules (over tcp,
  where they are useless and crash at exit beside the system's libefa). UCX loaded before ours:
  no effect. Only transport_env's tcp settings carry it; over rdma nothing is set.

Where it listens: NIXL's own listener thread is off (peers get our metadata in the handoff's Hello).
UCX's TCP transport listens on every interface with an address unless its NET_DEVICES names some
(seen here: with nothing set, on eth0 and lo; with lo named, on 127.0.0.1 only);
transfer.transport_env names the data-plane interface over tcp, and tests/netns shows nothing of it
on the pod network then. Over rdma we set nothing: the spec's env (UCX_NET_DEVICES=mlx5_0:1, or
UCX_TLS without tcp) decides, and without it UCX's TCP transport also listens on the pod network.
Neither UCX nor NIXL authenticates a peer: whoever holds an agent's metadata (which travels sealed but
not encrypted in Hello) can read and write its registered memory.
"""

from __future__ import annotations

import base64
import os
import threading
import time
import types
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from tilert_serve import defaults
from tilert_serve.transfer.base import TransferError, WriteOp

# Microseconds between progress-thread polls. 0 (NIXL's default) spins a whole core.
_PROGRESS_DELAY_US = 100
#: The bound on one write that the decode node's slot quarantine relies on (decode/slots.py).
_WRITE_TIMEOUT_S = defaults.WRITE_BOUND_S
#: Read by UCX once per process, when it is loaded: see the module's docstring.
_PROCESS_WIDE_UCX = frozenset({"UCX_MODULES"})
# Our engines' creations, one at a time: each one's temporary environment is its own.
_CREATING = threading.Lock()


def import_nixl() -> Any:
    """NIXL's Python API, unchanged."""
    try:
        from nixl import _api as nixl_api
    except ImportError as exc:
        raise TransferError(f"NIXL is not importable ({exc}); install nixl with its UCX backend") from exc
    return nixl_api


class _PollingBinding:
    """NIXL's binding module as an agent's constructor sees it, except that the agent it makes polls
    every _PROGRESS_DELAY_US instead of spinning."""

    def __init__(self, binding: Any) -> None:
        self._binding = binding

    def __getattr__(self, name: str) -> Any:
        return getattr(self._binding, name)

    def nixlAgent(self, name: str, config: Any) -> Any:  # named as the binding names it
        config.pthrDelay = max(int(config.pthrDelay), _PROGRESS_DELAY_US)
        return self._binding.nixlAgent(name, config)


def _polling_agent(api: Any, name: str, config: Any) -> Any:
    """A `nixl_agent` whose progress thread polls: NIXL's own constructor, run with _PollingBinding as
    its module's binding for this one call, so no other agent of the process is affected."""
    init = api.nixl_agent.__init__
    if "nixlBind" not in init.__code__.co_names:
        raise TransferError(
            "this NIXL's nixl_agent no longer makes its agent through nixlBind; "
            "tilert_serve.transfer.nixl cannot raise its progress delay (update it)"
        )
    scoped_init = types.FunctionType(
        init.__code__,
        {**init.__globals__, "nixlBind": _PollingBinding(api.nixlBind)},
        init.__name__,
        init.__defaults__,
        init.__closure__,
    )
    scoped_init.__kwdefaults__ = init.__kwdefaults__
    agent = api.nixl_agent.__new__(api.nixl_agent)
    scoped_init(agent, name, config)
    return agent


def poll_in_every_agent() -> None:
    """For the processes of `tilert-pd local` and the CPU vLLM image only (site/sitecustomize.py): every
    NIXL agent of this process, vLLM's included, polls instead of spinning a core. Process-wide by
    intent; NixlEngine does not need it."""
    api = import_nixl()
    if not isinstance(api.nixlBind, _PollingBinding):
        api.nixlBind = _PollingBinding(api.nixlBind)


def _ucx_engine_config(ucx: Mapping[str, str]) -> str:
    """UCX settings as the UCX backend's engine_config: KEY=VALUE (without UCX_), comma-separated."""
    items = []
    for key, value in ucx.items():
        if not key.startswith("UCX_") or "," in value or "=" in key:
            raise TransferError(
                f"UCX setting {key}={value!r} cannot be given to one NIXL agent (a UCX_ "
                "variable without commas in its value); set it in the environment instead"
            )
        items.append(f"{key.removeprefix('UCX_')}={value}")
    return ",".join(items)


@contextmanager
def _environment_while(settings: Mapping[str, str]) -> Iterator[None]:
    """`settings` in the process environment for the duration, where it does not set them already."""
    added = {key: value for key, value in settings.items() if key not in os.environ}
    os.environ.update(added)
    try:
        yield
    finally:
        for key, value in added.items():
            if os.environ.get(key) == value:
                del os.environ[key]


def _mem_type(device: str) -> tuple[str, int]:
    if device == "cpu":
        return "DRAM", 0
    if device.startswith("cuda"):
        return "VRAM", int(device.partition(":")[2] or 0)
    raise TransferError(f"unknown device {device!r}; use cpu or cuda:N")


class NixlEngine:
    name = "nixl"

    def __init__(self, agent_name: str, ucx: Mapping[str, str] | None = None) -> None:
        """`ucx`: UCX_* settings for this agent's UCX context (transfer.transport_env's); the process
        environment wins over each."""
        api = import_nixl()
        self._api = api
        ucx = dict(ucx or {})
        engine_config = _ucx_engine_config({k: v for k, v in ucx.items() if k not in _PROCESS_WIDE_UCX})
        backend = {"engine_config": engine_config} if engine_config else {}
        # With its listener off NIXL defaults to no locking at all; the connector's sender threads
        # write concurrently (pd_vllm/worker.py), so transfers take NIXL's shared lock, metadata its
        # exclusive one. The UCX backend is made after the agent, to give it our settings.
        config = api.nixl_agent_config(
            enable_prog_thread=True,
            enable_listen_thread=False,
            backends=[],
            sync_mode=api.nixl_thread_sync_t.NIXL_THREAD_SYNC_RW,
        )
        with _CREATING:
            self._agent = _polling_agent(api, agent_name, config)
            with _environment_while({k: v for k, v in ucx.items() if k in _PROCESS_WIDE_UCX}):
                try:
                    self._agent.create_backend("UCX", backend)
                except Exception as exc:
                    raise TransferError(f"NIXL could not create its UCX backend ({backend}): {exc}") from exc
        self.agent_name = agent_name
        self._regs: dict[int, tuple[Any, str, int]] = {}  # addr -> (registration, mem type, device id)

    def register(self, addr: int, nbytes: int, device: str = "cpu") -> None:
        mem, dev = _mem_type(device)
        try:
            reg = self._agent.register_memory([(addr, nbytes, dev, "")], mem)
        except Exception as exc:
            raise TransferError(
                f"NIXL could not register {nbytes} bytes at 0x{addr:x} on {device}: {exc}"
            ) from exc
        self._regs[addr] = (reg, mem, dev)

    def unregister(self, addr: int) -> None:
        reg = self._regs.pop(addr, None)
        if reg is not None:
            self._agent.deregister_memory(reg[0])

    def peer_info(self) -> dict[str, Any]:
        # Taken after registration: NIXL peers only see regions present in the metadata they loaded.
        return {
            "agent": self.agent_name,
            "metadata": base64.b64encode(self._agent.get_agent_metadata()).decode(),
        }

    def connect(self, peer: dict[str, Any]) -> str:
        try:
            name = self._agent.add_remote_agent(base64.b64decode(peer["metadata"]))
        except Exception as exc:
            raise TransferError(f"NIXL could not load the peer's metadata: {exc}") from exc
        return name.decode() if isinstance(name, bytes) else str(name)

    def write(self, peer: str, ops: Sequence[WriteOp]) -> None:
        if not ops:
            return
        mem, dev = next(iter(self._regs.values()))[1:] if self._regs else ("DRAM", 0)
        local = self._agent.get_xfer_descs([(o.local_addr, o.nbytes, dev) for o in ops], mem)
        # The remote side is host memory on CPU nodes and GPU memory on GPU nodes; the node says
        # which in its peer info in a later version. Today both sides of a deployment match.
        remote = self._agent.get_xfer_descs([(o.remote_addr, o.nbytes, dev) for o in ops], mem)
        try:
            handle = self._agent.initialize_xfer("WRITE", local, remote, peer)
        except Exception as exc:
            raise TransferError(
                f"NIXL write to {peer} refused: {exc} (ranges outside the peer's registered "
                "buffer, or stale peer metadata)"
            ) from exc
        try:
            state = self._agent.transfer(handle)
            deadline = time.monotonic() + _WRITE_TIMEOUT_S
            while state == "PROC":
                if time.monotonic() > deadline:
                    raise TransferError(f"NIXL write to {peer} did not finish in {_WRITE_TIMEOUT_S:.0f} s")
                time.sleep(0.0002)
                state = self._agent.check_xfer_state(handle)
            if state != "DONE":
                raise TransferError(f"NIXL write to {peer} ended in state {state}: the peer may have died")
        finally:
            self._agent.release_xfer_handle(handle)

    def close(self) -> None:
        for addr in list(self._regs):
            self.unregister(addr)
