"""The prefill worker's job table (pd_vllm/jobs.py) alone: each path a send job takes, what the worker
may report when, and that every transition refuses a job in a state it does not leave from."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from tilert_serve.pd_vllm.jobs import IllegalTransition, Job, JobState, JobTable, StepWork
from tilert_serve.pd_vllm.metadata import Destination, SendJob


def send(req_id: str, upto: int | None = None, prompt: list[int] | None = None) -> SendJob:
    return SendJob(
        req_id=req_id,
        dest=Destination("127.0.0.1", 1, None),
        num_tokens=20,
        last_prompt_token=3,
        prompt_token_ids=list(range(20)) if prompt is None else prompt,
        block_ids=([1, 2],),
        upto=upto,
    )


def step(upto: int | None) -> StepWork:
    return StepWork({0, 1, 2}, upto, ([1],))


def test_a_whole_state_job_is_reported_once_after_its_copy_and_its_finish() -> None:
    t: JobTable[str] = JobTable()
    job = t.arrive("a", last=True)
    assert job.state is JobState.DUE and job.expected
    assert t.finish({"a"}) == (set(), [])  # vLLM finished it, but its blocks are still to be read
    assert t.wait(send("a"), now=5.0) is job
    assert job.state is JobState.WAITING and job.since == 5.0 and job.send is not None
    t.copied(job)
    assert job.state is JobState.COPIED and job.send is None
    assert t.finish(set()) == ({"a"}, [])  # finished earlier: reported as soon as it is copied
    assert t.finish({"a"}) == (set(), []) and len(t) == 0  # once


def test_a_copied_job_waits_for_vllm_to_finish_it() -> None:
    t: JobTable[str] = JobTable()
    job = t.wait(send("a"), now=0.0)  # a step with no begin before it (no record yet)
    t.copied(job)
    assert t.finish(set()) == (set(), [])
    assert t.finish({"a", "not-ours"}) == ({"a"}, [])


def test_waiting_jobs_are_served_in_the_order_they_began_waiting() -> None:
    t: JobTable[str] = JobTable()
    for req_id in ("c", "a", "b"):
        t.arrive(req_id, last=True)
    t.wait(send("b"), now=0.0)
    t.wait(send("c"), now=1.0)
    t.wait(send("a"), now=2.0)
    assert [j.req_id for j in t.waiting()] == ["b", "c", "a"]
    assert t.any_waiting()
    t.copied(t.waiting()[0])
    assert [j.req_id for j in t.waiting()] == ["c", "a"]


def test_a_layerwise_last_step_stages_in_its_step_and_is_copied_at_its_end() -> None:
    t: JobTable[str] = JobTable()
    job = t.arrive("a", last=True)
    t.start(job, "handoff-a", step(None))
    assert job.state is JobState.STAGING and job.handoff == "handoff-a"
    assert t.stepping == [job]
    assert t.end_step() == [job] and t.stepping == [] and t.end_step() == []
    t.copied(job)
    assert job.handoff is None and job.step is None
    assert t.finish({"a"}) == ({"a"}, [])


def test_a_chunked_prompt_goes_chunk_by_chunk_and_completes_in_its_last_step() -> None:
    t: JobTable[str] = JobTable()
    job = t.arrive("a", last=False, prompt=[7, 8, 9])
    assert job.state is JobState.ANNOUNCED and job.prompt == [7, 8, 9] and not job.expected
    assert t.arrive("a", last=False, prompt=[]).prompt == [7, 8, 9]  # later chunks carry no ids
    t.start(job, "h", step(7))
    assert job.state is JobState.CHUNKING and job.prompt is None
    assert t.end_step() == [job]
    t.pause(job)
    assert job.staged == 7 and job.step is None and job.handoff == "h"
    t.go_on(job, step(14))
    t.end_step()
    t.pause(job)
    assert job.staged == 14
    assert t.finish(set()) == (set(), [])  # a chunk holds no block: nothing to report
    t.arrive("a", last=True)
    assert job.state is JobState.CHUNKING  # begin decides: go on, or find the handoff over
    t.go_on(job, step(None))
    assert job.state is JobState.STAGING and job.expected
    t.end_step()
    t.copied(job)
    assert t.finish({"a"}) == ({"a"}, [])


def test_a_chunk_wise_handoff_that_ends_early_leaves_its_last_step_nothing_to_send() -> None:
    t: JobTable[str] = JobTable()
    job = t.arrive("a", last=False, prompt=[1])
    t.start(job, "h", step(7))
    t.end_step()
    t.pause(job)
    t.handoff_over(job, last=False)  # the sender ended it between steps
    assert job.state is JobState.ENDED and job.handoff is None
    assert t.arrive("a", last=False).state is JobState.ENDED
    t.arrive("a", last=True)
    t.handoff_over(job, last=True)
    assert job.state is JobState.COPIED
    assert t.finish({"a"}) == ({"a"}, [])


def test_a_request_ending_before_its_prompt_drops_its_job_and_names_the_handoff_to_stop() -> None:
    t: JobTable[str] = JobTable()
    t.arrive("announced", last=False, prompt=[1])
    chunking = t.arrive("chunking", last=False, prompt=[1])
    t.start(chunking, "h", step(7))
    t.end_step()
    t.pause(chunking)
    ended = t.arrive("ended", last=False, prompt=[1])
    t.start(ended, "h2", step(7))
    t.end_step()
    t.handoff_over(ended, last=False)
    assert t.finish({"announced", "chunking", "ended"}) == (set(), ["h"])
    assert len(t) == 0


def test_the_last_step_of_an_announced_job_makes_it_due_and_drops_its_prompt() -> None:
    t: JobTable[str] = JobTable()
    job = t.arrive("a", last=False, prompt=[1, 2])
    t.arrive("a", last=True)
    assert job.state is JobState.DUE and job.prompt is None


def _in(state: JobState) -> Callable[[JobTable[str]], Job[str]]:
    """A table's job brought to `state` by legal transitions."""

    def make(t: JobTable[str]) -> Job[str]:
        last = state in (JobState.DUE, JobState.WAITING, JobState.STAGING, JobState.COPIED)
        job = t.arrive("r1", last=last, prompt=[1])
        if state is JobState.WAITING:
            t.wait(send("r1"), now=0.0)
        elif state in (JobState.STAGING, JobState.CHUNKING, JobState.ENDED):
            t.start(job, "h", step(None if state is JobState.STAGING else 7))
            t.end_step()
            if state is JobState.ENDED:
                t.handoff_over(job, last=False)
        elif state is JobState.COPIED:
            t.wait(send("r1"), now=0.0)
            t.copied(job)
        assert job.state is state
        return job

    return make


ILLEGAL = [
    ("copied", JobState.DUE, lambda t, j: t.copied(j), "waiting or staging"),
    ("copied", JobState.COPIED, lambda t, j: t.copied(j), "waiting or staging"),
    ("start", JobState.CHUNKING, lambda t, j: t.start(j, "h", step(None)), "announced or due"),
    ("start", JobState.WAITING, lambda t, j: t.start(j, "h", step(None)), "announced or due"),
    ("go_on", JobState.ANNOUNCED, lambda t, j: t.go_on(j, step(None)), "chunking"),
    ("go_on", JobState.ENDED, lambda t, j: t.go_on(j, step(None)), "chunking"),
    ("pause", JobState.STAGING, lambda t, j: t.pause(j), "chunking"),
    ("wait", JobState.STAGING, lambda t, j: t.wait(send("r1"), 0.0), "due or announced"),
    ("wait", JobState.COPIED, lambda t, j: t.wait(send("r1"), 0.0), "due or announced"),
    ("handoff_over", JobState.WAITING, lambda t, j: t.handoff_over(j, last=True), "chunking or ended"),
]


@pytest.mark.parametrize(
    ("transition", "state", "call", "leaves"), ILLEGAL, ids=[f"{c[0]}-from-{c[1].value}" for c in ILLEGAL]
)
def test_an_illegal_transition_raises_naming_the_job_and_both_states(
    transition: str,
    state: JobState,
    call: Callable[[JobTable[str], Job[str]], object],
    leaves: str,
) -> None:
    t: JobTable[str] = JobTable()
    job = _in(state)(t)
    with pytest.raises(IllegalTransition) as err:
        call(t, job)
    assert str(err.value) == f"request r1: {transition} leaves {leaves}, but the job is {state.value}"
    assert job.state is state  # a refused transition changes nothing


def test_a_job_is_staged_at_most_once_a_step() -> None:
    t: JobTable[str] = JobTable()
    job = t.arrive("r1", last=False, prompt=[1])
    t.start(job, "h", step(7))
    t.end_step()
    t.pause(job)
    t.go_on(job, step(14))
    with pytest.raises(IllegalTransition, match=r"request r1: already staged in this step \(chunking\)"):
        t.go_on(job, step(14))
    assert t.stepping == [job]
