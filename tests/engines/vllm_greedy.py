"""Run vLLM (CPU build) on a checkpoint and print greedy token ids as JSON.

Started by the tests in a subprocess: vLLM spawns its own engine processes, so the driver needs a
__main__ guard, and keeping it out of the pytest process keeps torch thread settings and vLLM's
global state away from the other tests.

usage: python vllm_greedy.py MODEL_DIR REQUESTS_JSON OUT_JSON
  REQUESTS_JSON: {"prompts": [[token ids], ...], "max_tokens": N, "num_speculative_tokens": K}
  OUT_JSON: {"outputs": [[token ids], ...], "seconds_init": s, "seconds_generate": s}
"""

from __future__ import annotations

import json
import sys
import time


def main(model_dir: str, requests_path: str, out_path: str) -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from tilert_serve.tinymodel.vllm_cpu import VLLM_CPU_COMPILATION_CONFIG

    req = json.loads(open(requests_path).read())
    spec = None
    if req.get("num_speculative_tokens", 0) > 0:
        spec = {"method": "mtp", "num_speculative_tokens": req["num_speculative_tokens"]}
    t0 = time.monotonic()
    llm = LLM(
        model=model_dir,
        dtype="float32",
        load_format="auto",
        enforce_eager=True,
        gpu_memory_utilization=0.3,
        kv_cache_memory_bytes=256 * 1024 * 1024,
        max_model_len=req.get("max_model_len", 512),
        max_num_batched_tokens=req.get("max_model_len", 512),
        speculative_config=spec,
        seed=0,
        compilation_config=VLLM_CPU_COMPILATION_CONFIG,
    )
    t1 = time.monotonic()
    params = SamplingParams(temperature=0.0, max_tokens=req["max_tokens"], ignore_eos=True)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in req["prompts"]]
    results = llm.generate(prompts, params, use_tqdm=False)
    t2 = time.monotonic()
    outputs = [list(r.outputs[0].token_ids) for r in results]
    with open(out_path, "w") as f:
        json.dump({"outputs": outputs, "seconds_init": t1 - t0, "seconds_generate": t2 - t1}, f)


if __name__ == "__main__":
    main(*sys.argv[1:4])
