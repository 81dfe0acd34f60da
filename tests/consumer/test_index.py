"""PrefixIndex against the brute-force oracle (tests/oracle.py), plus the cases
worth naming: TP aggregation, refcounts, orphans, media, block sizes,
engine-hash mode, clear/drop."""

from __future__ import annotations

import random

import msgspec
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from oracle import Oracle

from kvwire import _core
from kvwire.consumer.index import MalformedEvent, PrefixIndex
from kvwire.consumer.keys import prompt_keys
from kvwire.schemas.events import AllBlocksCleared, BlockRemoved, BlockStored, WorkerId, stored


@pytest.fixture(autouse=True, params=[None, 1, 3], ids=["holder_sets_default", "every_key_a_set", "sets_from_3"])
def holder_sets(request, monkeypatch):
    """Every test runs with the core's default holder-set threshold (only keys with many
    holders get one), with every key a holder set, and with sets formed mid-life."""
    monkeypatch.setattr(PrefixIndex, "holder_sets_at", request.param)


A = WorkerId("a", 0)
B0, B1 = WorkerId("b", 0, 0, 2), WorkerId("b", 0, 1, 2)
C = WorkerId("c", 1)
TOKS = list(range(1000, 1064))


def eh(seq, upto, bs):
    """A vLLM-like engine hash: chained over the prefix, unrelated to our keys."""
    return hash((tuple(seq[:upto]), bs, "engine")) & 0xFFFFFFFFFFFF


def ev(seq, bs, a, b, medium="GPU", parent=True, **kw):
    hs = [eh(seq, (i + 1) * bs, bs) for i in range(a, b)]
    p = eh(seq, a * bs, bs) if (a and parent) else None
    return stored(hs, seq[a * bs : b * bs], bs, parent_block_hash=p, medium=medium, **kw)


def rm(seq, bs, a, b, medium="GPU"):
    return BlockRemoved(tuple(eh(seq, (i + 1) * bs, bs) for i in range(a, b)), medium=medium)


def both(*ops):
    ix, orc = PrefixIndex(), Oracle()
    for name, *args in ops:
        getattr(ix, name)(*args)
        getattr(orc, name)(*args)
    return ix, orc


def same(ix, orc, queries=()):
    assert ix.holder_blocks() == orc.holder_blocks()
    assert len(ix) == len(orc)
    assert ix.workers() == orc.workers()
    for q in queries:
        assert ix.score(q) == orc.score(q)


def test_scores_prefix_and_best_first():
    ix, orc = both(("store", A, ev(TOKS, 16, 0, 4)), ("store", C, ev(TOKS, 16, 0, 2)))
    s = ix.score(TOKS)
    assert [(x.instance_id, x.matched_tokens, x.by_medium, x.score) for x in s] == [
        ("a", 64, {"GPU": 64}, 64.0),
        ("c", 32, {"GPU": 32}, 32.0),
    ]
    assert ix.score(TOKS[:40])[0].matched_tokens == 32  # partial block ignored
    assert ix.score([1] + TOKS[1:]) == []
    assert [x.instance_id for x in ix.score(TOKS, workers=[("c", 1)])] == ["c"]
    same(ix, orc, [TOKS, TOKS[:20]])


def test_tp_counts_only_blocks_all_ranks_hold_whatever_the_batches():
    ix, orc = both(("store", B0, ev(TOKS, 16, 0, 4)), ("store", B1, ev(TOKS, 16, 0, 1)))
    assert ix.score(TOKS)[0].matched_tokens == 16
    for e in (ev(TOKS, 16, 1, 2), ev(TOKS, 16, 2, 4)):
        ix.store(B1, e)
        orc.store(B1, e)
    assert ix.score(TOKS)[0].matched_tokens == 64 and len(ix) == 4
    ix.remove(B0, rm(TOKS, 16, 3, 4))
    orc.remove(B0, rm(TOKS, 16, 3, 4))
    assert ix.score(TOKS)[0].matched_tokens == 48
    same(ix, orc, [TOKS])


def test_duplicate_stores_are_refcounted_and_unknown_removes_counted():
    ix, _orc = both(
        ("store", A, ev(TOKS, 16, 0, 2)), ("store", A, ev(TOKS, 16, 0, 2)), ("remove", A, rm(TOKS, 16, 0, 2))
    )
    assert ix.score(TOKS)[0].matched_tokens == 32
    ix.remove(A, rm(TOKS, 16, 0, 2))
    ix.remove(A, rm(TOKS, 16, 0, 2))
    assert ix.score(TOKS) == [] and len(ix) == 0
    st = ix.workers()[("a", 0)]
    assert (st.duplicate_stores, st.unknown_removes) == (2, 2)


def test_unknown_parent_is_an_orphan_never_a_false_match_and_stays_removable():
    ix, orc = both(("store", A, ev(TOKS, 16, 2, 4)))
    assert len(ix) == 2 and ix.workers()[("a", 0)].orphans == 2
    assert ix.score(TOKS) == []  # blocks 2..3 alone must not claim the prefix
    ix.store(A, ev(TOKS, 16, 0, 2))
    orc.store(A, ev(TOKS, 16, 0, 2))
    assert ix.score(TOKS)[0].matched_tokens == 32  # orphans are not re-keyed
    same(ix, orc, [TOKS])
    ix.remove(A, rm(TOKS, 16, 2, 4))
    assert ix.workers()[("a", 0)].orphans == 0 and len(ix) == 2
    # A child of an orphan is an orphan too; a parent on another medium or rank resolves.
    ix.store(A, ev(TOKS, 16, 3, 4))
    ix.store(A, ev(TOKS, 16, 2, 3, medium="CPU"))
    assert ix.workers()[("a", 0)].orphans == 1
    ix.store(A, ev(TOKS, 16, 3, 4, medium="CPU"))
    assert ix.workers()[("a", 0)].orphans == 1


def test_a_child_of_a_parent_just_removed_is_chained_not_orphaned():
    """LMCache evicts a chunk's parent just before it stores the chunk: one record carries
    BlockRemoved(parent), BlockStored(child, parent). The parent's engine hash still names
    the same prefix, so the child gets the chained key, and once the parent is stored again
    the whole chain scores (as LMCache's lookup credits it)."""
    ix, orc = both(("store", A, ev(TOKS, 16, 0, 2)))
    for x in (ix, orc):
        x.apply_batch(A, [rm(TOKS, 16, 1, 2), ev(TOKS, 16, 2, 4)])
    assert ix.workers()[("a", 0)].orphans == 0
    assert ix.score(TOKS)[0].matched_tokens == 16  # block 1 is gone: the chain stops there
    same(ix, orc, [TOKS])
    for x in (ix, orc):
        x.store(A, ev(TOKS, 16, 1, 2))
    assert ix.score(TOKS)[0].matched_tokens == 64
    same(ix, orc, [TOKS])
    # Removed by one TP rank's record, the child stored by the other's: the same worker's memo.
    for r in (B0, B1):
        ix.store(r, ev(TOKS, 16, 0, 2))
        orc.store(r, ev(TOKS, 16, 0, 2))
    for op in (("remove", B0, rm(TOKS, 16, 1, 2)), ("remove", B1, rm(TOKS, 16, 1, 2))):
        getattr(ix, op[0])(*op[1:])
        getattr(orc, op[0])(*op[1:])
    for r in (B1, B0):
        ix.store(r, ev(TOKS, 16, 2, 4))
        orc.store(r, ev(TOKS, 16, 2, 4))
        ix.store(r, ev(TOKS, 16, 1, 2))
        orc.store(r, ev(TOKS, 16, 1, 2))
    assert ix.workers()[("b", 0)].orphans == 0 and ix.score(TOKS, workers=[("b", 0)])[0].matched_tokens == 64
    same(ix, orc, [TOKS])


def test_the_memo_of_removed_parents_is_bounded_and_goes_with_its_worker():
    """The worker remembers its last PARENT_MEMO removed hashes, oldest out first; a parent
    older than that, or of a dropped worker, leaves an orphan again (an under-credit)."""
    n = _core.PARENT_MEMO + 1
    seq = list(range(n + 1))
    ix, orc = both(("store", A, ev(seq, 1, 0, n)), ("remove", A, rm(seq, 1, 0, n)))
    for x in (ix, orc):
        x.store(A, ev(seq, 1, 1, 2))  # its parent, block 0, was pushed out by block n - 1
        x.store(A, ev(seq, 1, n, n + 1))  # its parent, block n - 1, is remembered
    assert ix.workers()[("a", 0)].orphans == 1
    same(ix, orc, [seq])
    for x in (ix, orc):
        x.remove(A, rm(seq, 1, 0, n))
        x.drop_worker(("a", 0))
        x.store(A, ev(seq, 1, n, n + 1))
    assert ix.workers()[("a", 0)].orphans == 1
    same(ix, orc, [seq])


def test_parent_on_another_rank_of_the_worker_resolves():
    ix, orc = both(
        ("store", B0, ev(TOKS, 16, 0, 2)), ("store", B1, ev(TOKS, 16, 0, 1)), ("store", B1, ev(TOKS, 16, 1, 2))
    )
    assert ix.workers()[("b", 0)].orphans == 0 and ix.score(TOKS)[0].matched_tokens == 32
    same(ix, orc, [TOKS])


def test_media_weights_and_by_medium():
    ix, orc = both(
        ("store", A, ev(TOKS, 16, 0, 2)),
        ("store", A, ev(TOKS, 16, 0, 4, medium="cpu")),
        ("store", C, ev(TOKS, 16, 0, 3, medium="DISK")),
    )
    s = ix.score(TOKS)
    a = next(x for x in s if x.instance_id == "a")
    assert a.matched_tokens == 64 and a.by_medium == {"GPU": 32, "CPU": 64}
    assert a.score == pytest.approx(32 * 1.0 + 32 * 0.8)
    c = next(x for x in s if x.instance_id == "c")
    assert c.score == pytest.approx(48 * 0.5)  # unknown medium: default weight
    assert ix.score(TOKS, weights={"DISK": 2.0})[0].instance_id == "c"
    same(ix, orc, [TOKS])


def test_a_score_is_tokens_times_weight_on_every_path():
    """One float per prefix whichever path scores it: 6 blocks of 16 at CPU's 0.8 are 96 x 0.8
    (76.80000000000001), not six 0.8s summed (76.8). The one-medium walk, the several-media
    walk and the oracle gave the two different floats, and ordering or equality drifted."""
    t = list(range(2000, 2096))
    cpu_only = both(("store", A, ev(t, 16, 0, 6, medium="CPU")))
    assert cpu_only[0].score(t)[0].score == 96 * 0.8
    # Several media in the index: the general walk. A holds 2 blocks on GPU and 6 on CPU.
    mixed = both(
        ("store", A, ev(t, 16, 0, 2)),
        ("store", A, ev(t, 16, 0, 6, medium="CPU")),
        ("store", C, ev(t, 16, 0, 6, medium="CPU")),
    )
    by = {x.instance_id: x.score for x in mixed[0].score(t)}
    assert by == {"a": 32 * 1.0 + 64 * 0.8, "c": 96 * 0.8}
    for ix, orc in (cpu_only, mixed):
        same(ix, orc, [t, t[:80]])


def test_equal_scores_come_in_name_order_whatever_order_workers_joined():
    """The last tie-break, (instance_id, dp_rank), is kept as workers join (by bisection into
    the names so far); joined in a random order, equal scores still come out sorted."""
    t = list(range(3000, 3032))
    names = [WorkerId(f"w{i % 37:02d}-{i // 37}", i % 3) for i in range(200)]
    random.Random(7).shuffle(names)
    ix, orc = PrefixIndex(), Oracle()
    for w in names:
        for x in (ix, orc):
            x.store(w, ev(t, 16, 0, 2))
    got = [(s.instance_id, s.dp_rank) for s in ix.score(t)]
    assert got == sorted((w.instance_id, w.dp_rank) for w in names)
    assert [(s.instance_id, s.dp_rank) for s in ix.score(t, top_k=5)] == got[:5]
    same(ix, orc, [t])


def test_block_sizes_side_by_side_each_worker_gets_its_best():
    long = TOKS * 8  # 512 tokens
    ix, orc = both(
        ("store", A, ev(long, 16, 0, 4)),
        ("store", A, ev(long, 256, 0, 2, medium="CPU")),
        ("store", C, ev(long, 16, 0, 8)),
    )
    s = {x.instance_id: x for x in ix.score(long)}
    assert s["a"].matched_tokens == 512 and s["a"].by_medium == {"GPU": 64, "CPU": 512}
    assert s["c"].matched_tokens == 128
    assert ix.score(long, block_size=16)[0].instance_id == "c"
    assert ix.block_sizes() == [16, 256]
    same(ix, orc, [long, long[:300]])


def test_a_query_of_size_zero_is_every_size_the_index_holds():
    """The core expands size 0 under the score's own lock: the answer is the best over the
    sizes asked one by one, for token ids and for keys, and a size learned later counts."""
    long = TOKS * 8
    ix, _ = both(("store", A, ev(long, 16, 0, 4)), ("store", C, ev(long, 256, 0, 2, medium="CPU")))
    tok = np.asarray(long, np.uint32)

    def answer(qs):
        workers, matched, *_ = ix.core.score(qs, None, None, None, None)
        return sorted(zip(workers.tolist(), matched.tolist(), strict=True))

    def best(*answers):
        out: dict[int, int] = {}
        for a in answers:
            for w, m in a:
                out[w] = max(out.get(w, 0), m)
        return sorted(out.items())

    per_size = [answer([_core.ScoreQuery.Tokens(tok, bs, None, None)]) for bs in (16, 256)]
    assert answer([_core.ScoreQuery.Tokens(tok, 0, None, None)]) == best(*per_size) != []
    keys = prompt_keys(long, 16)
    per_scale = [answer([_core.ScoreQuery.Keys(keys, bs)]) for bs in (16, 256)]
    assert answer([_core.ScoreQuery.Keys(keys, 0)]) == best(*per_scale) != []
    # A third size, held by a third worker, learned after the queries above were made.
    ix.store(WorkerId("d", 0), ev(long, 32, 0, 1))
    assert len(answer([_core.ScoreQuery.Tokens(tok, 0, None, None)])) == 3
    assert ix.block_sizes() == [16, 32, 256]


def test_engine_hash_mode():
    e = stored([11, 12, 13], [], 0, parent_block_hash=10, medium="CPU")
    ix, orc = both(("store", A, e))
    assert ix.score(TOKS) == []
    assert [(x.matched_tokens, x.by_medium) for x in ix.score_engine_hashes([11, 12, 99], block_size=16)] == [
        (32, {"CPU": 32})
    ]
    assert ix.score_engine_hashes([99, 11]) == []
    assert ix.score_engine_hashes([11, 12, 13]) == orc.score_engine_hashes([11, 12, 13])
    # A token-mode child of an engine-mode parent is an orphan.
    ix.store(A, stored([14], TOKS[:16], 16, parent_block_hash=13, medium="CPU"))
    assert ix.workers()[("a", 0)].orphans == 1


def test_clear_and_drop():
    ix, orc = both(
        ("store", A, ev(TOKS, 16, 0, 4)),
        ("store", B0, ev(TOKS, 16, 0, 4)),
        ("store", B1, ev(TOKS, 16, 0, 4)),
        ("remove", A, BlockRemoved((12345,))),
    )
    for op in (("clear", A), ("drop_rank", B1)):
        getattr(ix, op[0])(*op[1:])
        getattr(orc, op[0])(*op[1:])
        same(ix, orc, [TOKS])
    assert ix.workers()[("a", 0)].unknown_removes == 1  # counters survive a clear
    assert len(ix) == 0 and ix.workers()[("b", 0)].ranks == 1
    ix.drop_worker(("b", 0))
    assert ("b", 0) not in ix.workers()
    ix.store(B0, ev(TOKS, 16, 0, 4))
    assert len(ix) == 0  # tp 2: one rank is not enough
    ix.store(B1, ev(TOKS, 16, 0, 4))
    assert len(ix) == 4


def test_malformed_event_is_a_typed_error_and_applies_nothing():
    ix = PrefixIndex()
    with pytest.raises(MalformedEvent):
        ix.store(A, stored([1, 2], TOKS[:17], 16))
    assert len(ix) == 0 and ix.workers() == {} and ix.block_sizes() == []


def test_tables_grow_and_shrink_with_many_blocks():
    rng = random.Random(3)
    ix, orc = PrefixIndex(), Oracle()
    seqs = [[rng.randrange(50_000) for _ in range(1024)] for _ in range(6)]
    ranks = [WorkerId(f"w{i}", 0) for i in range(4)] + [B0, B1]
    for i, s in enumerate(seqs):
        for r in ranks[i % 3 :]:
            e = ev(s, 16, 0, 64)
            ix.store(r, e)
            orc.store(r, e)
    same(ix, orc, [s[:500] for s in seqs])
    big = ix.nbytes()
    for r in ranks:
        ix.clear(r)
        orc.clear(r)
    same(ix, orc, [seqs[0]])
    # Cleared tables are retired at once (nothing is credited) and their slots swept by the
    # applies after: each purges a bounded number, then the memory is back.
    assert len(ix) == 0 and ix.unswept()[0] > 0
    while ix.unswept()[0]:
        ix.apply_batch(ranks[0], ())
        same(ix, orc, [seqs[0]])
    assert ix.nbytes() < big and len(ix) == 0


def test_tp_size_change_recounts():
    ix, orc = both(("store", B0, ev(TOKS, 16, 0, 4)))
    assert len(ix) == 0
    solo = WorkerId("b", 0, 0, 1)
    ix.store(solo, ev(TOKS, 16, 0, 1))
    orc.store(solo, ev(TOKS, 16, 0, 1))
    assert len(ix) == 4
    same(ix, orc, [TOKS])


def test_query_keys_match_event_keys():
    ix = PrefixIndex()
    ix.store(A, ev(TOKS, 16, 0, 4, lora_name="ad", extra_keys=[("ad",)] * 4))
    assert ix.score(TOKS) == []
    assert ix.score(TOKS, lora_name="ad")[0].matched_tokens == 64
    assert ix.score_keys(prompt_keys(TOKS, 16, lora_name="ad"), 16) == ix.score(TOKS, lora_name="ad")


# ---------------------------------------------------------------- property test

RANKS = [A, B0, B1, C, WorkerId("d", 0, 0, 3), WorkerId("d", 0, 1, 3), WorkerId("d", 0, 2, 3)]
MEDIA = ["GPU", "cpu", "CPU", "STORAGE", "DISK", None]
BS = [4, 8]


@st.composite
def scenario(draw):
    seqs = draw(st.lists(st.lists(st.integers(0, 2), min_size=32, max_size=32), min_size=2, max_size=3))
    n = draw(st.integers(1, 40))
    ops = []
    for _ in range(n):
        kind = draw(
            st.sampled_from(["store"] * 6 + ["remove"] * 3 + ["junk", "engine", "clear", "drop_rank", "drop_worker"])
        )
        r = draw(st.sampled_from(RANKS))
        s = draw(st.integers(0, len(seqs) - 1))
        bs = draw(st.sampled_from(BS))
        nb = 32 // bs
        a = draw(st.integers(0, nb - 1))
        b = draw(st.integers(a + 1, nb))
        m = draw(st.sampled_from(MEDIA))
        if kind == "store":
            parent = draw(st.sampled_from([True, True, True, False]))
            g = draw(st.sampled_from([None, None, 1]))
            ops.append(("store", r, ev(seqs[s], bs, a, b, m, parent, group_idx=g)))
        elif kind == "remove":
            ops.append(("remove", r, rm(seqs[s], bs, a, b, m)))
        elif kind == "junk":
            ops.append(("remove", r, BlockRemoved((draw(st.integers(0, 3)),), medium=m)))
        elif kind == "engine":
            hs = draw(st.lists(st.integers(0, 5), min_size=1, max_size=4))
            ops.append(("store", r, stored(hs, [], 0, parent_block_hash=draw(st.sampled_from([None, 0, 1])), medium=m)))
        elif kind == "drop_worker":
            ops.append(("drop_worker", r.worker))
        else:
            ops.append((kind, r))
    queries = []
    for _ in range(draw(st.integers(1, 4))):
        s = seqs[draw(st.integers(0, len(seqs) - 1))]
        q = s[: draw(st.integers(0, 32))]
        if draw(st.booleans()):
            q = q + draw(st.lists(st.integers(0, 2), max_size=8))
        queries.append(q)
    weights = draw(st.sampled_from([None, {"CPU": 1.5}, {"GPU": 0.1, "DISK": 3.0}]))
    subset = draw(st.sampled_from([None, [("a", 0), ("b", 0)], [("d", 0)]]))
    return ops, queries, weights, subset


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(scenario())
def test_index_equals_oracle(sc):
    ops, queries, weights, subset = sc
    ix, orc = PrefixIndex(), Oracle()
    for i, (name, *args) in enumerate(ops):
        getattr(ix, name)(*args)
        getattr(orc, name)(*args)
        if i % 8 == 7:
            assert ix.holder_blocks() == orc.holder_blocks()
    same(ix, orc)
    for q in queries:
        for bs in (None, 4, 8):
            # The one-medium walk weighs a run as blocks x weight, the spec as a sum of per-block
            # weights: equal up to float rounding (0.8 * 3 vs 0.8 + 0.8 + 0.8), so scores are
            # compared to 1e-9 while order, runs and media must match exactly.
            want = _rounded(orc.score(q, block_size=bs, weights=weights, workers=subset))
            assert _rounded(ix.score(q, block_size=bs, weights=weights, workers=subset)) == want
            for k in (1, 2):
                assert _rounded(ix.score(q, block_size=bs, weights=weights, workers=subset, top_k=k)) == want[:k]
    hs = [0, 1, 2, 3]
    assert ix.score_engine_hashes(hs, weights=weights) == orc.score_engine_hashes(hs, weights=weights)


# ---------------------------------------------------------------- apply_batch


@st.composite
def batches(draw):
    """Records of one rank: several events mixing tables (media, groups), stores
    whose parent sits in the same record, another table or rank, removals,
    clears, engine-hash mode and malformed stores (which end the record)."""
    seqs = draw(st.lists(st.lists(st.integers(0, 2), min_size=32, max_size=32), min_size=2, max_size=3))
    recs = []
    for _ in range(draw(st.integers(1, 12))):
        r = draw(st.sampled_from(RANKS))
        evs = []
        for _ in range(draw(st.integers(1, 6))):
            kind = draw(st.sampled_from(["store"] * 5 + ["remove"] * 2 + ["clear", "engine", "junk", "bad"]))
            s = seqs[draw(st.integers(0, len(seqs) - 1))]
            bs = draw(st.sampled_from(BS))
            nb = 32 // bs
            a = draw(st.integers(0, nb - 1))
            b = draw(st.integers(a + 1, nb))
            m = draw(st.sampled_from(["GPU", "GPU", "CPU", None]))
            if kind == "store":
                extra = [("x",)] * (b - a) if draw(st.integers(0, 5)) == 0 else None
                evs.append(
                    ev(
                        s,
                        bs,
                        a,
                        b,
                        m,
                        draw(st.booleans()),
                        group_idx=draw(st.sampled_from([None, None, 1])),
                        extra_keys=extra,
                    )
                )
            elif kind == "remove":
                evs.append(rm(s, bs, a, b, m))
            elif kind == "clear":
                evs.append(AllBlocksCleared())
            elif kind == "engine":
                evs.append(stored(draw(st.lists(st.integers(0, 5), min_size=1, max_size=3)), [], 0, medium=m))
            elif kind == "junk":
                evs.append(BlockRemoved((draw(st.integers(0, 3)),), medium=m))
            else:
                evs.append(stored([7, 8], s[:5], 4, medium=m))
        recs.append((r, evs))
    return seqs, recs


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(batches())
def test_apply_batch_equals_events_one_by_one(sc):
    seqs, recs = sc
    ix, orc = PrefixIndex(), Oracle()
    for r, evs in recs:
        want = 0
        try:
            got = ix.apply_batch(r, evs)
        except MalformedEvent:
            got = None
        for e in evs:
            if isinstance(e, AllBlocksCleared):
                orc.clear(r)
                continue
            try:
                getattr(orc, "store" if isinstance(e, BlockStored) else "remove")(r, e)
            except MalformedEvent:
                want = None
                break
            want += len(e.block_hashes)
        assert got == want
        assert ix.holder_blocks() == orc.holder_blocks()
    same(ix, orc)
    for s in seqs:
        for bs in (None, 4, 8):
            assert ix.score(s, block_size=bs) == orc.score(s, block_size=bs)


def _rounded(scores):
    return [msgspec.structs.replace(s, score=round(s.score, 9)) for s in scores]


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(scenario())
def test_index_equals_oracle_on_one_medium(sc):
    """The same scenarios with every event on one medium: the score takes its one-medium walk."""
    ops, queries, weights, subset = sc
    one = []
    for name, *args in ops:
        if name in ("store", "remove"):
            args = [args[0], msgspec.structs.replace(args[1], medium="GPU")]
        one.append((name, *args))
    ix, orc = PrefixIndex(), Oracle()
    for name, *args in one:
        getattr(ix, name)(*args)
        getattr(orc, name)(*args)
    same(ix, orc)
    assert ix.core.media() in ([], ["GPU"])
    for q in queries:
        for bs in (None, 4, 8):
            # The one-medium walk weighs a run as blocks x weight, the spec as a sum of per-block
            # weights: equal up to float rounding (0.8 * 3 vs 0.8 + 0.8 + 0.8), so scores are
            # compared to 1e-9 while order, runs and media must match exactly.
            assert _rounded(ix.score(q, block_size=bs, weights=weights, workers=subset)) == _rounded(
                orc.score(q, block_size=bs, weights=weights, workers=subset)
            )
            for k in (1, 2):
                assert (
                    ix.score(q, block_size=bs, workers=subset, top_k=k)
                    == orc.score(q, block_size=bs, workers=subset)[:k]
                )


def test_score_arrays_are_typed_arrays_each_score_owns():
    """The core makes ``ScoreArrays``' six arrays itself: their dtypes and shapes are the
    documented ones, they agree with the oracle's answer, and one score's arrays are not
    another's (each owns the vectors its walk filled)."""
    ix, orc = both(
        ("store", A, ev(TOKS, 16, 0, 4)),
        ("store", C, ev(TOKS, 16, 0, 2)),
        ("store", C, ev(TOKS, 16, 0, 2, medium="CPU")),
    )
    r = ix.score_arrays(TOKS)
    dtypes = [a.dtype for a in (r.worker, r.matched_tokens, r.score, r.by_off, r.by_medium, r.by_tokens)]
    assert dtypes == [np.dtype(t) for t in (np.uint32, np.int64, np.float64, np.uint32, np.uint32, np.int64)]
    assert len(r.by_off) == len(r.worker) + 1 and r.by_off[-1] == len(r.by_medium) == len(r.by_tokens)
    want = [(s.instance_id, s.matched_tokens) for s in orc.score(TOKS)]
    assert [(ix.worker_key(int(w))[0], int(m)) for w, m in zip(r.worker, r.matched_tokens, strict=True)] == want
    media = ix.media()
    c = [ix.worker_key(int(w))[0] for w in r.worker].index("c")
    held = {
        media[m]: int(t)
        for m, t in zip(
            r.by_medium[r.by_off[c] : r.by_off[c + 1]], r.by_tokens[r.by_off[c] : r.by_off[c + 1]], strict=True
        )
    }
    assert held == {"GPU": 32, "CPU": 32}
    again = ix.score_arrays(TOKS)
    r.worker[:] = 0
    assert again.worker.tolist() != r.worker.tolist()


def test_a_top_k_reads_its_hits_media_from_their_workers():
    """A few hits among many worker-media take their per-medium runs from the hits' own lists
    (walk.rs, ``FEW_HITS_PER_WM``): the same runs, in the same order, as the oracle's."""
    media = ["GPU", "CPU", "STORAGE"] + [f"disk{i}" for i in range(8)]
    ops = []
    other = [t + 7 for t in TOKS]
    for i, m in enumerate(media):
        # Every third medium of A's holds other blocks: a worker-medium that matches nothing.
        ops.append(("store", A, ev(other if i % 3 == 2 else TOKS, 16, 0, 4 - i % 2, medium=m)))
        ops.append(("store", C, ev(TOKS, 16, 0, 1 + i % 2, medium=m)))
    ix, orc = both(*ops)
    for k in (1, 2):
        assert _rounded(ix.score(TOKS, top_k=k)) == _rounded(orc.score(TOKS))[:k]
    best = orc.score(TOKS)[0]
    assert best.instance_id == "a" and 0 < len(best.by_medium) < len(media)
