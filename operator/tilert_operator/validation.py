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
POOL_FIELDS = {constants.PREFILL: "spec.prefill", constants.TILERT: "spec.decode.tilert",
               constants.NATIVE: "spec.decode.native", constants.ROUTER: "spec.router"}
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
        problems.append(Problem("metadata.name", (
            f"{len(name)} characters; at most {limit}: the TileRT StatefulSet is named {name[:8]}...-{constants.TILERT} and "
            f"the StatefulSet controller labels its pods controller-revision-hash=<statefulset>-<hash>, which must fit 63 "
            f"characters (a StatefulSet name of at most {STATEFULSET_NAME_MAX}); pick a shorter name")))
    if not DNS1035_LABEL.fullmatch(name):
        problems.append(Problem("metadata.name", (
            f"{name!r} cannot name the Services ({name}-prefill, ...): a Service name must start with a lowercase letter and "
            "hold only lowercase letters, digits and '-', ending in a letter or digit; rename it (e.g. "
            f"{'x' + re.sub('[^-a-z0-9]', '-', name.lower())!r})")))
    return problems


def _quantity_problems(field: str, resources: dict[str, Any]) -> Iterable[Problem]:
    for key in resources:
        if key not in RESOURCE_FIELDS:
            yield Problem(f"{field}.{key}", f"unknown field; ResourceRequirements has {', '.join(sorted(RESOURCE_FIELDS))}")
    values: dict[str, dict[str, Fraction]] = {"requests": {}, "limits": {}}
    for kind in ("requests", "limits"):
        section = resources.get(kind) or {}
        if not isinstance(section, dict):
            yield Problem(f"{field}.{kind}", "must be a map of resource name to quantity, e.g. {cpu: 500m, memory: 1Gi}")
            continue
        for name, raw in section.items():
            try:
                value = parse_quantity(raw)
            except ValueError as e:
                yield Problem(f"{field}.{kind}.{name}", f"{e}; write a quantity such as 500m, 2, 512Mi or 1.5Gi")
                continue
            if value < 0:
                yield Problem(f"{field}.{kind}.{name}", f"{raw!r} is negative; a request or limit must be 0 or more")
            values[kind][name] = value
    for name, limit in values["limits"].items():
        request = values["requests"].get(name)
        if request is not None and request > limit:
            yield Problem(f"{field}.requests.{name}", f"is above its limit ({resources['limits'][name]!r}); raise the limit "
                          "or lower the request")


def rule_resources(s: PDClusterSpec) -> Iterable[Problem]:
    for component, pool in _pools(s):
        yield from _quantity_problems(f"{POOL_FIELDS[component]}.resources", pool.resources)
    try:
        if parse_quantity(s.transfer.shm_size) <= 0:
            yield Problem("spec.transfer.shmSize", "must be above 0, e.g. 2Gi")
    except ValueError as e:
        yield Problem("spec.transfer.shmSize", f"{e}; write a size such as 2Gi or 512Mi")


def _pools(s: PDClusterSpec) -> list[tuple[str, Any]]:
    return [(constants.PREFILL, s.prefill), (constants.TILERT, s.decode.tilert), (constants.NATIVE, s.decode.native),
            (constants.ROUTER, s.router)]


def rule_env_names(s: PDClusterSpec) -> Iterable[Problem]:
    for name in s.transfer.rdma.env:
        if not ENV_NAME.fullmatch(name):
            yield Problem(f"spec.transfer.rdma.env.{name}", "is not a valid environment variable name: letters, digits, "
                          "'_', '-' and '.', not starting with a digit")
    own = operator_env_names(s)
    for name in sorted(set(s.transfer.rdma.env) & own):
        yield Problem(f"spec.transfer.rdma.env.{name}", f"{name} is set by the operator itself (the pods' own address "
                      "and identity through the downward API, which the data plane depends on); remove it from "
                      "spec.transfer.rdma.env")


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
    return [*(pod.get("initContainers") or []), *(pod.get("containers") or [])] if isinstance(pod, dict) else []


def rule_extra_args(s: PDClusterSpec) -> Iterable[Problem]:
    for field, args in (("spec.prefill.extraArgs", s.prefill.extra_args), ("spec.decode.native.extraArgs", s.decode.native.extra_args)):
        for i, arg in enumerate(args):
            flag = arg.split("=", 1)[0]
            if flag in RENDERED_FLAGS:
                yield Problem(f"{field}[{i}]", f"{flag} is rendered by the operator ({RENDERED_FLAGS[flag]}); remove it")


def rule_policy(s: PDClusterSpec) -> Iterable[Problem]:
    p = s.router.policy
    if p.default == "tilert" and not s.decode.tilert.replicas:
        yield Problem("spec.router.policy.default", "is tilert but spec.decode.tilert.replicas is 0, so every request "
                      "without a header or alias would fail; set default: auto (or native), or give the TileRT pool replicas")
    if p.default == "native" and not s.decode.native.replicas:
        yield Problem("spec.router.policy.default", "is native but spec.decode.native.replicas is 0, so every request "
                      "without a header or alias would fail; set default: auto (or tilert), or give the native pool replicas")
    for alias in sorted(set(p.tilert_aliases) & set(p.native_aliases)):
        yield Problem("spec.router.policy.nativeAliases", f"{alias!r} is in tilertAliases too; a model name picks one "
                      "path: remove it from one of the lists")


def rule_tolerations(s: PDClusterSpec) -> Iterable[Problem]:
    for component, pool in _pools(s):
        for i, tol in enumerate(pool.tolerations):
            field = f"{POOL_FIELDS[component]}.tolerations[{i}]"
            for key in sorted(set(tol) - TOLERATION_FIELDS):
                yield Problem(f"{field}.{key}", f"unknown field; a toleration has {', '.join(sorted(TOLERATION_FIELDS))}")
            op = tol.get("operator", "Equal")
            if op not in ("Equal", "Exists"):
                yield Problem(f"{field}.operator", f"{op!r}: use Equal or Exists")
            if op == "Exists" and tol.get("value"):
                yield Problem(f"{field}.value", "must be empty with operator Exists; remove it or use operator: Equal")
            if tol.get("effect", "") not in TOLERATION_EFFECTS:
                yield Problem(f"{field}.effect", f"{tol.get('effect')!r}: use NoSchedule, PreferNoSchedule or NoExecute (or omit it)")
            if "tolerationSeconds" in tol and (isinstance(tol["tolerationSeconds"], bool) or not isinstance(tol["tolerationSeconds"], int)):
                yield Problem(f"{field}.tolerationSeconds", "must be an integer number of seconds")


def label_problems(field: str, labels: Any) -> Iterable[Problem]:
    """Label keys and values the API server would refuse (in a nodeSelector or a selector's matchLabels)."""
    if not isinstance(labels, dict):
        yield Problem(field, "must be a map of label keys to values")
        return
    for key, value in labels.items():
        prefix, _, name = str(key).rpartition("/")
        if ("/" in str(key) and not (LABEL_PREFIX.fullmatch(prefix) and len(prefix) <= 253)) or not LABEL_NAME.fullmatch(name) or len(name) > 63:
            yield Problem(f"{field}.{key}", "is not a valid label key: an optional DNS-subdomain prefix and '/', then at most 63 "
                          "letters, digits, '-', '_' or '.', starting and ending with a letter or digit")
        if not isinstance(value, str) or len(value) > 63 or (value and not LABEL_NAME.fullmatch(value)):
            yield Problem(f"{field}.{key}", f"{value!r} is not a valid label value: at most 63 letters, digits, '-', '_' or "
                          "'.', starting and ending with a letter or digit (or empty)")


def rule_node_selectors(s: PDClusterSpec) -> Iterable[Problem]:
    for component, pool in _pools(s):
        yield from label_problems(f"{POOL_FIELDS[component]}.nodeSelector", pool.node_selector)


def rule_metrics_from(s: PDClusterSpec) -> Iterable[Problem]:
    for i, peer in enumerate(s.network_policies.metrics_from):
        field = f"spec.networkPolicies.metricsFrom[{i}]"
        unknown = sorted(set(peer) - PEER_FIELDS)
        for key in unknown:
            yield Problem(f"{field}.{key}", f"unknown field; a NetworkPolicyPeer has {', '.join(sorted(PEER_FIELDS))}")
        if not any(peer.get(k) is not None for k in PEER_FIELDS):
            yield Problem(field, "names no peer: set podSelector, namespaceSelector or ipBlock (podSelector: {} admits "
                          "every pod of the namespace)")
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
        if not isinstance(selector, dict) or not (selector.get("matchLabels") or selector.get("matchExpressions")):
            yield Problem(field, f"removes the {obj['kind']}'s spec.selector, which the API server requires (and which "
                          "cannot change after creation); do not override spec.selector")
        elif any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
            yield Problem(field, f"makes the {obj['kind']}'s pod labels miss its selector {selector.get('matchLabels')}; "
                          "keep the operator's labels in spec.template.metadata.labels")
        for c in _containers(obj):
            names = [str(e.get("name")) for e in c.get("env") or [] if isinstance(e, dict)]
            for dup in sorted({n for n in names if names.count(n) > 1 and n not in s.transfer.rdma.env}):
                yield Problem(field, f"sets the environment variable {dup} of container {c.get('name')} twice; set it once")


RULES: tuple[Callable[[PDClusterSpec], Iterable[Problem]], ...] = (
    rule_weights,
    rule_gpus,
    rule_engine_model,
    rule_kv_dtype,
    rule_mtp,
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
            out.append(Problem("spec", f"cannot be rendered ({type(e).__name__}: {e}); check spec.*.overrides"))
    return out


def explain(error: pydantic.ValidationError) -> list[Problem]:
    """pydantic's errors as Problems with the CRD's field spelling."""
    return [Problem(path, message)
            for path, message in pydantic_errors.problems(error, root="spec", spell=to_camel, show_input=True)]


def validate(raw_spec: dict[str, Any], name: str = "") -> tuple[PDClusterSpec | None, list[Problem]]:
    """Parse and check a raw `.spec`: (the parsed spec, []) or (None or the spec, problems)."""
    problems = check_name(name)
    try:
        parsed = specmod.parse(raw_spec)
    except pydantic.ValidationError as e:
        return None, problems + explain(e)
    problems += check(parsed)
    return (parsed, problems)
