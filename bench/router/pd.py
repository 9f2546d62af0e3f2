"""The two request bodies of vLLM's PD flow, as its toy proxy builds them; one home for the relays and
the load generator's "direct" baseline, so every baseline sends the prefill the same thing.

(tilert_serve/router/native_path.py builds the router's own; the bench keeps its own copy so that a
change in the router cannot silently change what the baselines do.)
"""

from __future__ import annotations

from typing import Any

#: "Decode happens elsewhere; keep the blocks for it": the prefill's kv_transfer_params.
REMOTE_DECODE: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """One token, not streamed: the prefill only fills the cache and returns where it is."""
    out = dict(body, kv_transfer_params=dict(REMOTE_DECODE), stream=False, max_tokens=1)
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    # The toy proxy drops what a non-streamed, one-token prefill rejects; the decode still gets them.
    for key in ("stream_options", "min_tokens", "min_completion_tokens"):
        out.pop(key, None)
    return out


def decode_body(body: dict[str, Any], prefill_answer: dict[str, Any]) -> dict[str, Any]:
    """The client's request, plus the prefill's kv_transfer_params when it returned any."""
    kvp = prefill_answer.get("kv_transfer_params")
    return dict(body, kv_transfer_params=kvp) if kvp else dict(body)
