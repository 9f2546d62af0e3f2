"""The prefill worker's send jobs, one record per claimed request; the one owner of every transition.

vLLM's step thread drives a rank's jobs through its hooks, each a TileRTWorker method: `begin`
(bind_connector_metadata, before the forward), `layer_saved` (save_kv_layer, after each main layer),
`step` (wait_for_save, after the drafter) and `finished` (get_finished). A job moves

    chunk job, no record     -> ANNOUNCED   arrive (begin): its prompt ids kept until a handoff begins
    last-step job, no record -> DUE         arrive (begin, expect): its blocks will be reported
    ANNOUNCED -> DUE                        arrive: the prompt's last step came before any handoff
    ANNOUNCED -> CHUNKING                   start (begin/_start): a chunk-wise handoff takes a region
    ANNOUNCED | DUE -> STAGING              start (begin/_start): the last step begins layer-wise
    CHUNKING  -> CHUNKING | STAGING         go_on (begin/_go_on): the next chunk, or the last step
    CHUNKING  -> ENDED                      handoff_over (begin/_go_on: the sender ended it between
                                            steps; step/_finish_staging: a chunk's gather failed)
    CHUNKING | ENDED -> COPIED              handoff_over(last) (begin): the last step finds it over
    ANNOUNCED | DUE -> WAITING              wait (step): not begun layer-wise; waits for a region
    STAGING   -> COPIED                     copied (step/_finish_staging): every layer staged or failed
    WAITING   -> COPIED                     copied (step, _give_up): gathered whole, or given up
    COPIED    -> reported                   finish (finished): vLLM finished it; its blocks may be freed
    ANNOUNCED | CHUNKING | ENDED -> dropped finish (finished): the request ended before its prompt did

and `finish` before COPIED only marks the job (its blocks stay held until it is copied). A job
staged in the current step (STAGING, or CHUNKING with a chunk to stage) carries a `StepWork`: the
layers left to stage and the tokens they end at; `end_step` hands those back once, for wait_for_save,
and each leaves it by `copied`, `handoff_over` or `pause` (CHUNKING, `staged` advanced). Every
transition checks the state it leaves and raises IllegalTransition, naming the job and both states.

Threads. Only vLLM's step thread touches the table (every hook above runs there), so it has no
lock. The sender threads see a job only through the handoff the worker gave them (its LayerFeed and
staging region, which have locks of their own): they never read or change a job's state here.

The table holds the worker's handoff objects without looking into them (`H`), so it needs nothing
of torch or vLLM at run time (SendJob is a type hint here) and its transitions are tested alone (tests/pd_vllm/test_jobs.py).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Generic, TypeVar

if TYPE_CHECKING:
    from tilert_serve.pd_vllm.metadata import SendJob

H = TypeVar("H")


class JobState(StrEnum):
    #: A step before the prompt's last was computed; no handoff has begun (prompt ids kept for it).
    ANNOUNCED = "announced"
    #: A chunk-wise handoff has begun while the prompt is still being computed; its region is the job's.
    CHUNKING = "chunking"
    #: The chunk-wise handoff ended before the prompt did: the last step has nothing left to send.
    ENDED = "ended"
    #: The prompt's last step arrived; not begun layer-wise. Its blocks will be reported.
    DUE = "due"
    #: Waits for a free staging region (its blocks held), oldest first.
    WAITING = "waiting"
    #: The prompt's last step, staged layer by layer as the forward reports them.
    STAGING = "staging"
    #: Its rows are in staging (or it was given up): its blocks are no longer read.
    COPIED = "copied"


class IllegalTransition(RuntimeError):
    """A transition asked of a job in a state it does not leave from: a bug in the worker."""


@dataclass
class StepWork:
    """What a job stages in the current step: its chunk's tokens (or all the rest), layer by layer."""

    #: This rank's layers not yet staged.
    pending: set[int]
    #: Tokens end (exclusive) staged this step; None: to the prompt's end (its last step).
    upto: int | None
    #: This step's block table (a chunked prompt's grows step by step).
    block_ids: tuple[list[int], ...]
    failed: bool = False


@dataclass
class Job(Generic[H]):
    req_id: str
    state: JobState
    #: ANNOUNCED: the prompt's ids, sent by the scheduler once, in the first chunk's job.
    prompt: list[int] | None = None
    #: CHUNKING / STAGING: the handoff given to the sender threads.
    handoff: H | None = None
    #: Chunk-wise: tokens of every layer of this rank already in staging, by the steps before this one.
    staged: int = 0
    #: Staged in the current step (see StepWork); None between steps.
    step: StepWork | None = None
    #: WAITING: the last step's job, to gather whole once a region is free.
    send: SendJob | None = None
    #: WAITING: when it began waiting (the give-up clock) and its place in line.
    since: float = 0.0
    order: int = 0
    #: vLLM has finished the request: reported as soon as it is COPIED.
    finished: bool = False

    @property
    def expected(self) -> bool:
        """Its prompt's last step arrived: its blocks are held until it is reported."""
        return self.state in _EXPECTED


_EXPECTED = frozenset({JobState.DUE, JobState.WAITING, JobState.STAGING, JobState.COPIED})


class JobTable(Generic[H]):
    def __init__(self) -> None:
        self._jobs: dict[str, Job[H]] = {}
        #: Jobs staged in the current step, in the order they began it (an index into _jobs).
        self._stepping: list[Job[H]] = []
        self._order = 0

    # -- queries -----------------------------------------------------------------------------------

    def get(self, req_id: str) -> Job[H] | None:
        return self._jobs.get(req_id)

    def __len__(self) -> int:
        return len(self._jobs)

    @property
    def stepping(self) -> list[Job[H]]:
        """The jobs staged in the current step (begin to step)."""
        return self._stepping

    def waiting(self) -> list[Job[H]]:
        """The WAITING jobs, oldest first."""
        return sorted((j for j in self._jobs.values() if j.state is JobState.WAITING), key=lambda j: j.order)

    def any_waiting(self) -> bool:
        return any(j.state is JobState.WAITING for j in self._jobs.values())

    # -- transitions -------------------------------------------------------------------------------

    def arrive(self, req_id: str, *, last: bool, prompt: list[int] | None = None) -> Job[H]:
        """A step's job for `req_id`: a record is made (ANNOUNCED for a chunk, DUE for the last step);
        the last step of an ANNOUNCED job makes it DUE. A chunk's prompt ids are kept while ANNOUNCED."""
        job = self._jobs.get(req_id)
        if job is None:
            job = self._jobs[req_id] = Job(req_id, JobState.DUE if last else JobState.ANNOUNCED)
        elif last and job.state is JobState.ANNOUNCED:
            job.state = JobState.DUE
        if last:
            job.prompt = None
        elif prompt and job.state is JobState.ANNOUNCED:
            job.prompt = prompt
        return job

    def start(self, job: Job[H], handoff: H, step: StepWork) -> None:
        """A handoff begins in this step: a chunk's (-> CHUNKING) or the last step's (-> STAGING)."""
        self._leave(job, "start", JobState.ANNOUNCED, JobState.DUE)
        job.state = JobState.STAGING if step.upto is None else JobState.CHUNKING
        job.handoff, job.prompt = handoff, None
        self._stage_now(job, step)

    def go_on(self, job: Job[H], step: StepWork) -> None:
        """A chunk-wise handoff stages this step's tokens; the last step's make it STAGING."""
        self._leave(job, "go_on", JobState.CHUNKING)
        if step.upto is None:
            job.state = JobState.STAGING
        self._stage_now(job, step)

    def handoff_over(self, job: Job[H], *, last: bool) -> None:
        """The chunk-wise handoff is over before the prompt is: its later chunks stage nothing (-> ENDED)
        and its last step sends nothing (-> COPIED: its blocks are free at once)."""
        self._leave(job, "handoff_over", JobState.CHUNKING, JobState.ENDED)
        if last:
            job.state = JobState.COPIED
        elif job.state is JobState.CHUNKING:
            job.state = JobState.ENDED
        job.handoff = None

    def end_step(self) -> list[Job[H]]:
        """wait_for_save: this step's staged jobs, once; each then leaves by `copied`, `handoff_over`
        or `pause`."""
        jobs, self._stepping = self._stepping, []
        return jobs

    def pause(self, job: Job[H]) -> None:
        """A chunk is staged: the job keeps its region (through its handoff) until its next step."""
        self._leave(job, "pause", JobState.CHUNKING)
        assert job.step is not None and job.step.upto is not None
        job.staged, job.step = job.step.upto, None

    def wait(self, send: SendJob, now: float) -> Job[H]:
        """The last step's job was not begun layer-wise: it waits for a region for its whole state."""
        job = self._jobs.get(send.req_id) or self.arrive(send.req_id, last=True)
        self._leave(job, "wait", JobState.DUE, JobState.ANNOUNCED)
        job.state, job.prompt, job.send, job.since = JobState.WAITING, None, send, now
        self._order += 1
        job.order = self._order
        return job

    def copied(self, job: Job[H]) -> None:
        """Its blocks are no longer read: gathered into staging, every layer staged, or given up."""
        self._leave(job, "copied", JobState.WAITING, JobState.STAGING)
        job.state, job.step, job.send, job.handoff = JobState.COPIED, None, None, None

    def finish(self, req_ids: Iterable[str]) -> tuple[set[str], list[H]]:
        """get_finished: vLLM finished these requests. Returns the ids whose blocks may now be freed
        (COPIED and finished, each once) and the handoffs of chunk-wise jobs whose request ended before
        its prompt did (the caller tells their senders)."""
        aborted: list[H] = []
        for req_id in req_ids:
            job = self._jobs.get(req_id)
            if job is None:
                continue
            if job.expected:
                job.finished = True
                continue
            del self._jobs[req_id]  # ANNOUNCED, CHUNKING or ENDED: no block of it is held
            if job.state is JobState.CHUNKING and job.handoff is not None:
                aborted.append(job.handoff)
        ready = {j.req_id for j in self._jobs.values() if j.state is JobState.COPIED and j.finished}
        for req_id in ready:
            del self._jobs[req_id]
        return ready, aborted

    # -- internals ---------------------------------------------------------------------------------

    def _stage_now(self, job: Job[H], step: StepWork) -> None:
        if job.step is not None:
            raise IllegalTransition(f"request {job.req_id}: already staged in this step ({job.state.value})")
        job.step = step
        self._stepping.append(job)

    @staticmethod
    def _leave(job: Job[H], transition: str, *allowed: JobState) -> None:
        if job.state not in allowed:
            raise IllegalTransition(
                f"request {job.req_id}: {transition} leaves {' or '.join(s.value for s in allowed)}, "
                f"but the job is {job.state.value}"
            )
