"""Hybrid models: a worker whose KV cache has several groups (vLLM 0.33's ``group_idx`` with
``kv_cache_spec_kind`` / ``kv_cache_spec_sliding_window``) is scored group by group.

The oracle (tests/oracle.py) searches every candidate prefix length; the last test holds the
index to vLLM's own hybrid ``KVCacheManager`` (full attention + sliding window) on CPU.
"""

from __future__ import annotations

import importlib
import random

import msgspec
import pytest
from ci_env import unavailable
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from oracle import Oracle

from kvwire.consumer.apply import Applier
from kvwire.consumer.index import PrefixIndex
from kvwire.schemas import codec
from kvwire.schemas.events import AllBlocksCleared, BlockRemoved, EventBatch, WorkerId, stored


@pytest.fixture(autouse=True, params=[None, 1], ids=["holder_sets_default", "every_key_a_set"])
def holder_sets(request, monkeypatch):
    """The grouped walk reads a shared key's holder set where one exists, its slots otherwise:
    every test runs with the core's default threshold and with every key a set."""
    monkeypatch.setattr(PrefixIndex, "holder_sets_at", request.param)


BS = 4
A = WorkerId("a", 0)
B0, B1 = WorkerId("b", 0, 0, 2), WorkerId("b", 0, 1, 2)
C = WorkerId("c", 0)
SEQ = list(range(500, 540))  # 10 blocks of BS
FULL = {"kv_cache_spec_kind": "full_attention"}
MAMBA = {"kv_cache_spec_kind": "mamba"}


def sw(window: int) -> dict:
    return {"kv_cache_spec_kind": "sliding_window", "kv_cache_spec_sliding_window": window}


def eh(seq, upto):
    """An engine hash chained over the prefix (vLLM's are group-independent too)."""
    return hash((tuple(seq[:upto]), "engine")) & 0xFFFFFFFFFFFF


def put(seq, a, b, group, spec, medium="GPU", bs=BS):
    hs = [eh(seq, (i + 1) * bs) for i in range(a, b)]
    parent = eh(seq, a * bs) if a else None
    return stored(hs, seq[a * bs : b * bs], bs, parent_block_hash=parent, medium=medium, group_idx=group, **spec)


def drop(seq, blocks, group, medium="GPU", bs=BS):
    return BlockRemoved(tuple(eh(seq, (i + 1) * bs) for i in blocks), medium=medium, group_idx=group)


def both(*batches):
    ix, orc = PrefixIndex(), Oracle()
    for rank, evs in batches:
        ix.apply_batch(rank, evs)
        orc.apply_batch(rank, evs)
    return ix, orc


def credit(ix, orc, q=SEQ):
    got = ix.score(q)
    assert got == orc.score(q)
    return {(s.instance_id, s.dp_rank): s.matched_tokens for s in got}


def test_a_sliding_group_never_extends_the_full_groups_prefix():
    # Full attention holds 4 blocks, the sliding window (2 blocks) all 10: the union of the
    # groups would claim 10 blocks; vLLM can use 4.
    ix, orc = both((A, [put(SEQ, 0, 4, 0, FULL), put(SEQ, 0, 10, 1, sw(2 * BS + 1))]))
    assert credit(ix, orc) == {("a", 0): 4 * BS}


def test_a_sliding_group_needs_only_the_blocks_its_window_reaches():
    window = 2 * BS + 1  # cdiv(window - 1, BS) = 2 blocks before the prefix's end
    evs = [put(SEQ, 0, 10, 0, FULL), put(SEQ, 0, 10, 1, sw(window)), drop(SEQ, range(6), 1)]
    ix, orc = both((A, evs))
    assert credit(ix, orc) == {("a", 0): 10 * BS}  # blocks 0-5 left the window: not needed
    ix.apply_batch(A, [drop(SEQ, [9], 1)])
    orc.apply_batch(A, [drop(SEQ, [9], 1)])
    assert credit(ix, orc) == {("a", 0): 9 * BS}  # ends where blocks 7 and 8 are the window
    ix.apply_batch(A, [drop(SEQ, [7], 1)])
    orc.apply_batch(A, [drop(SEQ, [7], 1)])
    assert credit(ix, orc) == {}  # no two adjacent window blocks left before any end


def test_a_block_removed_from_one_group_is_not_covered_by_another():
    ix, orc = both((A, [put(SEQ, 0, 10, 0, FULL), put(SEQ, 0, 10, 1, FULL), drop(SEQ, [3], 0)]))
    assert credit(ix, orc) == {("a", 0): 3 * BS}


def test_a_mamba_group_needs_the_state_block_at_the_end():
    evs = [put(SEQ, 0, 8, 0, FULL), put(SEQ, 0, 8, 1, MAMBA), drop(SEQ, [0, 1, 2, 3, 5, 6], 1)]
    ix, orc = both((A, evs))
    assert credit(ix, orc) == {("a", 0): 8 * BS}  # mamba holds block 7
    ix.apply_batch(A, [drop(SEQ, [7], 1)])
    orc.apply_batch(A, [drop(SEQ, [7], 1)])
    assert credit(ix, orc) == {("a", 0): 5 * BS}  # the state after block 4


def test_a_pure_sliding_window_model_is_credited_from_its_tail():
    # One sliding-window group: the prefix's first blocks are long gone, the window is held.
    ix, orc = both((A, [put(SEQ, 0, 8, 0, sw(2 * BS + 1)), drop(SEQ, range(6), 0)]))
    assert credit(ix, orc) == {("a", 0): 8 * BS}


def test_a_group_of_unknown_kind_is_read_as_full_attention():
    ix, orc = both((A, [put(SEQ, 0, 10, 0, FULL), put(SEQ, 0, 10, 1, {}), drop(SEQ, range(6), 1)]))
    assert credit(ix, orc) == {}


def test_groups_of_different_block_sizes_meet_at_a_common_multiple():
    # Full attention in blocks of 2*BS, the window group in blocks of BS (vLLM's hybrid page
    # sizes can differ): a usable prefix is a multiple of both.
    seq = SEQ
    full = put(seq, 0, 4, 0, FULL, bs=2 * BS)  # 8 BS-blocks worth
    swa = put(seq, 0, 10, 1, sw(2 * BS + 1))
    ix, orc = both((A, [full, swa, drop(seq, [7], 1)]))
    # L <= 8*BS (full); the window needs blocks L-2, L-1 of size BS: L=8*BS needs 6,7 (7 gone);
    # L=6*BS (a multiple of 2*BS) needs 4,5: held.
    assert credit(ix, orc) == {("a", 0): 6 * BS}


def test_tp_ranks_must_all_hold_each_groups_blocks():
    evs0 = [put(SEQ, 0, 6, 0, FULL), put(SEQ, 0, 6, 1, sw(BS + 1))]
    evs1 = [put(SEQ, 0, 6, 0, FULL), put(SEQ, 4, 5, 1, sw(BS + 1))]  # rank 1's window holds block 4 only
    ix, orc = both((B0, evs0), (B1, evs1))
    assert credit(ix, orc) == {("b", 0): 5 * BS}


def test_a_sparse_store_is_kept_for_removals_but_never_credited():
    """vLLM's ``cache_full_blocks`` leaves a sparse group's null or masked blocks out of
    ``block_hashes`` but not out of ``token_ids``: which blocks the hashes are is unknown."""
    full = put(SEQ, 0, 10, 0, FULL)
    hs = (eh(SEQ, 8 * BS), eh(SEQ, 10 * BS))
    sparse = stored(hs, SEQ[0 : 10 * BS], BS, group_idx=1, **sw(2 * BS + 1))
    ix, orc = both((A, [full, sparse]))
    assert ix.workers()[("a", 0)].orphans == orc.workers()[("a", 0)].orphans == 2
    assert credit(ix, orc) == {}
    rm = BlockRemoved(hs, medium="GPU", group_idx=1)
    ix.apply_batch(A, [rm])
    orc.apply_batch(A, [rm])
    assert ix.workers()[("a", 0)].orphans == 0
    assert ix.workers()[("a", 0)].unknown_removes == 0


def test_kinds_survive_the_avro_record_and_the_core_decoder():
    """The same events through a Kafka record's bytes (the core's decoder) and through Python."""
    evs = [put(SEQ, 0, 10, 0, FULL), put(SEQ, 0, 10, 1, sw(2 * BS + 1)), drop(SEQ, range(7), 1)]
    a = Applier()
    a.apply_record("t", 0, 0, b"a/0", codec.encode(EventBatch(A, 1, 0, 0, tuple(evs), reset=True)), 0)
    orc = Oracle()
    orc.apply_batch(A, evs)
    assert a.score(SEQ) == orc.score(SEQ)
    assert a.score(SEQ)[0].matched_tokens == 10 * BS
    a.apply_record("t", 0, 1, b"a/0", codec.encode(EventBatch(A, 1, 1, 0, (drop(SEQ, [8], 1),))), 0)
    orc.apply_batch(A, [drop(SEQ, [8], 1)])
    assert a.score(SEQ) == orc.score(SEQ) == []


def test_a_snapshot_keeps_the_groups_apart_and_their_kinds():
    evs = [put(SEQ, 0, 4, 0, FULL), put(SEQ, 0, 10, 1, FULL), put(SEQ, 0, 8, 2, sw(BS + 1)), drop(SEQ, [0], 2)]
    src, orc = both((A, evs), (C, [put(SEQ, 0, 9, 0, MAMBA), drop(SEQ, range(7), 0)]))
    dst = PrefixIndex()
    dst.import_workers(src.export_workers({("a", 0), ("c", 0)}))
    assert dst.score(SEQ) == src.score(SEQ) == orc.score(SEQ)
    assert credit(src, orc) == {("a", 0): 4 * BS, ("c", 0): 9 * BS}
    assert dst.digest() == src.digest()


# ---------------------------------------------------------------- against the oracle

SPECS = {"a": {0: FULL, 1: sw(2 * BS + 1)}, "b": {0: FULL, 1: MAMBA}, "c": {0: sw(3 * BS + 1)}}
RANKS = [A, B0, B1, C]


@st.composite
def hybrid_ops(draw):
    seqs = draw(st.lists(st.lists(st.integers(0, 2), min_size=40, max_size=40), min_size=2, max_size=3))
    batches = []
    for _ in range(draw(st.integers(1, 30))):
        r = draw(st.sampled_from(RANKS))
        evs = []
        for _ in range(draw(st.integers(1, 4))):
            op = draw(st.sampled_from(["store"] * 5 + ["remove"] * 3 + ["sparse", "clear"]))
            seq = seqs[draw(st.integers(0, len(seqs) - 1))]
            g = draw(st.sampled_from(sorted(SPECS[r.instance_id])))
            spec = SPECS[r.instance_id][g] if draw(st.integers(0, 3)) else {}
            m = draw(st.sampled_from(["GPU", "GPU", "CPU"]))
            a = draw(st.integers(0, 9))
            b = draw(st.integers(a + 1, 10))
            if op == "store":
                evs.append(put(seq, a, b, g, spec, m))
            elif op == "remove":
                evs.append(drop(seq, draw(st.lists(st.integers(0, 9), min_size=1, max_size=4)), g, m))
            elif op == "sparse":
                evs.append(stored([eh(seq, (b) * BS)], seq[a * BS : b * BS] + seq[:BS], BS, group_idx=g, **spec))
            else:
                evs.append(AllBlocksCleared())
        batches.append((r, evs))
    queries = [seqs[draw(st.integers(0, len(seqs) - 1))][: draw(st.integers(0, 40))] for _ in range(3)]
    weights = draw(st.sampled_from([None, {"CPU": 1.5}, {"GPU": 0.1}]))
    return batches, queries, weights


def _rounded(scores):
    return [msgspec.structs.replace(s, score=round(s.score, 9)) for s in scores]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(hybrid_ops())
def test_hybrid_index_equals_oracle(sc):
    batches, queries, weights = sc
    ix, orc = both(*batches)
    assert ix.holder_blocks() == orc.holder_blocks()
    assert len(ix) == len(orc)
    assert ix.workers() == orc.workers()
    for q in queries:
        assert _rounded(ix.score(q, weights=weights)) == _rounded(orc.score(q, weights=weights))
        assert _rounded(ix.score(q, workers=[("a", 0)])) == _rounded(orc.score(q, workers=[("a", 0)]))


# ---------------------------------------------------------------- against vLLM itself

VBS = 16


def require(module: str):
    """Skip locally without vLLM; under CI=true it is installed, so a missing one FAILS."""
    try:
        return importlib.import_module(module)
    except Exception as e:
        unavailable(f"{module} is not installed (CI installs it): {e}")


def _vllm_hybrid(full_bs: int, window_bs: int, window: int):
    """vLLM 0.33's ``KVCacheManager`` for a model with a full-attention and a sliding-window
    group (``HybridKVCacheCoordinator``), on CPU, the scheduler block being the full-attention
    block. Returns (manager, serve, request): ``serve`` runs a prompt through chunked prefills in
    a small pool, so window blocks are freed early and evicted apart from full-attention ones.
    Only the forward pass (a GPU's job) is absent: it does not touch the cache."""
    torch = require("torch")
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, SlidingWindowSpec
    from vllm.v1.request import Request

    init_none_hash(sha256)
    full = FullAttentionSpec(block_size=full_bs, num_kv_heads=1, head_size=8, dtype=torch.float16)
    # Equal page sizes per group: a smaller window block holds proportionally more heads.
    swa = SlidingWindowSpec(
        block_size=window_bs,
        num_kv_heads=full_bs // window_bs,
        head_size=8,
        dtype=torch.float16,
        sliding_window=window,
    )
    cfg = KVCacheConfig(
        num_blocks=64,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["full.0"], full), KVCacheGroupSpec(["swa.0"], swa)],
    )
    mgr = KVCacheManager(
        cfg, max_model_len=8192, scheduler_block_size=full_bs, hash_block_size=window_bs, enable_kv_cache_events=True
    )
    hasher = get_request_block_hasher(window_bs, sha256)
    n = [0]

    def request(tokens):
        n[0] += 1
        return Request(f"r{n[0]}", list(tokens), SamplingParams(max_tokens=1), None, block_hasher=hasher)

    def serve(tokens, chunk=32):
        r = request(tokens)
        blocks, hit, _ = mgr.get_computed_blocks(r)
        done, first = hit, True
        while done < len(tokens):
            k = min(chunk, len(tokens) - done)
            got = mgr.allocate_slots(r, k, hit if first else 0, blocks if first else None)
            assert got is not None, "engine out of blocks"
            r.num_computed_tokens = (hit if first else r.num_computed_tokens) + k
            first, done = False, done + k
        mgr.free(r)

    return mgr, serve, request


@pytest.mark.vllm
@pytest.mark.parametrize(
    ("full_bs", "window_bs", "window"),
    [(VBS, VBS, 40), (2 * VBS, VBS, 40), (2 * VBS, VBS, 24)],
    ids=["same_block_size", "window_blocks_half_size", "window_blocks_half_size_w24"],
)
def test_hybrid_credit_equals_vllms_own_cache_hit(full_bs, window_bs, window):
    """The events of vLLM's own hybrid manager go through vLLM's msgpack encoding and kvwire's
    wire decoder into the index; for every query the credit must equal the hit vLLM's
    ``get_computed_blocks`` finds for the same prompt, also when the groups' block sizes differ."""
    ke = require("vllm.distributed.kv_events")
    from kvwire.producer.vllm_wire import decode_batch

    mgr, serve, request = _vllm_hybrid(full_bs, window_bs, window)
    index = PrefixIndex()
    enc = msgspec.msgpack.Encoder()
    rng = random.Random(7)
    systems = [[rng.randrange(50_000) for _ in range(96)] for _ in range(3)]
    disagree_with_union = 0
    for _ in range(150):
        serve(rng.choice(systems) + [rng.randrange(50_000) for _ in range(rng.randrange(150))])
        events = mgr.take_events()
        wire = decode_batch(enc.encode(ke.KVEventBatch(ts=0.0, events=events)))
        index.apply_batch(A, wire.events)
        q = rng.choice(systems) + [rng.randrange(50_000) for _ in range(rng.randrange(40))]
        r = request(q)
        truth = mgr.get_computed_blocks(r, max_cache_hit_length=len(q))[1]
        got = {(s.instance_id, s.dp_rank): s.matched_tokens for s in index.score(q)}.get(("a", 0), 0)
        assert got == truth, (got, truth)
        union = 0
        for bh in r.block_hashes:
            if all(mgr.block_pool.get_cached_block(bh, [g]) is None for g in (0, 1)):
                break
            union += 1
        disagree_with_union += union * window_bs != truth
    # The workload reaches the cases where crediting any group's blocks would be wrong.
    assert disagree_with_union > 0


@pytest.mark.vllm
def test_sparse_window_stores_never_over_credit():
    """Window blocks half the scheduler block and a 16-token window: vLLM keeps only the last
    block of each 2-block segment (``reachable_block_mask``), so every window store names
    blocks 1, 3, 5, ... of its range and its token ids span twice as many blocks as it has
    hashes. The event does not say which blocks they are (docs/engines/vllm-hybrid.md), so the
    index may under-credit such a worker but never credit more than vLLM's own hit."""
    ke = require("vllm.distributed.kv_events")
    from kvwire.producer.vllm_wire import decode_batch

    mgr, serve, request = _vllm_hybrid(2 * VBS, VBS, VBS)
    index, enc, rng = PrefixIndex(), msgspec.msgpack.Encoder(), random.Random(7)
    systems = [[rng.randrange(50_000) for _ in range(96)] for _ in range(3)]
    sparse = hits = 0
    for _ in range(100):
        serve(rng.choice(systems) + [rng.randrange(50_000) for _ in range(rng.randrange(150))])
        events = mgr.take_events()
        sparse += sum(
            isinstance(e, ke.BlockStored) and e.group_idx == 1 and len(e.token_ids) == 2 * VBS * len(e.block_hashes)
            for e in events
        )
        index.apply_batch(A, decode_batch(enc.encode(ke.KVEventBatch(ts=0.0, events=events))).events)
        q = rng.choice(systems) + [rng.randrange(50_000) for _ in range(rng.randrange(40))]
        truth = mgr.get_computed_blocks(request(q), max_cache_hit_length=len(q))[1]
        got = {(s.instance_id, s.dp_rank): s.matched_tokens for s in index.score(q)}.get(("a", 0), 0)
        assert got <= truth, (got, truth)
        hits += truth > 0
    assert sparse > 0 and hits > 0, (sparse, hits)  # the case is reached, and vLLM would hit
    # The sparse stores are kept (removable later), as orphans: nothing credited, nothing lost.
    assert index.workers()[("a", 0)].orphans > 0
