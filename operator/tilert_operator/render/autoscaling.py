"""HorizontalPodAutoscalers for `spec.autoscaling.actuator: HPA`: one autoscaling/v2 HPA per autoscaled
pool and live generation, on the pods' own metrics as a metrics adapter (prometheus-adapter) or KEDA
serves them through the custom metrics API, with the pool's bounds and stabilization windows. The
workloads they scale are applied without `replicas` (reconcile_children.desired), so the HPA owns that
field and the operator never sets it back.

Each pool is sized on the metric the planner reads first for it, at the spec's `targetUtilization`:

| pool | metric (type Pods, average per pod) | target |
|---|---|---|
| prefill | `vllm:num_requests_waiting` | PREFILL_WAITING_PER_REPLICA |
| TileRT | `tilert_decode_slots_busy` | slots x targetUtilization |
| native | `vllm:kv_cache_usage_perc` | targetUtilization |

An HPA sees one pool at a time: no TileRT-first, no prefill:decode balance, no drain-first (why the
operator actuator is the default; docs/autoscaling.md).
"""

from __future__ import annotations

from collections.abc import Sequence

from tilert_operator import constants
from tilert_operator.render import pods
from tilert_operator.render.generations import Live
from tilert_operator.render.pods import Manifest
from tilert_operator.spec import PDClusterSpec, ServingPool
from tilert_serve import metric_defs as m

#: Prefill requests waiting per replica the prefill HPA holds (the planner's own threshold).
PREFILL_WAITING_PER_REPLICA = 2.0


def _quantity(x: float) -> str:
    """A quantity in milli-units, as the API server writes a fractional one back (no diff on resync)."""
    milli = round(x * 1000)
    return str(milli // 1000) if milli % 1000 == 0 else f"{milli}m"


def _targets(spec: PDClusterSpec) -> list[tuple[str, str, ServingPool, str, float]]:
    """(component, workload kind, pool, metric, average value per pod) for each autoscaled pool."""
    u = spec.autoscaling.target_utilization
    t = spec.decode.tilert
    rows: list[tuple[str, str, ServingPool, str, float]] = [
        (constants.PREFILL, "Deployment", spec.prefill, m.VLLM_WAITING, PREFILL_WAITING_PER_REPLICA),
        (constants.TILERT, "StatefulSet", t, m.DECODE_SLOTS_BUSY, t.slots * u),
        (constants.NATIVE, "Deployment", spec.decode.native, m.VLLM_KV_USAGE, u),
    ]
    return [r for r in rows if r[2].autoscaling.enabled]


def render(spec: PDClusterSpec, cluster: str, namespace: str, lives: Sequence[Live]) -> list[Manifest]:
    """The HPAs of the autoscaled pools of every live generation; none unless the actuator is HPA."""
    if spec.autoscaling.actuator != "HPA":
        return []
    out: list[Manifest] = []
    for live in lives:
        for component, kind, pool, metric, target in _targets(spec):
            a = pool.autoscaling
            lo, hi = a.bounds(pool.replicas)
            name = live.name(cluster, component)
            out.append(
                {
                    "apiVersion": "autoscaling/v2",
                    "kind": "HorizontalPodAutoscaler",
                    "metadata": pods.metadata(cluster, namespace, component, name=name),
                    "spec": {
                        "scaleTargetRef": {"apiVersion": "apps/v1", "kind": kind, "name": name},
                        # 0 needs the HPAScaleToZero feature gate, which few clusters have on.
                        "minReplicas": max(1, lo),
                        "maxReplicas": max(1, hi),
                        "metrics": [
                            {
                                "type": "Pods",
                                "pods": {
                                    "metric": {"name": metric},
                                    "target": {"type": "AverageValue", "averageValue": _quantity(target)},
                                },
                            }
                        ],
                        "behavior": {
                            "scaleUp": {"stabilizationWindowSeconds": a.scale_up_stabilization_seconds},
                            "scaleDown": {"stabilizationWindowSeconds": a.scale_down_stabilization_seconds},
                        },
                    },
                }
            )
    return out
