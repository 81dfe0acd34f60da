"""Fencing rules: epochs, sequence dedup, gaps, stale incarnations, expiry."""

from hypothesis import given, settings
from hypothesis import strategies as st

from kvwire.consumer.rank_state import RankTable, Verdict
from kvwire.schemas.events import EventBatch, WorkerId

W0 = WorkerId("a", 0, 0, 1)


def b(epoch, seq, reset=False, gap=0, worker=W0, ts=0):
    return EventBatch(worker, epoch, seq, ts, (), reset=reset, gap=gap)


def test_first_record_with_reset_is_trusted():
    t = RankTable()
    assert t.admit(b(7, 0, reset=True)) is Verdict.RESET
    assert t.worker_trusted(("a", 0))


def test_first_record_without_reset_is_untrusted_until_next_reset():
    t = RankTable()
    assert t.admit(b(7, 5)) is Verdict.RESET
    assert not t.worker_trusted(("a", 0))
    assert "mid-stream" in t.ranks[W0.rank].untrusted_reason
    assert t.admit(b(9, 0, reset=True)) is Verdict.RESET
    assert t.worker_trusted(("a", 0))


def test_duplicates_are_skipped_and_holes_distrust():
    t = RankTable()
    t.admit(b(1, 0, reset=True))
    assert t.admit(b(1, 1)) is Verdict.APPLY
    assert t.admit(b(1, 1)) is Verdict.DUPLICATE
    assert t.admit(b(1, 0)) is Verdict.DUPLICATE
    assert t.worker_trusted(("a", 0))
    assert t.admit(b(1, 4)) is Verdict.APPLY
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
    assert t.admit(b(-5, 0, reset=True)) is Verdict.RESET  # restart: epochs are random, not ordered
    assert t.admit(b(100, 2)) is Verdict.STALE_EPOCH  # the zombie flushes late
    assert t.admit(b(-5, 1)) is Verdict.APPLY
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
            assert seq > applied.get(epoch, -1) or v is Verdict.RESET
            applied[epoch] = seq
