"""bench/change's bar, from records (pure): a planned change loses nothing and keeps TTFT p99 within
2x of steady; a kill may take only what was in flight (cleanly), new requests are served again within
2 s, and requests for a route the stack no longer has are left out."""

from __future__ import annotations

from bench.change import judge, scenarios
from bench.load.record import Record
from bench.load.stack import EXAMPLE
from bench.load.summary import Mark, Stats
from tests.bench.test_load_summary import rec
from tilert_operator.render.generations import generation
from tilert_operator.spec import parse

STEADY = [rec(i, float(i), float(i) + 1, ttft=0.1) for i in range(5)]
ROLL = scenarios.Scenario("roll", "a rollout", edit=lambda d: None)
KILL = scenarios.Scenario("kill", "a kill", kill="tilert-decode")
MARKS = [Mark("roll", 10.0), Mark(judge.after("roll"), 20.0)]
KILL_MARKS = [Mark("kill", 10.0), Mark(judge.after("kill"), 20.0)]


def row(records: list[Record], scenario: scenarios.Scenario = ROLL, marks: list[Mark] = MARKS) -> judge.Row:
    return judge.row(STEADY + records, marks, scenario, Stats.of(STEADY))


def test_a_planned_change_that_lost_nothing_meets_the_bar() -> None:
    r = row([rec(10 + i, 10.0 + i, 11.0 + i, ttft=0.15) for i in range(12)])
    assert r.met and r.stats.requests == 12 and r.took_s == 10.0
    assert r.ttft_ratio is not None and abs(r.ttft_ratio - 1.5) < 1e-9


def test_a_planned_change_fails_on_a_loss_a_wrong_text_or_slow_first_tokens() -> None:
    slow = row([rec(10, 12.0, 13.0, ttft=0.3)])
    assert slow.problems == ("TTFT p99 while it ran is 3.00x the steady state's (bar 2x)",)
    # A failure in the settle window (after the apply returned) counts too.
    bad = row([rec(10, 12.0, 13.0, ttft=0.1, greedy_match=False), rec(11, 21.0, 21.5, "stream_cut")])
    assert bad.problems == (
        "1 requests failed: {'stream_cut': 1}",
        "1 of 1 greedy outputs differ from vLLM alone's",
    )


def test_requests_for_a_route_the_stack_no_longer_has_are_left_out() -> None:
    gone = scenarios.Scenario("roll", "native to zero", edit=lambda d: None, unservable=scenarios.NO_NATIVE)
    records = [rec(10, 11.0, 11.1, "http_5xx", route="native"), rec(11, 12.0, 13.0, ttft=0.1)]
    assert row(records, gone).met
    assert not row(records).met


def test_a_kill_may_take_what_was_in_flight_and_must_serve_again_within_2_s() -> None:
    records = [
        rec(20, 9.5, 10.5, "stream_error"),  # in flight at the kill, ended with an error event
        rec(21, 10.5, 10.6, "http_5xx"),
        rec(22, 11.5, 12.0),
        rec(23, 15.0, 16.0),
    ]
    r = row(records, KILL, KILL_MARKS)
    assert r.met and (r.in_flight_failed, r.in_flight_clean) == (1, 1) and r.served_again_s == 1.5
    clean = row([rec(22, 11.5, 12.0)], KILL, KILL_MARKS)
    assert clean.met and clean.served_again_s == 0.0  # nothing failed after the kill: served all along
    cut = row([rec(20, 9.5, 10.5, "stream_cut"), *records[1:]], KILL, KILL_MARKS)
    assert cut.problems == ("1 in-flight requests ended without a clean error",)
    late = row([*records, rec(24, 13.0, 13.1, "connect_error"), rec(25, 14.0, 14.5)], KILL, KILL_MARKS)
    assert late.problems == (
        "requests sent after the kill all succeed only from 4.00 s on (bar 2 s; 2 failed after it)",
    )
    never = row([*records, rec(26, 19.0, 19.1, "connect_error")], KILL, KILL_MARKS)
    assert never.problems == ("the last request sent after the kill still failed (2 failed)",)


def test_the_sequence_scales_a_pool_to_two_before_killing_one_of_its_pods() -> None:
    """Every doc of the sequence is a valid PDCluster; each kill leaves its pool another pod; the
    pools end at 1/1/0; and the last change is a new compatibility generation."""
    doc = scenarios.base_doc(EXAMPLE)
    first = generation(parse(doc["spec"]))
    for sc in scenarios.sequence():
        spec = parse(doc["spec"])
        counts = {"prefill": spec.prefill.replicas, "tilert-decode": spec.decode.tilert.replicas}
        counts["native-decode"] = spec.decode.native.replicas
        counts["router"] = spec.router.replicas
        if sc.kill:
            assert counts[sc.kill] >= 2, f"{sc.name} kills the last pod of its pool"
        before = generation(spec)
        doc = sc.apply_to(doc)
        assert (generation(parse(doc["spec"])) != before) == sc.name.startswith("generation")
    last = parse(doc["spec"])
    assert (last.prefill.replicas, last.decode.tilert.replicas, last.decode.native.replicas) == (1, 1, 0)
    assert generation(last) != first


def test_ttft_while_a_change_ran_counts_the_requests_in_flight_during_it() -> None:
    # A change of 2 s with no request sent within it: the one sent just before and still running is
    # what it slowed; the one that ended before it started, and the one sent after it, are not.
    marks = [Mark("roll", 10.0), Mark(judge.after("roll"), 12.0)]
    records = [rec(10, 8.0, 9.0, ttft=0.9), rec(11, 9.5, 11.0, ttft=0.3), rec(12, 13.0, 14.0, ttft=0.9)]
    r = row(records, ROLL, marks)
    assert r.ttft_ratio is not None and abs(r.ttft_ratio - 3.0) < 1e-9
    assert r.stats.requests == 1  # the counts stay those sent from the change's start on
