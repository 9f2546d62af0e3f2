"""Cross-field rules of a PDCluster spec that a structural schema cannot express.

Pure functions: each rule returns the problems it finds, and every message names the field and the
fix. The admission webhook rejects with them; the operator sets SpecValid=False with them when a bad
spec reaches it anyway (a cluster without the webhook), and then changes nothing in the cluster.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from fractions import Fraction
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


def may_run(pool: specmod.ServingPool) -> bool:
    """The pool has replicas now, or the planner may give it some (its autoscaling bound): the rules
    about what its pods need apply either way."""
    return most_replicas(pool) > 0


def rule_gpus(s: PDClusterSpec) -> Iterable[Problem]:
    yield from _gpus_vs_tp("prefill", s.prefill.gpus, s.prefill.tensor_parallel_size)
    yield from _no_gpu_in_resources("prefill", s.prefill.resources)
    if may_run(s.decode.native):
        yield from _gpus_vs_tp("decode.native", s.decode.native.gpus, s.decode.native.tensor_parallel_size)
    yield from _no_gpu_in_resources("decode.native", s.decode.native.resources)
    yield from _no_gpu_in_resources("decode.tilert", s.decode.tilert.resources)
    t = s.decode.tilert
    if may_run(t) and t.engine == "tilert" and t.gpus != constants.TILERT_GPUS:
        yield Problem(
            "spec.decode.tilert.gpus",
            f"engine tilert shards the model over exactly {constants.TILERT_GPUS} GPUs, got {t.gpus}; "
            f"set gpus: {constants.TILERT_GPUS}, or engine: reference",
        )


def rule_engine_model(s: PDClusterSpec) -> Iterable[Problem]:
    t = s.decode.tilert
    if may_run(t) and t.engine == "tilert" and s.model.tilert_model not in specmod.DSA_MODELS:
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
    if may_run(t) and t.mtp and not s.prefill.mtp.enabled:
        yield Problem(
            "spec.prefill.mtp.enabled",
            "the TileRT pool decodes with MTP (spec.decode.tilert.mtp), whose draft-layer KV is filled "
            "during prefill; set spec.prefill.mtp.enabled: true, or spec.decode.tilert.mtp: false",
        )


def rule_generation_rollout(s: PDClusterSpec) -> Iterable[Problem]:
    """A blue/green rollout of a new compatibility generation holds both generations' data-plane pools
    at once (render/generations.py, rollout.py): the bound is checked against what this spec's pools
    hold, since the next generation change starts exactly these beside the running ones."""
    from tilert_operator.render import generations

    r = s.generation_rollout
    if r.max_surge_gpus is None:
        return
    if r.strategy != "BlueGreen":
        yield Problem(
            "spec.generationRollout.maxSurgeGpus",
            f"maxSurgeGpus bounds the extra GPUs of a BlueGreen rollout; strategy {r.strategy} adds none: "
            "remove maxSurgeGpus, or set strategy: BlueGreen",
        )
        return
    need = generations.surge_gpus(s)
    if need > r.max_surge_gpus:
        n = s.decode
        yield Problem(
            "spec.generationRollout.maxSurgeGpus",
            f"a new compatibility generation of this spec starts {need} GPUs beside the running one "
            f"(prefill {s.prefill.replicas}x{s.prefill.gpus}, TileRT {n.tilert.replicas}x{n.tilert.gpus}, "
            f"native {n.native.replicas}x{n.native.gpus}) but maxSurgeGpus is {r.max_surge_gpus}: raise it "
            f"to {need}, lower the pools' replicas, or set spec.generationRollout.strategy: Recreate (the old "
            "generation goes before the new one starts: no extra GPUs, a gap in the routes it served)",
        )


def rule_decode_pools(s: PDClusterSpec) -> Iterable[Problem]:
    if s.decode.tilert.replicas + s.decode.native.replicas == 0:
        yield Problem(
            "spec.decode",
            "both decode pools have 0 replicas; set spec.decode.tilert.replicas or "
            "spec.decode.native.replicas above 0",
        )
    if may_run(s.decode.native) and s.prefill.native_connector == "none":
        yield Problem(
            "spec.prefill.nativeConnector",
            f"is none but the native pool may have replicas (replicas {s.decode.native.replicas}, "
            f"autoscaling up to {s.decode.native.autoscaling.bounds(s.decode.native.replicas)[1]}): "
            "it reads KV through it; set NixlConnector",
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


# ---- autoscaling -------------------------------------------------------------------------------

#: The pools the planner sizes, with their spec field.
AUTOSCALED_POOLS = ("prefill", "decode.tilert", "decode.native")


def _autoscaled(s: PDClusterSpec) -> list[tuple[str, specmod.ServingPool]]:
    return [("prefill", s.prefill), ("decode.tilert", s.decode.tilert), ("decode.native", s.decode.native)]


def rule_autoscaling(s: PDClusterSpec) -> Iterable[Problem]:
    """Bounds the planner can honour: each pool's [min, max] holds its starting replicas, a decode
    pool always remains, the ratio bounds can be met inside the pools' bounds, and the pools at
    their maximum still fit a blue/green rollout's GPU bound."""
    from tilert_operator.render import generations

    for field, pool in _autoscaled(s):
        a = pool.autoscaling
        if not a.enabled:
            continue
        base = f"spec.{field}.autoscaling"
        if a.max_replicas is None:
            yield Problem(
                f"{base}.maxReplicas",
                f"is needed when autoscaling is enabled; set it (at least minReplicas, {a.min_replicas})",
            )
            continue
        if a.min_replicas > a.max_replicas:
            yield Problem(
                f"{base}.minReplicas",
                f"{a.min_replicas} is above maxReplicas {a.max_replicas}; lower minReplicas or raise maxReplicas",
            )
            continue
        if not a.min_replicas <= pool.replicas <= a.max_replicas:
            yield Problem(
                f"spec.{field}.replicas",
                f"{pool.replicas} (the starting point) is outside autoscaling's [{a.min_replicas}, "
                f"{a.max_replicas}]; set replicas within it, or change the bounds",
            )
    t, n = s.decode.tilert, s.decode.native
    (t_lo, t_hi), (n_lo, n_hi) = t.autoscaling.bounds(t.replicas), n.autoscaling.bounds(n.replicas)
    if (t.autoscaling.enabled or n.autoscaling.enabled) and t_lo + n_lo == 0:
        yield Problem(
            "spec.decode",
            "the planner may take both decode pools to 0 (TileRT and native minReplicas, or fixed replicas, "
            "are 0); set spec.decode.tilert.autoscaling.minReplicas or spec.decode.native.autoscaling."
            "minReplicas to 1",
        )
    default = s.router.policy.default
    if default != "auto" and (t if default == "tilert" else n).autoscaling.enabled:
        lo = t_lo if default == "tilert" else n_lo
        if lo == 0:
            yield Problem(
                f"spec.decode.{default}.autoscaling.minReplicas",
                f"is 0 but spec.router.policy.default is {default}: requests with no header would find no "
                "pool; set minReplicas to 1, or the default to auto",
            )
    r = s.autoscaling.prefill_to_decode_ratio
    if r.min is not None and r.max is not None and r.min > r.max:
        yield Problem(
            "spec.autoscaling.prefillToDecodeRatio.min",
            f"{r.min:g} is above max {r.max:g}; lower min or raise max",
        )
    else:
        p_lo, p_hi = s.prefill.autoscaling.bounds(s.prefill.replicas)
        d_lo, d_hi = t_lo + n_lo, t_hi + n_hi
        # The ratio can be met iff some prefill count in [p_lo, p_hi] over some decode count in
        # [d_lo, d_hi] falls in [min, max]: the extremes p_lo/d_hi and p_hi/d_lo bound what is reachable.
        if r.max is not None and d_hi > 0 and p_lo > r.max * d_hi:
            yield Problem(
                "spec.autoscaling.prefillToDecodeRatio.max",
                f"{r.max:g} cannot be met: even at the fewest prefills ({p_lo}) and the most decode replicas "
                f"({d_hi}) the ratio is {p_lo / d_hi:.3g}; raise max, lower spec.prefill.autoscaling.minReplicas "
                "or raise the decode pools' maxReplicas",
            )
        if r.min is not None and d_lo > 0 and p_hi < r.min * d_lo:
            yield Problem(
                "spec.autoscaling.prefillToDecodeRatio.min",
                f"{r.min:g} cannot be met: even at the most prefills ({p_hi}) and the fewest decode replicas "
                f"({d_lo}) the ratio is {p_hi / d_lo:.3g}; lower min, raise spec.prefill.autoscaling.maxReplicas "
                "or lower the decode pools' minReplicas",
            )
    g = s.generation_rollout
    if (
        g.strategy == "BlueGreen"
        and g.max_surge_gpus is not None
        and any(p.autoscaling.enabled for _, p in _autoscaled(s))
    ):
        at_max = s.model_copy(
            update={
                "prefill": s.prefill.model_copy(update={"replicas": most_replicas(s.prefill)}),
                "decode": s.decode.model_copy(
                    update={
                        "tilert": t.model_copy(update={"replicas": most_replicas(t)}),
                        "native": n.model_copy(update={"replicas": most_replicas(n)}),
                    }
                ),
            }
        )
        need = generations.surge_gpus(at_max)
        if need > g.max_surge_gpus:
            yield Problem(
                "spec.generationRollout.maxSurgeGpus",
                f"at the pools' autoscaling maxReplicas (prefill {most_replicas(s.prefill)}x{s.prefill.gpus}, TileRT "
                f"{most_replicas(t)}x{t.gpus}, native {most_replicas(n)}x{n.gpus} GPUs) a new generation starts {need} GPUs "
                f"beside the running one but maxSurgeGpus is {g.max_surge_gpus}: raise it to {need}, lower the "
                "maxReplicas, or set spec.generationRollout.strategy: Recreate",
            )


def most_replicas(pool: specmod.ServingPool) -> int:
    """The most replicas the pool may have: its autoscaling maximum, or its fixed replicas."""
    return pool.autoscaling.bounds(pool.replicas)[1]


# ---- what the API server and the controllers will accept -------------------------------------

#: The StatefulSet controller labels each pod `controller-revision-hash: <statefulset>-<hash>` (a
#: 32-bit FNV hash in Kubernetes' safe alphabet: up to 10 characters). A label value holds at most 63
#: characters, so a StatefulSet named longer than 63 - 1 - 10 = 52 is accepted by the API server and
#: can never create a pod.
STATEFULSET_NAME_MAX = 63 - 1 - 10
#: Service names are DNS-1035 labels; so is every child name's worst case, which must then fit 63.
DNS1035_LABEL = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
#: Environment variable names the API server accepts (v1.30-1.33; 1.34 relaxes it).
ENV_NAME = re.compile(r"[-._a-zA-Z][-._a-zA-Z0-9]*")
#: resource.Quantity's grammar: sign, decimal number, one suffix (binary, decimal SI, or an exponent).
QUANTITY = re.compile(r"([+-]?)([0-9]*)(?:\.([0-9]*))?(Ki|Mi|Gi|Ti|Pi|Ei|n|u|m|k|M|G|T|P|E|[eE][+-]?[0-9]+)?")
_BINARY = {"Ki": 10, "Mi": 20, "Gi": 30, "Ti": 40, "Pi": 50, "Ei": 60}
_DECIMAL = {"n": -9, "u": -6, "m": -3, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}
#: Label keys (an optional DNS-subdomain prefix and a name) and values, as the API server checks them.
LABEL_NAME = re.compile(r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]")
LABEL_PREFIX = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
TOLERATION_FIELDS = frozenset({"key", "operator", "value", "effect", "tolerationSeconds"})
TOLERATION_EFFECTS = frozenset({"", "NoSchedule", "PreferNoSchedule", "NoExecute"})
PEER_FIELDS = frozenset({"podSelector", "namespaceSelector", "ipBlock"})
RESOURCE_FIELDS = frozenset({"requests", "limits", "claims"})
#: Where each component's pool is configured in the spec.
POOL_FIELDS = {
    constants.PREFILL: "spec.prefill",
    constants.TILERT: "spec.decode.tilert",
    constants.NATIVE: "spec.decode.native",
    constants.ROUTER: "spec.router",
}
#: vLLM flags the operator sets from the spec (what to set instead).
RENDERED_FLAGS = {
    "--port": "the operator sets it: probes, Services and the router use the rendered port",
    "--host": "the operator sets it: probes and Services need the pod to listen on every address",
    "--served-model-name": "set spec.model.name",
    "--tensor-parallel-size": "set the pool's tensorParallelSize",
    "--max-model-len": "set spec.model.maxSeqLen",
    "--kv-cache-dtype": "set spec.model.kvCacheDtype",
    "--kv-transfer-config": "the operator renders it from spec.transfer and spec.prefill.nativeConnector",
    "--speculative-config": "set spec.prefill.mtp",
}


def parse_quantity(value: Any) -> Fraction:
    """The value of a Kubernetes quantity (`500m`, `1.5Gi`, `8`, `1e3`); ValueError if the API server
    would not parse it. Two spellings of one value (`0.5`, `500m`) are equal here."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ValueError(f"{value!r} is not a quantity")
    if isinstance(value, int):
        return Fraction(value)
    m = QUANTITY.fullmatch(value)
    if m is None or not (m.group(2) or m.group(3)):
        raise ValueError(f"{value!r} is not a quantity (e.g. 500m, 2, 1.5Gi, 512Mi)")
    sign, whole, frac, suffix = m.groups()
    out = Fraction(int(whole or "0")) + (Fraction(int(frac), 10 ** len(frac)) if frac else 0)
    if suffix in _BINARY:
        out *= 2 ** _BINARY[suffix]
    elif suffix in _DECIMAL:
        out *= Fraction(10) ** _DECIMAL[suffix]
    elif suffix:
        out *= Fraction(10) ** int(suffix[1:])
    out = Fraction(-((-out * 10**9) // 1), 10**9)  # the API server rounds up to a nano, as it stores it
    return -out if sign == "-" else out


def max_name_length() -> int:
    """The longest PDCluster name whose children all fit, from the children's naming: the TileRT
    StatefulSet `<name>-tilert-decode` within STATEFULSET_NAME_MAX, every `<name>-<component>` (Services
    are DNS-1035 labels) within 63."""
    suffix = {c: len(constants.child_name("", c)) for c in constants.COMPONENTS}
    return min(STATEFULSET_NAME_MAX - suffix[constants.TILERT], 63 - max(suffix.values()))


def check_name(name: str) -> list[Problem]:
    if not name:
        return []
    problems = []
    limit = max_name_length()
    if len(name) > limit:
        problems.append(
            Problem(
                "metadata.name",
                (
                    f"{len(name)} characters; at most {limit}: the TileRT StatefulSet is named {name[:8]}...-{constants.TILERT} and "
                    f"the StatefulSet controller labels its pods controller-revision-hash=<statefulset>-<hash>, which must fit 63 "
                    f"characters (a StatefulSet name of at most {STATEFULSET_NAME_MAX}); pick a shorter name"
                ),
            )
        )
    if not DNS1035_LABEL.fullmatch(name):
        problems.append(
            Problem(
                "metadata.name",
                (
                    f"{name!r} cannot name the Services ({name}-prefill, ...): a Service name must start with a lowercase letter and "
                    "hold only lowercase letters, digits and '-', ending in a letter or digit; rename it (e.g. "
                    f"{'x' + re.sub('[^-a-z0-9]', '-', name.lower())!r})"
                ),
            )
        )
    return problems


def _quantity_problems(field: str, resources: dict[str, Any]) -> Iterable[Problem]:
    for key in resources:
        if key not in RESOURCE_FIELDS:
            yield Problem(
                f"{field}.{key}",
                f"unknown field; ResourceRequirements has {', '.join(sorted(RESOURCE_FIELDS))}",
            )
    values: dict[str, dict[str, Fraction]] = {"requests": {}, "limits": {}}
    for kind in ("requests", "limits"):
        section = resources.get(kind) or {}
        if not isinstance(section, dict):
            yield Problem(
                f"{field}.{kind}", "must be a map of resource name to quantity, e.g. {cpu: 500m, memory: 1Gi}"
            )
            continue
        for name, raw in section.items():
            try:
                value = parse_quantity(raw)
            except ValueError as e:
                yield Problem(
                    f"{field}.{kind}.{name}", f"{e}; write a quantity such as 500m, 2, 512Mi or 1.5Gi"
                )
                continue
            if value < 0:
                yield Problem(
                    f"{field}.{kind}.{name}", f"{raw!r} is negative; a request or limit must be 0 or more"
                )
            values[kind][name] = value
    for name, limit in values["limits"].items():
        request = values["requests"].get(name)
        if request is not None and request > limit:
            yield Problem(
                f"{field}.requests.{name}",
                f"is above its limit ({resources['limits'][name]!r}); raise the limit or lower the request",
            )


def rule_resources(s: PDClusterSpec) -> Iterable[Problem]:
    for component, pool in _pools(s):
        yield from _quantity_problems(f"{POOL_FIELDS[component]}.resources", pool.resources)
    try:
        if parse_quantity(s.transfer.shm_size) <= 0:
            yield Problem("spec.transfer.shmSize", "must be above 0, e.g. 2Gi")
    except ValueError as e:
        yield Problem("spec.transfer.shmSize", f"{e}; write a size such as 2Gi or 512Mi")


def _pools(s: PDClusterSpec) -> list[tuple[str, Any]]:
    return [
        (constants.PREFILL, s.prefill),
        (constants.TILERT, s.decode.tilert),
        (constants.NATIVE, s.decode.native),
        (constants.ROUTER, s.router),
    ]


def rule_env_names(s: PDClusterSpec) -> Iterable[Problem]:
    for name in s.transfer.rdma.env:
        if not ENV_NAME.fullmatch(name):
            yield Problem(
                f"spec.transfer.rdma.env.{name}",
                "is not a valid environment variable name: letters, digits, "
                "'_', '-' and '.', not starting with a digit",
            )
    own = operator_env_names(s)
    for name in sorted(set(s.transfer.rdma.env) & own):
        yield Problem(
            f"spec.transfer.rdma.env.{name}",
            f"{name} is set by the operator itself (the pods' own address "
            "and identity through the downward API, which the data plane depends on); remove it from "
            "spec.transfer.rdma.env",
        )


def operator_env_names(s: PDClusterSpec) -> frozenset[str]:
    """The environment variables the operator sets from the downward API in any data-plane pod: the
    rendered children's env entries that are not plain values (the spec's own env is plain values)."""
    from tilert_operator import render

    names = set()
    for obj in render.children(s, "x", "default"):
        for c in _containers(obj):
            names |= {e["name"] for e in c.get("env") or [] if "valueFrom" in e}
    return frozenset(names)


def _containers(obj: dict[str, Any]) -> list[dict[str, Any]]:
    pod = ((obj.get("spec") or {}).get("template") or {}).get("spec") or {}
    return (
        [*(pod.get("initContainers") or []), *(pod.get("containers") or [])] if isinstance(pod, dict) else []
    )


def rule_extra_args(s: PDClusterSpec) -> Iterable[Problem]:
    for field, args in (
        ("spec.prefill.extraArgs", s.prefill.extra_args),
        ("spec.decode.native.extraArgs", s.decode.native.extra_args),
    ):
        for i, arg in enumerate(args):
            flag = arg.split("=", 1)[0]
            if flag in RENDERED_FLAGS:
                yield Problem(
                    f"{field}[{i}]", f"{flag} is rendered by the operator ({RENDERED_FLAGS[flag]}); remove it"
                )


def rule_policy(s: PDClusterSpec) -> Iterable[Problem]:
    p = s.router.policy
    if p.default == "tilert" and not s.decode.tilert.replicas:
        yield Problem(
            "spec.router.policy.default",
            "is tilert but spec.decode.tilert.replicas is 0, so every request "
            "without a header or alias would fail; set default: auto (or native), or give the TileRT pool replicas",
        )
    if p.default == "native" and not s.decode.native.replicas:
        yield Problem(
            "spec.router.policy.default",
            "is native but spec.decode.native.replicas is 0, so every request "
            "without a header or alias would fail; set default: auto (or tilert), or give the native pool replicas",
        )
    for alias in sorted(set(p.tilert_aliases) & set(p.native_aliases)):
        yield Problem(
            "spec.router.policy.nativeAliases",
            f"{alias!r} is in tilertAliases too; a model name picks one "
            "path: remove it from one of the lists",
        )


def rule_tolerations(s: PDClusterSpec) -> Iterable[Problem]:
    for component, pool in _pools(s):
        for i, tol in enumerate(pool.tolerations):
            field = f"{POOL_FIELDS[component]}.tolerations[{i}]"
            for key in sorted(set(tol) - TOLERATION_FIELDS):
                yield Problem(
                    f"{field}.{key}",
                    f"unknown field; a toleration has {', '.join(sorted(TOLERATION_FIELDS))}",
                )
            op = tol.get("operator", "Equal")
            if op not in ("Equal", "Exists"):
                yield Problem(f"{field}.operator", f"{op!r}: use Equal or Exists")
            if op == "Exists" and tol.get("value"):
                yield Problem(
                    f"{field}.value", "must be empty with operator Exists; remove it or use operator: Equal"
                )
            if tol.get("effect", "") not in TOLERATION_EFFECTS:
                yield Problem(
                    f"{field}.effect",
                    f"{tol.get('effect')!r}: use NoSchedule, PreferNoSchedule or NoExecute (or omit it)",
                )
            if "tolerationSeconds" in tol and (
                isinstance(tol["tolerationSeconds"], bool) or not isinstance(tol["tolerationSeconds"], int)
            ):
                yield Problem(f"{field}.tolerationSeconds", "must be an integer number of seconds")


def label_problems(field: str, labels: Any) -> Iterable[Problem]:
    """Label keys and values the API server would refuse (in a nodeSelector or a selector's matchLabels)."""
    if not isinstance(labels, dict):
        yield Problem(field, "must be a map of label keys to values")
        return
    for key, value in labels.items():
        prefix, _, name = str(key).rpartition("/")
        if (
            ("/" in str(key) and not (LABEL_PREFIX.fullmatch(prefix) and len(prefix) <= 253))
            or not LABEL_NAME.fullmatch(name)
            or len(name) > 63
        ):
            yield Problem(
                f"{field}.{key}",
                "is not a valid label key: an optional DNS-subdomain prefix and '/', then at most 63 "
                "letters, digits, '-', '_' or '.', starting and ending with a letter or digit",
            )
        if not isinstance(value, str) or len(value) > 63 or (value and not LABEL_NAME.fullmatch(value)):
            yield Problem(
                f"{field}.{key}",
                f"{value!r} is not a valid label value: at most 63 letters, digits, '-', '_' or "
                "'.', starting and ending with a letter or digit (or empty)",
            )


def rule_node_selectors(s: PDClusterSpec) -> Iterable[Problem]:
    for component, pool in _pools(s):
        yield from label_problems(f"{POOL_FIELDS[component]}.nodeSelector", pool.node_selector)


def rule_metrics_from(s: PDClusterSpec) -> Iterable[Problem]:
    for i, peer in enumerate(s.network_policies.metrics_from):
        field = f"spec.networkPolicies.metricsFrom[{i}]"
        unknown = sorted(set(peer) - PEER_FIELDS)
        for key in unknown:
            yield Problem(
                f"{field}.{key}", f"unknown field; a NetworkPolicyPeer has {', '.join(sorted(PEER_FIELDS))}"
            )
        if not any(peer.get(k) is not None for k in PEER_FIELDS):
            yield Problem(
                field,
                "names no peer: set podSelector, namespaceSelector or ipBlock (podSelector: {} admits "
                "every pod of the namespace)",
            )
        for key in ("podSelector", "namespaceSelector"):
            selector = peer.get(key)
            if isinstance(selector, dict) and "matchLabels" in selector:
                yield from label_problems(f"{field}.{key}.matchLabels", selector["matchLabels"])


def rule_rendered(s: PDClusterSpec) -> Iterable[Problem]:
    """Checks on the rendered workloads, overrides applied: what the API server refuses in them."""
    from tilert_operator import render

    for obj in render.children(s, "x", "default"):
        if obj["kind"] not in ("Deployment", "StatefulSet"):
            continue
        component = (obj["metadata"].get("labels") or {}).get(constants.LABEL_COMPONENT, "")
        field = f"{POOL_FIELDS.get(component, 'spec')}.overrides"
        spec: dict[str, Any] = obj["spec"] if isinstance(obj.get("spec"), dict) else {}
        selector = spec.get("selector")
        template: dict[str, Any] = spec["template"] if isinstance(spec.get("template"), dict) else {}
        labels = (template.get("metadata") or {}).get("labels") or {}
        if not isinstance(selector, dict) or not (
            selector.get("matchLabels") or selector.get("matchExpressions")
        ):
            yield Problem(
                field,
                f"removes the {obj['kind']}'s spec.selector, which the API server requires (and which "
                "cannot change after creation); do not override spec.selector",
            )
        elif any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
            yield Problem(
                field,
                f"makes the {obj['kind']}'s pod labels miss its selector {selector.get('matchLabels')}; "
                "keep the operator's labels in spec.template.metadata.labels",
            )
        for c in _containers(obj):
            names = [str(e.get("name")) for e in c.get("env") or [] if isinstance(e, dict)]
            for dup in sorted({n for n in names if names.count(n) > 1 and n not in s.transfer.rdma.env}):
                yield Problem(
                    field,
                    f"sets the environment variable {dup} of container {c.get('name')} twice; set it once",
                )


# ---- what runs as asked: accepted by every server, broken in the pods ---------------------------

#: An image reference as the container runtime parses it (the distribution/reference grammar): a
#: repository path in lowercase, an optional registry host before it, a tag and/or a digest after it.
_PATH_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_DOMAIN = r"(?:(?:[a-zA-Z0-9]|[a-zA-Z0-9][a-zA-Z0-9-]*[a-zA-Z0-9])(?:\.(?:[a-zA-Z0-9]|[a-zA-Z0-9][a-zA-Z0-9-]*[a-zA-Z0-9]))*|\[[a-fA-F0-9:]+\])(?::[0-9]+)?"
IMAGE_REFERENCE = re.compile(
    rf"(?:{_DOMAIN}/)?{_PATH_COMPONENT}(?:/{_PATH_COMPONENT})*(?::[\w][\w.-]{{0,127}})?"
    r"(?:@[A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9a-fA-F]{32,})?"
)
DNS1123_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
#: A Secret's keys (and so the file names of its volume).
SECRET_KEY = re.compile(r"[-._a-zA-Z0-9]+")
#: A Multus network as the pod annotation names it: `[namespace/]name[@interface]`.
NETWORK_NAME = re.compile(
    r"(?:([a-z0-9]([-a-z0-9]*[a-z0-9])?)/)?([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*)(?:@[-._a-zA-Z0-9]{1,15})?"
)


def rule_images(s: PDClusterSpec) -> Iterable[Problem]:
    for component, pool in _pools(s):
        image, field = pool.image, f"{POOL_FIELDS[component]}.image"
        if image != image.strip():
            yield Problem(
                field,
                f"{image!r} has leading or trailing whitespace, which the API server refuses in a pod (so "
                "no pod would start); remove it",
            )
        elif len(image) > 4096 or not IMAGE_REFERENCE.fullmatch(image):
            yield Problem(
                field,
                f"{image!r} is not an image reference the container runtime can pull (InvalidImageName): "
                "[registry[:port]/]path[:tag][@digest], the path in lowercase letters, digits and '.', '_' "
                f"or '-' separators; e.g. {image.lower()!r}",
            )


def rule_termination(s: PDClusterSpec) -> Iterable[Problem]:
    """The kubelet SIGKILLs a pod gracePeriodSeconds after it starts stopping it, preStop hook
    included: a sleep that leaves no time to drain cuts every stream at once."""
    for component, pool in _pools(s):
        t, field = pool.termination, f"{POOL_FIELDS[component]}.termination"
        sleep, grace, floor = (
            t.pre_stop_sleep_seconds,
            t.grace_period_seconds,
            t.pre_stop_sleep_seconds + specmod.EXIT_MARGIN_S,
        )
        if sleep and floor >= grace:
            when = "before SIGTERM even reaches it" if sleep >= grace else "as its drain starts"
            yield Problem(
                f"{field}.preStopSleepSeconds",
                (
                    f"{sleep} s of preStop sleep and {specmod.EXIT_MARGIN_S} s to exit leave no time to drain within "
                    f"{field}.gracePeriodSeconds ({grace}): the kubelet kills the pod (SIGKILL) {when}; set gracePeriodSeconds "
                    f"above {floor} (e.g. {floor + 60}), or lower preStopSleepSeconds"
                ),
            )


def rule_router_secret(s: PDClusterSpec) -> Iterable[Problem]:
    secret = s.router.api_keys_secret
    if secret is None:
        return
    if len(secret.name) > 253 or not DNS1123_SUBDOMAIN.fullmatch(secret.name):
        yield Problem(
            "spec.router.apiKeysSecret.name",
            (
                f"{secret.name!r} cannot name a Secret (lowercase letters, digits, '-' and '.'), so the router's pods would "
                "wait for it for ever; name the Secret that holds the keys"
            ),
        )
    if len(secret.key) > 253 or not SECRET_KEY.fullmatch(secret.key):
        yield Problem(
            "spec.router.apiKeysSecret.key",
            (
                f"{secret.key!r} cannot be a key of a Secret (letters, digits, '-', '_' and '.'), so the router would never "
                "find its keys file; name the key that holds the keys (default keys)"
            ),
        )


def rule_networks(s: PDClusterSpec) -> Iterable[Problem]:
    for i, net in enumerate(s.transfer.rdma.networks):
        m = NETWORK_NAME.fullmatch(net)
        if m is None or len(m.group(3)) > 253:
            yield Problem(
                f"spec.transfer.rdma.networks[{i}]",
                (
                    f"{net!r} cannot name a NetworkAttachmentDefinition ([namespace/]name: lowercase letters, digits, '-' and "
                    "'.'), so Multus could never attach it and the pods would not start; name an existing one"
                ),
            )


def rule_weights_volume(s: PDClusterSpec) -> Iterable[Problem]:
    volume = s.model.weights.volume
    if volume == {}:
        yield Problem(
            "spec.model.weights.volume",
            (
                "is empty: it names no volume source, and the pods would load the model from an empty directory; give "
                "exactly one volume source, e.g. persistentVolumeClaim: {claimName: weights}"
            ),
        )
    if volume and "name" in volume:
        yield Problem(
            "spec.model.weights.volume",
            (
                f"names the volume ({volume['name']!r}); the operator names it model and mounts it by that name, so the "
                "pods would mount a volume that does not exist: remove name (give the volume source alone)"
            ),
        )


#: Fields of a workload the overrides must leave alone: they say which object is applied.
IDENTITY = (("apiVersion",), ("kind",), ("metadata", "name"), ("metadata", "namespace"))


def rule_overrides_identity(s: PDClusterSpec) -> Iterable[Problem]:
    for component, pool in _pools(s):
        for path in IDENTITY:
            node: Any = pool.overrides
            for key in path:
                node = node.get(key, ...) if isinstance(node, dict) else ...
            if node is not ...:
                yield Problem(
                    f"{POOL_FIELDS[component]}.overrides",
                    (
                        f"sets {'.'.join(path)}, which says which object the operator applies: it would create a second "
                        "workload beside the one it manages (and never clean it up); remove it from the overrides"
                    ),
                )


def rule_root(s: PDClusterSpec) -> Iterable[Problem]:
    """runAsNonRoot with user 0: the kubelet refuses to start the container (CreateContainerConfigError)."""
    from tilert_operator import render

    pools = dict(_pools(s))
    seen: set[str] = set()
    for obj in render.children(s, "x", "default"):
        if obj["kind"] not in ("Deployment", "StatefulSet"):
            continue
        component = (obj["metadata"].get("labels") or {}).get(constants.LABEL_COMPONENT, "")
        pool = pools.get(component)
        pod = obj["spec"]["template"]["spec"]
        pod_sc = pod.get("securityContext") or {}
        for c in _containers(obj):
            sc = c.get("securityContext") or {}
            non_root = sc.get("runAsNonRoot", pod_sc.get("runAsNonRoot"))
            user = sc.get("runAsUser", pod_sc.get("runAsUser"))
            if pool is None or non_root is not True or user != 0:
                continue
            base = POOL_FIELDS[component]
            if {"runAsNonRoot", "runAsUser"} & set(pool.security_context):
                field = f"{base}.securityContext"
            elif {"runAsNonRoot", "runAsUser"} & set(pool.pod_security_context):
                field = f"{base}.podSecurityContext"
            else:
                field = f"{base}.overrides"
            if field in seen:
                continue
            seen.add(field)
            rendered_root = s.transfer.protocol == "rdma" and component != constants.ROUTER
            if rendered_root and "runAsUser" not in {**pool.pod_security_context, **pool.security_context}:
                why = (
                    "over RDMA this pool runs as root (runAsUser 0: registering memory needs IPC_LOCK, which Kubernetes "
                    "grants to root only) and runAsNonRoot: true makes the kubelet refuse to start it; remove runAsNonRoot, "
                    f"or also set runAsUser to the image's non-root user ({constants.RUN_AS_USER}) where the runtime's "
                    "memlock limit is unlimited"
                )
            else:
                why = (
                    f"runs container {c.get('name')} as root (runAsUser 0) under runAsNonRoot: true, so the kubelet "
                    "refuses to start it; set runAsNonRoot: false beside runAsUser: 0, or a non-root runAsUser"
                )
            yield Problem(field, why)


# ---- the children, as the API server would check them -----------------------------------------


def _without_overrides(s: PDClusterSpec) -> PDClusterSpec:
    return s.model_copy(
        update={
            "prefill": s.prefill.model_copy(update={"overrides": {}}),
            "decode": s.decode.model_copy(
                update={
                    "tilert": s.decode.tilert.model_copy(update={"overrides": {}}),
                    "native": s.decode.native.model_copy(update={"overrides": {}}),
                }
            ),
            "router": s.router.model_copy(update={"overrides": {}}),
        }
    )


#: Where each part of a workload comes from in the pool's spec (first match wins).
_WORKLOAD_SOURCES: tuple[tuple[str, str], ...] = (
    (r"\.(init)?[cC]ontainers\[\d+\]\.image$", "image"),
    (r"\.(init)?[cC]ontainers\[\d+\]\.resources", "resources"),
    (r"\.(init)?[cC]ontainers\[\d+\]\.securityContext", "securityContext"),
    (r"\.(init)?[cC]ontainers\[\d+\]\.lifecycle", "termination.preStopSleepSeconds"),
    (r"template\.spec\.securityContext", "podSecurityContext"),
    (r"terminationGracePeriodSeconds", "termination.gracePeriodSeconds"),
    (r"\.nodeSelector", "nodeSelector"),
    (r"\.tolerations", "tolerations"),
    (r"\.topologySpreadConstraints", "topologySpread"),
    (r"^spec\.(strategy|updateStrategy)", "rollout"),
)
#: The data-plane volumes and the spec field each comes from.
_VOLUME_SOURCES = {
    "model": "spec.model.weights.volume",
    "shm": "spec.transfer.shmSize",
    "api-keys": "spec.router.apiKeysSecret",
}


def source_field(s: PDClusterSpec, obj: dict[str, Any], where: str) -> str:
    """The PDCluster field that a field of a child (`where`, dotted) comes from, overrides aside."""
    component = (obj["metadata"].get("labels") or {}).get(constants.LABEL_COMPONENT, "")
    base = POOL_FIELDS.get(component, "spec")
    kind = obj["kind"]
    if kind in ("NetworkPolicy", "MultiNetworkPolicy"):
        return "spec.networkPolicies.metricsFrom" if ".ingress" in where else "spec.networkPolicies"
    if kind == "ConfigMap":
        return "spec.router.policy"
    if kind == "Service":
        return "spec.router.service" if component == constants.ROUTER else base
    if kind == "PodDisruptionBudget":
        return f"{base}.disruptionBudget"
    if kind not in ("Deployment", "StatefulSet"):
        return base
    volumes = re.match(r"spec\.template\.spec\.volumes\[(\d+)\]", where)
    if volumes:
        vols = obj["spec"]["template"]["spec"].get("volumes") or []
        name = vols[int(volumes.group(1))].get("name") if int(volumes.group(1)) < len(vols) else None
        return _VOLUME_SOURCES.get(str(name), base)
    if ".volumeMounts" in where:
        return "spec.model.weights.volume"
    if ".env" in where:
        return "spec.transfer.rdma.env"
    if "annotations" in where:
        return "spec.transfer.rdma.networks"
    resource = re.search(r"\.resources\.(limits|requests)\.(.+)$", where)
    if resource and resource.group(2) in s.transfer.rdma.resources:
        return "spec.transfer.rdma.resources"
    for pattern, sub in _WORKLOAD_SOURCES:
        if re.search(pattern, where):
            return f"{base}.{sub}"
    return base


def children_problems(s: PDClusterSpec, name: str) -> list[Problem]:
    """What the API server would refuse in the rendered children, each named by the PDCluster field it
    comes from: a finding the same render without overrides has too comes from a typed field, any
    other from the pool's overrides."""
    from tilert_operator import childcheck, render

    cluster = name or "x"
    rendered = render.children(s, cluster, "default")
    found = [(obj, f) for obj in rendered for f in childcheck.findings(obj)]
    if not found:
        return []
    plain = {
        (f.kind, f.name, f.path, f.message)
        for f in childcheck.all_findings(render.children(_without_overrides(s), cluster, "default"))
    }
    out: list[Problem] = []
    for obj, f in found:
        if (f.kind, f.name, f.path, f.message) in plain:
            field, fix = source_field(s, obj, f.where), ""
        else:
            component = (obj["metadata"].get("labels") or {}).get(constants.LABEL_COMPONENT, "")
            field, fix = (
                f"{POOL_FIELDS.get(component, 'spec')}.overrides",
                " (the overrides make it so: change them)",
            )
        if f.kind == "StatefulSet" and f.where.startswith("spec.template.spec."):
            # The API server does not validate a StatefulSet's pod template: the StatefulSet is stored and
            # every pod its controller creates from it is refused.
            what = f"every pod of StatefulSet {f.name} (the StatefulSet itself is accepted, its pods never start)"
        elif f.where.startswith("spec.template.spec."):
            # Some pod checks (an image's whitespace) apply to pods only: then the pods are the ones refused.
            what = f"Deployment {f.name} or its pods (they would never start)"
        else:
            what = f"{f.kind} {f.name}"
        problem = Problem(field, f"the API server would refuse {what}: {f.where}: {f.message}{fix}")
        if problem not in out:
            out.append(problem)
    return out


RULES: tuple[Callable[[PDClusterSpec], Iterable[Problem]], ...] = (
    rule_weights,
    rule_weights_volume,
    rule_images,
    rule_termination,
    rule_router_secret,
    rule_networks,
    rule_overrides_identity,
    rule_root,
    rule_gpus,
    rule_engine_model,
    rule_kv_dtype,
    rule_mtp,
    rule_generation_rollout,
    rule_autoscaling,
    rule_decode_pools,
    rule_transfer,
    rule_ports,
    rule_resources,
    rule_env_names,
    rule_extra_args,
    rule_policy,
    rule_tolerations,
    rule_metrics_from,
    rule_node_selectors,
    rule_rendered,
)


def check(s: PDClusterSpec) -> list[Problem]:
    """Every cross-field problem of a parsed spec (empty = valid)."""
    out: list[Problem] = []
    for rule in RULES:
        try:
            out += rule(s)
        except Exception as e:  # a spec the renderer cannot even render: say so rather than crash the webhook
            out.append(
                Problem("spec", f"cannot be rendered ({type(e).__name__}: {e}); check spec.*.overrides")
            )
    return out


def explain(error: pydantic.ValidationError) -> list[Problem]:
    """pydantic's errors as Problems with the CRD's field spelling."""
    return [
        Problem(path, message)
        for path, message in pydantic_errors.problems(error, root="spec", spell=to_camel, show_input=True)
    ]


def validate(raw_spec: dict[str, Any], name: str = "") -> tuple[PDClusterSpec | None, list[Problem]]:
    """Parse and check a raw `.spec`: (the parsed spec, []) or (None or the spec, problems)."""
    problems = check_name(name)
    try:
        parsed = specmod.parse(raw_spec)
    except pydantic.ValidationError as e:
        return None, problems + explain(e)
    problems += check(parsed)
    if not problems:
        # Last: a spec that breaks a rule above would mostly repeat itself here in Kubernetes' terms.
        try:
            problems += children_problems(parsed, name)
        except Exception as e:  # a spec the checks cannot follow: say so rather than crash the webhook
            problems.append(
                Problem("spec", f"cannot be checked ({type(e).__name__}: {e}); check spec.*.overrides")
            )
    return (parsed, problems)
