"""TileRTConnector pieces without a running engine: config, the claim filter, the scheduler side
driven with vLLM's own SchedulerOutput types, and the gather out of paged caches."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest
import torch
from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput

from tilert_serve import layouts
from tilert_serve.pd_vllm.config import ConfigError, ConnectorConfig
from tilert_serve.pd_vllm.extract import gather
from tilert_serve.pd_vllm.metadata import Destination
from tilert_serve.pd_vllm.scheduler import TileRTScheduler
from tilert_serve.pd_vllm.worker import classify

BASE = {"tilert_model": "mla", "tilert_max_seq_len": 256, "tilert_local_host": "127.0.0.1"}
#: The scheduler's compatibility fingerprint (what generation.prefill_compat gives in the connector).
COMPAT = "0123456789ab"


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"tilert_max_seq_len": 256}, r"tilert_model: Field required \(state layout family"),
        (
            {**BASE, "tilert_modle": "mla"},
            r"unknown TileRTConnector keys \['tilert_modle'\]; known keys: \['model_revision', 'tilert_data_plane_networks', 'tilert_handoff_digest', 'tilert_layerwise', 'tilert_local_host'",
        ),
        ({**BASE, "tilert_host": "10.0.0.1"}, "destination is per request"),
        (
            {**BASE, "tilert_max_seq_len": "many"},
            r"tilert_max_seq_len: Input should be a valid integer.*\(got 'many'\)",
        ),
        (
            {**BASE, "tilert_transfer": "rdma"},
            r"tilert_transfer: use one of \('mooncake', 'nixl'\) \(got 'rdma'\)",
        ),
        ({**BASE, "tilert_model": "llama"}, r"tilert_model: use one of .* \(got 'llama'\)"),
        (
            {**BASE, "tilert_protocol": "udp"},
            r"tilert_protocol: Input should be 'tcp' or 'rdma' \(got 'udp'\)",
        ),
        (
            {**BASE, "tilert_staging_requests": 0},
            r"tilert_staging_requests: Input should be greater than or equal to 1",
        ),
    ],
)
def test_bad_config_names_the_key(extra, message):
    with pytest.raises(ConfigError, match=message):
        ConnectorConfig.from_extra_config(extra)


def test_config_defaults():
    cfg = ConnectorConfig.from_extra_config(BASE)
    assert (cfg.transfer, cfg.protocol, cfg.staging_requests, cfg.local_host) == (
        "mooncake",
        "tcp",
        2,
        "127.0.0.1",
    )


def test_claim_filter_and_destination_parsing():
    assert Destination.claims({"tilert_host": "h"})
    assert not Destination.claims({"do_remote_decode": True})
    assert not Destination.claims(None)
    assert Destination.parse(
        {"tilert_host": "h", "tilert_ctrl_port": 5556, "tilert_ticket": "t"}
    ) == Destination("h", 5556, "t")
    with pytest.raises(ValueError, match="tilert_ctrl_port must be a port number"):
        Destination.parse({"tilert_host": "h", "tilert_ctrl_port": "5556"})
    # A request may choose the layer-wise handoff or not (else the connector's tilert_layerwise).
    assert (
        Destination.parse({"tilert_host": "h", "tilert_ctrl_port": 1, "tilert_layerwise": False}).layerwise
        is False
    )
    assert Destination.parse({"tilert_host": "h", "tilert_ctrl_port": 1}).layerwise is None
    with pytest.raises(ValueError, match="tilert_layerwise must be true or false"):
        Destination.parse({"tilert_host": "h", "tilert_ctrl_port": 1, "tilert_layerwise": "no"})


@dataclass
class FakeRequest:
    request_id: str
    prompt_token_ids: list[int]
    kv_transfer_params: dict | None = None
    output_token_ids: list[int] = field(default_factory=list)
    status: object = field(default_factory=lambda: SimpleNamespace(name="FINISHED_LENGTH_CAPPED"))

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


def _new(req: FakeRequest, blocks: list[int], computed: int = 0) -> NewRequestData:
    return NewRequestData(
        req_id=req.request_id,
        prompt_token_ids=req.prompt_token_ids,
        mm_features=[],
        sampling_params=None,
        pooling_params=None,
        block_ids=(blocks,),
        num_computed_tokens=computed,
        lora_request=None,
    )


def _output(
    new: list[NewRequestData], cached: CachedRequestData, scheduled: dict[str, int]
) -> SchedulerOutput:
    return SchedulerOutput(
        scheduled_new_reqs=new,
        scheduled_cached_reqs=cached,
        num_scheduled_tokens=scheduled,
        total_num_scheduled_tokens=sum(scheduled.values()),
        scheduled_spec_decode_tokens={},
        scheduled_encoder_inputs={},
        num_common_prefix_blocks=[],
        finished_req_ids=set(),
        free_encoder_mm_hashes=[],
    )


def _cached(req_ids: list[str], new_blocks: list, computed: list[int], resumed: set[str] | None = None):
    return CachedRequestData(
        req_ids=req_ids,
        resumed_req_ids=resumed or set(),
        new_token_ids=[[] for _ in req_ids],
        all_token_ids={},
        new_block_ids=new_blocks,
        num_computed_tokens=computed,
        num_output_tokens=[0 for _ in req_ids],
    )


DEST = {"tilert_host": "127.0.0.1", "tilert_ctrl_port": 5556, "tilert_ticket": "tk"}


def chunked_steps(claimed: FakeRequest, plain: FakeRequest) -> list[SchedulerOutput]:
    """vLLM's chunks of a 164-token prompt: 9/63/63/29 tokens (docs/reference/vllm-connector.md,
    "Chunked prefill")."""
    return [
        _output([_new(claimed, [3]), _new(plain, [7, 8])], _cached([], [], []), {"a": 9, "b": 30}),
        _output([], _cached(["a"], [([1, 4, 5, 6],)], [9]), {"a": 63}),
        _output([], _cached(["a"], [([9, 10, 11, 12],)], [72]), {"a": 63}),
        _output([], _cached(["a"], [([13],)], [135]), {"a": 29}),
    ]


def test_chunked_prefill_sends_each_chunk_and_completes_once_with_every_block():
    sched = TileRTScheduler(ConnectorConfig.from_extra_config(BASE), COMPAT)
    claimed = FakeRequest("a", list(range(100, 264)), dict(DEST))
    plain = FakeRequest("b", list(range(30)))
    for r in (claimed, plain):
        sched.on_new_request(r)
    assert sched.tracked == 1  # the unclaimed request is not even remembered
    metas = [sched.build_meta(s) for s in chunked_steps(claimed, plain)]
    assert [len(m.jobs) for m in metas] == [1, 1, 1, 1]
    chunks, job = [m.jobs[0] for m in metas[:3]], metas[-1].jobs[0]
    # Layer-wise (the default): each earlier step may send the tokens computed so far, with the block
    # table that covers them; the prompt's ids go with the first chunk only, and with the last step.
    assert [c.upto for c in chunks] == [9, 72, 135]
    assert [c.block_ids for c in chunks] == [([3],), ([3, 1, 4, 5, 6],), ([3, 1, 4, 5, 6, 9, 10, 11, 12],)]
    assert [len(c.prompt_token_ids) for c in chunks] == [164, 0, 0]
    assert job.upto is None and job.prompt_token_ids == claimed.prompt_token_ids
    assert job.block_ids == ([3, 1, 4, 5, 6, 9, 10, 11, 12, 13],)
    assert (job.num_tokens, job.last_prompt_token, job.dest.ticket) == (164, 263, "tk")
    claimed.output_token_ids = [42]
    assert sched.request_finished(claimed) == (
        True,
        {"tilert_num_tokens": 164, "tilert_first_token": 42, "tilert_status": "queued", "compat": COMPAT},
    )
    assert sched.request_finished(plain) == (False, None)
    assert sched.tracked == 0
    # Blocks stay held (and the engine keeps stepping) until a worker reports the copy done.
    assert sched.pending_copies == 1
    sched.sent({"someone-else"})
    assert sched.pending_copies == 1
    sched.sent({"a"})
    assert sched.pending_copies == 0


def test_without_layerwise_a_chunked_prompt_has_one_job_in_its_last_step():
    sched = TileRTScheduler(ConnectorConfig.from_extra_config(BASE), COMPAT)
    claimed = FakeRequest("a", list(range(100, 264)), {**DEST, "tilert_layerwise": False})
    sched.on_new_request(claimed)
    metas = [sched.build_meta(s) for s in chunked_steps(claimed, FakeRequest("b", list(range(30))))]
    assert [[j.upto for j in m.jobs] for m in metas] == [[], [], [], [None]]


def test_resumed_request_replaces_its_block_table():
    sched = TileRTScheduler(ConnectorConfig.from_extra_config(BASE), COMPAT)
    r = FakeRequest("a", list(range(40)), dict(DEST))
    sched.on_new_request(r)
    sched.build_meta(_output([_new(r, [1, 2])], _cached([], [], []), {"a": 20}))
    meta = sched.build_meta(_output([], _cached(["a"], [([7, 8, 9],)], [0], resumed={"a"}), {"a": 40}))
    assert meta.jobs[0].block_ids == ([7, 8, 9],)


@pytest.mark.parametrize(
    ("params", "tokens", "error"),
    [
        ({"tilert_host": "h"}, 10, "bad kv_transfer_params: tilert_ctrl_port"),
        (DEST, 300, "exceeds tilert_max_seq_len 256"),
    ],
)
def test_requests_that_cannot_go_are_reported_not_sent(params, tokens, error):
    sched = TileRTScheduler(ConnectorConfig.from_extra_config(BASE), COMPAT)
    r = FakeRequest("a", list(range(tokens)), dict(params))
    sched.on_new_request(r)
    assert sched.build_meta(_output([_new(r, [1])], _cached([], [], []), {"a": tokens})).jobs == []
    delay, out = sched.request_finished(r)
    assert not delay and out["tilert_status"] == "failed" and error in out["tilert_error"]
    assert "tilert_fault" not in out  # the request itself cannot go: no prefill is to blame


def test_connector_lines_reach_vllms_handler():
    """vLLM logs through one handler on its `vllm` logger (propagation off); the connector's lines
    must reach it, or they never show in the prefill's output."""
    seen: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = seen.append  # type: ignore[method-assign]
    vllm_logger = logging.getLogger("vllm")
    vllm_logger.addHandler(handler)
    try:
        sched = TileRTScheduler(ConnectorConfig.from_extra_config(BASE), COMPAT)
        sched.on_new_request(FakeRequest("too-long", list(range(300)), dict(DEST)))
    finally:
        vllm_logger.removeHandler(handler)
    assert [r.getMessage() for r in seen] == [
        "request too-long will not be handed to TileRT: prompt of 300 tokens exceeds tilert_max_seq_len 256"
    ]


def test_aborted_before_its_prefill_completes():
    sched = TileRTScheduler(ConnectorConfig.from_extra_config(BASE), COMPAT)
    r = FakeRequest("a", list(range(50)), dict(DEST), status=SimpleNamespace(name="FINISHED_ABORTED"))
    sched.on_new_request(r)
    sched.build_meta(_output([_new(r, [1, 2])], _cached([], [], []), {"a": 20}))
    delay, out = sched.request_finished(r)
    assert not delay and out["tilert_status"] == "failed" and "FINISHED_ABORTED" in out["tilert_error"]
    assert out["tilert_fault"] == "prefill"  # the router retries on another prefill, same node


def test_gather_takes_exactly_the_requests_rows():
    num_blocks, bs = 12, 16
    caches = {f"model.layers.{i}.self_attn.attn": torch.randn(num_blocks, 1, bs, 576) for i in range(3)}
    layout, paged = classify(caches, "mla", {}, {0: bs}, num_hidden_layers=2)
    assert (layout.num_layers, layout.num_mtp_layers, layout.kv_cache_dtype) == (3, 1, "float32")
    staging = layouts.Placement(layout, max_tokens=64)
    region = [torch.zeros(staging.total_nbytes(), dtype=torch.uint8)]
    blocks = [5, 2, 9]
    n = 37
    assert gather(paged, (blocks,), n, staging, region) == layout.request_bytes(n)
    for lid in range(3):
        _, off = staging.offset("mla", lid)
        got = region[0][off : off + n * 576 * 4].view(torch.float32).view(n, 576)
        flat = caches[f"model.layers.{lid}.self_attn.attn"].view(-1, 576)
        want = torch.stack([flat[blocks[t // bs] * bs + t % bs] for t in range(n)])
        assert torch.equal(got, want)


def test_classify_rejects_a_cache_the_layout_does_not_describe():
    with pytest.raises(ValueError, match="bytes per block"):
        classify({"model.layers.0.attn": torch.zeros(4, 1, 16, 512)}, "mla", {}, {0: 16}, num_hidden_layers=1)
    with pytest.raises(ValueError, match=r"not 0\.\.1"):
        classify(
            {f"model.layers.{i}.attn": torch.zeros(4, 1, 16, 576) for i in (0, 2)}, "mla", {}, {0: 16}, 2
        )
    fp8 = {f"model.layers.{i}.self_attn.attn": torch.zeros(4, 64, 656, dtype=torch.uint8) for i in range(79)}
    fp8 |= {
        f"model.layers.{i}.self_attn.indexer.k_cache": torch.zeros(4, 64, 132, dtype=torch.uint8)
        for i in range(79)
    }
    layout, paged = classify(fp8, "glm5", {}, {0: 64}, num_hidden_layers=78)
    assert layout.kv_cache_dtype == "fp8_ds_mla" and len(paged) == 158


def test_a_native_path_prefill_names_the_generation_and_nothing_else_is_touched():
    """A request vLLM's own connector moves (do_remote_decode) gets this prefill's generation in its
    answer, so the router decodes it only on a native decode of the same one; it is not claimed."""
    sched = TileRTScheduler(ConnectorConfig.from_extra_config(BASE), COMPAT)
    native = FakeRequest("n", list(range(10)), {"do_remote_decode": True})
    plain = FakeRequest("p", list(range(10)))
    for r in (native, plain):
        sched.on_new_request(r)
    assert sched.tracked == 0
    assert sched.request_finished(native) == (False, {"compat": COMPAT})
    assert sched.request_finished(plain) == (False, None)
    assert sched.pending_copies == 0
