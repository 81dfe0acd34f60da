"""The coordinator-topic converter on records built by LMCache's own wire models
(``CacheEventsRequest``/``CacheEventBatch``/``ObjectKey``, serialised as its Kafka sink does)."""

from __future__ import annotations

import pytest
from lmcache_mp import require

from kvwire.producer.lmcache_topic import (
    SOURCE,
    LmcacheTopicConverter,
    TopicRecordError,
    engine_id,
    unknown_parent,
)
from kvwire.schemas.events import BlockRemoved, BlockStored

pytestmark = pytest.mark.lmcache
CHUNK = 4


@pytest.fixture(autouse=True)
def _lmcache():
    require("lmcache.v1.mp_coordinator.schemas")
    require("blake3")


def hashes(tokens):
    from lmcache.v1.multiprocess.token_hasher import TokenHasher

    return TokenHasher(chunk_size=CHUNK, hash_algorithm="blake3").compute_chunk_hashes(list(tokens))


def record(seq, kind="store", entries=(), inc=7, tier="l1", backend="dram", shared=False, inst="lmc") -> bytes:
    """One record exactly as ``KafkaCacheEventSink.publish`` writes it."""
    from lmcache.v1.distributed.api import Tier
    from lmcache.v1.mp_coordinator.api import CacheEventBatch, CacheEventType
    from lmcache.v1.mp_coordinator.schemas import CacheEventsRequest

    b = CacheEventBatch(
        instance_id=inst,
        incarnation=inc,
        seq=seq,
        event_type=CacheEventType(kind),
        tier=Tier(tier),
        backend=backend if kind != "access" else "",
        entries=list(entries),
        shared=shared,
        ts=1.25,
    )
    return CacheEventsRequest(batches=[b]).model_dump_json().encode()


def entry(h, tokens=None, offset=-1, rank=0, world=1, salt="", model="m", group=0):
    from lmcache.v1.distributed.api import ObjectKey
    from lmcache.v1.mp_coordinator.api import CacheEventEntry

    key = ObjectKey(h, model, ObjectKey.ComputeKVRank(world, rank, world, rank), group, salt)
    return CacheEventEntry(
        key=key.to_encoded_object_key(), size_bytes=64, token_ids=list(tokens or []), token_offset=offset
    )


def chunk_entries(tokens, start=0, **kw):
    hs = hashes(tokens)
    return [entry(hs[i], tokens[i * CHUNK : (i + 1) * CHUNK], i * CHUNK, **kw) for i in range(start // CHUNK, len(hs))]


def stores(batches):
    return [e for b in batches for e in b.events if isinstance(e, BlockStored)]


def test_store_delete_and_heartbeats_keep_every_ranks_sequence():
    c = LmcacheTopicConverter()
    toks = list(range(10, 22))
    hs = hashes(toks)
    ents = [e for r in (0, 1) for e in chunk_entries(toks, rank=r, world=2)]
    out = c.convert_record(b"lmc", record(1, entries=ents))
    assert [(b.worker.tp_rank, b.worker.tp_size, b.epoch, b.seq, b.reset, b.gap, b.source) for b in out] == [
        (0, 2, 7, 1, True, 0, SOURCE),
        (1, 2, 7, 1, True, 0, SOURCE),
    ]
    ev = out[0].events
    # remove-then-store per chunk; chained by proven parents; medium CPU for L1 DRAM
    assert [type(e) for e in ev] == [BlockRemoved, BlockStored] * 3
    st = [e for e in ev if isinstance(e, BlockStored)]
    assert [e.block_hashes for e in st] == [(engine_id(h, "", "m"),) for h in hs]
    assert [e.parent_block_hash for e in st] == [None, engine_id(hs[0], "", "m"), engine_id(hs[1], "", "m")]
    assert [e.token_ids.tolist() for e in st] == [toks[0:4], toks[4:8], toks[8:12]]
    assert {e.medium for e in ev} == {"CPU"} and {e.block_size for e in st} == {CHUNK}
    out = c.convert_record(b"lmc", record(2, "delete", [entry(hs[2], rank=1, world=2)], tier="l2", backend="fs"))
    assert [b.events for b in out] == [(), (BlockRemoved((engine_id(hs[2], "", "m"),), "l2:fs", 0),)]
    assert [b.reset for b in out] == [False, False]
    out = c.convert_record(b"lmc", record(3, "access", [entry(hs[0])]))
    assert [(b.seq, b.events) for b in out] == [(3, ()), (3, ())]


def test_fencing_stale_duplicate_and_restart():
    c = LmcacheTopicConverter()
    toks = list(range(4))
    e = chunk_entries(toks)
    assert len(c.convert_record(b"lmc", record(1, entries=e, inc=5))) == 1
    assert c.convert_record(b"lmc", record(1, entries=e, inc=5)) == []  # redelivered
    assert c.stats.duplicates == 1
    (b,) = c.convert_record(b"lmc", record(1, entries=e, inc=9))  # restarted
    assert (b.epoch, b.seq, b.reset) == (9, 1, True)
    assert c.convert_record(b"lmc", record(2, entries=e, inc=5)) == []  # a zombie of the old process
    assert c.stats.stale == 1
    # joined mid-incarnation: no reset, so the index distrusts the worker until it restarts
    (b,) = LmcacheTopicConverter().convert_record(b"lmc", record(4, entries=e, inc=9))
    assert not b.reset


def test_losses_are_reported_as_gaps():
    c = LmcacheTopicConverter()
    e = chunk_entries(list(range(4)))
    c.convert_record(b"lmc", record(1, entries=e))
    with pytest.raises(TopicRecordError):
        c.convert_record(b"lmc", b"{not json")
    (b,) = c.convert_record(b"lmc", record(2, entries=e))
    assert b.gap == 1  # the bad record's loss, on the instance's next record
    bad = record(3, entries=e).replace(b'"store"', b'"teleport"')
    (b,) = c.convert_record(b"lmc", bad)
    assert b.gap == 1 and b.events == ()
    (b,) = c.convert_record(b"lmc", record(4, entries=[entry(hashes(range(4))[0], list(range(4)), 0, world=2)]))
    assert b.gap == 1  # a second parallel layout under one instance cannot be converted
    (b,) = c.convert_record(b"lmc", record(5, entries=e))
    assert b.gap == 0


def test_continuations_chain_only_when_the_hash_proves_it():
    c = LmcacheTopicConverter()
    a = list(range(100, 112))
    b = a[:4] + list(range(200, 208))
    c.convert_record(b"lmc", record(1, entries=chunk_entries(b[:8])))
    # one batch: A whole, then B's third chunk alone; A's second chunk also ends at offset 8
    (out,) = c.convert_record(b"lmc", record(2, entries=chunk_entries(a) + chunk_entries(b, start=8)))
    st = stores([out])
    hb = hashes(b)
    assert st[-1].parent_block_hash == engine_id(hb[1], "", "m")
    # a chunk whose parent was never seen: an orphan, never chained under a guess
    (out,) = c.convert_record(b"lmc", record(3, entries=chunk_entries(list(range(300, 312)), start=8)))
    (s,) = stores([out])
    assert s.parent_block_hash == unknown_parent(hashes(range(300, 312))[2])
    assert c.stats.orphaned == 1
    # without a hasher nothing past the first chunk is chained
    (out,) = LmcacheTopicConverter(hasher=None).convert_record(b"lmc", record(1, entries=chunk_entries(a)))
    assert [s.parent_block_hash is None for s in stores([out])] == [True, False, False]
    assert all(s.parent_block_hash == unknown_parent(h) for s, h in zip(stores([out])[1:], hashes(a)[1:], strict=True))


def test_salt_model_shared_and_tokenless_entries():
    toks = list(range(8))
    hs = hashes(toks)
    c = LmcacheTopicConverter(model="m")
    (out,) = c.convert_record(b"lmc", record(1, entries=chunk_entries(toks, salt="t1")))
    s0, s1 = stores([out])
    assert s0.extra_keys == (("t1",),) and s1.extra_keys is None
    assert s0.block_hashes == (engine_id(hs[0], "t1", "m"),) != (engine_id(hs[0], "", "m"),)
    assert s1.parent_block_hash == engine_id(hs[0], "t1", "m")
    (out,) = c.convert_record(b"lmc", record(2, entries=chunk_entries(toks, model="other")))
    assert out.events == () and c.stats.other_model_skipped == 2
    (out,) = c.convert_record(b"lmc", record(3, entries=chunk_entries(toks), tier="l2", backend="s3", shared=True))
    assert out.events == () and c.stats.shared_skipped == 1
    (out,) = c.convert_record(b"lmc", record(4, entries=[entry(hs[1])]))
    (s,) = stores([out])
    assert s.block_size == 0 and len(s.token_ids) == 0 and s.parent_block_hash is None  # engine-hash mode


def test_candidate_parents_are_bounded_and_the_oldest_go_first():
    c = LmcacheTopicConverter(max_candidates=2)
    seqs_ = [list(range(k, k + 8)) for k in (100, 200, 300)]
    for i, s in enumerate(seqs_):
        c.convert_record(b"lmc", record(i + 1, entries=chunk_entries(s[:4])))
    (out,) = c.convert_record(b"lmc", record(4, entries=chunk_entries(seqs_[0], start=4)))
    assert stores([out])[0].parent_block_hash == unknown_parent(hashes(seqs_[0])[1])  # forgotten: an orphan
    (out,) = c.convert_record(b"lmc", record(5, entries=chunk_entries(seqs_[2], start=4)))
    assert stores([out])[0].parent_block_hash == engine_id(hashes(seqs_[2])[0], "", "m")
    assert sum(len(v) for v in c.instances["lmc"].by_end.values()) == len(c.instances["lmc"].lru) == 2
