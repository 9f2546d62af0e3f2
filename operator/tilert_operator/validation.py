"""Cross-field rules of a PDCluster spec that a structural schema cannot express.

Pure functions: each rule returns the problems it finds, and every message names the field and the
fix. The admission webhook rejects with them; the operator sets SpecValid=False with them when a bad
spec reaches it anyway (a cluster without the webhook), and then changes nothing in the cluster.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import pydantic
from pydantic.alias_generators import to_camel

from tilert_operator import constants
from tilert_operator import spec as specmod
from tilert_operator.spec import PDClusterSpec
from tilert_serve import defaults, pydantic_errors


@dataclass(frozen=True)
class Problem:
    #: Dotted path of the offending field, as users write it (spec.decode.tilert.gpus).
    field: str
    #: What is wrong and how to fix it.
    message: str

    def __str__(self) -> str:
        return f"{self.field}: {self.message}"


#: Ports vLLM listens on besides its API port; a host-network decode node must not take them.
#: 5600 is vLLM's default NIXL side-channel port (VLLM_NIXL_SIDE_CHANNEL_PORT).
VLLM_SIDE_PORTS: dict[int, str] = {defaults.VLLM_PORT: "vLLM's API port", 5600: "vLLM's NIXL side channel"}


def _gpus_vs_tp(pool: str, gpus: int, tp: int) -> Iterable[Problem]:
    if gpus and gpus != tp:
        yield Problem(
            f"spec.{pool}.gpus",
            f"{gpus} GPUs per replica but tensorParallelSize is {tp}: one replica is one tensor-parallel "
            f"group; set gpus: {tp} or tensorParallelSize: {gpus} (or gpus: 0 for CPU)",
        )


def _no_gpu_in_resources(pool: str, resources: dict[str, Any]) -> Iterable[Problem]:
    for kind in ("requests", "limits"):
        if constants.GPU_RESOURCE in (resources.get(kind) or {}):
            yield Problem(
                f"spec.{pool}.resources.{kind}",
                f"do not set {constants.GPU_RESOURCE} here; set spec.{pool}.gpus instead (the one source)",
            )


def rule_gpus(s: PDClusterSpec) -> Iterable[Problem]:
    yield from _gpus_vs_tp("prefill", s.prefill.gpus, s.prefill.tensor_parallel_size)
    yield from _no_gpu_in_resources("prefill", s.prefill.resources)
    if s.decode.native.replicas:
        yield from _gpus_vs_tp("decode.native", s.decode.native.gpus, s.decode.native.tensor_parallel_size)
    yield from _no_gpu_in_resources("decode.native", s.decode.native.resources)
    yield from _no_gpu_in_resources("decode.tilert", s.decode.tilert.resources)
    t = s.decode.tilert
    if t.replicas and t.engine == "tilert" and t.gpus != constants.TILERT_GPUS:
        yield Problem(
            "spec.decode.tilert.gpus",
            f"engine tilert shards the model over exactly {constants.TILERT_GPUS} GPUs, got {t.gpus}; "
            f"set gpus: {constants.TILERT_GPUS}, or engine: reference",
        )


def rule_engine_model(s: PDClusterSpec) -> Iterable[Problem]:
    t = s.decode.tilert
    if t.replicas and t.engine == "tilert" and s.model.tilert_model not in specmod.DSA_MODELS:
        yield Problem(
            "spec.decode.tilert.engine",
            f"engine tilert runs only glm5 and deepseek_v3_2, not tilertModel {s.model.tilert_model}; "
            "set engine: reference",
        )


def rule_kv_dtype(s: PDClusterSpec) -> Iterable[Problem]:
    if s.model.kv_cache_dtype == "fp8_ds_mla" and s.model.tilert_model not in specmod.DSA_MODELS:
        yield Problem(
            "spec.model.kvCacheDtype",
            f"fp8_ds_mla is the sparse-attention cache of glm5 and deepseek_v3_2, not of tilertModel "
            f"{s.model.tilert_model}; set kvCacheDtype: bfloat16 (or auto)",
        )
    if s.model.kv_cache_dtype == "float32" and s.model.tilert_model in specmod.DSA_MODELS:
        yield Problem(
            "spec.model.kvCacheDtype",
            f"float32 is for small mla models on CPUs; {s.model.tilert_model} hands off fp8_ds_mla or "
            "bfloat16: set kvCacheDtype: auto",
        )


def rule_mtp(s: PDClusterSpec) -> Iterable[Problem]:
    t = s.decode.tilert
    if t.replicas and t.mtp and not s.prefill.mtp.enabled:
        yield Problem(
            "spec.prefill.mtp.enabled",
            "the TileRT pool decodes with MTP (spec.decode.tilert.mtp), whose draft-layer KV is filled "
            "during prefill; set spec.prefill.mtp.enabled: true, or spec.decode.tilert.mtp: false",
        )


def rule_decode_pools(s: PDClusterSpec) -> Iterable[Problem]:
    if s.decode.tilert.replicas + s.decode.native.replicas == 0:
        yield Problem(
            "spec.decode",
            "both decode pools have 0 replicas; set spec.decode.tilert.replicas or "
            "spec.decode.native.replicas above 0",
        )
    if s.decode.native.replicas and s.prefill.native_connector == "none":
        yield Problem(
            "spec.prefill.nativeConnector",
            f"is none but spec.decode.native.replicas is {s.decode.native.replicas}: the native pool "
            "reads KV through it; set NixlConnector",
        )


def rule_transfer(s: PDClusterSpec) -> Iterable[Problem]:
    r = s.transfer.rdma
    if s.transfer.protocol == "rdma" and not r.resources:
        yield Problem(
            "spec.transfer.rdma.resources",
            "protocol rdma needs the RDMA device-plugin resources each pod requests, e.g. "
            "{rdma/ib: 1}; set them, or protocol: tcp",
        )
    if r.host_network and r.networks:
        yield Problem(
            "spec.transfer.rdma.networks",
            "Multus secondary networks do not attach to host-network pods; remove networks or set "
            "hostNetwork: false",
        )


def rule_ports(s: PDClusterSpec) -> Iterable[Problem]:
    t = s.decode.tilert
    if t.ctrl_port == t.http_port:
        yield Problem(
            "spec.decode.tilert.httpPort",
            f"equals ctrlPort ({t.ctrl_port}); the node listens on both, set different ports",
        )
    if not s.transfer.rdma.host_network or not t.replicas:
        return
    # Host-network pods share the node's ports: a decode node next to a prefill or native pod must
    # not take vLLM's ports. (Two pods of one pool never share a node: the renderer adds
    # anti-affinity under hostNetwork.)
    for field, port in (("ctrlPort", t.ctrl_port), ("httpPort", t.http_port)):
        if port in VLLM_SIDE_PORTS:
            yield Problem(
                f"spec.decode.tilert.{field}",
                f"{port} is {VLLM_SIDE_PORTS[port]} and spec.transfer.rdma.hostNetwork puts both on the "
                "node's network; pick another port",
            )


def rule_weights(s: PDClusterSpec) -> Iterable[Problem]:
    w = s.model.weights
    if (w.volume is not None) == w.tiny:
        yield Problem(
            "spec.model.weights",
            "set exactly one of volume (a volume source such as persistentVolumeClaim) or tiny: true",
        )


RULES: tuple[Callable[[PDClusterSpec], Iterable[Problem]], ...] = (
    rule_weights,
    rule_gpus,
    rule_engine_model,
    rule_kv_dtype,
    rule_mtp,
    rule_decode_pools,
    rule_transfer,
    rule_ports,
)


def check(s: PDClusterSpec) -> list[Problem]:
    """Every cross-field problem of a parsed spec (empty = valid)."""
    return [p for rule in RULES for p in rule(s)]


def explain(error: pydantic.ValidationError) -> list[Problem]:
    """pydantic's errors as Problems with the CRD's field spelling."""
    return [Problem(path, message)
            for path, message in pydantic_errors.problems(error, root="spec", spell=to_camel, show_input=True)]


def check_name(name: str) -> list[Problem]:
    if len(name) > 40:
        return [Problem("metadata.name", f"{len(name)} characters; children need it at most 40, pick a shorter name")]
    return []


def validate(raw_spec: dict[str, Any], name: str = "") -> tuple[PDClusterSpec | None, list[Problem]]:
    """Parse and check a raw `.spec`: (the parsed spec, []) or (None or the spec, problems)."""
    problems = check_name(name)
    try:
        parsed = specmod.parse(raw_spec)
    except pydantic.ValidationError as e:
        return None, problems + explain(e)
    problems += check(parsed)
    return (parsed, problems)
