"""The digest of what a handoff wrote: each sender rank hashes the bytes it wrote, in write order
(layouts.write_ranges: layer by layer, plane by plane, `num_tokens` rows each) and sends it in Done;
the node hashes the same ranges of its receive buffer before it converts them, and refuses a state
whose bytes differ (torn, or overwritten by another writer of the unauthenticated data plane).

The hash is chosen by measured cost (bench/digest, bench/RESULTS.md): BLAKE3 (a cryptographic hash
as fast as a memcpy on the CPUs measured) when the `blake3` package is importable, else BLAKE2b from
hashlib (~6x slower). The node lists what it can compute in Hello (`digests`); the sender takes its
first preference the node shares and names it in the digest ("blake3:HEX"), so a node without
`blake3` still gets digests it can check. A cryptographic hash matters because the digest travels
readable (sealed, not encrypted) and the bytes can be read back from the data plane: a writer who
could find a second preimage could swap the state undetected.

Buffers on a GPU are hashed where they are when the digest is BLAKE3 and Triton is importable
(handoff/blake3_gpu.py: the same digest, computed in place, so a GPU node and a CPU prefill agree on
the string; a whole GLM-5 state 70-160x faster than through the host on an H200, bench/digest/gpu.py).
BLAKE2b, or GPU buffers without Triton, go through pinned host copies in chunks (bench/digest/run.py).
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from tilert_serve.layouts import Placement, senders_layers, write_ranges

#: Bytes copied to the host per step when hashing GPU memory (two such pinned buffers per thread).
_CHUNK = 64 << 20
_local = threading.local()


def _blake3() -> Callable[[], Any] | None:
    try:
        import blake3
    except ImportError:
        return None
    return blake3.blake3


def _hasher(algorithm: str) -> Any:
    if algorithm == "blake3":
        factory = _blake3()
        if factory is None:
            raise DigestError(
                "the digest uses blake3, which is not installed on this side; install the "
                "`blake3` package (or run both sides with the same digest)"
            )
        # AUTO: large updates are hashed on several threads (same digest; the GIL is released).
        return factory(max_threads=factory.AUTO)  # type: ignore[attr-defined, call-arg]
    if algorithm == "blake2b":
        return hashlib.blake2b(digest_size=32)
    raise DigestError(f"unknown digest algorithm {algorithm!r}; known: blake3, blake2b")


class DigestError(Exception):
    """A digest that cannot be computed or does not match; the message says which and why."""


def available() -> list[str]:
    """The algorithms this side can compute, preferred first."""
    return ["blake3", "blake2b"] if _blake3() is not None else ["blake2b"]


def preferred(theirs: Sequence[str] | None = None) -> str:
    """Our preferred algorithm that the other side can also compute (`theirs`, when known)."""
    ours = available()
    return next((a for a in ours if theirs is None or a in theirs), "blake2b")


def of_ranges(buffers: Sequence[torch.Tensor], ranges: Sequence[tuple[int, int, int]], algorithm: str) -> str:
    """ "ALGORITHM:HEX" of the bytes of `ranges` ((shard, offset, nbytes), in order) of `buffers`: on their
    GPU when `_on_gpu` says so (one set of launches for all the ranges), else on the host."""
    if algorithm == "blake3" and _on_gpu(buffers, ranges):
        from tilert_serve.handoff import blake3_gpu

        return f"blake3:{blake3_gpu.hexdigest(buffers, ranges)}"
    return of_ranges_on_host(buffers, ranges, algorithm)


def warm_up(device: torch.device | str) -> None:
    """Compile the GPU digest's kernels for `device` now (a no-op off CUDA or without blake3): the
    first call otherwise compiles them, tens of seconds inside a handoff whose ticket is ticking. A
    message of whole, straddling and short chunks over two ranges takes every kernel the handoff uses."""
    device = torch.device(device)
    if device.type != "cuda" or "blake3" not in available():
        return
    buf = torch.zeros(300 << 10, dtype=torch.uint8, device=device)
    of_ranges([buf], [(0, 0, 656 * 300), (0, 656 * 300, 8448 * 5 + 17)], "blake3")


def _on_gpu(buffers: Sequence[torch.Tensor], ranges: Sequence[tuple[int, int, int]]) -> bool:
    """Every buffer a range reads is a 1-D uint8 tensor on one CUDA device, and Triton imports."""
    used = {shard for shard, _, n in ranges if n > 0}
    if not used:
        return False
    device = buffers[next(iter(used))].device
    if device.type != "cuda" or any(
        buffers[s].device != device or buffers[s].dtype != torch.uint8 or buffers[s].dim() != 1 for s in used
    ):
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def of_ranges_on_host(
    buffers: Sequence[torch.Tensor], ranges: Sequence[tuple[int, int, int]], algorithm: str
) -> str:
    """of_ranges through the host: CPU buffers as they are, GPU ones through pinned copies."""
    h = _hasher(algorithm)
    for shard, off, n in ranges:
        view = buffers[shard][off : off + n]
        if view.device.type == "cpu":
            h.update(view.numpy())
        else:
            _update_from_gpu(h, view)
    return f"{algorithm}:{h.hexdigest()}"


def _update_from_gpu(h: Any, view: torch.Tensor) -> None:
    """Hash GPU bytes through two pinned host buffers: the copy of the next chunk (on a side stream,
    after the work already queued) overlaps the hashing of this one."""
    n = view.numel()
    if n == 0:
        return
    pinned = getattr(_local, "pinned", None)
    if pinned is None:
        pinned = _local.pinned = [torch.empty(_CHUNK, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
    stream = torch.cuda.Stream(view.device)  # type: ignore[no-untyped-call]
    stream.wait_stream(torch.cuda.current_stream(view.device))
    events = [torch.cuda.Event(), torch.cuda.Event()]  # type: ignore[no-untyped-call]
    starts = list(range(0, n, _CHUNK))

    def issue(i: int) -> None:
        start = starts[i]
        m = min(_CHUNK, n - start)
        with torch.cuda.stream(stream):
            pinned[i % 2][:m].copy_(view[start : start + m], non_blocking=True)
            events[i % 2].record(stream)

    issue(0)
    for i, start in enumerate(starts):
        events[i % 2].synchronize()
        if i + 1 < len(starts):
            issue(i + 1)  # into the other buffer, whose hashing finished last iteration
        h.update(pinned[i % 2][: min(_CHUNK, n - start)].numpy())


def sender_ranges(
    staging: Placement, rank: int, num_senders: int, num_tokens: int, layers: Sequence[int] | None = None
) -> list[tuple[int, int, int]]:
    """What rank `rank` writes, as (staging shard, offset, nbytes) in write order; with `layers`, only
    those layers' ranges (in the order given: a LayersDone's digest)."""
    which = senders_layers(staging.layout, rank, num_senders) if layers is None else list(layers)
    return [(r.src_shard, r.src, r.nbytes) for r in write_ranges(staging, staging, which, num_tokens)]


def receiver_ranges(
    placement: Placement, rank: int, num_senders: int, num_tokens: int, layers: Sequence[int] | None = None
) -> list[tuple[int, int, int]]:
    """Where rank `rank`'s bytes land in a slot of `placement`, in the same order (slot-relative)."""
    which = senders_layers(placement.layout, rank, num_senders) if layers is None else list(layers)
    return [(r.dst_shard, r.dst, r.nbytes) for r in write_ranges(placement, placement, which, num_tokens)]


def check(expected: str, buffers: Sequence[torch.Tensor], ranges: Sequence[tuple[int, int, int]]) -> None:
    """Raise DigestError unless the bytes of `ranges` hash to `expected`."""
    algorithm, _, _ = expected.partition(":")
    got = of_ranges(buffers, ranges, algorithm)
    if got != expected:
        raise DigestError(
            f"the received state's {algorithm} digest differs from the one its sender wrote "
            "(torn, or overwritten by another writer on the data plane); not decoded"
        )
