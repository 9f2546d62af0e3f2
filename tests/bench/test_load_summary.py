"""The harness's numbers from records (pure): percentiles, phases, the recovery after a mark (who was
in flight, when serving came back), the rate ladder's verdicts, and the tables that print them."""

from __future__ import annotations

from typing import Any

import pytest

from bench.load import report
from bench.load.rate import Queue, pick, verdict
from bench.load.record import Record
from bench.load.summary import (
    Mark,
    Stats,
    percentile,
    summarize,
)


def rec(seq: int, start: float, end: float, outcome: str = "ok", phase: str = "steady", **kw: Any) -> Record:
    r = Record(
        seq=seq,
        kind="completions",
        stream=True,
        route_asked=kw.pop("route", "tilert"),
        greedy=True,
        prompt_index=0,
        due=start,
        start=start,
        phase=phase,
        end=end,
        outcome=outcome,  # type: ignore[arg-type]
        **kw,
    )
    return r


def test_percentiles_are_nearest_rank() -> None:
    xs = [float(i) for i in range(1, 101)]
    assert percentile(xs, 0.5) == 50.0 and percentile(xs, 0.99) == 99.0 and percentile(xs, 1.0) == 100.0
    assert percentile([3.0, 1.0, 2.0], 0.99) == 3.0  # few samples: p99 is the worst
    assert percentile([], 0.5) is None


def test_a_kill_counts_the_in_flight_apart_and_measures_when_serving_came_back() -> None:
    kill = Mark("kill", 10.0)
    records = [
        rec(0, 1.0, 2.0, ttft=0.1),
        rec(1, 9.0, 11.0, "stream_error", error_type="upstream_error"),  # in flight at the kill: taken
        rec(2, 9.5, 10.5, ttft=0.2),  # in flight, on another node: fine
        rec(3, 10.2, 10.3, "http_5xx", phase="kill", error_type="upstream_error"),
        rec(4, 10.8, 11.5, phase="kill", ttft=0.4),  # first success: 0.8 s after the kill
        rec(5, 11.0, 11.1, "connect_error", phase="kill"),  # one more failure after it
        rec(6, 11.6, 12.0, phase="kill", ttft=0.3),  # from here all succeed: 1.6 s
        rec(7, 12.5, 13.0, phase="kill", ttft=0.3),
        Record(8, "chat", False, "native", True, 0, 13.0, 13.0, "kill"),  # still in flight: pending
    ]
    s = summarize(records, [kill], "steady")
    r = s.recovery("kill")
    assert r.first_ok_s == pytest.approx(0.8) and r.steady_from_s == pytest.approx(1.6)
    assert r.failed == 2 and r.failed_in_flight == 1
    assert s.pending == 1
    assert s.phase("steady").failures == {"stream_error:upstream_error": 1}
    assert s.phase("kill").failures == {"http_5xx:upstream_error": 1, "connect_error": 1}
    assert s.failed == 3
    assert s.phase("kill").ttft_p99 == 0.4 and s.phase("steady").ttft_p99 == 0.2
    assert s.ttft_p99_ratio("kill", "steady") == pytest.approx(2.0)
    with pytest.raises(KeyError, match="no requests were sent in phase 'rollout'"):
        s.phase("rollout")
    with pytest.raises(KeyError, match="no mark 'rollout'"):
        s.recovery("rollout")


def test_no_success_after_a_mark_reads_never() -> None:
    s = summarize([rec(0, 5.0, 6.0, "http_5xx", phase="down")], [Mark("down", 4.0)], "steady")
    assert s.recovery("down").first_ok_s is None and s.recovery("down").steady_from_s is None
    assert "never" in report.recovery_table(s)


def test_routes_and_served_paths_are_counted_per_phase() -> None:
    records = [
        rec(0, 0.0, 1.0, route="auto", route_served="tilert"),
        rec(1, 0.1, 1.0, route="auto", route_served="native"),
        rec(2, 0.2, 1.0, route="native", route_served="native"),
        rec(3, 0.3, 1.0, route="auto", retried=True, route_served="native", greedy_match=False),
    ]
    s = summarize(records, [], "steady")
    assert s.routes["auto"].served == {"tilert": 1, "native": 2}
    assert s.routes["auto"].retried == 1 and s.mismatches == 1
    assert set(s.cells) == {("steady", "auto"), ("steady", "native")}
    text = report.summary_table(s)
    assert "| steady | auto | 3 | 3 | native 2, tilert 1 | 0 | 1 | 1 / 1 |" in text


def stats(failures: dict[str, int] | None = None, p50: float | None = 0.5) -> Stats:
    n = 10
    return Stats(
        n, n - sum((failures or {}).values()), failures or {}, 0, 0, 0, {}, p50, p50, None, None, p50, p50
    )


CALM = Queue(growth=1.0, drain_s=0.5, first_third_p50=0.5)


def test_the_rate_ladder_keeps_the_highest_rate_served_without_failure_or_queue() -> None:
    low = stats(p50=0.5)
    ladder = [
        verdict(0.5, low, CALM, None),
        verdict(1.0, stats(p50=0.9), CALM, low),
        verdict(2.0, stats(p50=1.2), CALM, low),  # over 2x the lowest rate's median: a queue
        verdict(4.0, stats(), CALM, low),
    ]
    assert [v.sustained for v in ladder] == [True, True, False, True]
    assert "requests queue" in ladder[2].why
    assert pick(ladder) == (1.0, True)
    failed = verdict(0.5, stats({"http_5xx:upstream_error": 2}), CALM, None)
    assert not failed.sustained and "2 of 10 failed (http_5xx:upstream_error 2)" in failed.why
    assert pick([failed]) == (0.5, False)


def test_a_queue_growing_or_a_backlog_draining_is_not_sustained() -> None:
    low = stats(p50=0.5)  # p99 0.5 s too
    growing = verdict(1.0, stats(p50=0.6), Queue(growth=3.0, drain_s=0.5, first_third_p50=0.4), low)
    assert not growing.sustained and "queue grew" in growing.why
    # a small absolute growth is noise, not a queue
    assert verdict(1.0, stats(p50=0.1), Queue(growth=3.0, drain_s=0.1, first_third_p50=0.1), low).sustained
    backlog = verdict(1.0, stats(p50=0.6), Queue(growth=1.0, drain_s=3.0, first_third_p50=0.6), low)
    assert not backlog.sustained and "backlog" in backlog.why


def test_queue_signs_come_from_send_order_and_the_last_answer() -> None:
    # latencies by send time: first third's median 1, last third's 4
    lat = [1, 1, 1, 2, 2, 2, 3, 4, 5]
    q = Queue.of([rec(i, float(i), float(i) + x) for i, x in enumerate(lat)])
    assert q.growth == pytest.approx(4.0) and q.first_third_p50 == 1.0
    assert q.drain_s == pytest.approx(5.0)  # last sent at 8, answered at 13
    # Too few to compare thirds (one request against one is the mix's spread, not a queue).
    few = Queue.of([rec(i, float(i), float(i) + x) for i, x in enumerate([1, 1, 4, 1, 5])])
    assert few.growth is None and few.drain_s == pytest.approx(5.0)
    assert Queue.of([]) == Queue(None, None, None)


def test_the_comparison_divides_by_the_baseline() -> None:
    text = report.comparison_table({"router": stats(p50=0.3), "alone": stats(p50=0.2)}, "alone")
    assert "| 1.50x / 1.50x |" in text and "| 1.00x / 1.00x |" in text
