"""A tiny Llama checkpoint directory for vLLM on CPU (recipe: vllm-kv-connector.md §10): a locally
trained byte-level BPE tokenizer with a chat template, and a config; weights come from vLLM's
`--load-format dummy`. The router only needs some model that vLLM serves, and a Llama boots faster
than the DeepSeek-V3-style one `tilert-pd tiny-model` writes for the whole stack.
"""

from __future__ import annotations

import json
from pathlib import Path

_TEXT = """The quick brown fox jumps over the lazy dog. A router sends each request to a prefill
server and then to a decode server. Tokens stream back to the client one by one, and the client
reads them as they come. Numbers 0 1 2 3 4 5 6 7 8 9 and words like hello, world, stream, token.
"""

# Enough of a chat template for vLLM's chat endpoint: role: content lines, then the assistant turn.
_CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def write(out: Path) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=344,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_TEXT.splitlines(keepends=True), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    fast.chat_template = _CHAT_TEMPLATE
    fast.save_pretrained(str(out))
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 64,
        "vocab_size": 512,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }
    (out / "config.json").write_text(json.dumps(config, indent=1))
    return out
