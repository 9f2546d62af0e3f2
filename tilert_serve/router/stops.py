"""Stop strings on streamed text: pure, no I/O.

The TileRT node applies EOS, stop token ids and max_tokens; stop strings are the router's job. Text
that could be the start of a stop string is held back until the next delta decides, so the client
never sees part of a stop string (as with OpenAI and vLLM).
"""

from __future__ import annotations


class StopMatcher:
    def __init__(self, stops: tuple[str, ...], include_stop: bool = False) -> None:
        self._stops = stops
        self._include = include_stop
        # The longest text that may still turn into a stop string: hold back that many chars minus one.
        self._hold = max((len(s) for s in stops), default=1) - 1
        self._pending = ""
        self.stopped = False

    def feed(self, delta: str) -> str:
        """Add a delta; return the text that can be sent now. Sets `stopped` on a match."""
        if self.stopped:
            return ""
        if not self._stops:
            return delta
        text = self._pending + delta
        cut = -1
        match = ""
        for s in self._stops:
            i = text.find(s)
            if i >= 0 and (cut < 0 or i < cut):
                cut, match = i, s
        if cut >= 0:
            self.stopped = True
            self._pending = ""
            return text[: cut + len(match)] if self._include else text[:cut]
        if self._hold <= 0:
            return text
        keep = self._tail_that_may_start_a_stop(text)
        self._pending = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep]

    def flush(self) -> str:
        """At the end of the stream: what was held back is plain text after all."""
        out, self._pending = self._pending, ""
        return "" if self.stopped else out

    def _tail_that_may_start_a_stop(self, text: str) -> int:
        for keep in range(min(self._hold, len(text)), 0, -1):
            tail = text[-keep:]
            if any(s.startswith(tail) for s in self._stops):
                return keep
        return 0
