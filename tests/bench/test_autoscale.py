"""The autoscaling simulator's pure parts: traces, the queueing model, static sizing, the CPU HPA's
stabilization, and the accounting of replica-seconds."""

from __future__ import annotations

import math

import pytest

from bench.autoscale import model, run, strategies, traces
from bench.autoscale.__main__ import glm5, tiny
from tilert_operator.autoscale import queueing

N, DT = 960, 15.0


@pytest.mark.parametrize("name", list(traces.TRACES))
def test_every_trace_has_the_mean_it_is_asked_for(name: str) -> None:
    rates = traces.TRACES[name](20.0, N, DT, 0)
    assert len(rates) == N and min(rates) >= 0
    assert sum(rates) / N == pytest.approx(20.0, rel=1e-9)


def test_the_traces_have_their_shapes() -> None:
    spike = traces.spike(10.0, N, DT, 0)
    assert max(spike) / min(spike) == pytest.approx(traces.SPIKE_X)
    assert sum(1 for r in spike if r == max(spike)) == int(traces.SPIKE_AT[1] * N) - int(
        traces.SPIKE_AT[0] * N
    )
    diurnal = traces.diurnal(10.0, N, DT, 0)
    assert min(diurnal) == pytest.approx(3.0) and max(diurnal) == pytest.approx(17.0, rel=1e-3)
    bursty = traces.bursty(10.0, N, DT, 0)
    assert len(set(round(r, 9) for r in bursty)) == 2  # two states
    assert bursty == traces.bursty(10.0, N, DT, 0) and bursty != traces.bursty(10.0, N, DT, 1)


def test_arrivals_are_poisson_around_the_rate() -> None:
    rates = [5.0] * 4000
    got = traces.arrivals(rates, DT, 0)
    mean = sum(got) / len(got)
    var = sum((g - mean) ** 2 for g in got) / len(got)
    assert mean == pytest.approx(5.0, rel=0.02)
    assert var == pytest.approx(5.0 / DT, rel=0.1)  # Poisson: the count's variance equals its mean


def test_erlang_formulas() -> None:
    assert queueing.erlang_b(1, 2.0) == pytest.approx(2.0 / 3.0)
    assert queueing.erlang_b(0, 1.0) == 1.0
    # M/M/1: C = rho, and P(W > t) = rho e^-(mu - lambda) t.
    assert queueing.erlang_c(1, 0.5) == pytest.approx(0.5)
    assert queueing.wait_quantile(1, 5.0, 0.1, 0.95) == pytest.approx(math.log(0.5 / 0.05) / 5.0)
    assert queueing.wait_quantile(2, 0.0, 0.1, 0.95) == 0.0
    assert queueing.wait_quantile(1, 20.0, 0.1, 0.95) == math.inf


@pytest.mark.parametrize("cap", [glm5(), tiny()], ids=lambda c: c.name)
@pytest.mark.parametrize("trace", list(traces.TRACES))
def test_static_at_peak_meets_the_slo_by_construction(cap: model.Capacities, trace: str) -> None:
    results = {r.strategy: r for r in run.run_trace(cap, trace, 20.0, 1.0, DT, 0)}
    peak = results["static at peak"]
    assert peak.attainment == 1.0 and peak.changes == 0
    # ... and it is the fewest that does: one fewer native replica misses at the peak rate.
    rates = traces.arrivals(traces.TRACES[trace](20.0, int(3600 / DT), DT, 0), DT, 0)
    size = model.static_size(cap, max(rates), 0.7)
    if size.native > 1:
        fewer = model.Ready(size.prefill, size.tilert, size.native - 1)
        iv = model.step(cap, max(rates), fewer, model.Backlog(), 1.0)
        assert not (iv.met and iv.backlog == model.Backlog())


def test_replica_seconds_of_a_static_pool_are_replicas_times_time() -> None:
    cap = glm5()
    fixed = model.Ready(2, 3, 4)
    r = run.simulate(cap, "steady", [10.0] * 100, strategies.Static("s", fixed), fixed, DT)
    assert r.replica_s == 9 * 100 * DT
    assert r.gpu_s == (2 * 8 + 3 * 8 + 4 * 8) * 100 * DT


def test_a_replica_counts_from_being_asked_for_and_serves_after_its_start_up() -> None:
    pools = run.Pools(model.Ready(1, 1, 1), {"prefill": 60.0, "tilert": 8.0, "native": 46.0})
    pools.set({"prefill": 3, "tilert": 1, "native": 1}, 0.0)
    assert pools.asked()["prefill"] == 3
    assert pools.ready(59.0).prefill == 1 and pools.ready(60.0).prefill == 3
    pools.set({"prefill": 2, "tilert": 1, "native": 1}, 30.0)  # the youngest goes first
    assert pools.ready(60.0).prefill == 2


def _interval(occupancy: float) -> model.Interval:
    return model.Interval(
        met=True,
        rate=1.0,
        ttft_s=0.1,
        tpot_s=0.01,
        backlog=model.Backlog(),
        prefill_busy=occupancy * 4,
        tilert_admitted=0.0,
        tilert_busy=0.0,
        overflow=0.0,
        native_rate=0.0,
        native_streams=0.0,
        native_running=0.0,
        native_waiting=0.0,
        native_occupancy=0.0,
        tilert_tpot_s=0.01,
        native_tpot_s=0.02,
    )


def test_the_cpu_hpa_scales_up_at_once_and_down_only_after_its_window() -> None:
    hpa = strategies.CpuHpa({"prefill": (1, 20), "tilert": (0, 4), "native": (0, 4)}, window_s=300.0)
    asked = {"prefill": 4, "tilert": 0, "native": 0}
    ready = model.Ready(4, 0, 0)
    # Full: CPU 100 % against 80 %: ceil(4 x 1.25) = 5 at once.
    up = hpa.decide(0.0, _interval(1.0), asked, ready)
    assert up["prefill"] == 5
    asked, ready = {**asked, "prefill": 5}, model.Ready(5, 0, 0)
    # Idle (5 % CPU) from then on: held until the 300 s window no longer holds the 5.
    series = []
    for i in range(1, 30):
        series.append(hpa.decide(i * DT, _interval(0.0), asked, ready)["prefill"])
    assert series[: int(300 / DT) - 1] == [5] * (int(300 / DT) - 1)
    assert series[-1] == 1


def test_the_cpu_hpa_holds_within_its_tolerance() -> None:
    hpa = strategies.CpuHpa({"prefill": (1, 20), "tilert": (0, 4), "native": (0, 4)})
    use = strategies.cpu_use(0.5)  # 0.8: the target
    assert use == pytest.approx(strategies.HPA_TARGET)
    got = hpa.decide(0.0, _interval(0.5), {"prefill": 4, "tilert": 0, "native": 0}, model.Ready(4, 0, 0))
    assert got["prefill"] == 4


def test_the_verdict_names_what_is_missed() -> None:
    def res(name: str, met: int, gpu_s: float) -> run.Result:
        return run.Result("t", name, 100, met, gpu_s / 8, gpu_s, 0, {"prefill": 1, "tilert": 1, "native": 1})

    good = [
        res("planner", 97, 50),
        res("static at peak", 100, 100),
        res("static at mean", 60, 40),
        res("HPA on CPU", 90, 80),
    ]
    assert run.verdict(good) == "met"
    bad = [
        res("planner", 90, 120),
        res("static at peak", 100, 100),
        res("static at mean", 95, 40),
        res("HPA on CPU", 92, 80),
    ]
    v = run.verdict(bad)
    assert "attainment 90.0% < 95 %" in v and "not fewer replica-seconds" in v and "above the CPU HPA" in v
