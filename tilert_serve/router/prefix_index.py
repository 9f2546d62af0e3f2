"""An approximate index of what each prefill replica holds in its prefix cache, from the prompts this
router sent it. Pure data structure: no I/O, no clock.

vLLM caches a prompt's KV in fixed-size blocks, each keyed by a hash chained over every block before
it, so a block hit means the whole prefix up to it is cached. The router has no tokenizer, so it
imitates that over what it has: the prompt's token ids when the request carries them, else its text
(a chat's messages rendered one after the other, so a shared system prompt and earlier turns of a
conversation hash alike), cut into blocks of characters. Only whole blocks count, as in vLLM.

What this index believes may be wrong both ways (vLLM evicted a block; another router replica sent the
prefix): it only steers a choice, never correctness. Its memory is bounded: at most
`max_blocks_per_endpoint` block hashes per prefill and `max_blocks_total` over all, least recently
used evicted first.

Hashes come from hashlib (blake2b), never from `hash()`, so two router replicas, and two runs, key the
same prompt alike whatever PYTHONHASHSEED is.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

_DIGEST = 8  # bytes: 2^64 hashes, collisions negligible at a few million entries
#: Request fields that change the rendered prompt's beginning (tools are rendered into the system
#: part by most chat templates): they seed the chain, so a different value matches nothing.
_CHAT_SEED_FIELDS = ("tools", "chat_template", "chat_template_kwargs", "add_generation_prompt")


@dataclass(frozen=True)
class PrefixKey:
    """A prompt's chained block hashes: `blocks[i]` stands for the prompt's first i + 1 blocks."""

    blocks: tuple[int, ...] = ()

    def __len__(self) -> int:
        return len(self.blocks)


def _chain(seed: bytes, chunks: Iterable[bytes], limit: int) -> PrefixKey:
    out: list[int] = []
    parent = hashlib.blake2b(seed, digest_size=_DIGEST).digest()
    for chunk in chunks:
        if len(out) >= limit:
            break
        parent = hashlib.blake2b(parent + chunk, digest_size=_DIGEST).digest()
        out.append(int.from_bytes(parent, "little"))
    return PrefixKey(tuple(out))


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, ensure_ascii=False, separators=(",", ":"))


def text_key(text: str, *, block_chars: int, seed: str = "", limit: int) -> PrefixKey:
    """The key of a text prompt: its whole blocks of `block_chars` characters (UTF-8 encoded)."""
    whole = len(text) - len(text) % block_chars
    chunks = (text[i : i + block_chars].encode() for i in range(0, whole, block_chars))
    return _chain(b"text\x00" + seed.encode(), chunks, limit)


def token_key(ids: Sequence[int], *, block_tokens: int, limit: int) -> PrefixKey:
    """The key of a prompt given as token ids: whole blocks of `block_tokens` ids (8 bytes each)."""
    whole = len(ids) - len(ids) % block_tokens
    chunks = (
        b"".join(int(t).to_bytes(8, "little", signed=True) for t in ids[i : i + block_tokens])
        for i in range(0, whole, block_tokens)
    )
    return _chain(b"tokens\x00", chunks, limit)


def render_chat(messages: Sequence[Any]) -> str:
    """The messages as one text, each message canonical JSON on its own line: a conversation's next turn
    renders as this text with more appended, so the earlier turns match as a prefix."""
    return "".join(_canonical(m) + "\n" for m in messages)


def request_key(
    kind: str, body: Mapping[str, Any], *, block_chars: int, block_tokens: int, limit: int
) -> PrefixKey:
    """The key of a checked request body (openai_request.parse passed it): `kind` "chat" keys the
    rendered messages; a completion keys its token ids or its text. A batch of prompts keys nothing
    (no one replica is its home)."""
    if kind == "chat":
        seed = _canonical({f: body[f] for f in _CHAT_SEED_FIELDS if f in body})
        return text_key(
            render_chat(body.get("messages") or []), block_chars=block_chars, seed=seed, limit=limit
        )
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if isinstance(prompt, str):
        return text_key(prompt, block_chars=block_chars, limit=limit)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return token_key(prompt, block_tokens=block_tokens, limit=limit)
    return PrefixKey()


class PrefixIndex:
    """Per prefill endpoint, the block hashes it was sent, least recently used first.

    Owned by `pools.Pools` (one owner: it records a prompt when it picks that prompt's prefill, and
    forgets an endpoint that leaves the config); everything runs on the event loop thread.
    """

    def __init__(self, max_blocks_per_endpoint: int, max_blocks_total: int) -> None:
        if max_blocks_per_endpoint < 1 or max_blocks_total < 1:
            raise ValueError(
                "prefix index caps must be at least 1 (policy.prefix_index_blocks_per_endpoint, "
                "policy.prefix_index_blocks_total)"
            )
        self.max_per_endpoint = max_blocks_per_endpoint
        self.max_total = max_blocks_total
        #: endpoint -> block hash -> tick of its last use (the oldest first).
        self._blocks: dict[str, OrderedDict[int, int]] = {}
        self._total = 0
        self._tick = 0
        #: Entries dropped to stay under the caps (for tests and the index-size metric's readers).
        self.evicted = 0

    def __len__(self) -> int:
        """Block hashes held, over all endpoints: what the memory bound is about."""
        return self._total

    def size(self, endpoint: str) -> int:
        return len(self._blocks.get(endpoint, ()))

    def endpoints(self) -> list[str]:
        return list(self._blocks)

    def matched(self, key: PrefixKey, endpoint: str) -> int:
        """How many of the prompt's leading blocks `endpoint` was sent (and still holds here)."""
        held = self._blocks.get(endpoint)
        if not held:
            return 0
        n = 0
        for h in key.blocks:
            if h not in held:
                break
            n += 1
        return n

    def match(self, key: PrefixKey, endpoints: Iterable[str]) -> dict[str, int]:
        return {e: self.matched(key, e) for e in endpoints}

    def record(self, endpoint: str, key: PrefixKey) -> None:
        """`endpoint` was sent this prompt: its blocks become the most recently used there. The last
        block goes in first, so that eviction drops a prefix from its end (as vLLM's cache does) and
        what stays is still a prefix."""
        if not key.blocks:
            return
        held = self._blocks.setdefault(endpoint, OrderedDict())
        self._tick += 1
        for h in reversed(key.blocks[: self.max_per_endpoint]):
            if h in held:
                held.move_to_end(h)
            else:
                self._total += 1
            held[h] = self._tick
        while len(held) > self.max_per_endpoint:
            held.popitem(last=False)
            self._total -= 1
            self.evicted += 1
        while self._total > self.max_total:
            self._evict_oldest()

    def _evict_oldest(self) -> None:
        # The endpoint whose least recently used entry is the oldest of all: a few endpoints, so a scan.
        name = min(
            (e for e, held in self._blocks.items() if held),
            key=lambda e: next(iter(self._blocks[e].values())),
        )
        held = self._blocks[name]
        held.popitem(last=False)
        self._total -= 1
        self.evicted += 1
        if not held:
            del self._blocks[name]

    def forget(self, endpoint: str) -> None:
        """`endpoint` left (or restarted with an empty cache): drop what it was sent."""
        held = self._blocks.pop(endpoint, None)
        if held is not None:
            self._total -= len(held)

    def keep_only(self, endpoints: Iterable[str]) -> None:
        keep = set(endpoints)
        for name in [e for e in self._blocks if e not in keep]:
            self.forget(name)
