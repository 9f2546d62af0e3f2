"""Incremental detokenization: text deltas for streamed token ids.

Decoding each new token alone breaks multi-byte characters and tokenizers that change a token's
text by context (leading spaces), so each delta is the difference between decoding a short window
with and without the new tokens, and nothing is emitted while the text ends in an incomplete
character. The window starts with the prompt's tail and the first token, whose text the router
already sent, unless that token ends in an incomplete character: then the prefill could not send
its text, and it is emitted here with the token that completes it.
"""

from __future__ import annotations

from typing import Any

_CONTEXT = 6
_REPLACEMENT = "\ufffd"


class Detokenizer:
    def __init__(self, tokenizer: Any, context_ids: list[int], first_token: int) -> None:
        self.tok = tokenizer
        self.ids = [*context_ids[-_CONTEXT:], first_token]
        self.prefix = 0
        self.read = len(self.ids)
        if self._text(self.ids).endswith(_REPLACEMENT):
            self.read -= 1

    def _text(self, ids: list[int]) -> str:
        return str(self.tok.decode(ids, skip_special_tokens=True))

    def push(self, new_ids: list[int]) -> str:
        self.ids += new_ids
        before = self._text(self.ids[self.prefix:self.read])
        after = self._text(self.ids[self.prefix:])
        if len(after) > len(before) and not after.endswith(_REPLACEMENT):
            self.prefix, self.read = self.read, len(self.ids)
            return after[len(before):]
        return ""
