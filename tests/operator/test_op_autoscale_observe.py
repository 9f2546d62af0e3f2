"""autoscale/observe.py: rates over an interval (a restart is not a negative rate, a new pod gives no
rate), percentiles from the buckets' increase, gauges, and the whole Observed from two scrapes."""

from __future__ import annotations

import pytest

from tilert_operator.autoscale import observe
from tilert_operator.autoscale.observe import PodSample, Ready, Snapshot
from tilert_serve import metric_defs as m

BOUNDS = ("0.1", "0.5", "1.0", "+Inf")


def _router(routes: dict[tuple[str, str], float], ttft: tuple[float, ...] = (0, 0, 0, 0)) -> str:
    lines = [f"# TYPE {m.ROUTER_ROUTES.removesuffix('_total')} counter"]
    lines += [f'{m.ROUTER_ROUTES}{{path="{p}",reason="{r}"}} {v}' for (p, r), v in routes.items()]
    lines.append(f"# TYPE {m.ROUTER_TTFT} histogram")
    for le, c in zip(BOUNDS, ttft, strict=True):
        lines.append(f'{m.ROUTER_TTFT}_bucket{{path="tilert",le="{le}"}} {c}')
    lines += [
        f'{m.ROUTER_TTFT}_sum{{path="tilert"}} {ttft[-1] * 0.3}',
        f'{m.ROUTER_TTFT}_count{{path="tilert"}} {ttft[-1]}',
    ]
    return "\n".join(lines) + "\n"


def _snap(at: float, **pods: tuple[observe.Role, str]) -> Snapshot:
    return Snapshot(
        {
            name: PodSample(
                name, role, at, observe.parse(text), ordinal=int(name[-1]) if role == "tilert" else None
            )
            for name, (role, text) in pods.items()
        }
    )


def test_counter_rate_over_the_interval() -> None:
    a = _snap(100.0, r0=("router", _router({("tilert", "slot free"): 10, ("native", "tilert full"): 4})))
    b = _snap(110.0, r0=("router", _router({("tilert", "slot free"): 40, ("native", "tilert full"): 9})))
    assert observe.rate(a, b, "router", m.ROUTER_ROUTES) == pytest.approx(3.5)
    assert observe.rate(a, b, "router", m.ROUTER_ROUTES, observe.label_is("path", "native")) == pytest.approx(
        0.5
    )


def test_a_restart_is_not_a_negative_rate() -> None:
    a = _snap(0.0, r0=("router", _router({("tilert", "slot free"): 500})))
    b = _snap(10.0, r0=("router", _router({("tilert", "slot free"): 20})))
    # The counter began again from 0: the 20 since are the interval's.
    assert observe.rate(a, b, "router", m.ROUTER_ROUTES) == pytest.approx(2.0)


def test_a_new_pod_gives_gauges_but_no_rate() -> None:
    a = _snap(0.0, r0=("router", _router({("tilert", "slot free"): 10})))
    b = _snap(
        10.0,
        r0=("router", _router({("tilert", "slot free"): 30})),
        r1=("router", _router({("tilert", "slot free"): 9000})),
    )
    assert observe.rate(a, b, "router", m.ROUTER_ROUTES) == pytest.approx(2.0)
    vllm = f'{m.VLLM_WAITING}{{model_name="x"}} 3\n'
    c = _snap(10.0, p0=("prefill", vllm), p1=("prefill", vllm))
    assert observe.gauge_sum(c, "prefill", m.VLLM_WAITING) == 6


def test_quantile_from_bucket_increase() -> None:
    a = _snap(0.0, r0=("router", _router({}, (5, 5, 5, 5))))
    # This interval: 10 in (0, 0.1], 10 in (0.1, 0.5], none slower; the 5 from before do not count.
    b = _snap(10.0, r0=("router", _router({}, (15, 25, 25, 25))))
    buckets = observe.bucket_increase(a, b, "router", m.ROUTER_TTFT)
    assert buckets == {0.1: 10, 0.5: 20, 1.0: 20, float("inf"): 20}
    assert observe.quantile(0.5, buckets) == pytest.approx(0.1)
    assert observe.quantile(0.75, buckets) == pytest.approx(0.3)
    assert observe.quantile(0.95, {}) is None
    assert observe.quantile(0.95, {0.1: 0, float("inf"): 0}) is None  # no request ended: no evidence
    assert observe.quantile(0.99, {0.1: 0, 1.0: 0, float("inf"): 4}) == 1.0  # past the last bound


def test_quantile_after_a_restart_takes_the_new_buckets_whole() -> None:
    a = _snap(0.0, r0=("router", _router({}, (50, 60, 70, 80))))
    b = _snap(10.0, r0=("router", _router({}, (0, 4, 4, 4))))
    assert observe.bucket_increase(a, b, "router", m.ROUTER_TTFT) == {0.1: 0, 0.5: 4, 1.0: 4, float("inf"): 4}


def test_bad_text_is_a_clear_error() -> None:
    with pytest.raises(observe.MetricsTextError, match="Prometheus text format"):
        observe.parse("tilert_router_routes_total{path= 3 4 5\n")


def _node(busy: int, slots: int = 4) -> str:
    return f"{m.DECODE_SLOTS} {slots}\n{m.DECODE_SLOTS_BUSY} {busy}\n"


def test_observed_from_two_scrapes() -> None:
    routes0 = {("tilert", "slot free"): 0, ("native", "tilert full"): 0, ("native", "requested"): 0}
    routes1 = {("tilert", "slot free"): 60, ("native", "tilert full"): 30, ("native", "requested"): 30}
    native = f"{m.VLLM_KV_USAGE} 0.5\n{m.VLLM_RUNNING} 6\n{m.VLLM_WAITING} 1\n"
    a = _snap(0.0, r0=("router", _router(routes0)), t0=("tilert", _node(1)), t1=("tilert", _node(0)))
    b = _snap(
        30.0,
        r0=("router", _router(routes1)),
        t0=("tilert", _node(4)),
        n0=("native", native),
        n1=("native", f"{m.VLLM_KV_USAGE_OLD} 0.3\n"),
    )
    # t1 is ready but did not answer the second scrape: it may hold streams, so it counts as full.
    obs = observe.observed(
        a,
        b,
        Ready(1, 2, 2, tilert_ordinals=(0, 1)),
        {"prefill": 1, "tilert": 2, "native": 2},
        percentile=0.95,
        slots_per_node=4,
    )
    assert obs.prefill.arrival_rate == pytest.approx(4.0)
    assert obs.tilert.admit_rate == pytest.approx(2.0)
    assert obs.tilert.overflow_rate == pytest.approx(1.0)
    assert obs.tilert.busy_by_node == (4, 4)
    assert obs.tilert.slots_per_node == 4
    assert obs.native.arrival_rate == pytest.approx(2.0)
    assert obs.native.kv_usage == pytest.approx(0.4)
    assert obs.native.running == 6 and obs.native.waiting == 1
    assert obs.prefill.ttft_s is None  # nothing ended: no evidence either way
    assert obs.current == {"prefill": 1, "tilert": 2, "native": 2}
