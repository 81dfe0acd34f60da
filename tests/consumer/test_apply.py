"""The apply path: a record is applied whole or not at all."""

from kvwire.consumer.apply import Applier
from kvwire.consumer.keys import prompt_keys
from kvwire.schemas import codec
from kvwire.schemas.events import EventBatch, WorkerId, stored

W = WorkerId("w")


def test_a_record_with_one_bad_event_is_dead_lettered_whole():
    a = Applier()
    a.apply_record("t", 0, 0, b"w/0", codec.encode(EventBatch(W, 1, 0, 0, (), reset=True)), 0)
    good = stored([1, 2], range(32), 16)
    bad = stored([3, 4], range(20), 16)  # 20 tokens cannot be 2 blocks of 16
    a.apply_record("t", 0, 1, b"w/0", codec.encode(EventBatch(W, 1, 1, 0, (good, bad))), 0)
    assert len(a.index) == 0, "nothing of the bad record may be applied"
    (dead,) = a.take_dead_letters()
    assert dead.offset == 1 and "carries 20 token ids" in dead.error
    assert a.ranks.ranks[W.rank].last_seq == 0, "the sequence did not advance past the dead record"
    # the next record shows the hole: the worker is untrusted until its next reset
    a.apply_record("t", 0, 2, b"w/0", codec.encode(EventBatch(W, 1, 2, 0, (good,))), 0)
    assert len(a.index) == 2 and a.score(list(range(32))) == []
    a.apply_record("t", 0, 3, b"w/0", codec.encode(EventBatch(W, 2, 0, 0, (good,), reset=True)), 0)
    assert a.score(list(range(32)))[0].matched_tokens == 32


def test_reads_from_another_thread_wait_for_an_apply_call_instead_of_raising():
    """An apply call holds the core objects exclusively while it can still run Python code
    (here a record whose ``value`` is a Python property; in production, whatever the
    interpreter runs there), and the interpreter may switch to an HTTP thread then. That
    thread's reads (block sizes, names, trust) must wait for the call, not raise."""
    import threading
    import time

    a = Applier()
    a.apply_record(
        "t", 0, 0, b"w/0", codec.encode(EventBatch(W, 1, 0, 0, (stored([1], range(16), 16),), reset=True)), 0
    )
    got: dict[str, object] = {}
    readers: list[threading.Thread] = []

    def read() -> None:
        try:
            got["reads"] = (a.index.block_sizes(), a.ranks.untrusted_workers(), a.index.workers(), a.score(range(32)))
        except Exception as e:  # the failure this test is about
            got["error"] = e

    class Rec:
        offset, key, timestamp = 1, b"w/0", 0

        @property
        def value(self) -> bytes:
            t = threading.Thread(target=read)
            readers.append(t)
            t.start()
            time.sleep(0.05)  # the reader runs while the apply call holds the core
            return codec.encode(EventBatch(W, 1, 1, 0, (stored([2], range(16, 32), 16, parent_block_hash=1),)))

    assert a.apply_records("t", 0, [Rec()]) == 1
    readers[0].join(10)
    assert "error" not in got, got.get("error")
    sizes, untrusted, workers, scores = got["reads"]
    assert sizes == [16] and untrusted == set() and workers[("w", 0)].blocks == {"GPU": 2}
    assert scores[0].matched_tokens == 32  # it read the index after the call: both blocks


def test_the_core_and_the_oracle_behind_one_applier_agree():
    """Both ``Index`` implementations take one path through the Applier: the same records
    (a bad one, a duplicate, a gap, an undecodable value, a new epoch) leave the same dead
    letters, trust, blocks and scores, fenced by the same core fence."""
    from oracle import Oracle

    U = WorkerId("u", tp_size=2)
    U1 = WorkerId("u", tp_rank=1, tp_size=2)
    values = [
        codec.encode(EventBatch(W, 1, 0, 0, (stored([1, 2], range(32), 16),), reset=True)),
        codec.encode(EventBatch(W, 1, 1, 0, (stored([3], range(20), 16),))),  # malformed
        codec.encode(EventBatch(W, 1, 1, 0, (stored([5], range(32, 48), 16, 2),))),
        codec.encode(EventBatch(W, 1, 1, 0, (stored([5], range(32, 48), 16, 2),))),  # duplicate
        b"\x00not a record",
        codec.encode(EventBatch(U, 7, 0, 0, (stored([9, 8], range(32), 16),), reset=True)),
        codec.encode(EventBatch(U1, 7, 0, 0, (stored([9, 8], range(32), 16),), reset=True)),
        codec.encode(EventBatch(U1, 7, 2, 1, (stored([7], range(32, 48), 16, 8),))),  # gap
        codec.encode(EventBatch(W, 2, 0, 0, (stored([1], range(16), 16),), reset=True)),  # new epoch
    ]
    from typing import NamedTuple

    class Rec(NamedTuple):  # the fields of a ConsumerRecord the Applier reads
        offset: int
        key: bytes | None
        value: bytes
        timestamp: int

    recs = [Rec(i, b"k", v, 0) for i, v in enumerate(values)]
    core, model = Applier(), Applier(index=Oracle())
    for a in (core, model):
        assert a.apply_records("t", 0, recs, budget_us=1 << 40) == len(recs)
    assert [d.offset for d in core.take_dead_letters()] == [d.offset for d in model.take_dead_letters()] == [1, 4]
    assert core.index.holder_blocks() == model.index.holder_blocks()
    assert core.ranks.untrusted_workers() == model.ranks.untrusted_workers() == {("u", 0)}
    for q in (list(range(48)), list(range(16)), list(range(32))):
        assert core.score(q) == model.score(q)
        assert core.score_json(q) == model.score_json(q)
        # A prompt given as its keys (the routers' v1 hashes chained) answers as its tokens do.
        keys = prompt_keys(q, 16)
        assert core.score_keys_json(keys) == model.score_keys_json(keys) == core.score_json(q)
    assert core.workers() == model.workers()
