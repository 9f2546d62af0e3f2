"""Run vLLM (CPU build) on a checkpoint: greedy token ids, and optionally the MLA cache rows a prefill wrote.

Started by the tests in a subprocess: vLLM's offline LLM needs a __main__ guard, and keeping it out
of the pytest process keeps vLLM's global state and thread settings away from the other tests.
vLLM runs in-process inside this script (VLLM_ENABLE_V1_MULTIPROCESSING=0) so that the worker's
attention layers can be read directly.

usage: python vllm_run.py MODEL_DIR REQUEST_JSON OUT_DIR
  REQUEST_JSON: {"prompts": [[ids], ...], "max_tokens": N, "num_speculative_tokens": K,
                 "dump_prompts": [[ids], ...]}
  OUT_DIR/result.json: {"outputs": [[ids], ...], "first_tokens": [id per dump prompt],
                        "seconds_init": s, "seconds_generate": s, "spec_decode": {counter: value}}
  OUT_DIR/cache_rows.pt: per dump prompt, {attention layer name: [n, 576] rows read from vLLM's KV
                         cache at the slots the prefill step wrote}, main layers and the MTP layer
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"


def main(model_dir: str, request_path: str, out_dir: str) -> None:
    import torch
    from vllm import LLM, SamplingParams
    from vllm.forward_context import get_forward_context
    from vllm.inputs import TokensPrompt
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention

    from tilert_serve import vllm_cpu

    req = json.loads(Path(request_path).read_text())
    out = Path(out_dir)
    spec = None
    if req.get("num_speculative_tokens", 0) > 0:
        spec = {
            "method": "mtp",
            "num_speculative_tokens": req["num_speculative_tokens"],
            **vllm_cpu.drafter_config(),
        }
    t0 = time.monotonic()
    llm = LLM(
        model=model_dir,
        dtype="float32",
        load_format="auto",
        enforce_eager=True,
        gpu_memory_utilization=0.3,
        kv_cache_memory_bytes=256 * 1024 * 1024,
        max_model_len=512,
        max_num_batched_tokens=512,
        speculative_config=spec,
        seed=0,
        **vllm_cpu.llm_kwargs(),
        disable_log_stats=False,  # for the speculative-decoding counters below
    )
    t1 = time.monotonic()
    greedy = SamplingParams(temperature=0.0, max_tokens=req["max_tokens"], ignore_eos=True)
    results = llm.generate([TokensPrompt(prompt_token_ids=p) for p in req["prompts"]], greedy, use_tqdm=False)
    t2 = time.monotonic()
    spec_counts = {
        m.name: m.value
        for m in llm.get_metrics()
        if m.name in ("vllm:spec_decode_num_draft_tokens", "vllm:spec_decode_num_accepted_tokens")
    }

    # Cache rows: after each attention layer (target and drafter) runs, read its cache at the slots
    # this step wrote. One prompt per generate call, max_tokens=1: the step is the prefill plus the
    # drafter's pass over the prompt, which is what a PD handoff ships.
    runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
    layers = [m for m in runner.model.modules() if isinstance(m, MLAAttention)]
    if runner.drafter is not None:
        layers += [m for m in runner.drafter.model.modules() if isinstance(m, MLAAttention)]
    captured: dict[str, torch.Tensor] = {}

    def read_rows(module: MLAAttention, _args: object, _out: object) -> None:
        metadata = get_forward_context().attn_metadata
        if metadata is None:
            return
        if isinstance(metadata, list):
            metadata = metadata[0]
        meta = metadata[module.layer_name]
        slots = meta.slot_mapping[: meta.num_actual_tokens].long()
        cache = module.kv_cache[0] if isinstance(module.kv_cache, list) else module.kv_cache
        captured[module.layer_name] = cache.view(-1, cache.shape[-1])[slots].clone()

    for m in layers:
        m.register_forward_hook(read_rows)
    dumps, firsts = [], []
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    for prompt in req.get("dump_prompts", []):
        captured.clear()
        r = llm.generate([TokensPrompt(prompt_token_ids=prompt)], one, use_tqdm=False)
        firsts.append(r[0].outputs[0].token_ids[0])
        dumps.append(dict(captured))
    torch.save(dumps, out / "cache_rows.pt")

    result = {
        "outputs": [list(r.outputs[0].token_ids) for r in results],
        "first_tokens": firsts,
        "seconds_init": t1 - t0,
        "seconds_generate": t2 - t1,
        # vLLM's own MTP counters over the greedy run: draft tokens proposed and accepted.
        "spec_decode": spec_counts,
    }
    (out / "result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(*sys.argv[1:4])
