"""`Load`: a bounded open-loop run in the background of a test or a benchmark.

    async with Load(target, LoadPlan(rate=2, duration_s=60), references=refs) as load:
        await load.completed(10)               # steady state first (an event, not a sleep)
        load.mark("rollout-start")
        await asyncio.to_thread(apply_change)  # the change, while requests keep arriving
        load.mark("rollout-done")
        await load.completed(10, after="rollout-done")
    s = load.summary()
    assert s.failed == 0 and s.mismatches == 0
    assert s.ttft_p99_ratio("rollout-start", "steady") <= 2

Requests are sent at their planned times whatever the answers do (open loop); each is its own task,
so a slow or hung answer never delays the next arrival. Leaving the block stops new arrivals and waits
up to `drain_s` for the requests in flight; those still unanswered then are cancelled and recorded as
`abandoned`. `await load.finished()` instead lets the whole plan run out first.

Lifecycle, each transition made by one method only: new -(start)-> running -(stop)-> stopped.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Callable
from typing import Literal

import aiohttp

from bench.load import client
from bench.load.plan import LoadPlan, RequestSpec, schedule
from bench.load.record import Record
from bench.load.references import References
from bench.load.summary import Mark, Summary, summarize

State = Literal["new", "running", "stopped"]


class Load:
    def __init__(
        self,
        target: client.Target,
        plan: LoadPlan,
        *,
        references: References | None = None,
        phase: str = "steady",
        drain_s: float = 60.0,
        progress: Callable[[str], None] | None = None,
        progress_every_s: float = 10.0,
    ) -> None:
        if references is not None and references.model != target.model:
            raise ValueError(
                f"the references are for model {references.model!r}, the target serves {target.model!r}; "
                "collect references for the same model"
            )
        self.target = target
        self.plan = plan
        self.references = references
        self.initial_phase = phase
        self.drain_s = drain_s
        self.records: list[Record] = []
        self.marks: list[Mark] = []
        self.state: State = "new"
        #: In every request id (load-RUN-SEQ), so a server's logs name the run and the request.
        self.run_id = secrets.token_hex(3)
        self._progress = progress
        self._progress_every_s = progress_every_s
        self._t0 = 0.0
        self._http: aiohttp.ClientSession | None = None
        self._arrivals: asyncio.Task[None] | None = None
        self._inflight: set[asyncio.Task[None]] = set()
        self._changed = asyncio.Event()
        #: Errors of the harness itself (not outcomes of requests): raised by stop.
        self._errors: list[BaseException] = []

    # lifecycle

    async def start(self) -> Load:
        if self.state != "new":
            raise RuntimeError(f"a Load runs once; this one is {self.state}")
        self.state = "running"
        self._http = client.session(timeout_s=self.plan.timeout_s)
        self._t0 = time.monotonic()
        self._arrivals = asyncio.create_task(self._arrive(), name=f"load-arrivals-{self.target.name}")
        return self

    async def stop(self) -> Summary:
        """Stop new arrivals, wait up to drain_s for those in flight, cancel the rest; idempotent."""
        if self.state == "stopped":
            return self.summary()
        if self.state == "new":
            self.state = "stopped"
            return self.summary()
        assert self._arrivals is not None and self._http is not None
        self._arrivals.cancel()
        (arrivals,) = await asyncio.gather(self._arrivals, return_exceptions=True)
        if isinstance(arrivals, Exception):
            self._errors.append(arrivals)
        if self._inflight:
            _, late = await asyncio.wait(set(self._inflight), timeout=self.drain_s)
            for task in late:
                task.cancel()
            await asyncio.gather(*late, return_exceptions=True)
        await self._http.close()
        self.state = "stopped"
        self._notify()
        if self._errors:
            raise RuntimeError(f"the load harness failed ({len(self._errors)} errors)") from self._errors[0]
        return self.summary()

    async def __aenter__(self) -> Load:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # during the run

    @property
    def now(self) -> float:
        """Seconds since the run started."""
        return time.monotonic() - self._t0 if self.state != "new" else 0.0

    def mark(self, name: str) -> Mark:
        """Start a phase here: requests sent from now on count in `name` (a mark's name is unique)."""
        if name == self.initial_phase or any(m.name == name for m in self.marks):
            raise ValueError(f"phase {name!r} is already marked in this run; give each mark its own name")
        m = Mark(name, self.now)
        self.marks.append(m)
        self._say(f"  [{m.at:6.1f} s] mark {name!r}")
        return m

    @property
    def phase(self) -> str:
        return self.marks[-1].name if self.marks else self.initial_phase

    async def completed(
        self, n: int, *, after: str | None = None, ok: bool = False, timeout: float = 300.0
    ) -> None:
        """Wait until `n` requests sent in phase `after` (default: the current one) have ended (`ok`:
        ended successfully). Raises TimeoutError naming what was seen, and RuntimeError when the run
        ended before that could happen."""
        phase = after or self.phase

        def count() -> int:
            return sum(r.phase == phase and r.outcome is not None and (r.ok or not ok) for r in self.records)

        what = f"{n} {'successful ' if ok else ''}requests in phase {phase!r}"
        try:
            async with asyncio.timeout(timeout):
                while count() < n:
                    if self.state == "stopped" or self._ended():
                        raise RuntimeError(
                            f"the load ended with {count()} of the {what}; plan a longer run (duration_s / count)"
                        )
                    self._changed.clear()
                    await self._changed.wait()
        except TimeoutError:
            raise TimeoutError(
                f"waited {timeout:g} s for {what}; {count()} so far, {len(self._inflight)} in flight"
            ) from None

    def _ended(self) -> bool:
        # A request's task is still in the set between its last notification and its done callback.
        return self._arrivals is not None and self._arrivals.done() and all(t.done() for t in self._inflight)

    async def finished(self) -> Summary:
        """Wait for the plan to run out (every arrival sent and answered), then stop."""
        if self._arrivals is not None:
            await asyncio.gather(self._arrivals, return_exceptions=True)
        while self._inflight:
            await asyncio.wait(set(self._inflight))
        return await self.stop()

    def summary(self) -> Summary:
        return summarize(self.records, self.marks, self.initial_phase)

    # inside

    async def _arrive(self) -> None:
        next_report = self._progress_every_s
        for spec in schedule(self.plan):
            delay = self._t0 + spec.offset_s - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            rec = client.blank(spec, self.phase, self.now, self.run_id)
            self.records.append(rec)
            task = asyncio.create_task(self._one(spec, rec))
            self._inflight.add(task)
            task.add_done_callback(self._inflight.discard)
            if self.now >= next_report:
                next_report += self._progress_every_s
                self._report()
        self._notify()

    async def _one(self, spec: RequestSpec, rec: Record) -> None:
        assert self._http is not None
        try:
            await client.send(self._http, self.target, spec, rec, self._t0)
        except Exception as exc:  # a fault of the harness, not an outcome: stop() raises it
            self._errors.append(exc)
        finally:
            if rec.ok and self.references is not None:
                rec.greedy_match = self.references.match(spec, rec.text)
            self._notify()

    def _notify(self) -> None:
        self._changed.set()

    def _report(self) -> None:
        done = [r for r in self.records if r.outcome is not None]
        failed = sum(not r.ok for r in done)
        self._say(
            f"  [{self.now:6.1f} s] {self.target.name}: {len(self.records)} sent, {len(done)} answered, "
            f"{failed} failed, {len(self._inflight)} in flight (phase {self.phase})"
        )

    def _say(self, msg: str) -> None:
        if self._progress is not None:
            self._progress(msg)
