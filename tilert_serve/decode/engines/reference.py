"""The reference decode engine: DeepSeek-V3-style decoding with MTP in plain PyTorch (CPU or CUDA).

What the TileRT pool runs where TileRT itself cannot (anything but Blackwell). It takes the state
vLLM's prefill left in its MLA cache (per layer: normalised latent ``kv_c`` [seq, kv_lora_rank] and
roped ``k_pe`` [seq, rope_dim], main layers then the MTP layer) and decodes from the token the
prefill sampled, speculating with the MTP layer from the first step, as TileRT does:

1. warm start: recompute position seq_len-1 with the last prompt token; this rebuilds the main
   model's hidden state there, which MTP needs and which the cache does not hold;
2. MTP drafts k tokens from (that hidden state, first token), applied recursively for k > 1;
3. the main model verifies the pending token plus the drafts in one forward; greedy keeps the
   drafts that equal its argmax, sampling uses speculative sampling (see ``sampling``); either way
   the output is what plain decoding would give, plus one bonus token per step;
4. MTP runs over the newly accepted positions (writing its cache there) and drafts again.

Each sequence owns one slot of a preallocated per-layer cache [max_sequences, max_seq_len, latent].
``prefill`` computes the same state from token ids, as ground truth for tests and layout checks.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from tilert_serve.decode.engines import reference_model as rm
from tilert_serve.decode.engines import sampling as smp
from tilert_serve.decode.engines.base import DecodeStep, InjectedState, LayerState, Sampling

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class InjectedStateError(ValueError):
    """An InjectedState does not match the engine (layer count, shapes, length, token id)."""


class NoFreeSequenceError(RuntimeError):
    """Every sequence slot is in use; close a sequence first."""


@dataclass(frozen=True)
class ReferenceSettings:
    """How to run the reference engine (``engines.create`` builds these from the node's flags)."""

    model_dir: str
    device: str = "cpu"
    #: "float32", "bfloat16" or "float16": weights, activations and cache.
    dtype: str = "float32"
    #: Positions per sequence: prompt plus generated tokens must fit.
    max_seq_len: int = 2048
    max_sequences: int = 4
    #: Draft tokens per step (the MTP layer applied recursively); 0 disables MTP.
    num_speculative_tokens: int = 1

    def validate(self) -> None:
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype={self.dtype!r}: expected one of {sorted(_DTYPES)}")
        if self.max_seq_len < 2:
            raise ValueError(f"max_seq_len={self.max_seq_len}: must be at least 2")
        if self.max_sequences < 1:
            raise ValueError(f"max_sequences={self.max_sequences}: must be at least 1")
        if self.num_speculative_tokens < 0:
            raise ValueError(f"num_speculative_tokens={self.num_speculative_tokens}: must be >= 0")


class ReferenceEngine:
    """DecodeEngine for DeepSeek-V3-style checkpoints (the layout vLLM loads)."""

    name = "reference"

    def __init__(self, settings: ReferenceSettings) -> None:
        settings.validate()
        self.settings = settings
        self.config = rm.read_config(settings.model_dir)
        c = self.config
        k = settings.num_speculative_tokens
        if k > 0 and c.num_nextn_predict_layers != 1:
            raise rm.CheckpointError(
                f"num_speculative_tokens={k} needs exactly one MTP layer; config.json has "
                f"num_nextn_predict_layers={c.num_nextn_predict_layers} (set num_speculative_tokens=0 to decode without MTP)"
            )
        self.num_mtp_layers = 1 if k > 0 else 0
        self.num_layers = c.num_hidden_layers + self.num_mtp_layers
        self.max_seq_len = settings.max_seq_len
        self.max_sequences = settings.max_sequences
        self.num_speculative_tokens = k
        self.device = torch.device(settings.device)
        self.dtype = _DTYPES[settings.dtype]
        self._weights: rm.ModelWeights | None = None
        self._rope: rm.Rope | None = None
        #: One [max_sequences, max_seq_len, latent] tensor per layer (main layers, then MTP).
        self._caches: list[torch.Tensor] = []
        self._free_slots: list[int] = []
        self._lock = threading.Lock()  # guards _free_slots

    # -- DecodeEngine -------------------------------------------------------------------------

    def load(self) -> None:
        if self._weights is not None:
            return
        self._weights = rm.load_weights(
            Path(self.settings.model_dir),
            dtype=self.dtype,
            device=self.device,
            with_mtp=self.num_mtp_layers > 0,
        )
        # Drafting is clamped to the cache, so no position reaches max_seq_len.
        self._rope = rm.Rope.build(self.config, self.max_seq_len, dtype=self.dtype, device=self.device)
        self._caches = [
            torch.zeros(
                self.max_sequences,
                self.max_seq_len,
                self.config.latent_dim,
                dtype=self.dtype,
                device=self.device,
            )
            for _ in range(self.num_layers)
        ]
        self._free_slots = list(range(self.max_sequences - 1, -1, -1))

    def start(self, state: InjectedState) -> ReferenceSequence:
        self._check_loaded()
        self._check_state(state)
        with self._lock:
            if not self._free_slots:
                raise NoFreeSequenceError(f"all {self.max_sequences} sequences are in use (max_sequences)")
            slot = self._free_slots.pop()
        try:
            n = state.seq_len
            for cache, layer in zip(self._caches, state.layers, strict=True):
                row = cache[slot]
                row[:n, : self.config.kv_lora_rank] = layer.kv.to(device=self.device, dtype=self.dtype)
                row[:n, self.config.kv_lora_rank :] = layer.pe.to(device=self.device, dtype=self.dtype)
        except BaseException:
            self._release(slot)
            raise
        return ReferenceSequence(self, slot, state.seq_len, state.last_prompt_token)

    # -- ground truth -------------------------------------------------------------------------

    def prefill(self, prompt_token_ids: list[int]) -> tuple[InjectedState, int]:
        """Run the prompt through the model as vLLM's prefill does: the state vLLM's MLA cache
        holds for positions 0..n-1 (main layers, then the MTP layer fed the prompt shifted by one
        and the greedy first token) and that greedy first token."""
        self._check_loaded()
        w, rope = self._weights, self._rope
        assert w is not None and rope is not None
        n = len(prompt_token_ids)
        if n < 1:
            raise ValueError("prompt_token_ids is empty")
        if n > self.max_seq_len:
            raise ValueError(f"prompt of {n} tokens exceeds max_seq_len={self.max_seq_len}")
        self._check_token(max(prompt_token_ids), "prompt_token_ids")
        self._check_token(min(prompt_token_ids), "prompt_token_ids")
        c = self.config
        tokens = torch.tensor([prompt_token_ids], device=self.device)
        with torch.inference_mode():
            caches = [
                torch.empty(1, n, c.latent_dim, dtype=self.dtype, device=self.device)
                for _ in range(self.num_layers)
            ]
            hidden, _ = rm.forward_main(w, tokens, rope, 0, caches[: c.num_hidden_layers])
            first = int(rm.logits(w, hidden[0, -1]).argmax())
            if self.num_mtp_layers:
                shifted = torch.cat([tokens[:, 1:], torch.tensor([[first]], device=self.device)], dim=1)
                rm.forward_mtp(w, 0, shifted, hidden, rope, 0, caches[-1])
        layers = [
            LayerState(kv=cache[0, :, : c.kv_lora_rank].clone(), pe=cache[0, :, c.kv_lora_rank :].clone())
            for cache in caches
        ]
        return InjectedState(layers=layers, seq_len=n, last_prompt_token=int(prompt_token_ids[-1])), first

    # -- internals ----------------------------------------------------------------------------

    @property
    def weights(self) -> rm.ModelWeights:
        self._check_loaded()
        assert self._weights is not None
        return self._weights

    def _check_loaded(self) -> None:
        if self._weights is None:
            raise RuntimeError("ReferenceEngine.load() has not been called")

    def _check_token(self, token: int, what: str) -> None:
        if not 0 <= token < self.config.vocab_size:
            raise ValueError(
                f"{what}: token id {token} is outside the vocabulary [0, {self.config.vocab_size})"
            )

    def _check_state(self, state: InjectedState) -> None:
        c = self.config
        if len(state.layers) != self.num_layers:
            raise InjectedStateError(
                f"InjectedState has {len(state.layers)} layers; this engine takes {self.num_layers} "
                f"({c.num_hidden_layers} main + {self.num_mtp_layers} MTP)"
            )
        n = state.seq_len
        if n < 1:
            raise InjectedStateError(f"InjectedState.seq_len={n}: must be at least 1")
        if n > self.max_seq_len:
            raise InjectedStateError(f"InjectedState.seq_len={n} exceeds max_seq_len={self.max_seq_len}")
        if not 0 <= state.last_prompt_token < c.vocab_size:
            raise InjectedStateError(
                f"InjectedState.last_prompt_token={state.last_prompt_token} is outside the vocabulary [0, {c.vocab_size})"
            )
        for i, layer in enumerate(state.layers):
            which = f"layer {i} ({'MTP' if i >= c.num_hidden_layers else 'main'})"
            for field_name, tensor, width in (
                ("kv", layer.kv, c.kv_lora_rank),
                ("pe", layer.pe, c.qk_rope_head_dim),
            ):
                if tuple(tensor.shape) != (n, width):
                    raise InjectedStateError(
                        f"InjectedState {which} {field_name} has shape {tuple(tensor.shape)}, expected ({n}, {width})"
                    )
                if not tensor.is_floating_point():
                    raise InjectedStateError(
                        f"InjectedState {which} {field_name} has dtype {tensor.dtype}, expected a float type"
                    )
            if layer.ki is not None:
                raise InjectedStateError(
                    f"InjectedState {which} carries indexer keys (ki); this model has no indexer"
                )

    def _release(self, slot: int) -> None:
        with self._lock:
            if slot not in self._free_slots:
                self._free_slots.append(slot)

    @property
    def free_sequences(self) -> int:
        with self._lock:
            return len(self._free_slots)


class ReferenceSequence:
    """One request's decode in one cache slot. ``decode`` runs once; ``close`` frees the slot."""

    def __init__(self, engine: ReferenceEngine, slot: int, seq_len: int, last_prompt_token: int) -> None:
        self._engine = engine
        self._slot = slot
        self._seq_len = seq_len
        self._last_prompt_token = last_prompt_token
        self._closed = False
        self._started = False
        # Held while a step runs, so close() from another thread (a client gone) never frees the
        # slot under a step that is still writing into it.
        self._step_lock = threading.Lock()

    def close(self) -> None:
        """Free the slot; a decode still iterating stops before its next step. Idempotent."""
        with self._step_lock:
            if not self._closed:
                self._closed = True
                self._engine._release(self._slot)

    def decode(self, first_token: int, sampling: Sampling, max_new_tokens: int) -> Iterator[DecodeStep]:
        """Yield steps of tokens after ``first_token`` until ``max_new_tokens`` tokens are out
        (``first_token`` itself is not yielded and not counted). Checks run before the first step."""
        if self._closed:
            raise RuntimeError("decode() on a closed sequence")
        if self._started:
            raise RuntimeError("decode() was already called on this sequence")
        smp.validate(sampling)
        self._engine._check_token(first_token, "first_token")
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens={max_new_tokens}: must be >= 0")
        limit = self._engine.max_seq_len - self._seq_len
        if max_new_tokens > limit:
            raise ValueError(
                f"max_new_tokens={max_new_tokens} does not fit: prompt of {self._seq_len} tokens plus "
                f"{max_new_tokens} new ones exceeds max_seq_len={self._engine.max_seq_len} (at most {limit} new tokens)"
            )
        self._started = True
        decoder = _Decoder(
            self._engine, self._slot, self._seq_len, self._last_prompt_token, first_token, sampling
        )
        return self._run(decoder, max_new_tokens)

    def _run(self, decoder: _Decoder, max_new_tokens: int) -> Iterator[DecodeStep]:
        # Each step runs under inference_mode inside `step`; holding the mode across `yield` would
        # leak it into the caller's thread between steps.
        emitted = 0
        while emitted < max_new_tokens:
            with self._step_lock:
                if self._closed:
                    return
                step = decoder.step(max_new_tokens - emitted)
            emitted += len(step.token_ids)
            yield step


class _Decoder:
    """The draft/verify loop of one sequence, one step per call.

    Between steps: the main cache is valid below ``pos``; ``cur`` is the token at ``pos`` (sampled,
    not yet through the main model); ``mtp_hidden``/``mtp_tokens`` are the MTP layer's pending
    inputs for positions ``mtp_start..pos-1`` (the hidden state at p and the token at p+1, the last
    of which is ``cur``).
    """

    def __init__(
        self,
        engine: ReferenceEngine,
        slot: int,
        seq_len: int,
        last_prompt_token: int,
        first_token: int,
        sampling: Sampling,
    ) -> None:
        self.engine = engine
        self.w = engine.weights
        assert engine._rope is not None
        self.rope = engine._rope
        self.main_caches = [c[slot : slot + 1] for c in engine._caches[: engine.config.num_hidden_layers]]
        self.mtp_cache = engine._caches[-1][slot : slot + 1] if engine.num_mtp_layers else None
        self.sampling = sampling
        self.generator: torch.Generator | None = None
        if sampling.temperature > 0:
            self.generator = torch.Generator(device=engine.device)
            if sampling.seed is None:
                self.generator.seed()
            else:
                self.generator.manual_seed(sampling.seed)
        self.pos = seq_len
        self.cur = self._tokens([first_token])
        self.last_prompt_token = last_prompt_token
        self.mtp_hidden: torch.Tensor | None = None
        self.mtp_tokens: torch.Tensor | None = None
        self.mtp_start = seq_len - 1
        self.warm = False

    def _tokens(self, ids: list[int]) -> torch.Tensor:
        return torch.tensor([ids], device=self.engine.device)

    def _warm_start(self) -> None:
        # The cache holds the prompt's keys but not the main model's hidden state at seq_len-1,
        # which the MTP layer needs next to the first token: recompute that one position (its
        # cache row is rewritten with the same values, up to rounding).
        self.mtp_hidden, _ = rm.forward_main(
            self.w, self._tokens([self.last_prompt_token]), self.rope, self.pos - 1, self.main_caches
        )
        self.mtp_tokens = self.cur

    def _draft(self, k: int) -> torch.Tensor:
        assert self.mtp_hidden is not None and self.mtp_tokens is not None and self.mtp_cache is not None
        w, rope, cache = self.w, self.rope, self.mtp_cache
        g, _ = rm.forward_mtp(w, 0, self.mtp_tokens, self.mtp_hidden, rope, self.mtp_start, cache)
        g = g[:, -1:]
        drafts = [rm.logits(w, g[0, -1]).argmax(dim=-1, keepdim=True)]
        # Deeper drafts: the same MTP layer again, on its own output hidden state and last draft,
        # one position further each time (vLLM's recursion for a single MTP module).
        for j in range(1, k):
            g, _ = rm.forward_mtp(w, 0, drafts[-1].view(1, 1), g, rope, self.pos + j - 1, cache)
            drafts.append(rm.logits(w, g[0, -1]).argmax(dim=-1, keepdim=True))
        return torch.cat(drafts)

    @torch.inference_mode()
    def step(self, remaining: int) -> DecodeStep:
        eng = self.engine
        # Drafts past what can still be emitted, or past the cache, are wasted work.
        k = min(eng.num_speculative_tokens, remaining - 1, eng.max_seq_len - 1 - self.pos)
        if k > 0 and not self.warm:
            self._warm_start()
            self.warm = True
        drafts = self._draft(k) if k > 0 else torch.empty(0, dtype=torch.long, device=eng.device)

        hidden, _ = rm.forward_main(
            self.w, torch.cat([self.cur, drafts.view(1, -1)], dim=1), self.rope, self.pos, self.main_caches
        )
        lg = rm.logits(self.w, hidden[0])
        if self.generator is None:
            verdict = smp.greedy_verify(lg, drafts)
        else:
            verdict = smp.sample_verify(lg, drafts, self.sampling, self.generator)
        # The one host read per step: the step's tokens and how many drafts held.
        values = verdict.tolist()
        accepted = values[-1]

        settled = verdict[: accepted + 1].view(1, -1)
        if self.mtp_cache is not None and self.warm:
            # The MTP layer next runs over every position this step settled (hidden at p, token at
            # p+1). A step without drafts leaves its positions pending for the next MTP run.
            new_hidden = hidden[:, : accepted + 1]
            if k == 0 and self.mtp_hidden is not None and self.mtp_tokens is not None:
                self.mtp_hidden = torch.cat([self.mtp_hidden, new_hidden], dim=1)
                self.mtp_tokens = torch.cat([self.mtp_tokens, settled], dim=1)
            else:
                self.mtp_hidden, self.mtp_tokens, self.mtp_start = new_hidden, settled, self.pos
        self.pos += accepted + 1
        self.cur = settled[:, -1:]
        return DecodeStep(token_ids=values[: accepted + 1][:remaining], drafted=k, accepted=accepted)
