"""The GPU BLAKE3 (handoff/blake3_gpu.py) against the `blake3` package, bit for bit, and digest.py's use
of it: sizes around the block, chunk and program boundaries, ranges of odd sizes and alignments across
two shards, a GLM-5 receive placement, and `check` over GPU buffers.

Without a GPU, the host model of the kernels' tree (`reference`: chunks in programs of aligned
subtrees, odd nodes carried up, ROOT on the last parent) and the plan of which programs need the
general kernel are checked here too. Timing lives in bench/digest/gpu.py.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
import torch

from tilert_serve import layouts
from tilert_serve.handoff import blake3_gpu, digest

blake3 = pytest.importorskip("blake3")


def gpu(test: Callable[..., None]) -> Callable[..., None]:
    """The Triton kernels run only on a GPU; the host model and the plan beside them run everywhere."""
    needs = pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs CUDA: the Triton kernels run only on a GPU"
    )
    return pytest.mark.gpu(needs(test))  # type: ignore[no-any-return]


#: Message sizes around BLAKE3's block (64 bytes) and chunk (1 KiB) boundaries, for both the host model
#: and the kernels.
AROUND_BLOCKS_AND_CHUNKS = (0, 1, 63, 64, 65, 1023, 1024, 1025, 2048, 3072, 4097)


def want(data: bytes) -> str:
    return str(blake3.blake3(data).hexdigest())


# -- everywhere: the tree the kernels compute, and which programs the general kernel takes -------------


@pytest.mark.parametrize("fanin", [2, 4, 8, 256])
def test_the_kernels_tree_is_blake3s(fanin: int) -> None:
    rng = random.Random(fanin)
    for n in (
        *AROUND_BLOCKS_AND_CHUNKS,
        5 * 1024,
        7 * 1024 + 3,
        9 * 1024,
        17 * 1024 - 1,
        33 * 1024 + 100,
        64 * 1024,
    ):
        data = rng.randbytes(n)
        assert blake3_gpu.reference(data, fanin).hex() == want(data), (n, fanin)


def _chunks_the_fast_kernel_leaves(ranges: list[tuple[int, int]]) -> set[int]:
    """By definition: chunks that are short, not inside one range, at an address that is not 16-byte
    aligned, or the message's only chunk."""
    where: list[tuple[int, int]] = []  # (range, address) of each message byte
    for r, (addr, n) in enumerate(ranges):
        where.extend((r, a) for a in range(addr, addr + n))
    num_chunks = max(1, -(-len(where) // 1024))
    out = set()
    for c in range(num_chunks):
        chunk = where[c * 1024 : (c + 1) * 1024]
        if (
            not (len(chunk) == 1024 and chunk[0][1] % 16 == 0 and chunk[0][0] == chunk[-1][0])
            or num_chunks == 1
        ):
            out.add(c)
    return out


@pytest.mark.parametrize("seed", range(8))
def test_the_plan_lists_every_chunk_the_fast_kernel_leaves(seed: int) -> None:
    rng = random.Random(seed)
    ranges, addr = [], 0
    for _ in range(rng.randint(1, 12)):
        n = rng.choice([0, 1, 100, 656, 1024, 2048, 4096, 8448, rng.randint(1, 6000)])
        addr += rng.choice([0, 0, 16, 1024, rng.randint(0, 99)])
        ranges.append((addr, n))
        addr += n
    p = blake3_gpu.plan(ranges)
    assert _chunks_the_fast_kernel_leaves([r for r in ranges if r[1]]) <= set(p.general)
    assert p.total == sum(n for _, n in ranges)
    assert p.num_chunks == max(1, -(-p.total // 1024))


def test_a_glm5_state_needs_the_general_kernel_only_where_rows_cut_chunks() -> None:
    place = layouts.Placement(layouts.get("glm5", "fp8_ds_mla"), max_tokens=4096)
    for tokens, most in (
        (4096, 0),
        (64, 2 * place.layout.num_layers + 1),
        (777, 2 * place.layout.num_layers + 1),
    ):
        ranges = digest.sender_ranges(place, 0, 1, tokens)
        assert len(blake3_gpu.plan([(off, n) for _, off, n in ranges]).general) <= most, tokens


# -- on a GPU: bit for bit ------------------------------------------------------------------------------


def _rand(n: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda", generator=gen)


@gpu
@pytest.mark.parametrize(
    "n",
    [
        *AROUND_BLOCKS_AND_CHUNKS,
        5 * 1024 + 7,
        128 * 1024,
        128 * 1024 + 1,
        129 * 1024,
        1000 * 1024,
        3 * 128 * 1024 - 5,
        (128 << 20) + 5,
        (1 << 30) + 4097,
    ],
)
def test_one_range_equals_blake3(n: int) -> None:
    gen = torch.Generator(device="cuda").manual_seed(n)
    buf = _rand(n + 64, gen)
    for off in (0, 16, 3):  # aligned, aligned off the start, unaligned (the general kernel throughout)
        if off == 3 and n > 1 << 26:
            continue
        got = blake3_gpu.hexdigest([buf], [(0, off, n)])
        assert got == want(buf[off : off + n].cpu().numpy().tobytes()), (n, off)


@gpu
@pytest.mark.parametrize("seed", range(4))
def test_many_odd_ranges_over_two_shards_equal_blake3(seed: int) -> None:
    rng = random.Random(seed)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    shards = [_rand(4 << 20, gen), _rand(3 << 20, gen)]
    ranges, pos = [], [0, 0]
    for _ in range(rng.randint(50, 400)):
        s = rng.randrange(2)
        n = rng.choice([0, 1, 5, 656, 1152, 8448, 1024 * rng.randint(1, 40), rng.randint(1, 30000)])
        off = pos[s] + rng.choice([0, 0, 16, rng.randint(0, 64)])
        if off + n > shards[s].numel():
            continue
        ranges.append((s, off, n))
        pos[s] = off + n if rng.random() < 0.8 else rng.randrange(shards[s].numel() // 2)
    host = [b.cpu() for b in shards]
    data = b"".join(host[s][o : o + n].numpy().tobytes() for s, o, n in ranges)
    assert blake3_gpu.hexdigest(shards, ranges) == want(data)
    assert digest.of_ranges(shards, ranges, "blake3") == digest.of_ranges(host, ranges, "blake3")


@gpu
@pytest.mark.parametrize("tokens", [64, 777, 4096])
def test_a_glm5_receive_slot_digests_as_on_the_host(tokens: int) -> None:
    place = layouts.Placement(layouts.get("glm5", "fp8_ds_mla"), max_tokens=4096, shards=2)
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    bufs = [_rand(place.shard_nbytes(s), gen) for s in range(place.shards)]
    host = [b.cpu() for b in bufs]
    for rank, senders, layers in ((0, 1, None), (3, 8, None), (0, 1, [5])):
        ranges = digest.receiver_ranges(place, rank, senders, tokens, layers)
        assert digest.of_ranges(bufs, ranges, "blake3") == digest.of_ranges(host, ranges, "blake3")
        assert digest.of_ranges(bufs, ranges, "blake2b") == digest.of_ranges(host, ranges, "blake2b")


@gpu
def test_check_over_gpu_buffers_accepts_the_same_bytes_and_refuses_one_flipped() -> None:
    gen = torch.Generator(device="cuda").manual_seed(7)
    bufs = [_rand(1 << 20, gen), _rand(1 << 20, gen)]
    ranges = [(0, 0, 300_000), (1, 4096, 656 * 500), (0, 400_000, 8448 * 3)]
    expected = digest.of_ranges([b.cpu() for b in bufs], ranges, "blake3")
    digest.check(expected, bufs, ranges)
    bufs[1][4096 + 1000] ^= 1
    with pytest.raises(digest.DigestError, match="differs"):
        digest.check(expected, bufs, ranges)


@gpu
def test_the_digest_waits_for_the_work_queued_before_it() -> None:
    buf = torch.zeros(64 << 20, dtype=torch.uint8, device="cuda")
    torch.cuda._sleep(10_000_000)  # a slow kernel ahead of the write: the hash must see the write
    buf.fill_(0x5A)
    assert blake3_gpu.hexdigest([buf], [(0, 0, buf.numel())]) == want(b"\x5a" * buf.numel())
