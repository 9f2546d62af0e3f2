"""A writer on the data plane (no handoff secret, no node token: only a transfer engine that can reach
the node's registered receive buffer) against the node's promise: a state that is not what its
sender hashed is refused, never decoded, and a write that lands after the node took the bytes
changes nothing. For every layout dtype, layer-wise and whole-state, the attacker overwrites what the
sender wrote over Mooncake TCP at each point of the flow:

- after the sender is done, before the node took the bytes: refused (digest), nothing injected;
- between the node's copy of the bytes and its check of that copy: decoded, the sender's state;
- after the node checked and converted everything, before /generate injects: decoded, the sender's
  state (a check over bytes that can still change would have let this through for the dtypes whose
  conversion is a view of the received bytes).
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from tests.decode import synthetic
from tests.decode.attacker import DataPlaneWriter
from tests.decode.conftest import RunningNode, converter_held, running_node
from tests.decode.test_layerwise import NUM_TOKENS, assert_same_state, wait_for
from tilert_serve.decode.buffers import ReceiveBuffers

CASES = list(synthetic.LAYOUT_CASES)
MODES = {"whole": (), "layerwise": ("--layerwise",)}
SEED = 9


def _overwrite(
    writer: DataPlaneWriter, n: RunningNode, ranges: list[tuple[int, int, int]], slot: int = 0
) -> None:
    """Junk over `ranges` ((shard, slot-relative offset, nbytes)) of the node's receive region."""
    regions = n.node.buffers.regions(slot)
    writer.write(
        n.node.transfer.peer_info(), [(regions[shard].addr + off, nbytes) for shard, off, nbytes in ranges]
    )


def _everything(n: RunningNode, slot: int = 0) -> list[tuple[int, int, int]]:
    return [(shard, 0, view.numel()) for shard, view in enumerate(n.node.buffers.views(slot))]


@pytest.fixture(scope="module")
def attacker() -> Iterator[DataPlaneWriter]:
    writer = DataPlaneWriter()
    yield writer
    writer.close()


def _node(case: str, secret_file):  # type: ignore[no-untyped-def]
    shards = 2 if case.startswith("glm5") else 1
    return running_node(synthetic.layout_for(case), secret_file, slots=1, max_seq_len=128, shards=shards)


async def _send(n: RunningNode, case: str, mode: str, ticket: str) -> None:
    result = json.loads(
        (await n.send(case, NUM_TOKENS, SEED, "mooncake", ticket, *MODES[mode], request_id="v"))[7:]
    )
    assert result["ok"], result


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("case", CASES)
async def test_a_write_before_the_node_took_the_state_is_refused(case, mode, secret_file, attacker):
    async with _node(case, secret_file) as n:
        _, adm = await n.admit("v")
        with converter_held(n.node):  # the node takes what landed only once this block ends
            await _send(n, case, mode, adm["ticket"])
            _overwrite(attacker, n, _everything(n))
        status, events = await n.generate(adm["ticket"], max_tokens=2)
        assert status == 502 and "digest differs" in events[0]["error"]["message"], events
        assert n.engine.started == []  # never injected
        assert n.node.slots.free == 1


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("case", CASES)
async def test_a_write_between_the_copy_and_its_check_changes_nothing(
    case, mode, secret_file, attacker, monkeypatch
):
    async with _node(case, secret_file) as n:
        taken: list[list[tuple[int, int, int]]] = []
        copy = n.node.buffers.snapshot

        def copy_then_attack(slot: int, ranges) -> None:  # type: ignore[no-untyped-def]
            ranges = list(ranges)
            copy(slot, ranges)
            taken.append(ranges)
            _overwrite(attacker, n, ranges, slot)  # the very bytes just taken, before they are hashed

        monkeypatch.setattr(n.node.buffers, "snapshot", copy_then_attack)
        _, adm = await n.admit("v")
        await _send(n, case, mode, adm["ticket"])
        status, events = await n.generate(adm["ticket"], max_tokens=2)
        assert status == 200, events
        layout = synthetic.layout_for(case)
        # Layer-wise, each layer was taken at its LayersDone (Done covered nothing more); else at Done.
        assert len(taken) == (layout.num_layers if mode == "layerwise" else 1)
        assert_same_state(n, case, SEED)


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("case", CASES)
async def test_a_write_after_the_check_changes_nothing(case, mode, secret_file, attacker):
    async with _node(case, secret_file) as n:
        _, adm = await n.admit("v")
        await _send(n, case, mode, adm["ticket"])
        # Checked and converted ahead of /generate: the state waits for injection.
        await wait_for(
            lambda: (p := n.node.pipeline.build(0)) is not None and p.final is not None and p.final.done()
        )
        _overwrite(attacker, n, _everything(n))
        assert n.node.buffers.views(0)[0][:16].eq(0x41).all()  # it did land
        status, events = await n.generate(adm["ticket"], max_tokens=2)
        assert status == 200, events
        assert_same_state(n, case, SEED)


def test_snapshots_are_not_what_is_registered():
    """The snapshot twin is separate memory of the same size, laid out like the receive buffer."""
    layout = synthetic.layout_for("mla-f32")
    b = ReceiveBuffers(layout, max_seq_len=16, slots=2)
    assert [s.numel() for s in b.snapshots] == [r.numel() for r in b.buffers]
    assert all(s.data_ptr() != r.data_ptr() for s, r in zip(b.snapshots, b.buffers, strict=True))
    b.views(1)[0][8:12] = 7
    b.snapshot(1, [(0, 8, 2)])
    assert b.snapshot_views(1)[0][8:12].tolist() == [7, 7, 0, 0]
    assert not b.snapshot_views(0)[0].any()
