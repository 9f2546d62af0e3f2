"""The load harness (bench/load) against a scripted in-process OpenAI server: every outcome class is
recorded as such, greedy texts are compared with the references, arrivals are Poisson, and phases
split the statistics where the marks fall. No vLLM."""

from __future__ import annotations

import asyncio
import statistics
from collections.abc import AsyncIterator, Callable

import pytest

from bench.load import client
from bench.load.fake import FakeOpenAI, Reply, Seen, chunks_of
from bench.load.harness import Load
from bench.load.plan import KINDS, LoadPlan, Mix, PromptSet, RequestSpec, schedule
from bench.load.record import Record
from bench.load.references import References, cached
from tilert_serve.local.runner import free_port

PROMPTS = PromptSet(seed=3, n=4)
TEXT = "the answer is forty two"


@pytest.fixture
async def fake() -> AsyncIterator[FakeOpenAI]:
    async with FakeOpenAI() as server:
        yield server


def target(server: FakeOpenAI, **kw: object) -> client.Target:
    return client.Target("fake", server.url, "tiny", api_key=server.api_key, **kw)  # type: ignore[arg-type]


def spec(*, stream: bool, kind: str = "completions", route: str = "tilert") -> RequestSpec:
    return RequestSpec(0, 0.0, PROMPTS.prompts[0], kind, stream, route, True)  # type: ignore[arg-type]


async def one(server: FakeOpenAI, reply: Reply, **kw: object) -> Record:
    server.script = lambda _seen: reply
    return await client.one(target(server), spec(**kw))  # type: ignore[arg-type]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("kind", KINDS)
async def test_an_answer_is_ok_with_its_text_tokens_and_served_route(
    fake: FakeOpenAI, stream: bool, kind: str
) -> None:
    rec = await one(fake, Reply(text=TEXT, route="native", gap_s=0.05), stream=stream, kind=kind)
    assert rec.outcome == "ok" and rec.failure is None
    assert rec.text == TEXT
    assert rec.completion_tokens == len(chunks_of(TEXT))
    assert rec.route_served == "native" and not rec.retried
    seen = fake.requests[-1]
    assert seen.path == ("/v1/chat/completions" if kind == "chat" else "/v1/completions")
    assert seen.headers[client.ROUTE_HEADER] == "tilert"
    assert seen.body["temperature"] == 0.0 and seen.body["max_tokens"] == PROMPTS.prompts[0].max_tokens
    assert seen.headers["X-Request-Id"] == rec.request_id
    if stream:
        assert rec.ttft is not None and rec.ttft <= rec.latency  # type: ignore[operator]
        # five tokens written 50 ms apart: the mean gap after the first is near 50 ms (20 allows a
        # client that reads two of them late at once)
        assert rec.tpot is not None and rec.tpot >= 0.02
    else:
        assert rec.ttft is None and rec.tpot is None


async def test_a_503_is_an_http_5xx_with_its_error_type(fake: FakeOpenAI) -> None:
    rec = await one(fake, Reply(status=503, error_type="service_unavailable"), stream=True)
    assert (rec.outcome, rec.status, rec.error_type) == ("http_5xx", 503, "service_unavailable")
    assert rec.failure == "http_5xx:service_unavailable"
    rec = await one(fake, Reply(status=429, error_type="rate_limit_error"), stream=False)
    assert rec.failure == "http_4xx:rate_limit_error"


async def test_an_error_event_after_some_tokens_is_a_stream_error(fake: FakeOpenAI) -> None:
    rec = await one(fake, Reply(text=TEXT, error_after=2, error_type="upstream_error"), stream=True)
    assert (rec.outcome, rec.status, rec.error_type) == ("stream_error", 200, "upstream_error")
    assert rec.text == "".join(chunks_of(TEXT)[:2])  # what arrived before the failure is kept


async def test_a_stream_cut_midway_is_a_stream_cut(fake: FakeOpenAI) -> None:
    rec = await one(fake, Reply(text=TEXT, cut_after=2), stream=True)
    assert rec.outcome == "stream_cut" and rec.status == 200
    assert rec.text == "".join(chunks_of(TEXT)[:2])


async def test_a_refused_connection_is_a_connect_error() -> None:
    port = free_port()  # nothing listens there
    rec = await client.one(client.Target("gone", f"http://127.0.0.1:{port}", "tiny"), spec(stream=True))
    assert rec.outcome == "connect_error" and rec.status is None
    assert "Connect" in rec.error


async def test_a_retry_reported_by_the_router_is_recorded(fake: FakeOpenAI) -> None:
    assert (await one(fake, Reply(attempts=2), stream=False)).retried
    assert not (await one(fake, Reply(attempts=1), stream=False)).retried


async def test_an_unanswered_request_at_stop_is_abandoned(fake: FakeOpenAI) -> None:
    arrived = asyncio.Event()

    def hang(_seen: Seen) -> Reply:
        arrived.set()
        return Reply(delay_s=60)

    fake.script = hang
    load = Load(target(fake), LoadPlan(rate=50, count=1), drain_s=0.2)
    async with load:
        await arrived.wait()
    assert [r.outcome for r in load.records] == ["abandoned"]
    assert load.summary().total.failures == {"abandoned": 1}


async def test_a_wrong_greedy_text_is_a_mismatch(fake: FakeOpenAI) -> None:
    fake.script = lambda _seen: Reply(text=TEXT)
    refs = await cached(None, target(fake), PROMPTS)
    assert refs.covers(PROMPTS) and set(refs.texts.values()) == {TEXT}
    wrong = PROMPTS.prompts[1].text
    # The same answer for every prompt but one; and sampled (temperature 1) requests are not compared.
    fake.script = lambda seen: Reply(text="something else" if _prompt(seen) == wrong else TEXT)
    plan = LoadPlan(rate=200, count=60, seed=1, prompts=PROMPTS, mix=Mix(greedy=0.7))
    load = Load(target(fake), plan, references=refs)
    async with load:
        await load.finished()
    s = load.summary()
    assert s.failed == 0
    greedy_wrong = [r for r in load.records if r.greedy and r.prompt_index == 1]
    sampled = [r for r in load.records if not r.greedy]
    assert greedy_wrong and sampled, "the seeded mix should contain both"
    assert all(r.greedy_match is False for r in greedy_wrong)
    assert all(r.greedy_match is None for r in sampled)
    assert all(r.greedy_match is True for r in load.records if r.greedy and r.prompt_index != 1)
    assert s.mismatches == len(greedy_wrong)
    assert s.total.compared == sum(r.greedy for r in load.records)


def _prompt(seen: Seen) -> str:
    if "messages" in seen.body:
        return str(seen.body["messages"][-1]["content"])
    return str(seen.body["prompt"])


def test_references_refuse_another_harness_file(tmp_path: object) -> None:
    from pathlib import Path

    path = Path(str(tmp_path)) / "refs.json"
    path.write_text('{"texts": {}}')
    with pytest.raises(ValueError, match="delete it to collect again"):
        References.load(path)
    refs = References("tiny", "here", {"k": "v"})
    refs.save(path)
    assert References.load(path) == refs


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_arrivals_are_poisson_at_the_rate(seed: int) -> None:
    rate, duration = 20.0, 50.0
    plan = LoadPlan(rate=rate, duration_s=duration, seed=seed)
    offsets = [s.offset_s for s in schedule(plan)]
    mean = rate * duration
    # The count of a Poisson process has sd sqrt(mean); 5 sd is a one-in-a-million miss.
    assert abs(len(offsets) - mean) < 5 * mean**0.5
    assert offsets == sorted(offsets) and offsets[-1] <= duration
    gaps = [b - a for a, b in zip([0.0, *offsets], offsets, strict=False)]
    # Exponential gaps: mean 1/rate and coefficient of variation 1 (evenly spaced arrivals have 0).
    assert abs(statistics.mean(gaps) * rate - 1) < 0.15
    assert 0.85 < statistics.pstdev(gaps) / statistics.mean(gaps) < 1.15
    # Seeded: the same plan gives the same requests; another seed other ones.
    assert [s.offset_s for s in schedule(plan)] == offsets
    other = LoadPlan(rate=rate, duration_s=duration, seed=seed + 10)
    assert [s.offset_s for s in schedule(other)][:5] != offsets[:5]


def test_the_mix_follows_its_shares() -> None:
    plan = LoadPlan(rate=10, count=3000, mix=Mix(stream=0.25, chat=0.75, greedy=0.5))
    specs = list(schedule(plan))
    assert len(specs) == 3000
    for share, got in (
        (0.25, sum(s.stream for s in specs)),
        (0.75, sum(s.kind == "chat" for s in specs)),
        (0.5, sum(s.greedy for s in specs)),
    ):
        sd = (3000 * share * (1 - share)) ** 0.5
        assert abs(got - 3000 * share) < 5 * sd
    routes = {r: sum(s.route == r for s in specs) for r in ("tilert", "native", "auto")}
    assert all(abs(n - 1000) < 5 * (3000 * (1 / 3) * (2 / 3)) ** 0.5 for n in routes.values()), routes


@pytest.mark.parametrize(
    ("make", "what"),
    [
        (lambda: LoadPlan(rate=1), "duration_s or count"),
        (lambda: LoadPlan(rate=0, count=1), "rate"),
        (lambda: Mix(stream=1.5), "Mix.stream"),
        (lambda: Mix(routes=(("fast", 1.0),)), "unknown routes"),  # type: ignore[arg-type]
        (lambda: PromptSet(words=(5, 2)), "PromptSet.words"),
    ],
)
def test_bad_plans_are_refused_naming_the_field(make: Callable[[], object], what: str) -> None:
    with pytest.raises(ValueError, match=what):
        make()


async def test_the_harness_sends_every_planned_request_on_time(fake: FakeOpenAI) -> None:
    plan = LoadPlan(rate=40, duration_s=1.5, seed=4)
    load = Load(target(fake), plan)
    async with load:
        await load.finished()
    planned = list(schedule(plan))
    assert [r.seq for r in sorted(load.records, key=lambda r: r.seq)] == [s.seq for s in planned]
    assert len(fake.requests) == len(planned)
    # Open loop: never before its time (a loaded box may send late, never early).
    assert all(r.start >= r.due for r in load.records)
    assert load.summary().total.ok == len(planned)


async def test_phases_split_failures_latency_and_recovery(fake: FakeOpenAI) -> None:
    load = Load(target(fake), LoadPlan(rate=40, duration_s=60, mix=Mix(stream=1.0)))
    by_id = lambda seen: next(r for r in load.records if r.request_id == seen.headers["X-Request-Id"])  # noqa: E731
    failing = 3

    def script(seen: Seen) -> Reply:
        rec = by_id(seen)
        if rec.phase != "change":
            return Reply()
        before = [r for r in load.records if r.phase == "change" and r.seq < rec.seq]
        if len(before) < failing:
            return Reply(status=503, error_type="service_unavailable")
        return Reply(delay_s=0.3)

    fake.script = script
    async with load:
        await load.completed(10)
        load.mark("change")
        await load.completed(failing + 5, after="change")
        load.mark("after")
        await load.completed(5, after="after")
    s = load.summary()
    assert list(s.phases) == ["steady", "change", "after"]
    assert s.phase("steady").failed == 0 and s.phase("after").failed == 0
    assert s.phase("change").failures == {"http_5xx:service_unavailable": failing}
    assert s.failed == failing
    rec = s.recovery("change")
    assert rec.failed == failing and rec.failed_in_flight == 0
    first_ok = min(r.start for r in load.records if r.phase == "change" and r.ok)
    mark = s.marks[0].at
    assert rec.first_ok_s == pytest.approx(first_ok - mark)
    assert rec.steady_from_s == rec.first_ok_s  # the failures were the first three only
    change = s.phase("change")
    assert change.ttft_p50 is not None and change.ttft_p50 >= 0.3
    assert s.ttft_p99_ratio("change", "steady") == change.ttft_p99 / s.phase("steady").ttft_p99  # type: ignore[operator]
    with pytest.raises(ValueError, match="already marked"):
        load.mark("change")


async def test_a_fault_of_the_harness_is_raised_not_counted(
    fake: FakeOpenAI, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def broken(*_args: object) -> None:
        raise ValueError("a bug in the client")

    monkeypatch.setattr(client, "send", broken)
    load = Load(target(fake), LoadPlan(rate=100, count=2))
    with pytest.raises(RuntimeError, match="the load harness failed") as info:
        async with load:
            await load.finished()
    assert isinstance(info.value.__cause__, ValueError)


async def test_vllm_alone_gets_no_route_header_and_sampled_requests_sample(fake: FakeOpenAI) -> None:
    fake.script = lambda _seen: Reply(route=None)
    sampled = RequestSpec(0, 0.0, PROMPTS.prompts[0], "chat", False, "native", False)
    rec = await client.one(target(fake, routes=False), sampled)
    assert rec.ok and rec.route_served is None
    seen = fake.requests[-1]
    assert client.ROUTE_HEADER not in seen.headers
    assert seen.body["temperature"] == 1.0
    assert seen.body["messages"] == [{"role": "user", "content": PROMPTS.prompts[0].text}]
    # A sampled text is never compared, whatever the references hold.
    refs = References("tiny", "here", {sampled.reference_key: "anything"})
    assert refs.match(sampled, rec.text) is None


async def test_waiting_for_more_than_the_plan_sends_says_so(fake: FakeOpenAI) -> None:
    load = Load(target(fake), LoadPlan(rate=100, count=3))
    async with load:
        await load.completed(3)
        with pytest.raises(RuntimeError, match="the load ended with 3 of the 4 requests in phase 'steady'"):
            await load.completed(4)


async def test_a_wait_that_times_out_names_what_it_saw(fake: FakeOpenAI) -> None:
    fake.script = lambda _seen: Reply(delay_s=60)
    load = Load(target(fake), LoadPlan(rate=100, count=2), drain_s=0.1)
    async with load:
        with pytest.raises(TimeoutError, match=r"waited 0.2 s for 1 successful requests .*0 so far"):
            await load.completed(1, ok=True, timeout=0.2)
