"""The reference engine on the generated tiny model: MTP decoding, sequences, sampling, bad input."""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch
from engine_helpers import GREEDY, decode, prompts

from tilert_serve.decode.engines import reference_model as rm
from tilert_serve.decode.engines.base import InjectedState, LayerState, Sampling
from tilert_serve.decode.engines.reference import (
    InjectedStateError,
    NoFreeSequenceError,
    ReferenceEngine,
    ReferenceSettings,
)
from tilert_serve.tinymodel.generate import TinySpec, generate


def naive_greedy(weights: rm.ModelWeights, prompt: list[int], count: int) -> list[int]:
    """Greedy decoding by recomputing the whole sequence each token: no cache, no MTP."""
    rope = rm.Rope.build(weights.config, len(prompt) + count, dtype=weights.dtype, device=weights.device)
    seq = list(prompt)
    with torch.inference_mode():
        for _ in range(count):
            hidden, _ = rm.forward_main(weights, torch.tensor([seq]), rope, 0, None)
            seq.append(int(rm.logits(weights, hidden[0, -1]).argmax()))
    return seq[len(prompt) :]


def test_mtp_greedy_equals_plain_greedy(make_engine) -> None:
    plain = make_engine(num_speculative_tokens=0)
    expected = [decode(plain, p, GREEDY, 20)[0] for p in prompts(12)]
    # The cached, incremental engine agrees with recomputing everything from scratch.
    for p, want in zip(prompts(4), expected, strict=False):
        assert naive_greedy(plain.weights, p, 21) == want
    for k in (1, 2, 3):
        engine = make_engine(num_speculative_tokens=k)
        got = [decode(engine, p, GREEDY, 20)[0] for p in prompts(12)]
        assert got == expected, f"num_speculative_tokens={k}"


def test_mtp_acceptance_is_clearly_positive(make_engine) -> None:
    engine = make_engine(num_speculative_tokens=1)
    drafted = accepted = 0
    for p in prompts(12):
        _, d, a = decode(engine, p, GREEDY, 24)
        drafted += d
        accepted += a
    rate = accepted / drafted
    print(f"MTP acceptance (1 draft token, greedy): {accepted}/{drafted} = {rate:.2f}")
    assert drafted >= 12 * 12
    assert rate > 0.25


def test_steps_report_drafts_and_tokens(make_engine) -> None:
    engine = make_engine(num_speculative_tokens=2)
    state, first = engine.prefill(prompts(5)[4])
    seq = engine.start(state)
    try:
        steps = list(seq.decode(first, GREEDY, 10))
    finally:
        seq.close()
    assert sum(len(s.token_ids) for s in steps) == 10
    for s in steps:
        assert 0 <= s.accepted <= s.drafted <= 2
        assert 1 <= len(s.token_ids) <= s.accepted + 1
    assert any(s.accepted > 0 for s in steps)
    assert steps[0].drafted > 0  # MTP drafts from the first step, with the prefill's hidden state


def test_sequences_decode_independently(make_engine) -> None:
    engine = make_engine(num_speculative_tokens=1)
    ps = prompts(4)[1:4]
    alone = [decode(engine, p, GREEDY, 12)[0] for p in ps]
    # Now all three at once, their steps interleaved round-robin.
    started = [engine.prefill(p) for p in ps]
    seqs = [engine.start(state) for state, _ in started]
    try:
        assert engine.free_sequences == engine.max_sequences - 3
        iters = [seq.decode(first, GREEDY, 12) for seq, (_, first) in zip(seqs, started, strict=True)]
        outs = [[first] for _, first in started]
        live = set(range(3))
        while live:
            for i in sorted(live):
                step = next(iters[i], None)
                if step is None:
                    live.discard(i)
                else:
                    outs[i] += step.token_ids
    finally:
        for seq in seqs:
            seq.close()
    assert outs == alone
    assert engine.free_sequences == engine.max_sequences


def test_seeded_sampling_is_reproducible_and_differs_across_seeds(make_engine) -> None:
    engine = make_engine(num_speculative_tokens=2)
    p = prompts(5)[4]
    s1 = Sampling(temperature=1.0, top_p=0.95, top_k=50, seed=1)
    s2 = Sampling(temperature=1.0, top_p=0.95, top_k=50, seed=2)
    a = decode(engine, p, s1, 32)[0]
    assert decode(engine, p, s1, 32)[0] == a
    assert decode(engine, p, s2, 32)[0] != a
    # MTP depth changes how randomness is consumed, not whether it is seeded.
    plain = make_engine(num_speculative_tokens=0)
    assert decode(plain, p, s1, 32)[0] == decode(plain, p, s1, 32)[0]


def test_speculative_sampling_keeps_the_target_distribution(make_engine) -> None:
    """The first token after the prefill's token is verified against a draft; over many seeds its
    frequencies must follow the model's own distribution at that position."""
    engine = make_engine(num_speculative_tokens=1)
    p = prompts(4)[3]
    sampling = Sampling(temperature=2.0, top_k=20)
    state, first = engine.prefill(p)
    w = engine.weights
    rope = rm.Rope.build(w.config, len(p) + 1, dtype=w.dtype, device=w.device)
    with torch.inference_mode():
        hidden, _ = rm.forward_main(w, torch.tensor([[*p, first]]), rope, 0, None)
        from tilert_serve.decode.engines.sampling import probabilities

        target = probabilities(rm.logits(w, hidden[0, -1:]), sampling)[0]
    counts: Counter[int] = Counter()
    runs = 300
    for seed in range(runs):
        seq = engine.start(state)
        try:
            step = next(seq.decode(first, Sampling(temperature=2.0, top_k=20, seed=seed), 2))
        finally:
            seq.close()
        assert step.drafted == 1
        counts[step.token_ids[0]] += 1
    empirical = torch.zeros_like(target)
    for tok, n in counts.items():
        empirical[tok] = n / runs
    tv = 0.5 * float((empirical - target).abs().sum())
    assert set(counts) <= set(torch.nonzero(target).flatten().tolist())
    assert tv < 0.12, f"total variation {tv:.3f} between sampled and target distributions"


def test_bfloat16_engine_decodes(make_engine) -> None:
    engine = make_engine(dtype="bfloat16", num_speculative_tokens=1)
    tokens, drafted, _ = decode(engine, prompts(4)[3], GREEDY, 12)
    assert len(tokens) == 13 and drafted > 0
    assert all(0 <= t < 512 for t in tokens)


# -- bad input ------------------------------------------------------------------------------------


def _state(engine: ReferenceEngine, n: int) -> InjectedState:
    return engine.prefill(prompts(12)[6][:n])[0]


def test_seq_len_over_max_seq_len_is_rejected(make_engine) -> None:
    small = make_engine(max_seq_len=8)
    big = make_engine()
    state = _state(big, 12)
    with pytest.raises(InjectedStateError, match=r"seq_len=12 exceeds max_seq_len=8"):
        small.start(state)
    with pytest.raises(ValueError, match=r"prompt of 12 tokens exceeds max_seq_len=8"):
        small.prefill(prompts(12)[6][:12])
    assert small.free_sequences == small.max_sequences


def test_wrong_layer_count_is_rejected(make_engine) -> None:
    engine = make_engine()
    state = _state(engine, 6)
    short = InjectedState(layers=state.layers[:-1], seq_len=6, last_prompt_token=state.last_prompt_token)
    with pytest.raises(InjectedStateError, match=r"has 2 layers; this engine takes 3 \(2 main \+ 1 MTP\)"):
        engine.start(short)
    no_mtp = make_engine(num_speculative_tokens=0)
    with pytest.raises(InjectedStateError, match=r"has 3 layers; this engine takes 2 \(2 main \+ 0 MTP\)"):
        no_mtp.start(state)


def test_wrong_shapes_are_rejected(make_engine) -> None:
    engine = make_engine()
    state = _state(engine, 6)
    layers = list(state.layers)
    layers[1] = LayerState(kv=layers[1].kv[:, :256], pe=layers[1].pe)
    with pytest.raises(
        InjectedStateError, match=r"layer 1 \(main\) kv has shape \(6, 256\), expected \(6, 512\)"
    ):
        engine.start(InjectedState(layers=layers, seq_len=6, last_prompt_token=1))
    layers = list(state.layers)
    layers[2] = LayerState(kv=layers[2].kv, pe=layers[2].pe[:5])
    with pytest.raises(
        InjectedStateError, match=r"layer 2 \(MTP\) pe has shape \(5, 64\), expected \(6, 64\)"
    ):
        engine.start(InjectedState(layers=layers, seq_len=6, last_prompt_token=1))
    with pytest.raises(InjectedStateError, match=r"last_prompt_token=9999 is outside the vocabulary"):
        engine.start(InjectedState(layers=state.layers, seq_len=6, last_prompt_token=9999))
    assert engine.free_sequences == engine.max_sequences


def test_decode_limits_are_checked(make_engine) -> None:
    engine = make_engine(max_seq_len=16)
    state, first = engine.prefill(prompts(12)[6][:10])
    seq = engine.start(state)
    try:
        with pytest.raises(ValueError, match=r"max_new_tokens=7 does not fit.*at most 6 new tokens"):
            seq.decode(first, GREEDY, 7)
        with pytest.raises(ValueError, match=r"sampling.top_p=0.0"):
            seq.decode(first, Sampling(temperature=1.0, top_p=0.0), 3)
        with pytest.raises(ValueError, match=r"first_token: token id 512 is outside"):
            seq.decode(512, GREEDY, 3)
        # Exactly filling the cache works.
        assert sum(len(s.token_ids) for s in seq.decode(first, GREEDY, 6)) == 6
        with pytest.raises(RuntimeError, match=r"already called"):
            seq.decode(first, GREEDY, 1)
    finally:
        seq.close()
    seq.close()  # idempotent
    with pytest.raises(RuntimeError, match=r"closed sequence"):
        seq.decode(first, GREEDY, 1)


def test_no_free_sequence_is_reported(make_engine) -> None:
    engine = make_engine(max_sequences=2)
    state = _state(engine, 4)
    held = [engine.start(state), engine.start(state)]
    try:
        with pytest.raises(NoFreeSequenceError, match=r"all 2 sequences are in use"):
            engine.start(state)
    finally:
        for seq in held:
            seq.close()
    engine.start(state).close()


def test_close_mid_decode_stops_and_frees_the_slot(make_engine) -> None:
    engine = make_engine(num_speculative_tokens=1)
    state, first = engine.prefill(prompts(5)[4])
    seq = engine.start(state)
    steps = seq.decode(first, GREEDY, 20)
    next(steps)
    # Between steps the caller is back in normal autograd mode.
    assert not torch.is_inference_mode_enabled()
    seq.close()
    assert engine.free_sequences == engine.max_sequences
    assert list(steps) == []


def test_drafting_stops_at_the_end_of_the_cache(make_engine) -> None:
    """With the cache nearly full, drafts are cut short instead of running past max_seq_len."""
    prompt = prompts(12)[6][:10]
    plain = decode(make_engine(max_seq_len=16, num_speculative_tokens=0), prompt, GREEDY, 6)[0]
    assert decode(make_engine(max_seq_len=16, num_speculative_tokens=3), prompt, GREEDY, 6)[0] == plain


def test_model_without_query_lora(tmp_path) -> None:
    """q_lora_rank null (q_proj straight from the hidden state, as DeepSeek-V2-Lite): the cached
    MTP decode still equals recomputed greedy decoding. (Checked once against vLLM by hand too.)"""
    generate(TinySpec(seed=1, q_lora_rank=0), tmp_path)
    outs = {}
    for k in (0, 2):
        engine = ReferenceEngine(
            ReferenceSettings(model_dir=str(tmp_path), max_seq_len=64, num_speculative_tokens=k)
        )
        engine.load()
        assert engine.weights.layers[0].attn.q_a is None
        outs[k] = [decode(engine, p, GREEDY, 12)[0] for p in prompts(4)]
    assert outs[0] == outs[2]
    assert naive_greedy(engine.weights, prompts(4)[2], 13) == outs[0][2]


def test_unsupported_config_is_named(tiny_model_dir, tmp_path) -> None:
    raw = json.loads((tiny_model_dir / "config.json").read_text())
    with pytest.raises(rm.CheckpointError, match=r"rope_scaling type 'linear' is not supported"):
        rm.ModelConfig.from_dict({**raw, "rope_scaling": {"type": "linear", "factor": 2.0}})
    with pytest.raises(
        rm.CheckpointError, match=r"rope_scaling \(yarn\) is missing 'original_max_position_embeddings'"
    ):
        rm.ModelConfig.from_dict({**raw, "rope_scaling": {"type": "yarn", "factor": 2.0}})
    with pytest.raises(rm.CheckpointError, match=r"config.json is missing 'kv_lora_rank'"):
        rm.ModelConfig.from_dict({k: v for k, v in raw.items() if k != "kv_lora_rank"})
    (tmp_path / "config.json").write_text(json.dumps({**raw, "num_nextn_predict_layers": 2}))
    with pytest.raises(rm.CheckpointError, match=r"needs exactly one MTP layer.*num_nextn_predict_layers=2"):
        ReferenceEngine(ReferenceSettings(model_dir=str(tmp_path), num_speculative_tokens=1))
    with pytest.raises(rm.CheckpointError, match=r"no \*.safetensors file"):
        ReferenceEngine(ReferenceSettings(model_dir=str(tmp_path), num_speculative_tokens=0)).load()
