"""Production pod hygiene every pool gets from its spec: PodDisruptionBudgets, topology spread, a
rollout strategy fit for whole-node GPU pods, a preStop sleep and grace period so streams finish,
and a restricted securityContext.

Defaults (spec.py, the CRD) are what a platform team would pick:

- PodDisruptionBudget maxUnavailable 1: a node drain takes one pod of a pool at a time and never
  blocks (minAvailable would block the drain of a 1-replica pool for ever). None for 0 replicas.
- Spread over hostnames and zones with ScheduleAnyway: a preference, so a one-node kind cluster and a
  one-zone GPU cluster still schedule every replica.
- Rollout: a pool with GPUs takes its whole node(s); there is no free 8-GPU node to surge onto, so
  maxSurge 0 / maxUnavailable 1 (one replica down at a time). CPU pools surge first (1 / 0).
- preStop `sleep` (5 s) before SIGTERM while endpoints and proxies drop the pod, then the process
  drains (router and TileRT nodes: `--drain-timeout`; vLLM: uvicorn finishes what is in flight)
  within terminationGracePeriodSeconds (120 s for pools that stream, 60 s for the prefill).
- securityContext: no privilege escalation, every capability dropped, seccomp RuntimeDefault, and
  the images' non-root user (constants.RUN_AS_USER, made by every Dockerfile of ours) with
  runAsNonRoot and an fsGroup so mounted Secrets stay readable. Over RDMA the data-plane pods run as
  root with IPC_LOCK instead: registering memory needs a memlock limit as large as the buffers, and
  Kubernetes grants added capabilities to root only (no ambient capabilities), while the limit the
  runtime gives a non-root process varies (containerd's unit: unlimited; Docker: 8 MiB). Where the
  runtime's limit is known to be unlimited, podSecurityContext can ask for the non-root user again.
"""

from __future__ import annotations

from typing import Any

from tilert_operator import constants
from tilert_operator.spec import Pool
from tilert_serve import defaults

Manifest = dict[str, Any]


def topology_spread(pool: Pool, selector: dict[str, str]) -> list[Manifest]:
    """One constraint per topology key, counting the pool's own pods (`selector`)."""
    ts = pool.topology_spread
    return [
        {
            "maxSkew": ts.max_skew,
            "topologyKey": key,
            "whenUnsatisfiable": ts.when_unsatisfiable,
            "labelSelector": {"matchLabels": dict(selector)},
        }
        for key in ts.topology_keys
    ]


def surge_and_unavailable(pool: Pool, gpus: int) -> tuple[int, int]:
    """maxSurge and maxUnavailable: the spec's, else 0/1 with GPUs and 1/0 without; a value set alone
    gets a partner that lets the rollout progress (their sum must be positive)."""
    r = pool.rollout
    surge, unavailable = (0, 1) if gpus else (1, 0)
    if r.max_surge is not None and r.max_unavailable is None:
        return r.max_surge, unavailable if (r.max_surge or unavailable) else 1
    if r.max_unavailable is not None and r.max_surge is None:
        return surge if (r.max_unavailable or surge) else 1, r.max_unavailable
    return (
        surge if r.max_surge is None else r.max_surge,
        unavailable if r.max_unavailable is None else r.max_unavailable,
    )


def deployment_strategy(pool: Pool, gpus: int) -> Manifest:
    surge, unavailable = surge_and_unavailable(pool, gpus)
    return {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": surge, "maxUnavailable": unavailable}}


def statefulset_update_strategy(pool: Pool) -> Manifest:
    """RollingUpdate with the spec's partition; maxUnavailable only when the spec sets it (a
    StatefulSet field behind the MaxUnavailableStatefulSet feature gate)."""
    rolling: Manifest = {"partition": pool.rollout.partition}
    if pool.rollout.max_unavailable is not None:
        rolling["maxUnavailable"] = pool.rollout.max_unavailable
    return {"type": "RollingUpdate", "rollingUpdate": rolling}


def vllm_pre_stop(pool: Pool) -> list[str]:
    """The vLLM pools' preStop (prefill and native decode): `tilert-pd wait-idle` waits the preStop
    sleep (Services and the router drop the pod meanwhile), then until the local vLLM holds no request
    and, on a prefill, the connector has no handoff left to send (its default pending directory, which
    the connector also uses), so SIGTERM finds nothing to abort. It may use the whole grace period less
    the exit margin: when it returns because the pod is idle, vLLM's own drain after SIGTERM has nothing
    to wait for; when it times out, the kubelet's SIGKILL ends what is left, as it would anyway. It
    matters most when a generation's workloads are removed after a rollout (rollout.py): their pods
    drain only through preStop and the grace period."""
    t = pool.termination
    return [
        "tilert-pd", "wait-idle",
        "--url", f"http://127.0.0.1:{defaults.VLLM_PORT}",
        "--min-wait", str(t.pre_stop_sleep_seconds),
        "--timeout", str(t.pre_stop_sleep_seconds + t.drain_timeout_s),
    ]  # fmt: skip


def lifecycle(pool: Pool, pre_stop: list[str] | None = None) -> Manifest | None:
    """The preStop hook: `pre_stop` when given (vllm_pre_stop), else the preStop sleep (an exec of
    `sleep`, which every image of ours has; the kubelet's own sleep action needs Kubernetes 1.30's
    PodLifecycleSleepAction)."""
    if pre_stop:
        return {"preStop": {"exec": {"command": list(pre_stop)}}}
    seconds = pool.termination.pre_stop_sleep_seconds
    if not seconds:
        return None
    return {"preStop": {"exec": {"command": ["sleep", str(seconds)]}}}


def container_security_context(pool: Pool, *, add: list[str] | None = None) -> Manifest:
    caps: Manifest = {"drop": ["ALL"]}
    if add:
        caps["add"] = list(add)
    out: Manifest = {"allowPrivilegeEscalation": False, "capabilities": caps}
    return out | dict(pool.security_context)


def pod_security_context(pool: Pool, *, as_root: bool = False) -> Manifest:
    """`as_root`: the pod registers RDMA memory (see the module docstring)."""
    out: Manifest = {"seccompProfile": {"type": "RuntimeDefault"}}
    if as_root:
        # Explicit: the images' own user is the non-root one.
        out["runAsUser"] = 0
    else:
        uid = constants.RUN_AS_USER
        out |= {"runAsNonRoot": True, "runAsUser": uid, "runAsGroup": uid, "fsGroup": uid}
    return out | dict(pool.pod_security_context)


def pod_fields(pool: Pool, selector: dict[str, str], *, as_root: bool = False) -> Manifest:
    """What every pod template of a pool gets: spread, grace period and the pod securityContext."""
    out: Manifest = {
        "terminationGracePeriodSeconds": pool.termination.grace_period_seconds,
        "securityContext": pod_security_context(pool, as_root=as_root),
    }
    spread = topology_spread(pool, selector)
    if spread:
        out["topologySpreadConstraints"] = spread
    return out


def container_fields(
    pool: Pool, *, add_capabilities: list[str] | None = None, pre_stop: list[str] | None = None
) -> Manifest:
    """What every pool's main container gets: the preStop hook and the container securityContext."""
    out: Manifest = {"securityContext": container_security_context(pool, add=add_capabilities)}
    hook = lifecycle(pool, pre_stop)
    if hook:
        out["lifecycle"] = hook
    return out


def pod_disruption_budget(
    pool: Pool, replicas: int, metadata: Manifest, selector: dict[str, str]
) -> Manifest | None:
    """The pool's PodDisruptionBudget (`metadata`: the pool's child metadata), or None."""
    if not replicas or not pool.disruption_budget.enabled:
        return None
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": metadata,
        "spec": {
            "maxUnavailable": pool.disruption_budget.max_unavailable,
            "selector": {"matchLabels": dict(selector)},
            # Evict a pod that is not ready (crash-looping, still loading) even when the budget is
            # spent: it serves nothing, and keeping it would block the drain (policy/v1, 1.27+).
            "unhealthyPodEvictionPolicy": "AlwaysAllow",
        },
    }
