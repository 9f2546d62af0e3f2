"""Stop rules for a decode stream: EOS and stop token ids, and max_tokens. Pure functions.

The first token came from the prefill (the router already sent it); max_tokens counts the tokens
after it. An MTP step may yield several tokens: the ones after a stop are dropped, the stop token
itself is kept in the ids (as vLLM keeps it) and left out of the text by the detokenizer.
"""

from __future__ import annotations

from collections.abc import Collection


def cut(
    step_tokens: list[int], produced: int, max_tokens: int, stop_ids: Collection[int]
) -> tuple[list[int], str | None]:
    """(tokens to emit from this step, finish reason or None) given `produced` tokens so far."""
    out: list[int] = []
    for tok in step_tokens:
        if produced + len(out) >= max_tokens:
            return out, "length"
        out.append(tok)
        if tok in stop_ids:
            return out, "stop"
    if produced + len(out) >= max_tokens:
        return out, "length"
    return out, None
