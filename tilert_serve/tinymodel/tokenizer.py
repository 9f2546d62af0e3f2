"""A small byte-level BPE tokenizer, trained locally on built-in text (no hub access needed)."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

BOS = "<|bos|>"
EOS = "<|eos|>"
SPECIAL_TOKENS = (BOS, EOS)

# Most clients speak chat: a plain role-tagged template (vLLM renders it for /v1/chat/completions).
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ '<|' + m['role'] + '|>\\n' }}"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}"
    "{% for part in m['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}"
    "{% endif %}{{ '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)

# Built-in training text: enough variety for a few hundred merges. Written for this project.
CORPUS = """\
The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs.
How vexingly quick daft zebras jump! Sphinx of black quartz, judge my vow.
A prefill node reads the whole prompt at once and writes the attention cache for every layer.
A decode node then produces one token after another, and each new token reads the cache again.
Splitting the two lets each side run on the hardware and batch size that suits it best.
The router in front decides where a request goes: to a fast single-stream decode node, or to a
pool of ordinary decode workers that keep serving everything else.
Multi-head latent attention stores a compressed latent vector for each token instead of full keys
and values, which makes the cache small enough to move between machines quickly.
Speculative decoding lets a cheap draft model propose several tokens; the main model checks them
all in one step and keeps the longest prefix it agrees with, plus one token of its own.
Once upon a time there was a little robot who liked to count the stars. Every night it climbed the
hill behind the village, sat on a flat stone and counted: one, two, three, four, five, six, seven.
It never reached the end, because new stars kept appearing, and so it came back the next night.
The river runs past the old mill, under the stone bridge and into the green valley below.
In the morning the market opens early; bakers, farmers and fishermen set out bread, eggs and fish.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 32 64 128 256 512 1024 2048.
def add(a, b):
    return a + b

for i in range(10):
    print(i, add(i, i))
{"model": "tiny", "prompt": "hello world", "max_tokens": 16, "temperature": 0.0}
Questions and answers: What is a token? A piece of text. What is a layer? One step of the model.
Why test with a tiny model? Because it loads in seconds and still exercises every code path.
"""


def train_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """Byte-level BPE with BOS/EOS specials and exactly ``vocab_size`` entries. Deterministic."""
    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(
            f"vocab {vocab_size} is too small: byte-level BPE needs at least {256 + len(SPECIAL_TOKENS)}"
        )
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS.splitlines(keepends=True), trainer)
    # The corpus runs out of merges near 850 entries; reserved specials fill the rest so that every
    # id the model can emit decodes (vLLM detokenises each generated id).
    missing = vocab_size - tok.get_vocab_size()
    if missing > 0:
        tok.add_special_tokens([f"<|reserved_{i}|>" for i in range(missing)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS)  # type: ignore[no-untyped-call]
    fast.chat_template = CHAT_TEMPLATE
    return fast


def write_tokenizer(tokenizer: PreTrainedTokenizerFast, out_dir: Path) -> None:
    tokenizer.save_pretrained(str(out_dir))
