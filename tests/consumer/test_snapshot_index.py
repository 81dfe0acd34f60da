"""PrefixIndex.export_workers / import_workers / digest: a snapshot of some
workers, loaded anywhere, is the same index (blocks, stats, memos of removed
parents, so the log's tail applies alike), and the digest sees only the set of
holder-blocks."""

from __future__ import annotations

import random

import msgspec
import pytest
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvwire import _core
from kvwire.consumer.index import _EXPORT_HEAD, _EXPORT_MAGIC, PrefixIndex
from kvwire.schemas.events import BlockRemoved, WorkerId, stored


@pytest.fixture(autouse=True, params=[None, 1], ids=["holder_sets_default", "every_key_a_set"])
def holder_sets(request, monkeypatch):
    monkeypatch.setattr(PrefixIndex, "holder_sets_at", request.param)


RANKS = [WorkerId("a", 0), WorkerId("b", 0, 0, 2), WorkerId("b", 0, 1, 2), WorkerId("c", 1), WorkerId("d", 0, 0, 1)]
MEDIA = ["GPU", "cpu", "STORAGE", "nvme"]


def random_ops(rng: random.Random, n: int):
    """Stores with parents (known, unknown: orphans), duplicates, engine-hash
    mode, several media and groups, removals (known and unknown), clears."""
    seqs = [[rng.randrange(50_000) for _ in range(16 * 8)] for _ in range(6)]
    ops = []
    for _ in range(n):
        r = rng.choice(RANKS)
        s = rng.randrange(len(seqs))
        bs = rng.choice([16, 16, 8, 0])
        med, grp = rng.choice(MEDIA), rng.choice([None, None, 1])
        a = rng.randrange(0, 6)
        b = rng.randrange(a + 1, 8)
        hs = [s * 1000 + (bs or 3) * 100 + i for i in range(a, b)]
        x = rng.random()
        if x < 0.6:
            toks = seqs[s][a * (bs or 1) : b * (bs or 1)] if bs else []
            parent = (
                s * 1000 + (bs or 3) * 100 + a - 1
                if a and rng.random() < 0.8
                else (rng.randrange(1 << 40) if a else None)
            )
            ops.append(("store", r, stored(hs, toks, bs, parent_block_hash=parent, medium=med, group_idx=grp)))
        elif x < 0.95:
            ops.append(("remove", r, BlockRemoved(tuple(hs + [rng.randrange(1 << 63)]), medium=med, group_idx=grp)))
        else:
            ops.append(("clear", r))
    return ops


def build(ops, capacity=0):
    ix = PrefixIndex(capacity=capacity)
    for name, *args in ops:
        getattr(ix, name)(*args)
    return ix


def reference_digest(ix: PrefixIndex, workers=None) -> str:
    total, n = 0, 0
    for (worker, medium), keys in ix.holder_blocks().items():
        if workers is not None and worker not in workers:
            continue
        seed = xxhash.xxh3_64_intdigest(msgspec.msgpack.encode([worker[0], worker[1], medium])) | 1
        for k in keys:
            total += xxhash.xxh3_64_intdigest(k.to_bytes(8, "little"), seed=seed)
            n += 1
    return f"{total % 2**64:016x}{n:016x}"


def per_worker(ix: PrefixIndex, workers):
    hb = {k: v for k, v in ix.holder_blocks().items() if k[0] in workers}
    stats = {w: s for w, s in ix.workers().items() if w in workers}
    return hb, stats


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 2**32), st.integers(1, 250))
def test_export_import_is_the_same_index(seed, n):
    rng = random.Random(seed)
    ops = random_ops(rng, n)
    src = build(ops)
    moved = {("b", 0), ("c", 1)} if rng.random() < 0.5 else {w.worker for w in RANKS}
    # The target already holds other workers: import must add to it, not replace it.
    others = [op for op in random_ops(random.Random(seed + 1), 40) if op[1].worker not in moved]
    dst = build(others)
    before = per_worker(dst, {w.worker for w in RANKS} - moved)
    dst.import_workers(src.export_workers(moved))
    assert per_worker(dst, moved) == per_worker(src, moved)
    assert per_worker(dst, {w.worker for w in RANKS} - moved) == before
    assert dst.digest(moved) == src.digest(moved) == reference_digest(src, moved)
    assert dst.digest() == reference_digest(dst)
    assert set(src.block_sizes()) <= set(dst.block_sizes())
    # What comes after the snapshot (the log's tail) applies the same way to both, and to the
    # snapshot imported anywhere else: a snapshot carries each worker's memo of removed parents,
    # so a child of a parent removed before it is chained (or orphaned) alike.
    fresh = PrefixIndex()
    fresh.import_workers(src.export_workers(moved))
    tail = [op for op in random_ops(random.Random(seed + 2), 60) if op[1].worker in moved]
    for name, *args in tail:
        for ix in (src, dst, fresh):
            getattr(ix, name)(*args)
    assert per_worker(dst, moved) == per_worker(src, moved) == per_worker(fresh, moved)
    assert dst.digest(moved) == src.digest(moved) == fresh.digest()
    for q in ([int(x) for x in range(64)],):
        assert [s for s in dst.score(q) if (s.instance_id, s.dp_rank) in moved] == [
            s for s in src.score(q) if (s.instance_id, s.dp_rank) in moved
        ]
        assert [s for s in src.score(q) if (s.instance_id, s.dp_rank) in moved] == fresh.score(q)


def as_version_1(blob: bytes) -> bytes:
    """The blob as the index wrote it before memos (format version 1): no memo arrays, no
    ``memos`` header key."""
    _, _, flags, hlen = _EXPORT_HEAD.unpack_from(blob)
    hs = _EXPORT_HEAD.size
    head = msgspec.msgpack.decode(blob[hs : hs + hlen])
    del head["memos"]
    n = sum(int(t[6]) for t in head["tables"])
    off = hs + hlen + (-(hs + hlen) % 8)
    arrays = blob[off : off + 18 * n]
    h1 = msgspec.msgpack.encode(head)
    pad = -(hs + len(h1)) % 8
    return _EXPORT_HEAD.pack(_EXPORT_MAGIC, 1, flags, len(h1)) + h1 + b"\0" * pad + arrays


def test_the_memo_line_survives_the_round_trip():
    """The memo's order decides what it pushes out next, so it must come back as it was: a
    line rebuilt in any other order forgets another parent first."""
    a = WorkerId("a", 0)
    n = _core.PARENT_MEMO
    toks = list(range(16 * (n + 2)))

    def child(eh, parent):  # hash h covers blocks up to h (1-based): its child covers block h + 1
        return stored([eh], toks[16 * parent : 16 * (parent + 1)], 16, parent_block_hash=parent)

    src = PrefixIndex()
    src.store(a, stored(range(1, n + 2), toks[: 16 * (n + 1)], 16))
    # Newest hash removed first: the line's oldest is n, not 1.
    src.remove(a, BlockRemoved(tuple(range(n, 0, -1))))
    blob = src.export_workers([a.worker])
    dst, old = PrefixIndex(), PrefixIndex()
    dst.import_workers(blob)
    old.import_workers(as_version_1(blob))
    # One more removed hash pushes the oldest (n) out: its child is an orphan, n - 1's is not.
    tail = [BlockRemoved((n + 1,)), child(n + 10, n), child(n + 11, n - 1)]
    for ix in (src, dst, old):
        ix.apply_batch(a, tail)
    assert per_worker(dst, {a.worker}) == per_worker(src, {a.worker})
    assert src.workers()[a.worker].orphans == 1
    assert dst.digest() == src.digest()
    q = toks[: 16 * n]
    assert dst.score(q) == src.score(q)
    # A version 1 blob (no memos) still loads, with empty memos: both children orphaned, the
    # same entries, never more credit.
    assert old.workers()[a.worker].orphans == 2
    assert old.workers()[a.worker].entries == src.workers()[a.worker].entries


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 2**32), st.integers(1, 250))
def test_a_version_1_blob_loads_with_empty_memos(seed, n):
    """An export written before memos restores the same tables and holder-blocks; fed the log's
    tail, it may orphan a child the source chains: the same entries, no fewer orphans, never
    more credit (a safe under-credit, so the blob is loaded, not refused)."""
    rng = random.Random(seed)
    src = build(random_ops(rng, n))
    moved = {w.worker for w in RANKS}
    dst = PrefixIndex()
    dst.import_workers(as_version_1(src.export_workers(moved)))
    assert per_worker(dst, moved) == per_worker(src, moved)
    assert dst.digest() == src.digest()
    for name, *args in random_ops(random.Random(seed + 2), 60):
        for ix in (src, dst):
            getattr(ix, name)(*args)
    kept, restored = src.workers(), dst.workers()
    assert kept.keys() == restored.keys()
    for w, st_ in kept.items():
        assert restored[w].entries == st_.entries and restored[w].orphans >= st_.orphans
    q = [int(x) for x in range(64)]
    credit = {(s.instance_id, s.dp_rank): s.matched_tokens for s in src.score(q)}
    for s in dst.score(q):
        assert s.matched_tokens <= credit.get((s.instance_id, s.dp_rank), 0)


def test_digest_ignores_history_capacity_and_order():
    ops = random_ops(random.Random(7), 300)
    a = build(ops)
    b = build(ops, capacity=1 << 16)
    assert a.nbytes() != b.nbytes()  # different table capacities
    assert a.digest() == b.digest() == reference_digest(a)
    # Same holder-blocks reached another way: a fresh index importing them.
    c = PrefixIndex()
    c.import_workers(a.export_workers({w.worker for w in RANKS}))
    assert c.digest() == a.digest()
    # Store order within and across workers does not matter.
    stores = [op for op in ops if op[0] == "store" and op[2].parent_block_hash is None]
    fwd, rev = build(stores), build(list(reversed(stores)))
    assert fwd.holder_blocks() == rev.holder_blocks() and fwd.digest() == rev.digest()
    # Any change to the held set changes it.
    w = next(iter(a.holder_blocks()))
    d = build(ops)
    d.drop_worker(w[0])
    assert d.digest() != a.digest()
    assert PrefixIndex().digest() == f"{0:016x}{0:016x}"


def test_tp_worker_counts_only_blocks_all_ranks_hold_after_import():
    b0, b1 = WorkerId("b", 0, 0, 2), WorkerId("b", 0, 1, 2)
    ix = PrefixIndex()
    ix.store(b0, stored([1, 2, 3], range(48), 16))
    ix.store(b1, stored([1, 2], range(32), 16))
    dst = PrefixIndex()
    dst.import_workers(ix.export_workers([("b", 0)]))
    assert len(dst) == len(ix) == 2
    dst.store(b1, stored([3], range(32, 48), 16, parent_block_hash=2))
    assert len(dst) == 3 and dst.score(list(range(48)))[0].matched_tokens == 48


@pytest.mark.parametrize("cut", [0, 5, 12, 40, -1])
def test_damaged_blob_raises_value_error(cut):
    ix = build(random_ops(random.Random(3), 100))
    blob = ix.export_workers({w.worker for w in RANKS})
    with pytest.raises(ValueError):
        PrefixIndex().import_workers(blob[:cut])


def test_duplicate_entries_are_refused():
    ix = PrefixIndex()
    ix.store(RANKS[0], stored([1, 2], range(32), 16))
    blob = ix.export_workers([("a", 0)])
    dst = PrefixIndex()
    dst.import_workers(blob)
    with pytest.raises(ValueError):
        dst.import_workers(blob)  # same workers again: not a blob export wrote for this index
