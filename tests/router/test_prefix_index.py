"""The router's prefix index (prefix_index.py) and the pure prefill choice (prefill_choice.py)."""

from __future__ import annotations

import os
import random
import subprocess
import sys

import pytest

from tilert_serve.router import prefill_choice as pc
from tilert_serve.router import prefix_index as pi

BC = 16  # characters a block, small so that tests read


def key(text: str, limit: int = 10_000) -> pi.PrefixKey:
    return pi.text_key(text, block_chars=BC, limit=limit)


def chat_key(messages: list[dict[str, str]], **extra: object) -> pi.PrefixKey:
    return pi.request_key(
        "chat", {"messages": messages, **extra}, block_chars=BC, block_tokens=4, limit=10_000
    )


def test_only_whole_blocks_are_keyed_and_each_block_hash_stands_for_its_whole_prefix() -> None:
    assert len(key("x" * (BC - 1))) == 0
    assert len(key("x" * (3 * BC + 5))) == 3
    a, b = key("a" * BC + "b" * BC), key("c" * BC + "b" * BC)
    # The same second block after another first block is another hash: hashes are chained.
    assert a.blocks[1] != b.blocks[1]
    assert key("a" * BC + "b" * BC + "zz").blocks == a.blocks


def test_matching_counts_the_leading_blocks_an_endpoint_was_sent() -> None:
    idx = pi.PrefixIndex(1000, 10_000)
    system = "You are a helpful assistant. " * 4
    idx.record("p0", key(system + "first question, a long one"))
    asked = key(system + "second question, also long")
    shared = len(key(system))
    got = idx.match(asked, ["p0", "p1"])
    assert got["p1"] == 0
    assert shared <= got["p0"] < len(asked)
    assert idx.matched(key(system + "first question, a long one"), "p0") == len(
        key(system + "first question, a long one")
    )


def test_a_chat_turn_matches_the_earlier_turns_and_tools_change_everything() -> None:
    turn1 = [{"role": "system", "content": "S" * 64}, {"role": "user", "content": "hello there, how are you"}]
    turn2 = [
        *turn1,
        {"role": "assistant", "content": "fine thanks " * 3},
        {"role": "user", "content": "and?" * 8},
    ]
    idx = pi.PrefixIndex(1000, 10_000)
    k1 = chat_key(turn1)
    idx.record("p0", k1)
    # The rendered turn 1 may end mid-block; every whole block of it is a prefix of turn 2's.
    assert idx.matched(chat_key(turn2), "p0") == len(k1)
    assert len(chat_key(turn2)) > len(k1)
    assert idx.matched(chat_key(turn2, tools=[{"type": "function", "function": {"name": "f"}}]), "p0") == 0


def test_token_id_prompts_are_keyed_by_ids_and_batches_by_nothing() -> None:
    ids = list(range(40))
    k = pi.request_key("completion", {"prompt": ids}, block_chars=BC, block_tokens=8, limit=100)
    assert len(k) == 5
    assert k == pi.request_key("completion", {"prompt": [ids]}, block_chars=BC, block_tokens=8, limit=100)
    assert k != pi.request_key(
        "completion", {"prompt": [*ids[:8], 999, *ids[9:]]}, block_chars=BC, block_tokens=8, limit=100
    )
    two = pi.request_key(
        "completion", {"prompt": ["a" * 64, "b" * 64]}, block_chars=BC, block_tokens=8, limit=100
    )
    assert len(two) == 0


def test_the_per_endpoint_cap_evicts_the_least_recently_sent_from_the_end_of_a_prefix() -> None:
    idx = pi.PrefixIndex(8, 1000)
    old, new = key("o" * BC * 6), key("n" * BC * 6)
    idx.record("p0", old)
    idx.record("p0", new)
    assert idx.size("p0") == 8 and len(idx) == 8
    assert idx.matched(new, "p0") == 6
    # Of the older prompt its head stays: eviction took its last blocks first.
    assert idx.matched(old, "p0") == 2
    idx.record("p0", old)  # sent again: most recent now
    assert idx.matched(old, "p0") == 6


def test_the_total_cap_evicts_the_oldest_over_all_endpoints_and_forget_frees() -> None:
    idx = pi.PrefixIndex(100, 10)
    a, b = key("a" * BC * 6), key("b" * BC * 6)
    idx.record("p0", a)
    idx.record("p1", b)
    assert len(idx) == 10 and idx.evicted == 2
    assert idx.matched(b, "p1") == 6 and idx.matched(a, "p0") == 4
    idx.keep_only(["p1"])
    assert len(idx) == 6 and idx.endpoints() == ["p1"]


def test_memory_stays_bounded_under_100k_unique_prompts() -> None:
    per, total = 500, 1200
    idx = pi.PrefixIndex(per, total)
    rng = random.Random(7)
    eps = ["p0", "p1", "p2"]
    peak = 0
    for i in range(100_000):
        idx.record(eps[i % 3], key(f"{i:08d}" + "q" * (BC * rng.randint(1, 4))))
        peak = max(peak, len(idx))
    assert peak == total == len(idx)
    assert all(idx.size(e) <= per for e in eps)
    assert sum(idx.size(e) for e in eps) == len(idx)
    assert idx.evicted > 100_000  # it kept evicting rather than growing


def test_keys_do_not_depend_on_the_hash_seed() -> None:
    code = (
        "from tilert_serve.router.prefix_index import request_key as k;"
        "print(k('chat', {'messages': [{'role': 'user', 'content': 'x' * 300}]},"
        " block_chars=16, block_tokens=4, limit=100).blocks[-1])"
    )
    outs = {
        subprocess.run(
            [sys.executable, "-c", code],
            env={**os.environ, "PYTHONHASHSEED": seed},
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        for seed in ("1", "2", "3")
    }
    assert len(outs) == 1 and outs.pop().strip().isdigit()


def test_bad_caps_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match="prefix_index_blocks_per_endpoint"):
        pi.PrefixIndex(0, 10)


# The choice.

C = pc.Candidate


def test_cache_aware_takes_the_longest_match_while_loads_are_close() -> None:
    got = pc.choose_prefill("cache_aware", [C(2, 1), C(3, 9), C(0, 0)], 10, turn=0)
    assert got == pc.Choice(1, "prefix")


def test_cache_aware_gives_the_request_to_the_least_loaded_past_both_balance_thresholds() -> None:
    t = pc.Thresholds(balance_abs=4, balance_rel=1.5, min_match_ratio=0.3)
    # 10 - 1 > 4 and 10 > 1.5: out of balance.
    assert pc.choose_prefill("cache_aware", [C(10, 9), C(1, 0)], 10, 0, t) == pc.Choice(1, "imbalance")
    # 5 - 1 = 4 is not past the absolute threshold.
    assert pc.choose_prefill("cache_aware", [C(5, 9), C(1, 0)], 10, 0, t) == pc.Choice(0, "prefix")
    # 30 - 25 > 4 but 30 < 25 * 1.5: not past the relative one.
    assert pc.choose_prefill("cache_aware", [C(30, 9), C(25, 0)], 10, 0, t) == pc.Choice(0, "prefix")


def test_cache_aware_ignores_a_short_match_and_rotates_among_equal_loads() -> None:
    t = pc.Thresholds(min_match_ratio=0.5)
    assert pc.choose_prefill("cache_aware", [C(3, 4), C(1, 0)], 10, 0, t) == pc.Choice(1, "short_match")
    picks = {pc.choose_prefill("cache_aware", [C(0), C(0), C(1)], 0, turn).index for turn in range(6)}
    assert picks == {0, 1}


def test_equal_matches_go_to_the_less_loaded() -> None:
    assert pc.choose_prefill("cache_aware", [C(4, 8), C(2, 8)], 8, 0).index == 1


def test_round_robin_ignores_load_and_least_loaded_ignores_matches() -> None:
    cands = [C(9, 9), C(0, 0), C(5, 0)]
    assert [pc.choose_prefill("round_robin", cands, 9, t).index for t in range(4)] == [0, 1, 2, 0]
    assert pc.choose_prefill("least_loaded", cands, 9, 0) == pc.Choice(1, "least_loaded")


def test_power_of_two_picks_the_less_loaded_of_its_pair_and_spreads() -> None:
    rng = random.Random(3)
    assert pc.power_of_two([5], rng) == 0
    assert all(pc.power_of_two([7, 2], rng, turn) == 1 for turn in range(20))
    assert [pc.power_of_two([0, 0], rng, turn) for turn in range(4)] == [0, 1, 0, 1]  # ties take turns
    loads = [0] * 8
    for turn in range(4000):
        loads[pc.power_of_two(loads, rng, turn)] += 1
    assert max(loads) - min(loads) <= 2  # two choices keep every server near the mean
    with pytest.raises(ValueError):
        pc.power_of_two([], rng)
