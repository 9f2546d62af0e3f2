"""The real TileRT engine (tilert 0.1.6), Blackwell (sm_100) only.

Written against the API described in docs/reference/tilert-api.md: `tilert.load_backend`,
the GLM-5 / DeepSeek-V3.2 generators, `inject_cache` with bf16 (ki, kv, pe) per layer including the
MTP layer, `set_cur_pos`, and the warm start (one step with the last prompt token at seq_len-1, which with MTP
rebuilds the hidden state the drafter needs, then decoding from the token vLLM sampled). It cannot run on the machines
this project is developed on; tests drive it against a double that checks the calls, their order and
tensor shapes (tests/decode/test_tilert_engine.py). Unverified on hardware.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from typing import Any, Final

import torch

from tilert_serve.decode.engines import sampling as smp
from tilert_serve.decode.engines.base import DecodeStep, InjectedState, Sampling

#: TileRT's MTP drafts 3 tokens a step (its `mtp_seq_len` is 4: one token plus 3 drafts).
DRAFT_TOKENS: Final = 3
_GENERATORS: Final = {
    "glm5": (
        "tilert.models.glm_5.generator",
        "GLM5Generator",
        "tilert.models.glm_5.model_args",
        "ModelArgsGLM5",
    ),
    "deepseek_v3_2": (
        "tilert.models.deepseek_v3_2.generator",
        "DSAv32Generator",
        "tilert.models.deepseek_v3_2.model_args",
        "ModelArgs",
    ),
}
_LAYERS: Final = {"glm5": 79, "deepseek_v3_2": 62}


class TileRTEngine:
    name = "tilert"
    #: TileRT decodes one sequence per node (max_batch_size = 1).
    max_sequences = 1
    num_mtp_layers = 1
    dtype = torch.bfloat16

    def __init__(
        self,
        *,
        model: str,
        weights_dir: str,
        max_seq_len: int,
        with_mtp: bool = True,
        max_new_tokens: int = 32768,
        device: str = "cuda",
    ) -> None:
        if model not in _GENERATORS:
            raise ValueError(
                f"the tilert engine runs {', '.join(_GENERATORS)}, not {model!r}; use the reference "
                "engine for other models"
            )
        self.model = model
        self.weights_dir = weights_dir
        self.max_seq_len = max_seq_len
        self.with_mtp = with_mtp
        self.max_new_tokens = max_new_tokens
        #: Where step inputs are built (the generator's GPU; a test double runs on cpu).
        self.device = device
        self.num_layers = _LAYERS[model]
        self.gen: Any = None
        self._sampling: Sampling | None = None
        self._busy = False

    def load(self) -> None:
        try:
            tilert = importlib.import_module("tilert")
        except ImportError as exc:
            raise RuntimeError(
                "the tilert package is not installed: the tilert engine needs the TileRT image "
                "on NVIDIA Blackwell (B200) GPUs; use --engine reference elsewhere"
            ) from exc
        tilert.load_backend(self.model)
        gen_mod, gen_cls, args_mod, args_cls = _GENERATORS[self.model]
        generator = getattr(importlib.import_module(gen_mod), gen_cls)
        model_args = getattr(importlib.import_module(args_mod), args_cls)()
        self.gen = generator(
            model_args=model_args,
            max_new_tokens=self.max_new_tokens,
            model_weights_dir=self.weights_dir,
            with_mtp=self.with_mtp,
        )
        self.gen.init()
        self.gen.from_pretrained()

    def start(self, state: InjectedState) -> TileRTSequence:
        if self.gen is None:
            raise RuntimeError("load() the engine before starting a sequence")
        if self._busy:
            raise RuntimeError("TileRT holds one sequence at a time; close the running one first")
        if len(state.layers) != self.num_layers:
            raise ValueError(f"{self.model} takes {self.num_layers} layers of state, got {len(state.layers)}")
        if state.seq_len > self.max_seq_len:
            raise ValueError(f"{state.seq_len} tokens exceed max_seq_len {self.max_seq_len}")
        caches = []
        for lid, layer in enumerate(state.layers):
            if layer.ki is None:
                raise ValueError(f"layer {lid} has no indexer keys; {self.model} needs them")
            caches.append(
                (layer.ki.to(torch.bfloat16), layer.kv.to(torch.bfloat16), layer.pe.to(torch.bfloat16))
            )
        self._busy = True
        self.gen.inject_cache(caches, start_pos=0, end_pos=state.seq_len)
        self.gen.set_cur_pos(state.seq_len - 1)
        return TileRTSequence(self, state.last_prompt_token)

    def _apply_sampling(self, sampling: Sampling) -> None:
        # Changing sampling parameters recaptures CUDA graphs in TileRT: only when they change.
        if sampling != self._sampling:
            greedy = smp.greedy(sampling)
            # vLLM's floor, as the prefill sampled with: TileRT's kernels overflow below it as ours did.
            self.gen.update_sampling_params(
                temperature=max(sampling.temperature, smp.MIN_TEMPERATURE),
                top_p=1.0 if greedy else sampling.top_p,
                top_k=1 if greedy else (sampling.top_k or 256),
                use_topp=not greedy,
            )
            self._sampling = sampling


class TileRTSequence:
    def __init__(self, engine: TileRTEngine, last_prompt_token: int) -> None:
        self.engine = engine
        self.last_prompt_token = last_prompt_token
        self._open = True

    def _draft(self, token: int) -> torch.Tensor:
        width = DRAFT_TOKENS + 1 if self.engine.with_mtp else 1
        return torch.full((1, width), token, dtype=torch.int32, device=self.engine.device)

    def decode(self, first_token: int, sampling: Sampling, max_new_tokens: int) -> Iterator[DecodeStep]:
        engine = self.engine
        engine._apply_sampling(sampling)
        dl = engine.gen.decode_layer
        # Warm start, with or without MTP: start() set the position to seq_len-1, as upstream's inject
        # does, so the first forward runs the last prompt token there (its outputs are discarded; the
        # KV it writes is the one injected). With MTP this rebuilds the hidden state the drafter needs;
        # either way vLLM's first token then lands at position seq_len, where it belongs.
        dl.forward(self._draft(self.last_prompt_token))
        if not engine.with_mtp:
            prev = first_token
            for _ in range(max_new_tokens):
                dl.forward(self._draft(prev))
                prev = int(dl.get_predicted_tokens(0).flatten()[0])
                yield DecodeStep([prev])
            return
        draft = self._draft(first_token)
        produced = 0
        while produced < max_new_tokens:
            dl.forward(draft)
            accepted = int(dl.get_num_accepted(0))
            tokens = [int(t) for t in dl.get_predicted_tokens(0).flatten()[:accepted]]
            produced += len(tokens)
            yield DecodeStep(tokens, drafted=DRAFT_TOKENS, accepted=max(accepted - 1, 0))
            draft = dl.get_next_draft_tokens(0).to(torch.int32).reshape(1, DRAFT_TOKENS + 1)

    def close(self) -> None:
        if self._open:
            self._open = False
            self.engine.gen.decode_layer.reset_sequence()
            self.engine._busy = False
