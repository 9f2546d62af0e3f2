"""What a load run sends, decided before it starts: the prompt set, the request mix and the Poisson
arrival schedule. All pure and seeded: the same seed gives the same prompts, the same requests in the
same order and the same arrival offsets, on any machine, so two runs (a steady one and one through a
change, or the router and vLLM alone) send the same requests and their outputs can be compared one by
one."""

from __future__ import annotations

import hashlib
import json
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

Kind = Literal["completions", "chat"]
Route = Literal["tilert", "native", "auto"]
ROUTES: tuple[Route, ...] = ("tilert", "native", "auto")
KINDS: tuple[Kind, ...] = ("completions", "chat")

# Plain English words: every tokenizer splits them the same way run after run, and the tiny model's
# tokenizer knows them.
_WORDS = (
    "the model reads a prompt and writes tokens one at a time while the cache holds every key and "
    "value it has seen so far a decode node takes that state from the prefill over the network and "
    "carries on from the first token the router picks the path sends the prompt to the prefill and "
    "streams the answer back to the client who never learns where it was computed memory bandwidth "
    "bounds decode compute bounds prefill so the two run on different machines and meet in the middle "
    "data center river mountain window garden silver quiet morning evening number letter question"
).split()


@dataclass(frozen=True)
class Prompt:
    index: int
    text: str
    max_tokens: int


@dataclass(frozen=True)
class PromptSet:
    """`n` prompts of `words` words (inclusive range) each asking for `max_tokens` tokens (inclusive
    range), drawn from `seed`."""

    seed: int = 0
    n: int = 8
    words: tuple[int, int] = (6, 40)
    max_tokens: tuple[int, int] = (8, 24)
    prompts: tuple[Prompt, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name, (lo, hi) in (("words", self.words), ("max_tokens", self.max_tokens)):
            if not 1 <= lo <= hi:
                raise ValueError(
                    f"PromptSet.{name} must be (low, high) with 1 <= low <= high; got {(lo, hi)}"
                )
        if self.n < 1:
            raise ValueError(f"PromptSet.n must be at least 1; got {self.n}")
        rng = random.Random(f"prompts-{self.seed}")
        prompts = tuple(
            Prompt(
                i,
                " ".join(rng.choice(_WORDS) for _ in range(rng.randint(*self.words))),
                rng.randint(*self.max_tokens),
            )
            for i in range(self.n)
        )
        object.__setattr__(self, "prompts", prompts)


@dataclass(frozen=True)
class Mix:
    """Shares of the requests: routes by weight; `stream`, `chat` and `greedy` (temperature 0) as
    fractions. Requests that are not greedy sample at temperature 1 and are not compared."""

    routes: tuple[tuple[Route, float], ...] = (("tilert", 1.0), ("native", 1.0), ("auto", 1.0))
    stream: float = 0.5
    chat: float = 0.5
    greedy: float = 1.0

    def __post_init__(self) -> None:
        for name in ("stream", "chat", "greedy"):
            v = getattr(self, name)
            if not 0.0 <= v <= 1.0:
                raise ValueError(f"Mix.{name} is a fraction between 0 and 1; got {v}")
        bad = [r for r, _ in self.routes if r not in ROUTES]
        if bad:
            raise ValueError(f"Mix.routes names unknown routes {bad}; use {', '.join(ROUTES)}")
        if any(w < 0 for _, w in self.routes) or sum(w for _, w in self.routes) <= 0:
            raise ValueError(f"Mix.routes needs non-negative weights with a positive sum; got {self.routes}")

    @classmethod
    def only(cls, route: Route, **kw: float) -> Mix:
        return cls(routes=((route, 1.0),), **kw)


@dataclass(frozen=True)
class RequestSpec:
    """One request of the run, as planned (what it asks for, not what happened)."""

    seq: int
    #: Seconds after the run's start at which it is due.
    offset_s: float
    prompt: Prompt
    kind: Kind
    stream: bool
    route: Route
    greedy: bool

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.kind == "chat" else "/v1/completions"

    def body(self, model: str) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": model,
            "max_tokens": self.prompt.max_tokens,
            "temperature": 0.0 if self.greedy else 1.0,
            "stream": self.stream,
        }
        if self.kind == "chat":
            body["messages"] = [{"role": "user", "content": self.prompt.text}]
        else:
            body["prompt"] = self.prompt.text
        if self.stream:
            body["stream_options"] = {"include_usage": True}
        return body

    @property
    def reference_key(self) -> str:
        return reference_key(self.kind, self.prompt.text, self.prompt.max_tokens)


def reference_key(kind: Kind, text: str, max_tokens: int) -> str:
    """Identifies a greedy request's expected output: the same prompt, kind and length give the same
    text whatever the route, the streaming or the run."""
    digest = hashlib.sha256(json.dumps([kind, text, max_tokens]).encode()).hexdigest()[:20]
    return f"{kind}/{max_tokens}/{digest}"


@dataclass(frozen=True)
class LoadPlan:
    """Poisson arrivals at `rate` per second, for `duration_s` seconds or `count` requests, whichever
    ends first (at least one must be set: the load is always bounded)."""

    rate: float
    duration_s: float | None = None
    count: int | None = None
    seed: int = 0
    mix: Mix = Mix()
    prompts: PromptSet = PromptSet()
    #: Per-request limit, headers to last byte; past it the request is recorded as a timeout.
    timeout_s: float = 120.0

    def __post_init__(self) -> None:
        if not (self.rate > 0 and math.isfinite(self.rate)):
            raise ValueError(
                f"LoadPlan.rate must be a positive number of requests per second; got {self.rate}"
            )
        if self.duration_s is None and self.count is None:
            raise ValueError("LoadPlan needs duration_s or count (or both): open-loop load must be bounded")
        if self.duration_s is not None and self.duration_s <= 0:
            raise ValueError(f"LoadPlan.duration_s must be positive; got {self.duration_s}")
        if self.count is not None and self.count < 1:
            raise ValueError(f"LoadPlan.count must be at least 1; got {self.count}")


def schedule(plan: LoadPlan) -> Iterator[RequestSpec]:
    """The run's requests in arrival order: exponential gaps of mean 1/rate (a Poisson process), each
    request's shape drawn from the mix. Two random streams, so changing the mix leaves the arrival
    times of a seed alone."""
    gaps = random.Random(f"arrivals-{plan.seed}")
    shapes = random.Random(f"shapes-{plan.seed}")
    routes = [r for r, _ in plan.mix.routes]
    weights = [w for _, w in plan.mix.routes]
    t = 0.0
    seq = 0
    while plan.count is None or seq < plan.count:
        t += gaps.expovariate(plan.rate)
        if plan.duration_s is not None and t > plan.duration_s:
            return
        yield RequestSpec(
            seq=seq,
            offset_s=t,
            prompt=shapes.choice(plan.prompts.prompts),
            kind="chat" if shapes.random() < plan.mix.chat else "completions",
            stream=shapes.random() < plan.mix.stream,
            route=shapes.choices(routes, weights)[0],
            greedy=shapes.random() < plan.mix.greedy,
        )
        seq += 1
