"""Each component's command line and environment: the one source for pods and local processes.

`commands(spec)` gives what a pod runs; `tilert-pd local` calls the same function with local paths
and hosts, so the demo runs exactly what the cluster runs. Pod-specific wiring (downward-API env,
volumes, probes) stays in the pod renderers.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from tilert_operator import constants
from tilert_operator.spec import PDClusterSpec
from tilert_serve import dataplane, defaults, vllm_cpu
from tilert_serve.tracing import FOLLOW_PARENT_ONLY, OTLP_HTTP_PROTOCOL, VLLM_PROTOCOL_ENV, VLLM_SAMPLER_ENV

#: Module vLLM loads TileRTConnector from.
TILERT_CONNECTOR_MODULE = "tilert_serve.pd_vllm.prefill_connector"
TINY_MODEL = "tiny-model"


@dataclass(frozen=True)
class ContainerCommand:
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Paths:
    """Where a component finds its files and how it binds: pods and local runs differ only here."""

    #: Directory of the checkpoint.
    model_dir: str
    #: File with the handoff's shared secret (its `accept` file lies beside it).
    secret_file: str = defaults.SECRET_PATH
    #: File with the node API token (decode node and router). Pods mount it (Paths.pod); None = no
    #: flag (a local run given no token file: the node's API is then open, and it logs so).
    api_token_file: str | None = None
    #: The router's config.yaml.
    router_config: str = constants.ROUTER_CONFIG_FILE
    #: Address servers bind to.
    host: str = "0.0.0.0"
    # Ports. Pods use the defaults and the spec's; a local run puts several servers on one host and
    # gives each process its own (e.g. prefill and native decode cannot both take VLLM_PORT).
    vllm_port: int = defaults.VLLM_PORT
    #: None = the spec's decode.tilert.ctrlPort / httpPort, router.service.port.
    ctrl_port: int | None = None
    http_port: int | None = None
    router_port: int | None = None

    @classmethod
    def pod(cls, spec: PDClusterSpec) -> Paths:
        return cls(model_dir=spec.model.model_dir, api_token_file=defaults.NODE_API_TOKEN_PATH)


def _json(obj: object) -> str:
    # Compact and key-ordered: the argument is stable, so a re-render never restarts a pod.
    return json.dumps(obj, separators=(",", ":"), sort_keys=True)


def has_native_connector(spec: PDClusterSpec) -> bool:
    """The prefill loads the native pool's connector whenever the spec names one, whatever the native
    pool's size: scaling that pool between 0 and N must not change (and so restart) the prefill pods."""
    return spec.prefill.native_connector != "none"


def tilert_connector(spec: PDClusterSpec, paths: Paths) -> dict[str, object]:
    return {
        "kv_connector": "TileRTConnector",
        "kv_connector_module_path": TILERT_CONNECTOR_MODULE,
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {
            "tilert_model": spec.model.tilert_model,
            "tilert_max_seq_len": spec.model.max_seq_len,
            "tilert_transfer": spec.transfer.engine,
            "tilert_protocol": spec.transfer.protocol,
            "tilert_secret_path": paths.secret_file,
            # Rendered only when off (on is both sides' default), so the default spec renders as before.
            **({} if spec.transfer.handoff_digest else {"tilert_handoff_digest": False}),
            **({} if spec.transfer.layerwise else {"tilert_layerwise": False}),
            # Part of the compatibility fingerprint the prefill advertises (tilert_serve/compat.py);
            # rendered only when set ("" is the connector's default), so specs without it render as before.
            **({"model_revision": spec.model.revision} if spec.model.revision else {}),
            # The prefill finds its own address on the handoff's networks, as the decode node does.
            **(
                {"tilert_data_plane_networks": list(spec.transfer.rdma.networks)}
                if spec.transfer.rdma.networks
                else {}
            ),
        },
    }


def prefill_kv_transfer_config(spec: PDClusterSpec, paths: Paths) -> dict[str, object]:
    """TileRTConnector alone, or MultiConnector[TileRTConnector, native] when the spec names a native
    connector (`nativeConnector: none` for a stack that never has a native pool).

    TileRTConnector comes first: MultiConnector asks children in order and TileRT claims only
    requests carrying tilert_host, so native requests fall through to the native connector.
    """
    tilert = tilert_connector(spec, paths)
    if not has_native_connector(spec):
        return tilert
    native = {"kv_connector": spec.prefill.native_connector, "kv_role": "kv_producer"}
    return {
        "kv_connector": "MultiConnector",
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"connectors": [tilert, native]},
    }


def speculative_config(spec: PDClusterSpec, on_cpu: bool = False) -> dict[str, object] | None:
    mtp = spec.prefill.mtp
    if not mtp.enabled:
        return None
    cfg: dict[str, object] = {"method": "mtp", "num_speculative_tokens": mtp.num_speculative_tokens}
    return cfg | vllm_cpu.drafter_config() if on_cpu else cfg


def _vllm(
    spec: PDClusterSpec,
    paths: Paths,
    tp: int,
    gpus: int,
    kv_transfer_config: dict[str, object],
    extra_args: list[str],
    drain_timeout_s: int,
) -> ContainerCommand:
    """`vllm serve` for a pool; a pool without GPUs gets what vLLM's CPU build needs for MLA models."""
    on_cpu = gpus == 0
    argv = _vllm_common(spec, paths, tp)
    # vLLM aborts the requests in flight on SIGTERM unless told to wait (its default is 0 = abort):
    # finish them within the pool's grace period (spec.<pool>.termination).
    argv += ["--shutdown-timeout", str(drain_timeout_s)]
    if on_cpu:
        argv += vllm_cpu.serve_args()
    argv += ["--kv-transfer-config", _json(kv_transfer_config)]
    spec_cfg = speculative_config(spec, on_cpu)
    if spec_cfg is not None:
        argv += ["--speculative-config", _json(spec_cfg)]
    env = {**vllm_cpu.serve_env(tp), **spec.transfer.rdma.env} if on_cpu else dict(spec.transfer.rdma.env)
    argv, env = _vllm_tracing(spec, argv, env)
    return ContainerCommand(argv + extra_args, env)


def _vllm_tracing(
    spec: PDClusterSpec, argv: list[str], env: dict[str, str]
) -> tuple[list[str], dict[str, str]]:
    """vLLM's own OTLP tracing when the spec sets an endpoint: a span per request whose traceparent
    (the router's prefill or decode leg) is sampled, a child of that leg, and none for a request
    without one (the router decides). The endpoint is an OTLP/HTTP URL, and vLLM's exporter speaks gRPC
    unless its container's env says otherwise."""
    endpoint = spec.observability.tracing.endpoint
    if not endpoint:
        return argv, env
    otel = {VLLM_PROTOCOL_ENV: OTLP_HTTP_PROTOCOL, VLLM_SAMPLER_ENV: FOLLOW_PARENT_ONLY}
    return [*argv, "--otlp-traces-endpoint", endpoint], {**env, **otel}


def _vllm_common(spec: PDClusterSpec, paths: Paths, tp: int) -> list[str]:
    kv_dtype = spec.model.resolved_kv_cache_dtype
    argv = [
        "vllm", "serve", paths.model_dir,
        "--served-model-name", spec.model.name,
        "--host", paths.host,
        "--port", str(paths.vllm_port),
        "--tensor-parallel-size", str(tp),
        "--max-model-len", str(spec.model.max_seq_len),
    ]  # fmt: skip
    if kv_dtype == "float32":
        # vLLM has no float32 cache dtype: its cache follows the model's dtype ("auto").
        return [*argv, "--kv-cache-dtype", "auto", "--dtype", "float32"]
    return [*argv, "--kv-cache-dtype", kv_dtype]


def prefill(spec: PDClusterSpec, paths: Paths) -> ContainerCommand:
    p = spec.prefill
    return _vllm(
        spec,
        paths,
        p.tensor_parallel_size,
        p.gpus,
        prefill_kv_transfer_config(spec, paths),
        list(p.extra_args),
        p.termination.drain_timeout_s,
    )


def native_decode(spec: PDClusterSpec, paths: Paths) -> ContainerCommand:
    n = spec.decode.native
    connector = spec.prefill.native_connector if spec.prefill.native_connector != "none" else "NixlConnector"
    return _vllm(
        spec,
        paths,
        n.tensor_parallel_size,
        n.gpus,
        {"kv_connector": connector, "kv_role": "kv_consumer"},
        list(n.extra_args),
        n.termination.drain_timeout_s,
    )


def tilert_decode(spec: PDClusterSpec, paths: Paths) -> ContainerCommand:
    t = spec.decode.tilert
    argv = [
        "tilert-pd", "decode-node",
        "--model-dir", paths.model_dir,
        "--tilert-model", spec.model.tilert_model,
        "--engine", t.engine,
        "--slots", str(t.slots),
        "--host", paths.host,
        "--ctrl-port", str(paths.ctrl_port or t.ctrl_port),
        "--http-port", str(paths.http_port or t.http_port),
        "--transfer", spec.transfer.engine,
        "--protocol", spec.transfer.protocol,
        "--secret-file", paths.secret_file,
        "--max-seq-len", str(spec.model.max_seq_len),
        "--kv-cache-dtype", spec.model.resolved_kv_cache_dtype,
        # The name the prefills serve: part of the compatibility generation both sides advertise.
        "--served-model-name", spec.model.name,
        # MTP resumes from the draft-layer KV the prefill computed: same depth on both sides.
        "--num-speculative-tokens", str(spec.prefill.mtp.num_speculative_tokens if t.mtp else 0),
    ]  # fmt: skip
    if spec.model.tilert_model == "mla":
        # The prefill registers (and hands over) the drafter's KV cache only with its MTP on: the
        # node's handoff layout follows the prefill's setting, whatever the node's own MTP.
        argv += ["--handoff-mtp-layers", "1" if spec.prefill.mtp.enabled else "0"]
    # After SIGTERM: refuse admissions, finish the streams in flight, within the grace period.
    argv += ["--drain-timeout", str(t.termination.drain_timeout_s)]
    if spec.model.revision:
        # Part of the compatibility fingerprint the node advertises and checks (tilert_serve/compat.py).
        argv += ["--model-revision", spec.model.revision]
    if not spec.transfer.handoff_digest:
        argv += ["--handoff-digest", "off"]
    if paths.api_token_file:
        # Only a holder of this token (the router) may admit, generate, cancel or list.
        argv += ["--api-token-file", paths.api_token_file]
    if t.gpus:
        # One receive-buffer shard per GPU (cuda:0..N-1); the engine's own device is the first.
        argv += ["--device", "cuda:0", "--shards", str(t.gpus)]
    if spec.observability.tracing.endpoint:
        # Spans of each traced request's admission and handoff stages (tilert_serve/tracing.py).
        argv += ["--otlp-traces-endpoint", spec.observability.tracing.endpoint]
    if spec.transfer.rdma.networks:
        # The node finds its own address on these in the Multus network-status file (dataplane.py).
        argv += [
            "--data-plane-networks",
            ",".join(spec.transfer.rdma.networks),
            "--network-status-file",
            dataplane.NETWORK_STATUS_FILE,
        ]
    return ContainerCommand(argv, dict(spec.transfer.rdma.env))


def router(spec: PDClusterSpec, paths: Paths) -> ContainerCommand:
    argv = [
        "tilert-pd", "router",
        "--config", paths.router_config,
        "--host", paths.host,
        "--port", str(paths.router_port or spec.router.service.port),
        # After SIGTERM: readiness false, finish the streams in flight, within the grace period.
        "--drain-timeout", str(spec.router.termination.drain_timeout_s),
    ]  # fmt: skip
    return ContainerCommand(argv)


def tiny_model(spec: PDClusterSpec, paths: Paths) -> ContainerCommand:
    """Writes the tiny checkpoint (spec.model.weights.tiny); deterministic, so every pod gets the same."""
    return ContainerCommand(["tilert-pd", "tiny-model", "--out", paths.model_dir])


def commands(spec: PDClusterSpec, paths: Paths | None = None) -> dict[str, ContainerCommand]:
    """The command of every component the spec runs, keyed by component name."""
    paths = paths or Paths.pod(spec)
    out = {constants.PREFILL: prefill(spec, paths), constants.ROUTER: router(spec, paths)}
    if spec.decode.tilert.replicas:
        out[constants.TILERT] = tilert_decode(spec, paths)
    if spec.decode.native.replicas:
        out[constants.NATIVE] = native_decode(spec, paths)
    if spec.model.weights.tiny:
        out[TINY_MODEL] = tiny_model(spec, paths)
    return out
