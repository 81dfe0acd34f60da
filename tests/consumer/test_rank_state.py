"""Fencing rules: epochs, sequence dedup, gaps, stale incarnations, expiry."""

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from oracle import FenceOracle

from kvwire.consumer.apply import Applier
from kvwire.consumer.index import IndexOverflow
from kvwire.consumer.rank_state import RankTable, Verdict
from kvwire.schemas import codec
from kvwire.schemas.events import AllBlocksCleared, BlockRemoved, EventBatch, WorkerId, stored

W0 = WorkerId("a", 0, 0, 1)


def b(epoch, seq, reset=False, gap=0, worker=W0, ts=0):
    return EventBatch(worker, epoch, seq, ts, (), reset=reset, gap=gap)


def test_first_record_with_reset_is_trusted():
    t = RankTable()
    assert t.admit(b(7, 0, reset=True)) == Verdict.RESET
    assert t.worker_trusted(("a", 0))


def test_first_record_without_reset_is_untrusted_until_next_reset():
    t = RankTable()
    assert t.admit(b(7, 5)) == Verdict.RESET
    assert not t.worker_trusted(("a", 0))
    assert "mid-stream" in t.ranks[W0.rank].untrusted_reason
    assert t.admit(b(9, 0, reset=True)) == Verdict.RESET
    assert t.worker_trusted(("a", 0))


def test_duplicates_are_skipped_and_holes_distrust():
    t = RankTable()
    t.admit(b(1, 0, reset=True))
    assert t.admit(b(1, 1)) == Verdict.APPLY
    assert t.admit(b(1, 1)) == Verdict.DUPLICATE
    assert t.admit(b(1, 0)) == Verdict.DUPLICATE
    assert t.worker_trusted(("a", 0))
    assert t.admit(b(1, 4)) == Verdict.APPLY
    assert not t.worker_trusted(("a", 0))
    assert "2..3 missing" in t.ranks[W0.rank].untrusted_reason


def test_producer_gap_distrusts_until_reset():
    t = RankTable()
    t.admit(b(1, 0, reset=True))
    t.admit(b(1, 1, gap=3))
    assert not t.worker_trusted(("a", 0))
    assert t.ranks[W0.rank].gaps == 3
    t.admit(b(1, 2))
    assert not t.worker_trusted(("a", 0))
    t.admit(b(2, 0, reset=True))
    assert t.worker_trusted(("a", 0))


def test_late_records_of_a_retired_epoch_are_ignored():
    t = RankTable()
    t.admit(b(100, 0, reset=True))
    t.admit(b(100, 1))
    assert t.admit(b(-5, 0, reset=True)) == Verdict.RESET  # restart: epochs are random, not ordered
    assert t.admit(b(100, 2)) == Verdict.STALE_EPOCH  # the zombie flushes late
    assert t.admit(b(-5, 1)) == Verdict.APPLY
    assert t.ranks[W0.rank].epoch == -5


def test_tp_worker_needs_every_rank_trusted():
    t = RankTable()
    r0, r1 = WorkerId("m", 0, 0, 2), WorkerId("m", 0, 1, 2)
    t.admit(b(1, 0, reset=True, worker=r0))
    assert not t.worker_trusted(("m", 0)), "rank 1 not seen yet"
    t.admit(b(2, 0, reset=True, worker=r1))
    assert t.worker_trusted(("m", 0))
    t.admit(b(2, 1, gap=1, worker=r1))
    assert t.untrusted_workers() == {("m", 0)}


def test_expiry_by_last_seen():
    t = RankTable()
    t.admit(b(1, 0, reset=True, ts=1_000))
    t.admit(b(1, 0, reset=True, worker=WorkerId("z"), ts=50_000))
    assert t.expired(now_us=60_000, timeout_us=20_000) == [W0.rank]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2), st.integers(0, 6), st.booleans()), max_size=40))
def test_applied_sequences_are_strictly_increasing_within_an_epoch(stream):
    """Whatever the log holds, the index never applies a (epoch, seq) twice
    or goes back within an epoch."""
    t = RankTable()
    applied = {}
    for epoch, seq, reset in stream:
        v = t.admit(b(epoch, seq, reset=reset))
        if v in (Verdict.APPLY, Verdict.RESET):
            assert seq > applied.get(epoch, -1) or v == Verdict.RESET
            applied[epoch] = seq


# ---------------------------------------------------------------- trust through the pipeline


class Rec(msgspec.Struct):
    offset: int
    key: bytes | None
    value: bytes | None
    timestamp: int


A = WorkerId("a", 0)
B0, B1 = WorkerId("b", 0, 0, 2), WorkerId("b", 0, 1, 2)
TOKS = list(range(100, 164))


def _feed(batches, applier=None):
    """Encode, then apply through the one-call-per-poll core path, in log order."""
    a = applier if applier is not None else Applier()
    recs = [Rec(i, b"k", codec.encode(bt), 0) for i, bt in enumerate(batches)]
    i = 0
    while i < len(recs):
        i = a.apply_records("t", 0, recs, i)
    return a


def test_a_clear_makes_a_rank_trusted_again_and_what_follows_applies():
    s = stored([1, 2], TOKS[:32], 16)
    a = _feed(
        [
            EventBatch(A, 1, 0, 0, (s,), reset=True),
            EventBatch(A, 1, 1, 0, (), gap=3),  # lost batches: untrusted
            EventBatch(A, 1, 5, 0, (s,)),  # and a hole
        ]
    )
    assert not a.ranks.worker_trusted(("a", 0)) and a.score(TOKS) == []
    _feed([EventBatch(A, 1, 6, 0, (AllBlocksCleared(), stored([7, 8], TOKS[:32], 16)), gap=2)], a)
    # The gap of that record happened before its clear: the state after it is known.
    assert a.ranks.worker_trusted(("a", 0))
    assert [(x.instance_id, x.matched_tokens) for x in a.score(TOKS)] == [("a", 32)]
    assert a.index.workers()[("a", 0)].entries == 2


def test_a_clear_on_one_tp_rank_trusts_only_that_rank():
    s = stored([1], TOKS[:16], 16)
    a = _feed(
        [
            EventBatch(B0, 1, 0, 0, (s,), reset=True),
            EventBatch(B1, 2, 3, 0, (s,)),  # rank 1 joined mid-stream
        ]
    )
    assert not a.ranks.worker_trusted(("b", 0))
    _feed([EventBatch(B0, 1, 1, 0, (AllBlocksCleared(),))], a)
    assert not a.ranks.worker_trusted(("b", 0)), "rank 1 is still unknown"
    _feed([EventBatch(B1, 2, 4, 0, (AllBlocksCleared(), s))], a)
    assert a.ranks.worker_trusted(("b", 0))


def test_an_overflowing_record_is_dead_lettered_whole_and_untrusts_its_rank():
    ceiling = 0x3FFF
    fill = stored([9] * ceiling, list(range(ceiling)), 1)
    a = _feed([EventBatch(A, 1, 0, 0, (fill, stored([1, 2], TOKS[:32], 16)), reset=True)])
    assert a.ranks.worker_trusted(("a", 0)) and not a.take_dead_letters()
    before = (a.index.holder_blocks(), a.index.workers(), a.index.digest())
    over = EventBatch(
        A, 1, 1, 0, (BlockRemoved((1,)), stored([3], TOKS[32:48], 16, parent_block_hash=2), stored([9], [0], 1))
    )
    _feed([over], a)
    (dead,) = a.take_dead_letters()
    assert dead.offset == 0 and "IndexOverflow" in dead.error
    assert (a.index.holder_blocks(), a.index.workers(), a.index.digest()) == before, "nothing of it applied"
    assert a.ranks.ranks[A.rank].last_seq == 1 and not a.ranks.worker_trusted(("a", 0))
    assert a.score(TOKS) == []
    # The decoded-record entry point (a record the fast decoder declines) behaves the same.
    with pytest.raises(IndexOverflow):
        a.apply_batch(EventBatch(A, 1, 2, 0, (stored([9], [0], 1),)))
    assert a.index.holder_blocks() == before[0]


MEDIA = ["GPU", "CPU"]


@st.composite
def streams(draw):
    """Records of three ranks with restarts, zombies, duplicates, holes, gaps,
    clears (alone or amid stores), resets with gaps and removals."""
    ranks = [A, B0, B1]
    epochs = {r.rank: [draw(st.integers(0, 3))] for r in ranks}
    seqs = {r.rank: 0 for r in ranks}
    out = []
    for _ in range(draw(st.integers(1, 30))):
        r = draw(st.sampled_from(ranks))
        kind = draw(st.sampled_from(["next"] * 6 + ["restart", "zombie", "dup", "hole", "gap", "reset"]))
        ep = epochs[r.rank]
        if kind == "restart":
            ep.append(draw(st.integers(0, 5)))
            seqs[r.rank] = 0
        seq = seqs[r.rank]
        epoch = ep[-1]
        reset = kind in ("restart", "reset") or (seq == 0 and draw(st.booleans()))
        if kind == "zombie" and len(ep) > 1:
            epoch, seq, reset = ep[-2], seq + 3, False
        elif kind == "dup":
            seq = max(0, seq - 1)
        elif kind == "hole":
            seq += 2
        gap = draw(st.integers(1, 3)) if kind == "gap" or (reset and draw(st.integers(0, 4)) == 0) else 0
        evs = []
        for _ in range(draw(st.integers(0, 3))):
            e = draw(st.sampled_from(["store", "store", "remove", "clear"]))
            a_, b_ = sorted(draw(st.lists(st.integers(0, 4), min_size=2, max_size=2)))
            b_ = max(b_, a_ + 1)
            m = draw(st.sampled_from(MEDIA))
            hs = [1000 + i for i in range(a_, b_)]
            if e == "store":
                evs.append(
                    stored(hs, TOKS[a_ * 16 : b_ * 16], 16, parent_block_hash=999 + a_ if a_ else None, medium=m)
                )
            elif e == "remove":
                evs.append(BlockRemoved(tuple(hs), medium=m))
            else:
                evs.append(AllBlocksCleared())
        if kind != "zombie" or len(ep) > 1:
            seqs[r.rank] = max(seqs[r.rank], seq + 1) if kind != "zombie" else seqs[r.rank]
        out.append(EventBatch(r, epoch, seq, 0, tuple(evs), reset=reset, gap=gap))
    return out


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(streams())
def test_pipeline_trust_and_blocks_equal_the_fence_oracle(batches):
    a = _feed(batches)
    model = FenceOracle()
    for bt in batches:
        model.feed(bt)
    assert a.ranks.untrusted_workers() == model.untrusted_workers()
    assert a.index.holder_blocks() == model.index.holder_blocks()
    for q in (TOKS, TOKS[:40]):
        want = [s for s in model.index.score(q) if (s.instance_id, s.dp_rank) not in model.untrusted_workers()]
        assert a.score(q) == want
    assert not a.take_dead_letters()
