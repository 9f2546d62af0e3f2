"""A request whose own parameters break its decode fails that request only: the node's data-plane
record (/v1/status, the operator's HandoffReady and Ready) stays as it was, and the node decodes the
next request. Before, one `"temperature": 5e-39` failed the decode on every node it reached and each
recorded `decode_failed`, which the operator reported as NotServing."""

from __future__ import annotations

import json
from collections.abc import Iterator

from tests.decode import synthetic
from tests.decode.conftest import running_node
from tilert_serve.decode.engines.base import DecodeStep, InvalidRequest, Sampling

CASE = "mla-f32"
NUM_TOKENS = 20


async def test_a_request_its_own_parameters_break_is_not_the_nodes_failure(secret_file, monkeypatch):
    async with running_node(synthetic.layout_for(CASE), secret_file, slots=1) as n:
        started = n.engine.start

        def start(state):  # type: ignore[no-untyped-def]
            seq = started(state)
            decode = seq.decode

            def checked(first_token: int, sampling: Sampling, max_new_tokens: int) -> Iterator[DecodeStep]:
                if sampling.temperature == 7.0:  # stands for a value the sampler cannot take
                    raise InvalidRequest("temperature 7.0 cannot be sampled here (test)")
                return decode(first_token, sampling, max_new_tokens)

            seq.decode = checked
            return seq

        monkeypatch.setattr(n.engine, "start", start)
        for temperature, want in ((7.0, 400), (0.0, 200)):
            _, adm = await n.admit(f"t{temperature}")
            assert json.loads(
                (await n.send(CASE, NUM_TOKENS, 1, "mooncake", adm["ticket"], request_id=f"t{temperature}"))[
                    7:
                ]
            )["ok"]
            status, events = await n.generate(
                adm["ticket"], max_tokens=2, sampling={"temperature": temperature}
            )
            assert status == want, events
            if want == 400:
                assert events[0]["error"]["type"] == "invalid_request"
                assert "temperature 7.0" in events[0]["error"]["message"]
            assert n.node.handoff.fail_at is None and n.node.handoff.failures == 0
            assert n.node.slots.free == 1
        assert n.node.handoff.successes == 1
