"""Incremental detokenization: the TileRT route's text is vLLM's text. The first token's text comes
from the prefill (vLLM), the rest from the node; their concatenation, and each delta, must equal what
vLLM's own detokenizer streams for the same ids (vLLM 0.32's class is the oracle), wherever a
generation ends: inside a multi-byte character, on one, after an invalid byte sequence."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

# The oracle is imported, not importorskip'd: make setup always installs vLLM, so a vLLM that moved
# or renamed it must fail this contract, not skip it.
from vllm.v1.engine import detokenizer as vllm_detok

from tilert_serve.decode.detokenize import StreamDetokenizer, WindowDetokenizer, detokenizer
from tilert_serve.tinymodel.tokenizer import train_tokenizer


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer(1024)


def vllm_deltas(tok, prompt: list[int], steps: list[list[int]]) -> list[str]:
    """What vLLM streams for each engine step (the first step is the prefill's first token)."""
    from vllm import SamplingParams
    from vllm.v1.engine import EngineCoreRequest

    req = EngineCoreRequest(
        request_id="r",
        prompt_token_ids=prompt,
        mm_features=None,
        sampling_params=SamplingParams(max_tokens=64),
        pooling_params=None,
        arrival_time=0.0,
        lora_request=None,
        cache_salt=None,
        data_parallel_rank=None,
    )
    d = vllm_detok.IncrementalDetokenizer.from_new_request(tok, req)
    assert isinstance(d, vllm_detok.FastIncrementalDetokenizer)
    out = []
    for step in steps:
        d.update(step, stop_terminated=False)
        out.append(d.get_next_output_text(finished=False, delta=True))
    assert "".join(out) == d.get_next_output_text(finished=True, delta=False)
    return out


def byte_ids(tok, data: bytes) -> list[int]:
    """The byte-level vocabulary's single-byte tokens for raw bytes (halves of characters included)."""
    chars, vocab = _byte_chars(), tok.get_vocab()
    return [vocab[chars[b]] for b in data]


def _byte_chars() -> list[str]:
    # GPT-2's byte-to-unicode table, which tokenizers' ByteLevel uses.
    bs = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    table = dict(zip(bs, cs, strict=True))
    return [chr(table[b]) for b in range(256)]


def node_deltas(tok, prompt: list[int], steps: list[list[int]]) -> list[str]:
    det = detokenizer(tok, prompt, steps[0][0])
    return [det.push(step) for step in steps[1:]]


def check(tok, prompt: list[int], steps: list[list[int]]) -> None:
    expected = vllm_deltas(tok, prompt, steps)
    assert node_deltas(tok, prompt, steps) == expected[1:], (prompt, steps, expected)


def test_the_fast_tokenizer_gets_vllms_stream(tok):
    assert isinstance(detokenizer(tok, [1, 2], 3), StreamDetokenizer)


def test_a_generation_that_ends_inside_a_character_ends_as_in_vllm(tok):
    prompt = tok.encode("Prefill is compute-bound; de")
    check_mark = byte_ids(tok, "✓".encode())
    for cut in range(1, 4):
        check(tok, prompt, [tok.encode(" ow")[:1], *[[t] for t in check_mark[:cut]]])


def test_an_invalid_byte_then_text_carries_the_replacement_character_as_vllm(tok):
    prompt = [10, 20, 30]
    lone, space_d = byte_ids(tok, b"\xe2"), tok.encode(" d")
    check(tok, prompt, [tok.encode("ow")[:1], lone, [space_d[0]], space_d[1:] or [tok.encode("d")[0]]])


def test_a_first_token_with_half_a_character_is_completed_by_the_node(tok):
    e_acute = byte_ids(tok, "é".encode())
    check(tok, tok.encode("caf"), [e_acute[:1], e_acute[1:], tok.encode("!")])


def test_a_prompt_ending_in_half_a_character_primes_with_the_whole_prompt(tok):
    prompt = tok.encode("a long enough prompt " * 8) + byte_ids(tok, b"\xe2\x9c")
    check(tok, prompt, [byte_ids(tok, b"\x93"), tok.encode(" ok")])


@settings(max_examples=60, deadline=None)
@given(
    prompt=st.lists(st.integers(2, 1023), min_size=1, max_size=50),
    raw=st.binary(min_size=1, max_size=12),
    steps=st.lists(st.integers(1, 2), min_size=12, max_size=12),
)
def test_any_ids_in_steps_of_one_or_two_stream_as_vllm(tok, prompt, raw, steps):
    ids = byte_ids(tok, raw) + tok.encode(" and pref stars")
    chunks, i = [ids[:1]], 1
    for n in steps:
        if i < len(ids):
            chunks.append(ids[i : i + n])
            i += n
    check(tok, prompt, chunks)


class ByteTokenizer:
    """No Rust core: token id = one byte, for the window detokenizer."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


def test_a_slow_tokenizer_gets_the_window_detokenizer_with_whole_characters():
    det = detokenizer(ByteTokenizer(), list(b"caf"), "é".encode()[0])
    assert isinstance(det, WindowDetokenizer)
    assert det.push(list("é".encode()[1:])) == "é"
    text = "héllo wörld ✓"
    ids = list(text.encode())
    det = detokenizer(ByteTokenizer(), list(b"prompt "), ids[0])
    assert "".join(det.push([t]) for t in ids[1:]) == text[1:]
