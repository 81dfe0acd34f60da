"""The event streams' side table: it describes blocks from the records, takes who holds them from
the index, and forgets a block once no rank of any worker has it (its memory is what the workers
hold). Keys are checked against the routers' v1 chain computed without kvwire's core."""

from __future__ import annotations

from streams_fleet import BS, engine_hash, v1_keys

from kvwire.consumer.apply import Applier
from kvwire.consumer.stream_table import StreamTable
from kvwire.schemas.events import AllBlocksCleared, BlockRemoved, EventBatch, WorkerId, stored

TOKENS = list(range(100, 100 + 4 * BS))
R0, R1 = WorkerId("w", 0, 0, 2), WorkerId("w", 0, 1, 2)


class Feed:
    def __init__(self) -> None:
        self.applier = Applier()
        self.table = StreamTable(self.applier.index)
        self.seq: dict[WorkerId, int] = {}

    def send(self, rank: WorkerId, *events) -> dict:
        seq = self.seq.get(rank, -1) + 1
        self.seq[rank] = seq
        batch = EventBatch(rank, 1, seq, 1, tuple(events), reset=seq == 0)
        self.applier.apply_batch(batch)
        self.table.observe(batch)
        return self.table.refresh()


def store(n: int, start: int = 0, medium: str = "GPU"):
    ehs = [engine_hash(TOKENS[: (i + 1) * BS]) for i in range(start, n)]
    parent = engine_hash(TOKENS[: start * BS]) if start else None
    return stored(ehs, TOKENS[start * BS : n * BS], BS, parent_block_hash=parent, medium=medium)


def test_a_block_is_held_once_every_tp_rank_has_it_and_its_keys_are_v1():
    f = Feed()
    f.send(R0, store(4))
    assert f.table.held(("w", 0)) == {}
    f.send(R1, store(2))
    f.send(R1, store(3, 2))  # a continuation: its parent is found by engine hash
    assert f.table.held(("w", 0)) == {("GPU", 0): set(v1_keys(TOKENS[: 3 * BS]))}
    blocks = f.table.blocks
    keys = v1_keys(TOKENS)
    assert [blocks[k].parent for k in keys[:3]] == [None, keys[0], keys[1]]
    assert [blocks[k].depth for k in keys] == [0, 1, 2, 3]
    assert list(blocks[keys[2]].token_ids) == TOKENS[2 * BS : 3 * BS]


def test_what_no_rank_has_is_forgotten():
    f = Feed()
    f.send(R0, store(4), store(4, 0, "CPU"))
    f.send(R1, store(4))
    changes = f.send(R0, BlockRemoved(tuple(engine_hash(TOKENS[: (i + 1) * BS]) for i in (3, 2)), medium="GPU"))
    gone = {(c.place, c.key) for c in changes[("w", 0)] if not c.held}
    assert gone == {(("GPU", 0), k) for k in v1_keys(TOKENS)[2:]}
    # R0 still has them on CPU: described while any rank has a block anywhere.
    assert len(f.table.blocks) == 4
    f.send(R0, AllBlocksCleared())
    assert f.table.held(("w", 0)) == {}
    f.send(R1, AllBlocksCleared())
    assert f.table.blocks == {} and f.table.workers[("w", 0)].by_hash == {}


def test_an_orphan_store_gets_no_key():
    f = Feed()
    lone = WorkerId("o", 0, 0, 1)
    f.send(lone, store(4, 2))  # its parent was never seen: the index keeps it as an orphan
    assert f.table.held(("o", 0)) == {} and f.table.blocks == {}


def test_a_block_is_held_while_any_physical_copy_is():
    f = Feed()
    one = WorkerId("d", 0, 0, 1)
    f.send(one, store(2))
    f.send(one, store(2))  # vLLM holds the same hash in a second physical block
    first = engine_hash(TOKENS[:BS])
    second = engine_hash(TOKENS[: 2 * BS])
    f.send(one, BlockRemoved((second, first), medium="GPU"))
    assert f.table.held(("d", 0)) == {("GPU", 0): set(v1_keys(TOKENS[: 2 * BS]))}
    changes = f.send(one, BlockRemoved((second, first), medium="GPU"))
    assert {c.key for c in changes[("d", 0)] if not c.held} == set(v1_keys(TOKENS[: 2 * BS]))
    assert f.table.held(("d", 0)) == {}
