"""OpenAI response bodies the router writes itself (the TileRT path): chunks, whole responses, usage.

The native path relays vLLM's own bodies and only rewrites `usage` (`with_cached_tokens`).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

from tilert_serve.router.openai_request import Kind


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None) -> dict[str, Any]:
    u: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if cached_tokens is not None:
        u["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return u


def with_cached_tokens(u: dict[str, Any] | None, cached_tokens: int | None) -> dict[str, Any] | None:
    """The prefill computed the prompt, so its cached-token count is the one the client pays for."""
    if u is None or cached_tokens is None:
        return u
    details = dict(u.get("prompt_tokens_details") or {})
    details["cached_tokens"] = cached_tokens
    return {**u, "prompt_tokens_details": details}


def cached_tokens_of(body: dict[str, Any]) -> int | None:
    u = body.get("usage")
    if not isinstance(u, dict):
        return None
    details = u.get("prompt_tokens_details")
    if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
        return int(details["cached_tokens"])
    return None


def first_choice_text(kind: Kind, body: dict[str, Any]) -> tuple[str, str | None]:
    """(text, finish_reason) of the first choice of a vLLM response; raises KeyError/TypeError if absent."""
    choice = body["choices"][0]
    if kind == "chat":
        text = (choice.get("message") or {}).get("content") or ""
    else:
        text = choice.get("text") or ""
    return str(text), choice.get("finish_reason")


@dataclass
class ChunkWriter:
    """Builds one request's chunks; ids and `created` stay the same across the stream."""

    kind: Kind
    request_id: str
    model: str
    created: int = field(default_factory=lambda: int(time.time()))
    _role_sent: bool = False
    _template: tuple[bytes, bytes] | None = None

    @property
    def id(self) -> str:
        return ("chatcmpl-" if self.kind == "chat" else "cmpl-") + self.request_id

    def chunk(self, text: str, finish_reason: str | None = None) -> dict[str, Any]:
        if self.kind == "chat":
            delta: dict[str, Any] = {}
            if not self._role_sent:
                delta["role"] = "assistant"
                self._role_sent = True
            if text or finish_reason is None:
                delta["content"] = text
            choice: dict[str, Any] = {
                "index": 0,
                "delta": delta,
                "logprobs": None,
                "finish_reason": finish_reason,
            }
            obj = "chat.completion.chunk"
        else:
            choice = _text_choice(text, finish_reason)
            obj = "text_completion"
        return self._envelope(obj, [choice])

    def content_chunk(self, text: str) -> bytes:
        """A whole SSE event carrying only text (every chunk after the first): the constant parts are
        encoded once per request, only the text is JSON-escaped per chunk."""
        if self._template is None:
            marker = "\x00TEXT\x00"
            enc = json.dumps(self.chunk(marker), separators=(",", ":"))
            head, tail = enc.split(json.dumps(marker))
            self._template = (b"data: " + head.encode(), tail.encode() + b"\n\n")
        head_b, tail_b = self._template
        return head_b + json.dumps(text).encode() + tail_b

    def usage_chunk(self, u: dict[str, Any]) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        return self._envelope(obj, [], usage=u)

    def whole(self, text: str, finish_reason: str | None, u: dict[str, Any]) -> dict[str, Any]:
        if self.kind == "chat":
            choice: dict[str, Any] = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
                "finish_reason": finish_reason,
            }
            obj = "chat.completion"
        else:
            choice = _text_choice(text, finish_reason)
            obj = "text_completion"
        return self._envelope(obj, [choice], usage=u)

    def _envelope(self, obj: str, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        """The fields every response object of this request carries, in OpenAI's order."""
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            **extra,
        }


def _text_choice(text: str, finish_reason: str | None) -> dict[str, Any]:
    """A completions choice (the same in a stream's chunk and in a whole answer)."""
    return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
