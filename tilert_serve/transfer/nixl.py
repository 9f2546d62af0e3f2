"""NIXL with the UCX backend. Peers exchange agent metadata (in Hello); writes are one-sided.

Facts (reference/transfer-engines.md §3): without torch tensors, memory is registered as
(addr, nbytes, device id, "") tuples with a memory type; NIXL's progress thread busy-spins unless its
delay is raised (two agents saturate a 2-core box), and UCX's ib modules crash at exit when the
system's libefa is present.

Where it listens: NIXL's own listener thread is off (peers get our metadata in the handoff's Hello).
UCX's TCP transport listens on every interface with an address unless UCX_NET_DEVICES names some
(seen here: with nothing set, on eth0 and lo; with UCX_NET_DEVICES=lo, on 127.0.0.1 only);
transfer.transport_env names the data-plane interface over tcp, and tests/netns shows nothing of it
on the pod network then. Over rdma we set nothing: the spec's env (UCX_NET_DEVICES=mlx5_0:1, or
UCX_TLS without tcp) decides, and without it UCX's TCP transport also listens on the pod network.
Neither UCX nor NIXL authenticates a peer: whoever holds an agent's metadata (which travels sealed but
not encrypted in Hello) can read and write its registered memory.
"""

from __future__ import annotations

import base64
import time
from collections.abc import Sequence
from typing import Any

from tilert_serve import defaults
from tilert_serve.transfer.base import TransferError, WriteOp

# Microseconds between progress-thread polls. 0 (NIXL's default) spins a whole core.
_PROGRESS_DELAY_US = 100
#: The bound on one write that the decode node's slot quarantine relies on (decode/slots.py).
_WRITE_TIMEOUT_S = defaults.WRITE_BOUND_S


def import_nixl() -> Any:
    """NIXL's Python API, with its progress thread patched to poll instead of spin (see above). UCX's
    settings for the protocol are transfer.transport_env's, set before this by transfer.create."""
    try:
        from nixl import _api as nixl_api
    except ImportError as exc:
        raise TransferError(f"NIXL is not importable ({exc}); install nixl with its UCX backend") from exc
    base_cls = nixl_api.nixlBind.nixlAgentConfig
    if not getattr(base_cls, "_tilert_patched", False):
        class _Config(base_cls):  # type: ignore[misc, valid-type]
            _tilert_patched = True

            def __setattr__(self, name: str, value: Any) -> None:
                if name == "pthrDelay":
                    value = max(int(value), _PROGRESS_DELAY_US)
                super().__setattr__(name, value)

        nixl_api.nixlBind.nixlAgentConfig = _Config
    return nixl_api


def _mem_type(device: str) -> tuple[str, int]:
    if device == "cpu":
        return "DRAM", 0
    if device.startswith("cuda"):
        return "VRAM", int(device.partition(":")[2] or 0)
    raise TransferError(f"unknown device {device!r}; use cpu or cuda:N")


class NixlEngine:
    name = "nixl"

    def __init__(self, agent_name: str) -> None:
        api = import_nixl()
        self._api = api
        # With its listener off NIXL defaults to no locking at all; the connector's sender threads
        # write concurrently (pd_vllm/worker.py), so transfers take NIXL's shared lock, metadata its
        # exclusive one.
        config = api.nixl_agent_config(enable_prog_thread=True, enable_listen_thread=False, backends=["UCX"],
                                       sync_mode=api.nixl_thread_sync_t.NIXL_THREAD_SYNC_RW)
        self._agent = api.nixl_agent(agent_name, config)
        self.agent_name = agent_name
        self._regs: dict[int, tuple[Any, str, int]] = {}  # addr -> (registration, mem type, device id)

    def register(self, addr: int, nbytes: int, device: str = "cpu") -> None:
        mem, dev = _mem_type(device)
        try:
            reg = self._agent.register_memory([(addr, nbytes, dev, "")], mem)
        except Exception as exc:
            raise TransferError(f"NIXL could not register {nbytes} bytes at 0x{addr:x} on {device}: {exc}") from exc
        self._regs[addr] = (reg, mem, dev)

    def unregister(self, addr: int) -> None:
        reg = self._regs.pop(addr, None)
        if reg is not None:
            self._agent.deregister_memory(reg[0])

    def peer_info(self) -> dict[str, Any]:
        # Taken after registration: NIXL peers only see regions present in the metadata they loaded.
        return {"agent": self.agent_name,
                "metadata": base64.b64encode(self._agent.get_agent_metadata()).decode()}

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
            raise TransferError(f"NIXL write to {peer} refused: {exc} (ranges outside the peer's registered "
                                "buffer, or stale peer metadata)") from exc
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
