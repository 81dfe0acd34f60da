"""For random workloads (hypothesis), the index a group member builds through a
real broker equals a brute-force oracle fed the same records, and every score
equals brute force over that oracle.

Workloads mix TP workers whose ranks report in separate batches, duplicate
stores, removals (known and unknown), clears, engine restarts (new epochs),
upstream gaps (the worker must then score nothing), several media and block
sizes."""

from __future__ import annotations

import asyncio
import random
import uuid

import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kafka_admin import create_topics, delete_topics
from oracle import Oracle

from kvwire.consumer.apply import Applier
from kvwire.consumer.ingest import IndexMember, IngestConfig
from kvwire.producer.publisher import KafkaPublisher, PublisherConfig
from kvwire.schemas import codec
from kvwire.schemas.events import AllBlocksCleared, BlockRemoved, WorkerId, stored

pytestmark = pytest.mark.integration

RANKS = [WorkerId("a", 0, 0, 1), WorkerId("b", 0, 0, 2), WorkerId("b", 0, 1, 2), WorkerId("c", 1, 0, 1)]
PROMPTS = [[(7 * p + i) % 997 for i in range(256)] for p in range(3)]

step = st.tuples(
    st.integers(0, len(RANKS) - 1),
    st.sampled_from(["store", "store", "store", "store", "remove", "dup", "clear", "restart", "gap"]),
    st.integers(0, 2),  # prompt
    st.integers(1, 12),  # blocks
    st.sampled_from(["GPU", "CPU"]),
    st.sampled_from([16, 16, 16, 64]),
)


def events_for(rank_state, action, prompt, nblocks, medium, bs, rng):
    """Turn one step into vLLM-like events; rank_state remembers what the rank stored."""
    tokens = PROMPTS[prompt][: nblocks * bs]
    n = len(tokens) // bs
    hashes = [hash((prompt, bs, i)) & ((1 << 64) - 1) for i in range(n)]
    if action in ("store", "dup"):
        start = 0 if action == "dup" else rng.randrange(0, n)
        ev = stored(
            hashes[start:n],
            tokens[start * bs : n * bs],
            bs,
            parent_block_hash=hashes[start - 1] if start else None,
            medium=medium,
        )
        rank_state.setdefault(medium, set()).update(hashes[start:n])
        return [ev]
    if action == "remove":
        held = sorted(rank_state.get(medium, set()))
        pick = rng.sample(held, k=min(len(held), rng.randrange(1, 4))) if held else []
        for h in pick:
            rank_state[medium].discard(h)
        return [BlockRemoved(tuple(pick) + (12345,), medium=medium)]  # plus one unknown hash
    if action == "clear":
        rank_state.clear()
        return [AllBlocksCleared()]
    return []


async def _read_all(bootstrap, topic, partitions):
    c = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False, auto_offset_reset="earliest")
    await c.start()
    try:
        tps = [TopicPartition(topic, p) for p in range(partitions)]
        c.assign(tps)
        ends = await c.end_offsets(tps)
        for tp, off in (await c.beginning_offsets(tps)).items():
            c.seek(tp, off)  # explicit: seek_to_beginning raced the assignment here
        out = []

        async def behind():
            return [tp for tp in tps if await c.position(tp) < ends[tp]]

        while await behind():
            for tp, recs in (await c.getmany(timeout_ms=1000)).items():
                out.extend((tp.partition, r) for r in recs)
        return out
    finally:
        await c.stop()


@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.lists(step, min_size=5, max_size=40), st.integers(0, 2**16))
def test_index_through_kafka_equals_oracle(kafka_bootstrap, steps, seed):
    asyncio.run(_check(kafka_bootstrap, steps, seed))


async def _check(bootstrap, steps, seed):
    rng = random.Random(seed)
    topic = f"t-oracle-{uuid.uuid4().hex[:8]}"
    await create_topics(bootstrap, [topic], 3)
    try:
        pub = KafkaPublisher(PublisherConfig(bootstrap_servers=bootstrap, topic=topic, partitions=3, linger_ms=1))
        streams = [pub.stream(r, "test") for r in RANKS]
        state = [dict() for _ in RANKS]
        for ri, action, prompt, nblocks, medium, bs in steps:
            if action == "restart":
                streams[ri].new_epoch()
                state[ri].clear()
            elif action == "gap":
                streams[ri].report_gap(2)
                streams[ri].publish([])
            else:
                evs = events_for(state[ri], action, prompt, nblocks, medium, bs, rng)
                assert streams[ri].publish(evs)
        await asyncio.to_thread(pub.close)

        # the oracle: brute force over the same records, in the same partition order
        oracle = Applier(index=Oracle())
        records = await _read_all(bootstrap, topic, 3)
        assert len(records) >= len(RANKS) + len(steps) - sum(a in ("restart",) for _, a, *_ in steps) - 1
        for p, r in sorted(records, key=lambda x: (x[0], x[1].offset)):
            oracle.apply_batch(codec.decode(r.value), p)

        member = IndexMember(IngestConfig(bootstrap, topic))
        await member.start()
        try:
            for _ in range(600):
                if member.ready:
                    break
                await asyncio.sleep(0.05)
            assert member.ready
            idx = member.applier.index
            assert idx.holder_blocks() == oracle.index.holder_blocks()
            assert len(idx) == len(oracle.index)
            assert member.applier.ranks.untrusted_workers() == oracle.ranks.untrusted_workers()
            for prompt in PROMPTS:
                for cut in (len(prompt), rng.randrange(len(prompt) + 1), 48):
                    q = prompt[:cut]
                    assert member.applier.score(q) == oracle.score(q)
        finally:
            await member.stop()
    finally:
        await delete_topics(bootstrap, [topic, f"{topic}.dlq"])
