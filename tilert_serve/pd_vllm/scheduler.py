"""TileRTConnector, scheduler side (runs in vLLM's EngineCore process).

Follows claimed requests across (chunked) prefill steps, accumulating their block ids, and in the
step that completes a request's prompt tells the workers to extract and send it; with the layer-wise
handoff, every earlier step of its prompt also gets a job (SendJob.upto), so the workers can send each
chunk as it is computed. Unclaimed requests never enter any structure here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tilert_serve.pd_vllm.config import ConnectorConfig
from tilert_serve.pd_vllm.logs import get_logger
from tilert_serve.pd_vllm.metadata import Destination, ReqId, SendJob, TileRTConnectorMetadata

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

log = get_logger(__name__)


@dataclass
class _Claimed:
    request: Request
    dest: Destination | None
    #: Why this request will not be handed off (bad params, too long); None while it still can.
    refused: str | None
    block_ids: tuple[list[int], ...] = ()
    #: Set once the step completing the prompt was scheduled and the job went to the workers.
    queued: bool = False
    #: A chunk job (with the prompt's ids) went to the workers: later chunks' jobs leave the ids out.
    announced: bool = False


def _job(req_id: ReqId, claimed: _Claimed, n: int, *, with_prompt: bool, upto: int | None = None) -> SendJob:
    """The send job of `claimed`'s prompt of `n` tokens (through `upto` for a chunk)."""
    assert claimed.dest is not None
    prompt = claimed.request.prompt_token_ids or []
    return SendJob(
        req_id=req_id,
        dest=claimed.dest,
        num_tokens=n,
        last_prompt_token=prompt[n - 1],
        prompt_token_ids=list(prompt) if with_prompt else [],
        block_ids=claimed.block_ids,
        upto=upto,
    )


class TileRTScheduler:
    def __init__(self, config: ConnectorConfig, compat: str) -> None:
        self.config = config
        #: This prefill's compatibility fingerprint (generation.py): in every claimed request's answer.
        self.compat = compat
        #: req_id -> state, for claimed requests between on_new_request and request_finished.
        self._claimed: dict[ReqId, _Claimed] = {}
        #: Finished requests whose blocks the workers still copy out (delay-free until reported).
        self._copying: set[ReqId] = set()

    def on_new_request(self, request: Request) -> None:
        params = request.kv_transfer_params
        if not Destination.claims(params):
            return
        dest, refused = None, None
        try:
            dest = Destination.parse(params)  # type: ignore[arg-type]
        except ValueError as exc:
            refused = f"bad kv_transfer_params: {exc}"
        if refused is None and request.num_prompt_tokens > self.config.max_seq_len:
            refused = (
                f"prompt of {request.num_prompt_tokens} tokens exceeds tilert_max_seq_len "
                f"{self.config.max_seq_len}"
            )
        if refused:
            log.warning("request %s will not be handed to TileRT: %s", request.request_id, refused)
        self._claimed[request.request_id] = _Claimed(request, dest, refused)

    def update_state_after_alloc(self, request: Request, block_ids: tuple[list[int], ...]) -> None:
        claimed = self._claimed.get(request.request_id)
        if claimed is not None and not claimed.block_ids:
            claimed.block_ids = tuple(list(b) for b in block_ids)

    def build_meta(self, out: SchedulerOutput) -> TileRTConnectorMetadata:
        meta = TileRTConnectorMetadata()
        if not self._claimed:
            return meta
        progress: dict[ReqId, int] = {}
        for new in out.scheduled_new_reqs:
            claimed = self._claimed.get(new.req_id)
            if claimed is not None:
                claimed.block_ids = tuple(list(b) for b in new.block_ids)
                progress[new.req_id] = new.num_computed_tokens
        cached = out.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            claimed = self._claimed.get(req_id)
            if claimed is None:
                continue
            new_blocks = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:  # a resumed request gets its whole block table anew
                claimed.block_ids = tuple(list(b) for b in (new_blocks or ()))
            elif new_blocks is not None:
                claimed.block_ids = tuple(
                    old + list(new)
                    for old, new in zip(
                        claimed.block_ids or tuple([] for _ in new_blocks), new_blocks, strict=True
                    )
                )
            progress[req_id] = cached.num_computed_tokens[i]
        for req_id, computed in progress.items():
            claimed = self._claimed[req_id]
            n = claimed.request.num_prompt_tokens
            if claimed.queued or claimed.refused or claimed.dest is None:
                continue
            upto = computed + out.num_scheduled_tokens.get(req_id, 0)
            if upto >= n:
                meta.jobs.append(_job(req_id, claimed, n, with_prompt=True))
                claimed.queued = True
            elif claimed.dest.wants_layerwise(self.config.layerwise):
                # A chunk: the prompt goes with the first one only (and the last, above).
                meta.jobs.append(_job(req_id, claimed, n, with_prompt=not claimed.announced, upto=upto))
                claimed.announced = True
        return meta

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        """(delay_free, the params the router reads). Blocks of a queued job stay until it is copied."""
        claimed = self._claimed.pop(request.request_id, None)
        if claimed is None:
            asked = request.kv_transfer_params
            if isinstance(asked, dict) and asked.get("do_remote_decode"):
                # A native-path prefill (vLLM's own connector moves its blocks): its answer names this
                # generation too, so the router decodes it only on a native decode of the same one.
                return False, {"compat": self.compat}
            return False, None
        # `compat`: the router decodes the request only on a server of this generation.
        params: dict[str, Any] = {"tilert_num_tokens": request.num_prompt_tokens, "compat": self.compat}
        if request.output_token_ids:
            params["tilert_first_token"] = int(request.output_token_ids[0])
        if claimed.queued:
            params["tilert_status"] = "queued"
            self._copying.add(request.request_id)
            return True, params
        params["tilert_status"] = "failed"
        params["tilert_error"] = (
            claimed.refused or f"request ended ({request.status.name}) before its prefill did"
        )
        if not claimed.refused:
            # This server ended it (aborted, shutting down): the router retries on another prefill and
            # keeps the node, which never saw the request, in rotation.
            params["tilert_fault"] = "prefill"
        return False, params

    def sent(self, finished_sending: set[ReqId]) -> None:
        """Workers reported these copied out (MultiConnector passes every child's ids: keep ours)."""
        self._copying -= finished_sending

    @property
    def pending_copies(self) -> int:
        return len(self._copying)

    @property
    def tracked(self) -> int:
        return len(self._claimed)
