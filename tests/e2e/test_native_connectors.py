"""The native path end to end on CPU: the router in front of a vLLM prefill running
MultiConnector[TileRTConnector, NixlConnector] (as the operator renders it) and a native vLLM decode
reading the KV with NixlConnector (on the session's shared prefill and plain vLLM, tests/e2e/conftest.py:
the prefill is what this module used to start for itself). The decode must not recompute the prompt (its
prompt-token counters by source say where each token came from) and must answer what vLLM alone answers,
token for token.

MooncakeConnector is not run here: on vLLM 0.32's CPU build its worker raises at once
(`torch.accelerator.current_device_index()` on a torch without an accelerator). With that one call
answered (device 0), the prefill side ran (bootstrap registry, the router's /query, the prefill leg),
but the decode's worker then blocked on its receiver loop in get_finished and never queried the
prefill's registry, so no KV moved. What the router sends for it is checked against vLLM's own
MooncakeConnectorScheduler in tests/router/test_router_native_connectors.py.
"""

from __future__ import annotations

import random

import pytest

from tests.e2e.conftest import Native, Plain
from tests.e2e.procs import metric, post_json

pytestmark = pytest.mark.slow

# vLLM's CPU build pays ~0.5 s a step with a connector loaded: short generations.
NEW_TOKENS = 6
rng = random.Random(99)
PROMPTS = [[rng.randrange(2, 512) for _ in range(n)] for n in (5, 33, 140)]


@pytest.fixture
def plain(plain_vllm: Plain) -> str:
    return plain_vllm.url


def _by_source(url: str) -> dict[str, float]:
    return {
        s: metric(url, "vllm:prompt_tokens_by_source_total", source=s)
        for s in ("local_compute", "local_cache_hit", "external_kv_transfer")
    }


def test_native_path_hands_the_kv_over_and_equals_vllm(native: Native, plain: str) -> None:
    for prompt in PROMPTS:
        body = {
            "model": "tiny",
            "prompt": prompt,
            "max_tokens": NEW_TOKENS,
            "temperature": 0,
            "return_token_ids": True,
            "ignore_eos": True,
        }
        expected = post_json(f"{plain}/v1/completions", body)["choices"][0]["token_ids"]
        before = _by_source(native.decode_url)
        out = post_json(f"{native.router_url}/v1/completions", body, timeout=300)
        after = _by_source(native.decode_url)
        got = {s: after[s] - before[s] for s in after}
        logs = "\n".join(p.tail(40) for p in native.procs.values())
        assert out["choices"][0]["token_ids"] == expected, logs
        # The decode computed at most the prompt's last token itself; the rest came over the connector.
        assert got["external_kv_transfer"] >= len(prompt) - 1, (got, logs)
        assert got["local_compute"] <= 1, (got, logs)
