"""The apply path: a record is applied whole or not at all."""

from kvwire.consumer.apply import Applier
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
