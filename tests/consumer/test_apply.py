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


def test_reads_from_another_thread_during_an_apply_call_see_whole_records():
    """An apply call runs Python code (here a record whose ``value`` is a Python property; in
    production, whatever the interpreter runs there), and the interpreter may switch to an HTTP
    thread then. That thread's reads (block sizes, names, trust, scores) must neither raise nor
    see half a record: the index is the one before the record or after it."""
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
            time.sleep(0.05)  # the reader runs while the apply call is under way
            return codec.encode(EventBatch(W, 1, 1, 0, (stored([2], range(16, 32), 16, parent_block_hash=1),)))

    assert a.apply_records("t", 0, [Rec()]) == 1
    readers[0].join(10)
    assert "error" not in got, got.get("error")
    sizes, untrusted, workers, scores = got["reads"]
    assert sizes == [16] and untrusted == set()
    held = workers[("w", 0)].blocks["GPU"]
    assert held in (1, 2) and scores[0].matched_tokens == 16 * held
    assert a.score(range(32))[0].matched_tokens == 32


def test_scores_from_other_threads_run_beside_apply_calls():
    """Apply calls release the GIL while they apply (in quanta): scores and reads from other
    threads run meanwhile, never raise, and each sees whole records. Here every record stores
    one more block of one chain, so each reader's scores of the whole chain are whole blocks
    and never go back, and the last one, after the calls, is the whole chain."""
    import threading

    n = 3000
    tokens = list(range(16 * n))
    values = [codec.encode(EventBatch(W, 1, 0, 0, (stored([1], tokens[:16], 16),), reset=True))]
    for i in range(1, n):
        ev = stored([i + 1], tokens[16 * i : 16 * (i + 1)], 16, parent_block_hash=i)
        values.append(codec.encode(EventBatch(W, 1, i, 0, (ev,))))

    class Rec:
        def __init__(self, offset: int, value: bytes) -> None:
            self.offset, self.key, self.value, self.timestamp = offset, b"w/0", value, 0

    recs = [Rec(i, v) for i, v in enumerate(values)]
    a = Applier()
    done = threading.Event()
    seen: list[list[int]] = [[], []]
    errors: list[BaseException] = []

    def read(mine: list[int]) -> None:
        try:
            while not done.is_set():
                s = a.score(tokens)
                a.index.block_sizes()
                a.ranks.untrusted_workers()
                mine.append(s[0].matched_tokens if s else 0)
        except BaseException as e:  # the failure this test is about
            errors.append(e)

    readers = [threading.Thread(target=read, args=(mine,)) for mine in seen]
    for t in readers:
        t.start()
    i = 0
    while i < n:
        i = a.apply_records("t", 0, recs, i, budget_us=300)
    done.set()
    for t in readers:
        t.join(10)
    assert errors == []
    for mine in seen:
        assert len(mine) > 2 and all(m % 16 == 0 for m in mine) and mine == sorted(mine)
    assert any(0 < m < 16 * n for mine in seen for m in mine), "no score ran beside the apply calls"
    assert a.score(tokens)[0].matched_tokens == 16 * n


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


def test_growth_built_beside_the_scores_leaves_the_index_an_inline_growth_would():
    """An apply call does not grow a table inside the quantum that fills it: it builds the
    grown shards between quanta under the read lock and the next quantum puts them in, unless
    another write came between (here an ``apply_batch`` and a removal between calls), which makes
    them stale and refused. Whatever the interleaving, the index holds what the same records
    applied one by one (every growth inline, the Python path) hold, and scores the same."""
    from typing import NamedTuple

    from kvwire.schemas.events import BlockRemoved

    class Rec(NamedTuple):
        offset: int
        key: bytes | None
        value: bytes
        timestamp: int

    # 48 workers x 24 records x 32 blocks: ~37k holder-blocks, ~9 a shard of S, so shards grow
    # several times each, most of them past the sizes whose growth may be deferred.
    workers = [WorkerId(f"w{i}") for i in range(48)]
    values, prompts = [], []
    for i, w in enumerate(workers):
        toks = [i * 1_000_000 + t for t in range(24 * 32 * 16)]
        prompts.append(toks[: 40 * 16])
        for r in range(24):
            ehs = [i << 20 | (r * 32 + b + 1) for b in range(32)]
            ev = stored(ehs, toks[r * 512 : (r + 1) * 512], 16, ehs[0] - 1 if r else None)
            values.append((w, codec.encode(EventBatch(w, 1, r, 0, (ev,), reset=r == 0))))
    order = [values[r + 24 * i] for r in range(24) for i in range(48)]  # interleaved, as a fleet publishes
    recs = [Rec(k, b"k", v, 0) for k, (_, v) in enumerate(order)]
    other = WorkerId("other")
    writes = [
        EventBatch(other, 1, 0, 0, (stored([7, 8], range(32), 16),), reset=True),
        EventBatch(other, 1, 1, 0, (BlockRemoved((8,)),)),
    ]

    sliced, inline = Applier(), Applier()
    i, w = 0, 0
    while i < len(recs):
        i = sliced.apply_records("t", 0, recs, i, budget_us=150)
        if w < len(writes) and i > len(recs) // (3 - w):
            sliced.apply_batch(writes[w])
            w += 1
    for r in recs:
        inline.apply_record("t", 0, r.offset, r.key, r.value, 0)
        if r.offset in (len(recs) // 3, len(recs) // 2):
            inline.apply_batch(writes[0 if r.offset == len(recs) // 3 else 1])
    assert sliced.index.holder_blocks() == inline.index.holder_blocks()
    assert len(sliced.index) == len(inline.index) == 48 * 24 * 32 + 1
    assert sliced.index.digest() == inline.index.digest()
    for q in prompts[::7] + [list(range(32))]:
        assert sliced.score_json(q) == inline.score_json(q)


def test_score_json_escapes_worker_ids_and_media_as_the_oracle_does():
    """The core writes a worker id or a medium name as it is when nothing in it needs escaping,
    and escapes it otherwise: either way byte for byte the JSON the oracle's encoder writes."""
    import json
    from typing import NamedTuple

    from tests.oracle import Oracle

    class Rec(NamedTuple):
        offset: int
        key: bytes | None
        value: bytes
        timestamp: int

    names = ["plain-1", 'quo"te', "back\\slash", "new\nline\ttab", "ctl\x01\x1f", "utf-8 é 世界"]
    values = []
    for i, name in enumerate(names):
        w = WorkerId(name, dp_rank=-i)
        medium = names[(i + 1) % len(names)]
        ev = stored([i + 1, i + 101], range(32), 16, medium=medium)
        values.append(codec.encode(EventBatch(w, 1, 0, 0, (ev,), reset=True)))
    recs = [Rec(k, b"k", v, 0) for k, v in enumerate(values)]
    core, model = Applier(), Applier(index=Oracle())
    for a in (core, model):
        assert a.apply_records("t", 0, recs, budget_us=1 << 40) == len(recs)
    got = core.score_json(list(range(32)))
    assert got == model.score_json(list(range(32)))
    entries = json.loads(got)
    assert sorted(e["instance_id"] for e in entries) == sorted(names)
    assert {e["dp_rank"] for e in entries} == {-i for i in range(len(names))}


def test_a_partition_remembers_each_rank_it_carried_once():
    """``workers_by_partition`` (what a revoked partition's workers are dropped by) lists each
    (instance, dp rank) whose records were fenced, once, however many records and ranks a call
    carries; a malformed record's rank is not listed (it was never fenced)."""
    from types import SimpleNamespace

    ranks = [WorkerId(f"w{i % 40:03d}", i % 3) for i in range(300)]
    seqs: dict = {}
    recs = []
    for off, w in enumerate(ranks):
        seq = seqs.get(w, 0)
        seqs[w] = seq + 1
        ev = stored([off + 1], range(off * 16, off * 16 + 16), 16)
        recs.append(
            SimpleNamespace(
                offset=off, key=None, timestamp=0, value=codec.encode(EventBatch(w, 1, seq, 0, (ev,), reset=seq == 0))
            )
        )
    lone = WorkerId("malformed-only", 0)
    bad = stored([9, 10], range(20), 16)  # 20 tokens cannot be 2 blocks of 16
    value = codec.encode(EventBatch(lone, 1, 0, 0, (bad,), reset=True))
    recs.append(SimpleNamespace(offset=len(recs), key=None, timestamp=0, value=value))
    a = Applier()
    assert a.apply_records("t", 5, recs, 0, budget_us=1 << 40) == len(recs)
    assert a.workers_by_partition[5] == {(w.instance_id, w.dp_rank) for w in ranks}
    assert (lone.instance_id, lone.dp_rank) not in a.workers_by_partition[5]
    assert len(a.take_dead_letters()) == 1
