"""Simulator invariants: what it emits is a history a real paged cache could have produced."""

from __future__ import annotations

from collections import defaultdict

import pytest

from kvwire.producer.simulator import SimConfig, Simulator
from kvwire.schemas.codec import decode, encode
from kvwire.schemas.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, WorkerId


class Oracle:
    """Replays the events per rank and fails on anything a cache could not have done."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.held: dict[tuple, set] = defaultdict(set)
        self.log: list = []
        self.restarts: list = []

    def sink(self, rank: WorkerId, events):
        self.log.append((rank, tuple(events)))
        held = self.held[rank.rank]
        for e in events:
            if isinstance(e, BlockRemoved):
                assert set(e.block_hashes) <= held, "removed a block that was never stored"
                held.difference_update(e.block_hashes)
            elif isinstance(e, BlockStored):
                assert not set(e.block_hashes) & held, "stored a block it already held"
                assert e.parent_block_hash is None or e.parent_block_hash in held
                assert len(e.token_ids) == e.block_size * len(e.block_hashes)
                held.update(e.block_hashes)
            else:
                assert isinstance(e, AllBlocksCleared)
                held.clear()
            assert len(held) <= self.capacity

    def restart(self, rank: WorkerId):
        self.restarts.append(rank)
        self.held[rank.rank].clear()


def run(steps=3000, **kw):
    cfg = SimConfig(**kw)
    oracle = Oracle(cfg.capacity_blocks)
    sim = Simulator(cfg, oracle.sink, oracle.restart)
    sim.run(steps)
    return sim, oracle


def test_history_is_consistent_and_matches_the_caches():
    sim, oracle = run(capacity_blocks=300, p_clear=0.01, p_restart=0.005)
    assert sim.restarts and sim.clears
    removed = sum(len(e.block_hashes) for _, evs in oracle.log for e in evs if isinstance(e, BlockRemoved))
    assert removed > 0, "capacity never forced an eviction"
    for w, ranks in enumerate(sim.ranks):
        for r in ranks:
            assert oracle.held[r.rank] == set(sim.caches[w])
        assert len(sim.caches[w]) <= 300


def test_deterministic_for_a_seed():
    a = run(steps=500, seed=7)[1].log
    b = run(steps=500, seed=7)[1].log
    c = run(steps=500, seed=8)[1].log
    assert a == b and a != c


def test_tp_ranks_emit_identical_events():
    sim, oracle = run(steps=300, tp_size=4, workers=2)
    per_rank = defaultdict(list)
    for rank, evs in oracle.log:
        assert rank.tp_size == 4
        per_rank[rank.rank].append(evs)
    for inst, dp in sim.workers:
        streams = [per_rank[(inst, dp, tp)] for tp in range(4)]
        assert streams[0] and all(s == streams[0] for s in streams)


def test_engine_hashes_look_like_vllm_and_encode():
    _sim, oracle = run(steps=300)
    hashes = [h for _, evs in oracle.log for e in evs if isinstance(e, BlockStored) for h in e.block_hashes]
    assert all(0 <= h < 1 << 64 for h in hashes)
    assert any(h >= 1 << 63 for h in hashes), "vLLM's unsigned u64 hashes are often >= 2^63"
    rank, evs = oracle.log[-1]
    b = EventBatch(rank, 1, 0, 0, evs)
    assert decode(encode(b)) == b


def test_system_prompts_are_shared_across_workers():
    sim, _ = run(steps=2000, workers=4, capacity_blocks=4096)
    first_blocks = [set(c) for c in sim.caches]
    shared = set.intersection(*first_blocks)
    assert shared, "no block held by every worker: prefixes are not shared"


@pytest.mark.parametrize("algo", ["sha256", "xxhash"])
def test_next_request_expects_the_longest_holder(algo):
    sim, _ = run(steps=1000, hash_algo=algo)
    hits = 0
    for _ in range(200):
        req = sim.next_request()
        held = [sim.prefix_blocks(w, req.token_ids) for w in range(len(sim.workers))]
        if req.expected_worker is None:
            assert max(held) == 0
        else:
            hits += 1
            assert held[req.expected_worker] == max(held) == req.expected_blocks > 0
        sim.serve(req.expected_worker or 0, req.token_ids)
    assert hits > 100, "requests should mostly extend what workers hold"


def test_multi_turn_extends_the_previous_prompt():
    sim = Simulator(SimConfig(seed=3, p_new_session=0.0))
    first = sim.next_request()
    second = sim.next_request()
    assert second.session == first.session
    assert second.token_ids[: len(first.token_ids)] == first.token_ids
    assert len(second.token_ids) > len(first.token_ids)
