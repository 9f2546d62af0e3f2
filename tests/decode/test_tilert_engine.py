"""The tilert engine adapter against a double of the tilert 0.1.6 API: the calls, their order, and
the shapes and dtypes of what is injected (TileRT itself runs only on Blackwell)."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from tilert_serve.decode.engines.base import InjectedState, LayerState, Sampling
from tilert_serve.decode.engines.tilert import TileRTEngine


class _DecodeLayer:
    """Accepts 2 tokens per step (1 draft + bonus): predicted = draft[0]+1, draft[0]+2. Each forward
    records the position it ran at: where set_cur_pos put it, then one further per step without MTP
    (with MTP, where the next step starts depends on acceptance, which the double does not model)."""

    def __init__(self, calls: list, gen) -> None:
        self.calls = calls
        self.gen = gen
        self.last: torch.Tensor | None = None

    def forward(self, tokens: torch.Tensor) -> None:
        self.calls.append(
            ("forward", tuple(tokens.shape), tokens.dtype, tokens.flatten().tolist(), self.gen.pos)
        )
        self.last = tokens
        if not self.gen.with_mtp:
            self.gen.pos += 1

    def get_num_accepted(self, i: int) -> int:
        return 2

    def get_predicted_tokens(self, i: int) -> torch.Tensor:
        t = int(self.last.flatten()[0])
        return torch.tensor([t + 1, t + 2, 0, 0])

    def get_next_draft_tokens(self, i: int) -> torch.Tensor:
        t = int(self.last.flatten()[0]) + 2
        return torch.tensor([t, t + 1, t + 2, t + 3])

    def reset_sequence(self) -> None:
        self.calls.append(("reset_sequence",))


@pytest.fixture
def fake_tilert(monkeypatch):
    calls: list = []

    class Generator:
        def __init__(self, **kwargs) -> None:
            calls.append(("generator", sorted(kwargs)))
            self.with_mtp = kwargs["with_mtp"]
            self.pos: int | None = None
            self.decode_layer = _DecodeLayer(calls, self)

        def init(self) -> None:
            calls.append(("init",))

        def from_pretrained(self) -> None:
            calls.append(("from_pretrained",))

        def inject_cache(self, caches, start_pos=0, end_pos=None) -> None:
            calls.append(
                (
                    "inject_cache",
                    len(caches),
                    start_pos,
                    end_pos,
                    {tuple(t.shape) for c in caches for t in c},
                    {t.dtype for c in caches for t in c},
                )
            )

        def set_cur_pos(self, pos: int) -> None:
            calls.append(("set_cur_pos", pos))
            self.pos = pos

        def update_sampling_params(self, **kwargs) -> None:
            calls.append(("update_sampling_params", kwargs))

    mods = {
        "tilert": types.SimpleNamespace(load_backend=lambda m: calls.append(("load_backend", m))),
        "tilert.models.glm_5.generator": types.SimpleNamespace(GLM5Generator=Generator),
        "tilert.models.glm_5.model_args": types.SimpleNamespace(ModelArgsGLM5=lambda: "glm5-args"),
    }
    for name, mod in mods.items():
        monkeypatch.setitem(sys.modules, name, mod)
    return calls


def _state(n: int = 10, layers: int = 79) -> InjectedState:
    return InjectedState(
        layers=[
            LayerState(kv=torch.zeros(n, 512), pe=torch.zeros(n, 64), ki=torch.zeros(n, 128))
            for _ in range(layers)
        ],
        seq_len=n,
        last_prompt_token=7,
    )


def test_calls_order_and_shapes(fake_tilert):
    engine = TileRTEngine(model="glm5", weights_dir="/w", max_seq_len=100, device="cpu")
    engine.load()
    seq = engine.start(_state())
    steps = list(seq.decode(first_token=20, sampling=Sampling(), max_new_tokens=5))
    seq.close()
    names = [c[0] for c in fake_tilert]
    assert names[:4] == ["load_backend", "generator", "init", "from_pretrained"]
    assert fake_tilert[0] == ("load_backend", "glm5")
    inject = next(c for c in fake_tilert if c[0] == "inject_cache")
    assert inject[1:4] == (79, 0, 10)
    assert inject[4] == {(10, 128), (10, 512), (10, 64)} and inject[5] == {torch.bfloat16}
    assert ("set_cur_pos", 9) in fake_tilert
    forwards = [c for c in fake_tilert if c[0] == "forward"]
    # Warm start with the last prompt token, then the first sampled token, then the drafts.
    assert forwards[0][1:] == ((1, 4), torch.int32, [7, 7, 7, 7], 9)
    assert forwards[1][3] == [20, 20, 20, 20]
    assert [t for s in steps for t in s.token_ids] == [21, 22, 23, 24, 25, 26]
    assert all((s.drafted, s.accepted) == (3, 1) for s in steps)
    assert names[-1] == "reset_sequence"
    assert names.index("update_sampling_params") < names.index("forward")


def test_without_mtp_the_first_token_goes_after_the_prompt(fake_tilert):
    """Position seq_len-1 holds the last prompt token (injected); vLLM's first token is position seq_len."""
    engine = TileRTEngine(model="glm5", weights_dir="/w", max_seq_len=100, with_mtp=False, device="cpu")
    engine.load()
    seq = engine.start(_state())  # 10 prompt tokens, the last one 7
    steps = list(seq.decode(first_token=20, sampling=Sampling(), max_new_tokens=3))
    seq.close()
    forwards = [(c[4], c[1], c[2], c[3]) for c in fake_tilert if c[0] == "forward"]
    # The warm start recomputes position 9 with the prompt's own token (its prediction is dropped).
    assert forwards == [
        (9, (1, 1), torch.int32, [7]),
        (10, (1, 1), torch.int32, [20]),
        (11, (1, 1), torch.int32, [21]),
        (12, (1, 1), torch.int32, [22]),
    ]
    assert [t for s in steps for t in s.token_ids] == [21, 22, 23]
    assert all((s.drafted, s.accepted) == (0, 0) for s in steps)


def test_one_sequence_at_a_time_and_clear_errors(fake_tilert):
    engine = TileRTEngine(model="glm5", weights_dir="/w", max_seq_len=100, device="cpu")
    with pytest.raises(RuntimeError, match="load"):
        engine.start(_state())
    engine.load()
    with pytest.raises(ValueError, match="takes 79 layers"):
        engine.start(_state(layers=62))
    with pytest.raises(ValueError, match="exceed max_seq_len"):
        engine.start(_state(n=101))
    seq = engine.start(_state())
    with pytest.raises(RuntimeError, match="one sequence at a time"):
        engine.start(_state())
    seq.close()
    engine.start(_state()).close()


def test_sampling_changes_recapture_only_when_changed(fake_tilert):
    engine = TileRTEngine(model="glm5", weights_dir="/w", max_seq_len=100, device="cpu")
    engine.load()
    for sampling in (Sampling(), Sampling(), Sampling(temperature=0.7, top_p=0.9)):
        seq = engine.start(_state())
        list(seq.decode(1, sampling, 2))
        seq.close()
    updates = [c for c in fake_tilert if c[0] == "update_sampling_params"]
    assert len(updates) == 2
    assert updates[1][1]["use_topp"] is True and updates[1][1]["top_p"] == 0.9


def test_missing_package_says_what_to_do():
    engine = TileRTEngine(model="deepseek_v3_2", weights_dir="/w", max_seq_len=10)
    with pytest.raises(RuntimeError, match="Blackwell"):
        engine.load()
    with pytest.raises(ValueError, match="reference engine"):
        TileRTEngine(model="mla", weights_dir="/w", max_seq_len=10)
