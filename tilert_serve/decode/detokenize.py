"""Incremental detokenization: the text deltas vLLM itself would stream for the same token ids.

The TileRT route's text must equal vLLM's alone, byte for byte: the prefill (vLLM) sends the first
token's text, the node the rest. vLLM 0.32 detokenizes with a fast tokenizer through
`tokenizers.decoders.DecodeStream` primed with the prompt's ids, so the node does the same and
steps the first token through it without emitting it: whatever that token left pending (half a
character) comes out with the token that completes it, exactly where vLLM emits it, and a trailing
half character is never emitted, as in vLLM.

Priming with the whole prompt costs a decode of the prompt; the stream's output depends only on the
prompt's text boundary, so a tail window gives the same deltas unless the window itself ends in an
incomplete character (the stream then keeps the window as pending text), when the whole prompt is
used as vLLM does.

Tokenizers without a Rust core (vLLM's slow path) get a window-diff detokenizer with the same
emission rule.
"""

from __future__ import annotations

from typing import Any, Protocol

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

_WINDOW = 32
#: Prompt tokens before the first new one that the slow path re-decodes with each delta (enough for a
#: tokenizer's leading-space and merged-character context).
_SLOW_CONTEXT = 6
_REPLACEMENT = "\ufffd"


class Detokenizer(Protocol):
    def push(self, new_ids: list[int]) -> str: ...


def detokenizer(tokenizer: Any, prompt_ids: list[int], first_token: int) -> Detokenizer:
    """The detokenizer for one generation whose first token the prefill already sent as text."""
    core = getattr(tokenizer, "_tokenizer", None)
    if isinstance(core, Tokenizer):
        return StreamDetokenizer(core, prompt_ids, first_token)
    return WindowDetokenizer(tokenizer, prompt_ids, first_token)


class StreamDetokenizer:
    """vLLM's FastIncrementalDetokenizer (skip_special_tokens=True), from the second token on."""

    def __init__(self, core: Tokenizer, prompt_ids: list[int], first_token: int) -> None:
        self.core = core
        primer = prompt_ids[-_WINDOW:]
        if len(primer) < len(prompt_ids) and core.decode(primer, skip_special_tokens=True).endswith(
            _REPLACEMENT
        ):
            primer = prompt_ids
        self.stream = DecodeStream(ids=primer, skip_special_tokens=True)
        self.step(first_token)

    def step(self, token: int) -> str:
        try:
            return self.stream.step(self.core, token) or ""
        except (OverflowError, TypeError):  # an id outside the vocabulary: vLLM emits nothing for it
            return ""
        except Exception as exc:
            # vLLM resets the stream on tokenizers' "Invalid prefix" (non-monotonic UTF-8 output) and
            # goes on from the token alone; anything else is a real error.
            if not str(exc).startswith("Invalid prefix encountered"):
                raise
            self.stream = DecodeStream(skip_special_tokens=True)
            return self.stream.step(self.core, token) or ""

    def push(self, new_ids: list[int]) -> str:
        return "".join(self.step(t) for t in new_ids)


class WindowDetokenizer:
    """Each delta is the difference between decoding a short window with and without the new tokens;
    nothing is emitted while the text ends in an incomplete character."""

    def __init__(self, tokenizer: Any, prompt_ids: list[int], first_token: int) -> None:
        self.tok = tokenizer
        self.ids = [*prompt_ids[-_SLOW_CONTEXT:], first_token]
        self.prefix = 0
        self.read = len(self.ids)
        if self._text(self.ids).endswith(_REPLACEMENT):
            self.read -= 1

    def _text(self, ids: list[int]) -> str:
        return str(self.tok.decode(ids, skip_special_tokens=True))

    def push(self, new_ids: list[int]) -> str:
        self.ids += new_ids
        before = self._text(self.ids[self.prefix : self.read])
        after = self._text(self.ids[self.prefix :])
        if len(after) > len(before) and not after.endswith(_REPLACEMENT):
            self.prefix, self.read = self.read, len(self.ids)
            return after[len(before) :]
        return ""
