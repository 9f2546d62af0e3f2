"""A load harness that keeps score: bounded open-loop load against an OpenAI-compatible endpoint (the
router, or vLLM alone) that records what happened to every request, for tests and benchmarks of a
stack that changes while it serves (rollouts, scaling, kills).

vLLM's own benchmark client (`vllm bench serve`) is what users measure serving with: it reports
throughput and latency percentiles over a run. This harness differs where a changing stack needs it:
it keeps each request's outcome (ok, HTTP error by status class and error type, connection error,
stream cut before `[DONE]`, error event inside the stream, retried), compares every greedy output with
vLLM alone's for the same prompt, and splits the numbers into phases at marks set while it runs, so a
test can say "0 failed and TTFT p99 within 2x of steady state during the rollout" or "served again
1.3 s after the kill".

    plan.py        prompt set, request mix, Poisson schedule (pure, seeded)
    client.py      one request and its Record; Target (an endpoint)
    references.py  vLLM alone's greedy texts, collected from any endpoint, cached in a file
    harness.py     Load: the run in the background, marks, waits
    summary.py     Summary: failures, mismatches, percentiles per phase and route, recovery after a mark
    report.py      the tables, and the RESULTS.md section through bench/common.py
    rate.py        whether a probe's rate was sustained (no failure, no queue): the benchmark's ladder
    fake.py        a scripted OpenAI server for tests
    stack.py       the tiny CPU stack and vLLM alone, for the benchmark and the slow test
    __main__.py    the benchmark: python -m bench.load
"""

from bench.load.client import Target
from bench.load.harness import Load
from bench.load.plan import LoadPlan, Mix, PromptSet
from bench.load.references import References
from bench.load.summary import Summary

__all__ = ["Load", "LoadPlan", "Mix", "PromptSet", "References", "Summary", "Target"]
