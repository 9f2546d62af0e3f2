"""HandoffReady in the full local stack: `tilert-pd local up`'s processes with the real vLLM
prefill (TileRTConnector, MTP), a TileRT node on the reference engine and the router driving handoff
probes, the condition computed by the operator's own code from the node's authenticated /v1/status.
Each fault turns it False with the data plane's reason, and its repair turns it True again; Ready
follows (this stack has no native pool, so without a working handoff it does not serve).
Faults and why they are modelled so: tests/local/handoff_stack.py."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.local import handoff_stack as hs

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="process identity is read from /proc"),
]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[hs.Stack]:
    s = hs.start(tmp_path_factory.mktemp("local-handoff") / "home", ticket_ttl_s=hs.TICKET_TTL_S)
    try:
        yield s
    finally:
        s.stop()


def test_the_stack_comes_up_handoff_ready(stack: hs.Stack) -> None:
    cond, _ = stack.until_true()
    assert cond["reason"] == "HandoffOK"
    # The probe's handoff went over the stack's transfer engine, which the node reports.
    assert "tilert-0: decoded from a handoff" in cond["message"] and "mooncake/tcp" in cond["message"], cond
    assert stack.ready()["reason"] == "Serving"


# "unreachable" last: the router's admission that timed out against the stopped node is served once the
# node resumes, and that ticket, which no one will use, holds the next restart's drain until it expires.
@pytest.mark.parametrize("fault", ["secret", "layout", "unreachable"])
def test_a_fault_turns_it_false_with_its_reason_and_the_repair_true(stack: hs.Stack, fault: str) -> None:
    stack.until_true()
    stack.inject(fault)
    try:
        cond, _ = stack.until_false(hs.EXPECTED[fault])
        assert "tilert-0" in cond["message"], cond
        if fault == "secret":
            assert "handoff secret may differ" in cond["message"], cond
        ready = stack.ready()
        assert ready["status"] == "False" and "HandoffReady" in ready["message"], ready
    finally:
        stack.repair(fault)
    cond, _ = stack.until_true()
    assert cond["reason"] == "HandoffOK"
    assert stack.ready()["reason"] == "Serving"
