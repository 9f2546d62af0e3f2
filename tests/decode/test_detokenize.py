"""Incremental detokenization: deltas add up to the text of all tokens after the first, characters
split across tokens are emitted whole, and a first token ending in half a character is completed."""

from tilert_serve.decode.detokenize import Detokenizer


class ByteTokenizer:
    """Token id = one byte (like a byte-level BPE's byte tokens)."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


def test_deltas_concatenate_to_the_text_after_the_first_token():
    tok = ByteTokenizer()
    text = "héllo wörld ✓"
    ids = list(text.encode())
    det = Detokenizer(tok, list(b"prompt "), ids[0])
    out = "".join(det.push([t]) for t in ids[1:])
    assert out == text[1:]


def test_a_character_split_across_tokens_is_emitted_once_complete():
    tok = ByteTokenizer()
    check = list("✓".encode())  # three bytes
    det = Detokenizer(tok, [], ord("a"))
    assert det.push(check[:1]) == ""
    assert det.push(check[1:2]) == ""
    assert det.push(check[2:]) == "✓"


def test_a_first_token_with_half_a_character_is_completed_here():
    tok = ByteTokenizer()
    e_acute = list("é".encode())  # the prefill's token is the first byte: it could not send any text
    det = Detokenizer(tok, list(b"caf"), e_acute[0])
    assert det.push(e_acute[1:]) == "é"
    assert det.push(list(b"!")) == "!"
