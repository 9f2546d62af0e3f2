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
from tilert_serve import defaults

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
    model_config = ConfigDict(
        extra="forbid", frozen=True, alias_generator=to_camel, populate_by_name=True
    )


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


class Mtp(_Section):
    enabled: bool = True
    num_speculative_tokens: int = Field(default=1, ge=1, le=8)


class Pool(_Section):
    #: Resource requests/limits (core/v1 ResourceRequirements) other than GPUs.
    resources: dict[str, Any] = {}
    node_selector: dict[str, str] = {}
    tolerations: list[dict[str, Any]] = []
    #: A JSON merge patch (RFC 7386) applied to the rendered workload: the escape hatch for anything
    #: the typed fields do not cover. Lists are replaced, not merged.
    overrides: dict[str, Any] = {}


class Prefill(Pool):
    replicas: int = Field(default=1, ge=1, le=1024)
    image: str = constants.DEFAULT_VLLM_IMAGE
    tensor_parallel_size: int = Field(default=1, ge=1, le=64)
    #: GPUs per replica; 0 = CPU.
    gpus: int = Field(default=0, ge=0, le=64)
    mtp: Mtp = Mtp()
    native_connector: NativeConnector = "NixlConnector"
    extra_args: list[str] = []


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


class NativeDecode(Pool):
    replicas: int = Field(default=0, ge=0, le=1024)
    image: str = constants.DEFAULT_VLLM_IMAGE
    tensor_parallel_size: int = Field(default=1, ge=1, le=64)
    gpus: int = Field(default=0, ge=0, le=64)
    extra_args: list[str] = []


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


class RouterService(_Section):
    type: ServiceType = "ClusterIP"
    port: int = Field(default=defaults.ROUTER_PORT, ge=1, le=65535)


class ApiKeysSecret(_Section):
    name: str = Field(min_length=1)
    key: str = "keys"


class Router(Pool):
    replicas: int = Field(default=1, ge=1, le=64)
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


class PDClusterSpec(_Section):
    model: Model
    transfer: Transfer = Transfer()
    prefill: Prefill = Prefill()
    decode: Decode = Decode()
    router: Router = Router()
    network_policies: NetworkPolicies = NetworkPolicies()


def parse(spec: dict[str, Any]) -> PDClusterSpec:
    """Parse a PDCluster's `.spec`; pydantic's errors name the field (see validation.explain)."""
    return PDClusterSpec.model_validate(spec)
