"""The expected text of every greedy request of a prompt set, from vLLM alone: the same model served
by one plain vLLM (no connector, no router). Collected once per prompt set and model from any
OpenAI-compatible endpoint, and cacheable in a JSON file, so a scenario test compares what the stack
answered through a change with what vLLM alone answers, request by request."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from bench.load import client
from bench.load.plan import KINDS, Kind, PromptSet, RequestSpec, reference_key

#: Bumped when the file's meaning changes; a cache of another version is collected again.
FORMAT = 1


@dataclass
class References:
    model: str
    #: Where the texts came from (the endpoint's name and URL), for the report.
    source: str
    #: reference_key -> text.
    texts: dict[str, str] = field(default_factory=dict)

    def match(self, spec: RequestSpec, text: str) -> bool | None:
        """Whether a greedy request's text equals vLLM alone's; None when it is not greedy or there
        is no reference for it."""
        if not spec.greedy:
            return None
        want = self.texts.get(spec.reference_key)
        return None if want is None else text == want

    def covers(self, prompts: PromptSet, kinds: tuple[Kind, ...] = KINDS) -> bool:
        return all(
            reference_key(k, p.text, p.max_tokens) in self.texts for p in prompts.prompts for k in kinds
        )

    def save(self, path: Path) -> None:
        body = {"format": FORMAT, "model": self.model, "source": self.source, "texts": self.texts}
        path.write_text(json.dumps(body, indent=1, sort_keys=True))

    @classmethod
    def load(cls, path: Path) -> References:
        try:
            body = json.loads(path.read_text())
            if body.get("format") != FORMAT:
                raise ValueError(f"format {body.get('format')!r}, this harness writes {FORMAT}")
            return cls(
                str(body["model"]), str(body["source"]), {str(k): str(v) for k, v in body["texts"].items()}
            )
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ValueError(
                f"{path} is not a references file of this harness ({exc}); delete it to collect again"
            ) from exc


async def collect(
    target: client.Target,
    prompts: PromptSet,
    *,
    kinds: tuple[Kind, ...] = KINDS,
    concurrency: int = 2,
    timeout_s: float = 120.0,
    progress: Callable[[str], None] | None = None,
) -> References:
    """Ask `target` (vLLM alone) each prompt greedily, whole (not streamed), once per kind. Any answer
    but a complete one is an error naming the prompt: a reference must not be a guess."""
    specs = [
        RequestSpec(seq=i, offset_s=0.0, prompt=p, kind=k, stream=False, route="native", greedy=True)
        for i, (p, k) in enumerate((p, k) for p in prompts.prompts for k in kinds)
    ]
    plain = client.Target(target.name, target.base_url, target.model, target.api_key, routes=False)
    refs = References(target.model, f"{target.name} ({target.base_url})")
    gate = asyncio.Semaphore(concurrency)

    async def ask(spec: RequestSpec) -> None:
        async with gate:
            rec = await client.one(plain, spec, timeout_s)
        if not rec.ok:
            raise RuntimeError(
                f"reference for prompt {spec.prompt.index} ({spec.kind}) from {plain.base_url}: "
                f"{rec.outcome} {rec.status or ''} {rec.error}; is vLLM alone up and serving {plain.model!r}?"
            )
        refs.texts[spec.reference_key] = rec.text
        if progress:
            progress(f"  reference {len(refs.texts)}/{len(specs)}")

    await asyncio.gather(*(ask(s) for s in specs))
    return refs


async def cached(
    path: Path | None,
    target: client.Target,
    prompts: PromptSet,
    *,
    kinds: tuple[Kind, ...] = KINDS,
    progress: Callable[[str], None] | None = None,
) -> References:
    """The references in `path` when they cover the prompt set for `target.model`; else collected from
    `target` and written there (None: collected, not cached)."""
    if path is not None and path.exists():
        refs = References.load(path)
        if refs.model == target.model and refs.covers(prompts, kinds):
            return refs
    refs = await collect(target, prompts, kinds=kinds, progress=progress)
    if path is not None:
        refs.save(path)
    return refs
