"""TileRTConnector: vLLM's prefill hands requests bound for TileRT to a decode node.

Load it with --kv-transfer-config (alone, or as a child of MultiConnector beside a native connector):

    {"kv_connector": "TileRTConnector",
     "kv_connector_module_path": "tilert_serve.pd_vllm.prefill_connector",
     "kv_role": "kv_producer",
     "kv_connector_extra_config": {"tilert_model": "glm5", "tilert_max_seq_len": 202752, ...}}

Only requests whose kv_transfer_params carry `tilert_host` are claimed (the router adds it with
tilert_ctrl_port and tilert_ticket); for every other request each hook is a no-op and no keys are
returned. Keys this connector returns are namespaced `tilert_*` so MultiConnector never clashes.

Hooks implemented
  scheduler: on_new_request (claim), update_state_after_alloc (block ids), build_connector_meta
             (jobs for requests whose prompt completes this step; layer-wise, also for each earlier
             step of a chunked prompt, whose tokens can leave as they are computed), request_finished[_all_groups]
             (tilert_status, tilert_first_token, tilert_num_tokens; blocks held until copied out),
             update_connector_output + has_pending_push_work (keep stepping until every copy is done).
  worker:    register_kv_caches (classify layers, staging, transfer engine, sender thread),
             bind_connector_metadata (before the forward: layer-wise jobs take staging and the sender
             starts the handshake), save_kv_layer (layer-wise: stage each main layer as the forward
             finishes it), wait_for_save (after the drafter: the MTP layers and whatever was not
             staged yet, or the whole state; hand to the sender),
             get_finished (ids copied out: their blocks may be freed), get_kv_connector_stats, shutdown.
Block contract: see worker.py.
No-ops, and why: get_num_new_matched_tokens -> (0, False) (a producer loads nothing);
start_load_kv / wait_for_layer_load (nothing to load; vLLM 0.32 calls start_load_kv after the
forward unless a load is synchronous, so the layer-wise handshake starts at bind_connector_metadata).
Reading path: config.py -> metadata.py -> scheduler.py -> worker.py (extract.py, stats.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)

from tilert_serve.pd_vllm.config import ConfigError, ConnectorConfig
from tilert_serve.pd_vllm.generation import prefill_compat
from tilert_serve.pd_vllm.logs import get_logger
from tilert_serve.pd_vllm.metadata import SendJob, TileRTConnectorMetadata
from tilert_serve.pd_vllm.scheduler import TileRTScheduler
from tilert_serve.pd_vllm.stats import TileRTPromMetrics, TileRTStats

if TYPE_CHECKING:
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import PromMetric, PromMetricT
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

log = get_logger(__name__)


class TileRTConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self.config = ConnectorConfig.from_extra_config(
            self._kv_transfer_config.kv_connector_extra_config or {}
        )
        self._scheduler: TileRTScheduler | None = None
        self._worker: Any = None
        try:
            #: This prefill's compatibility generation: in every claimed request's kv_transfer_params
            #: (`compat`) and in each handoff's Request.
            self.compat = prefill_compat(self.config.tilert_model, self.config.model_revision, vllm_config)
        except ValueError as exc:
            raise ConfigError(f"TileRTConnector: {exc}") from exc
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = TileRTScheduler(self.config, self.compat.fingerprint)
        else:
            from vllm.distributed.parallel_state import (
                get_tensor_model_parallel_rank,
                get_tensor_model_parallel_world_size,
            )

            from tilert_serve.pd_vllm.worker import TileRTWorker

            if vllm_config.parallel_config.pipeline_parallel_size > 1:
                raise ValueError(
                    "TileRTConnector does not support pipeline parallelism; use tensor parallelism"
                )
            group_of: dict[str, int] = {}
            block_size_of: dict[int, int] = {}
            for g, group in enumerate(getattr(kv_cache_config, "kv_cache_groups", []) or []):
                block_size_of[g] = group.kv_cache_spec.block_size
                for name in group.layer_names:
                    group_of[name] = g
            hf = vllm_config.model_config.hf_config
            self._worker = TileRTWorker(
                self.config,
                rank=get_tensor_model_parallel_rank(),
                world_size=get_tensor_model_parallel_world_size(),
                group_of=group_of,
                block_size_of=block_size_of,
                num_hidden_layers=int(hf.num_hidden_layers),
                compat=self.compat,
            )

    # -- scheduler side ----------------------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return 0, False

    def on_new_request(self, request: Request) -> None:
        assert self._scheduler is not None
        self._scheduler.on_new_request(request)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        assert self._scheduler is not None
        self._scheduler.update_state_after_alloc(request, blocks.get_block_ids())

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self._scheduler is not None
        return self._scheduler.build_meta(scheduler_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        return self._scheduler.request_finished(request)

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        return self._scheduler.request_finished(request)

    def update_connector_output(self, connector_output: Any) -> None:
        assert self._scheduler is not None
        self._scheduler.sent(connector_output.finished_sending or set())

    def has_pending_push_work(self) -> bool:
        return self._scheduler is not None and self._scheduler.pending_copies > 0

    # -- worker side -------------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._worker.register(kv_caches)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None and isinstance(connector_metadata, TileRTConnectorMetadata):
            self._worker.begin(connector_metadata.jobs)

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        # Every attention layer of every step comes here: the forward-context look-up only when a
        # layer-wise job is being staged.
        if self._worker is None or not self._worker.staging_layers or _micro_batched():
            return  # micro-batches report each layer once per batch: wait_for_save stages those steps
        self._worker.layer_saved(layer_name)

    def wait_for_save(self) -> None:
        # Every step, empty or not: jobs waiting for staging are retried here.
        jobs: list[SendJob] = []
        if self.has_connector_metadata():
            meta = self._get_connector_metadata()
            if isinstance(meta, TileRTConnectorMetadata):
                jobs = meta.jobs
        self._worker.expect(jobs)
        self._worker.step(jobs)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self._worker.finished(finished_req_ids), None

    def get_kv_connector_stats(self) -> TileRTStats | None:
        return self._worker.take_stats() if self._worker is not None else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> TileRTStats | None:
        return TileRTStats(data=data) if data is not None else TileRTStats()

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: Any,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> TileRTPromMetrics:
        return TileRTPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()


def _micro_batched() -> bool:
    from vllm.forward_context import get_forward_context, is_forward_context_available

    return is_forward_context_available() and get_forward_context().ubatch_slices is not None


def _register() -> None:
    # MultiConnector rebuilds its children's stats in the API-server process by registry name; a
    # connector loaded by module path is not in vLLM's registry unless it puts itself there, and an
    # unknown name there kills vLLM's output handler ("Connector 'TileRTConnector' is not registered").
    # vLLM imports this module in that process when it builds the connectors' Prometheus metrics.
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    try:
        KVConnectorFactory.register_connector(TileRTConnector.__name__, __name__, TileRTConnector.__name__)
    except ValueError:  # already registered (imported twice)
        pass


_register()
