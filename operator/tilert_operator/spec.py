"""The typed PDCluster spec: one frozen pydantic model per CRD section, defaults equal to the CRD's.

`crds/pdcluster.yaml` is the one source of the schema users see; this model is how the operator reads
it. tests/operator/test_op_crd.py checks that every default here equals the CRD default, so the two
cannot drift. Field names are snake_case in Python and camelCase on the wire (the CRD's spelling).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

from tilert_operator import constants
from tilert_serve import defaults, tracing
from tilert_serve.router.prefill_choice import PrefillPolicy

TilertModel = Literal["glm5", "deepseek_v3_2", "mla"]
KVCacheDtype = Literal["auto", "bfloat16", "float32", "fp8_ds_mla"]
ResolvedKVCacheDtype = Literal["bfloat16", "float32", "fp8_ds_mla"]
TransferEngine = Literal["mooncake", "nixl"]
TransferProtocol = Literal["tcp", "rdma"]
# MooncakeConnector is not offered: vLLM 0.32's has never run end to end with this stack (on vLLM's
# CPU build its worker needs an accelerator, and with that patched the decode never pulled), and its
# bootstrap registry is not yet rendered or fenced; the router already speaks its protocol (tested
# against vLLM's own MooncakeConnectorScheduler). NIXL is the native pool's connector until then.
NativeConnector = Literal["NixlConnector", "none"]
DecodeEngine = Literal["tilert", "reference"]
ServiceType = Literal["ClusterIP", "NodePort", "LoadBalancer"]
RoutePath = Literal["auto", "tilert", "native"]
Fallback = Literal["native", "reject"]

#: Models whose attention is DeepSeek sparse attention (an indexer beside MLA): the ones whose KV
#: vLLM can store as fp8_ds_mla, and the only ones the TileRT engine runs.
DSA_MODELS: frozenset[str] = frozenset({"glm5", "deepseek_v3_2"})


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, alias_generator=to_camel, populate_by_name=True)


class Weights(_Section):
    #: A core/v1 volume source (persistentVolumeClaim, hostPath, nfs, csi, image, ...) holding the
    #: checkpoint. Exactly one of `volume` and `tiny`.
    volume: dict[str, Any] | None = None
    #: Directory inside the volume that holds the checkpoint.
    sub_path: str = ""
    #: Generate a tiny DeepSeek-V3-style checkpoint into an emptyDir at pod start (CPU demos, tests).
    tiny: bool = False


class Model(_Section):
    #: The model name clients send (vLLM's --served-model-name).
    name: str = Field(min_length=1)
    weights: Weights
    tilert_model: TilertModel
    max_seq_len: int = Field(default=32768, ge=64, le=1048576)
    #: auto = fp8_ds_mla for glm5/deepseek_v3_2 (what TileRT's handoff ships), bfloat16 for mla.
    kv_cache_dtype: KVCacheDtype = "auto"
    #: What identifies the weights (a checkpoint revision, a commit, a date): part of the compatibility
    #: generation, so changing it rolls out a new generation beside the old one (render/generations.py).
    #: "" = unnamed; then a change of the weights under the same volume and subPath goes unnoticed.
    revision: str = Field(default="", max_length=128, pattern=r"^[A-Za-z0-9._:/+-]*$")

    @property
    def resolved_kv_cache_dtype(self) -> ResolvedKVCacheDtype:
        if self.kv_cache_dtype != "auto":
            return self.kv_cache_dtype
        return "fp8_ds_mla" if self.tilert_model in DSA_MODELS else "bfloat16"

    @property
    def model_dir(self) -> str:
        sub = self.weights.sub_path.strip("/")
        return f"{constants.MODEL_MOUNT}/{sub}" if sub else constants.MODEL_MOUNT


class Rdma(_Section):
    #: Device-plugin resources per pod, e.g. {"rdma/ib": 1} or {"nvidia.com/hostdev": 8}.
    resources: dict[str, int] = {}
    #: Multus NetworkAttachmentDefinitions ("name" or "namespace/name"); the first is the RDMA network
    #: whose address the operator publishes for each decode pod.
    networks: list[str] = []
    #: Run the data-plane pods in the host network namespace (RoCE without Multus).
    host_network: bool = False
    #: Extra environment for the transfer engine (UCX_*, MC_*, NCCL_*), on prefill and decode pods.
    env: dict[str, str] = {}


class Transfer(_Section):
    engine: TransferEngine = "mooncake"
    protocol: TransferProtocol = "tcp"
    rdma: Rdma = Rdma()
    #: Size of the /dev/shm emptyDir on prefill and decode pods (vLLM and the engines need it).
    shm_size: str = "2Gi"
    #: A digest of each handoff's bytes, checked by the TileRT node before it decodes the state.
    handoff_digest: bool = True
    #: Hand each layer over as the prefill's forward finishes it (the connector's tilert_layerwise).
    layerwise: bool = True


class Mtp(_Section):
    enabled: bool = True
    num_speculative_tokens: int = Field(default=1, ge=1, le=8)


#: Pod hygiene defaults (Pool's disruptionBudget, topologySpread, rollout, termination).
TOPOLOGY_HOSTNAME = "kubernetes.io/hostname"
TOPOLOGY_ZONE = "topology.kubernetes.io/zone"
#: Grace period of the pools that stream tokens (router, TileRT and native decode): long enough for
#: most completions in flight to finish.
STREAM_GRACE_S = 120
#: Grace period of the prefill pool: its requests are one forward pass.
PREFILL_GRACE_S = 60
#: The classic preStop sleep: endpoints controllers and proxies drop the pod before it sees SIGTERM.
PRE_STOP_SLEEP_S = 5
#: Seconds kept from the drain for a clean exit before the kubelet's SIGKILL.
EXIT_MARGIN_S = 5


class DisruptionBudget(_Section):
    #: Render a PodDisruptionBudget for the pool (never for a pool of 0 replicas).
    enabled: bool = True
    #: Pods of the pool a voluntary disruption (node drain, eviction) may take at once.
    max_unavailable: int = Field(default=1, ge=0)


class TopologySpread(_Section):
    #: Node labels to spread the pool's replicas over, one topologySpreadConstraint each; [] = none.
    topology_keys: list[str] = [TOPOLOGY_HOSTNAME, TOPOLOGY_ZONE]
    max_skew: int = Field(default=1, ge=1)
    #: ScheduleAnyway: a preference, so a small cluster still schedules every replica.
    when_unsatisfiable: Literal["ScheduleAnyway", "DoNotSchedule"] = "ScheduleAnyway"


class Rollout(_Section):
    #: None: 0 for pools with GPUs (a whole-node GPU pod has no free node to surge onto), else 1.
    max_surge: int | None = Field(default=None, ge=0)
    #: None: 1 for pools with GPUs, else 0 (surge first, never below the desired count).
    max_unavailable: int | None = Field(default=None, ge=0)
    #: StatefulSets (the TileRT pool) only: pods with an ordinal below it keep the old revision.
    partition: int = Field(default=0, ge=0)


class Termination(_Section):
    #: terminationGracePeriodSeconds: preStop sleep, then SIGTERM, drain, exit; SIGKILL after it.
    grace_period_seconds: int = Field(default=STREAM_GRACE_S, ge=1, le=86400)
    #: preStop sleep before SIGTERM, while the endpoints controller takes the pod out of its Services.
    pre_stop_sleep_seconds: int = Field(default=PRE_STOP_SLEEP_S, ge=0, le=300)

    @property
    def drain_timeout_s(self) -> int:
        """How long the process drains after SIGTERM: the grace period less the preStop sleep and a
        margin to exit cleanly (unregister buffers, close sessions) before the kubelet's SIGKILL."""
        return max(0, self.grace_period_seconds - self.pre_stop_sleep_seconds - EXIT_MARGIN_S)


class PrefillTermination(Termination):
    #: A prefill is one forward pass (seconds): a shorter grace period than the pools that stream.
    grace_period_seconds: int = Field(default=PREFILL_GRACE_S, ge=1, le=86400)


class Pool(_Section):
    #: Resource requests/limits (core/v1 ResourceRequirements) other than GPUs.
    resources: dict[str, Any] = {}
    node_selector: dict[str, str] = {}
    tolerations: list[dict[str, Any]] = []
    disruption_budget: DisruptionBudget = DisruptionBudget()
    topology_spread: TopologySpread = TopologySpread()
    rollout: Rollout = Rollout()
    termination: Termination = Termination()
    #: Merged over the container's rendered securityContext (render/hygiene.py), e.g.
    #: readOnlyRootFilesystem.
    security_context: dict[str, Any] = {}
    #: Merged over the pod's rendered securityContext (render/hygiene.py: the images' non-root user,
    #: root over RDMA), e.g. runAsUser for an image with another user.
    pod_security_context: dict[str, Any] = {}
    #: A JSON merge patch (RFC 7386) applied to the rendered workload: the escape hatch for anything
    #: the typed fields do not cover. Lists are replaced, not merged.
    overrides: dict[str, Any] = {}


#: The HPA's defaults: scale up at once, scale down only to the highest recommendation of the last
#: five minutes (a replica that starts in minutes must not go on the first quiet interval).
SCALE_UP_STABILIZATION_S = 0
SCALE_DOWN_STABILIZATION_S = 300


class PoolAutoscaling(_Section):
    """A pool's bounds under the planner (tilert_operator/autoscale/). When enabled, the pool's
    `replicas` is where it starts; the planner's decision (held in status) is what is rendered."""

    enabled: bool = False
    min_replicas: int = Field(default=1, ge=0, le=1024)
    #: None = not set; required when enabled (validation says so).
    max_replicas: int | None = Field(default=None, ge=1, le=1024)
    #: A rise is taken at once when 0; else the lowest recommendation of this window (as the HPA does).
    scale_up_stabilization_seconds: int = Field(default=SCALE_UP_STABILIZATION_S, ge=0, le=3600)
    #: A fall takes the highest recommendation of this window: no flapping on a noisy signal.
    scale_down_stabilization_seconds: int = Field(default=SCALE_DOWN_STABILIZATION_S, ge=0, le=3600)

    def bounds(self, replicas: int) -> tuple[int, int]:
        """[min, max] the pool may take: its bounds when enabled, else its fixed `replicas`."""
        if not self.enabled:
            return replicas, replicas
        return self.min_replicas, self.max_replicas if self.max_replicas is not None else replicas


class PrefillAutoscaling(PoolAutoscaling):
    #: A stack always has a prefill.
    min_replicas: int = Field(default=1, ge=1, le=1024)


class Prefill(Pool):
    replicas: int = Field(default=1, ge=1, le=1024)
    termination: PrefillTermination = PrefillTermination()
    image: str = constants.DEFAULT_VLLM_IMAGE
    tensor_parallel_size: int = Field(default=1, ge=1, le=64)
    #: GPUs per replica; 0 = CPU.
    gpus: int = Field(default=0, ge=0, le=64)
    mtp: Mtp = Mtp()
    native_connector: NativeConnector = "NixlConnector"
    extra_args: list[str] = []
    autoscaling: PrefillAutoscaling = PrefillAutoscaling()


class TileRTDecode(Pool):
    replicas: int = Field(default=1, ge=0, le=1024)
    image: str = constants.DEFAULT_DECODE_IMAGE
    engine: DecodeEngine = "tilert"
    slots: int = Field(default=1, ge=1, le=1024)
    ctrl_port: int = Field(default=defaults.DECODE_CTRL_PORT, ge=1, le=65535)
    http_port: int = Field(default=defaults.DECODE_HTTP_PORT, ge=1, le=65535)
    gpus: int = Field(default=constants.TILERT_GPUS, ge=0, le=64)
    #: Decode with multi-token prediction from the first step (needs prefill.mtp.enabled).
    mtp: bool = True
    autoscaling: PoolAutoscaling = PoolAutoscaling()


class NativeDecode(Pool):
    replicas: int = Field(default=0, ge=0, le=1024)
    image: str = constants.DEFAULT_VLLM_IMAGE
    tensor_parallel_size: int = Field(default=1, ge=1, le=64)
    gpus: int = Field(default=0, ge=0, le=64)
    extra_args: list[str] = []
    autoscaling: PoolAutoscaling = PoolAutoscaling()


#: The pools of model servers (an image, GPUs per replica, replicas), as the data-plane renderers take them.
ServingPool = Prefill | TileRTDecode | NativeDecode


class Decode(_Section):
    tilert: TileRTDecode = TileRTDecode()
    native: NativeDecode = NativeDecode()


class Policy(_Section):
    header: str = "x-pd-route"
    tilert_aliases: list[str] = []
    native_aliases: list[str] = []
    default: RoutePath = "auto"
    when_tilert_full: Fallback = "native"
    unsupported_on_tilert: Fallback = "native"
    #: How the router picks a prefill (tilert_serve/router/prefill_choice.py); cache_aware's thresholds
    #: and the prefix index's caps keep the router config's defaults.
    prefill: PrefillPolicy = "cache_aware"


class RouterService(_Section):
    type: ServiceType = "ClusterIP"
    port: int = Field(default=defaults.ROUTER_PORT, ge=1, le=65535)


class ApiKeysSecret(_Section):
    name: str = Field(min_length=1)
    key: str = "keys"


#: The router's requests (no pod of the stack is BestEffort by default) and a memory limit; no CPU
#: limit, whose throttling would show as latency on every stream.
ROUTER_RESOURCES: dict[str, Any] = {
    "requests": {"cpu": "250m", "memory": "256Mi"},
    "limits": {"memory": "1Gi"},
}


class Router(Pool):
    replicas: int = Field(default=1, ge=1, le=64)
    resources: dict[str, Any] = ROUTER_RESOURCES
    image: str = constants.DEFAULT_ROUTER_IMAGE
    service: RouterService = RouterService()
    policy: Policy = Policy()
    api_keys_secret: ApiKeysSecret | None = None
    #: With API keys: /metrics answers without a key (it names every endpoint's address).
    metrics_public: bool = False


class NetworkPolicies(_Section):
    enabled: bool = True
    #: NetworkPolicyPeers also admitted to the HTTP ports (a metrics scraper such as Prometheus).
    metrics_from: list[dict[str, Any]] = []


GenerationStrategy = Literal["BlueGreen", "Recreate"]


class GenerationRollout(_Section):
    """How a change of the compatibility generation (model revision, KV-cache dtype, MTP: anything
    that makes a prefill and a decode of the old and the new spec unable to pair) is rolled out.
    An image or resource change keeps the generation and is an ordinary rolling update."""

    #: BlueGreen: the new generation starts beside the old one (as many GPUs again as the data-plane
    #: pools use), traffic moves once it is ready, then the old one drains and goes. Recreate: the old
    #: generation goes first (no extra GPUs; requests are served only by the pools that have a
    #: compatible pair until the new one is ready).
    strategy: GenerationStrategy = "BlueGreen"
    #: With BlueGreen: the most GPUs the new generation may hold beside the old one; a spec whose new
    #: generation needs more is refused (say Recreate, or raise the bound). None = no bound.
    max_surge_gpus: int | None = Field(default=None, ge=0)
    #: Seconds the new generation may take to become ready before Progressing says RolloutStalled
    #: (nothing is undone: the old generation keeps serving). Loading a large checkpoint takes minutes.
    progress_deadline_seconds: int = Field(default=3600, ge=60, le=86400)


class Tracing(_Section):
    #: OTLP/HTTP traces URL of the collector; empty = no tracing.
    endpoint: str = Field(default="", max_length=512, pattern=f"^(|{tracing.URL_PATTERN})$")
    #: Share of the requests the router starts a trace for; a client's sampled traceparent is followed.
    sample_ratio: float = Field(default=1.0, ge=0.0, le=1.0)


class Observability(_Section):
    tracing: Tracing = Tracing()


AutoscalingActuator = Literal["Operator", "HPA"]


class Objective(_Section):
    """The latency the planner holds (docs/autoscaling.md): a pool whose observed percentile misses
    it is scaled up whatever its utilization says. 0 = no objective on that latency."""

    ttft_seconds: float = Field(default=2.0, ge=0.0, le=600.0)
    tpot_seconds: float = Field(default=0.1, ge=0.0, le=60.0)
    #: The percentile of TTFT and TPOT that is held (0.95 = p95).
    percentile: float = Field(default=0.95, ge=0.5, le=0.999)


class RatioBounds(_Section):
    """Prefill replicas per decode replica (TileRT + native). None = no bound on that side."""

    min: float | None = Field(default=None, ge=0.0, le=1024.0)
    max: float | None = Field(default=None, ge=0.0, le=1024.0)


class Autoscaling(_Section):
    """What the planner aims at, for the pools whose `autoscaling.enabled` is true."""

    objective: Objective = Objective()
    #: The share of a pool's capacity the planner sizes for (TileRT slots busy, native KV cache used,
    #: prefill queue per replica against its batch): the headroom that absorbs a rise while a replica starts.
    target_utilization: float = Field(default=0.7, ge=0.05, le=1.0)
    prefill_to_decode_ratio: RatioBounds = RatioBounds()
    #: Operator: the operator sets the pools' replicas from the planner's decision. HPA: it renders
    #: HorizontalPodAutoscalers on external metrics (KEDA or a metrics adapter) and leaves replicas to them.
    actuator: AutoscalingActuator = "Operator"
    #: Seconds between two runs of the planner.
    interval_seconds: int = Field(default=15, ge=5, le=600)


class PDClusterSpec(_Section):
    model: Model
    transfer: Transfer = Transfer()
    prefill: Prefill = Prefill()
    decode: Decode = Decode()
    router: Router = Router()
    network_policies: NetworkPolicies = NetworkPolicies()
    generation_rollout: GenerationRollout = GenerationRollout()
    observability: Observability = Observability()
    autoscaling: Autoscaling = Autoscaling()


def parse(spec: dict[str, Any]) -> PDClusterSpec:
    """Parse a PDCluster's `.spec`; pydantic's errors name the field (see validation.explain)."""
    return PDClusterSpec.model_validate(spec)
