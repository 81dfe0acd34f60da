"""LMCache end to end: a real LMCacheEngine on CPU stores prompts, its events flow
through the real publisher and a real broker into an index member, and the
index's score for the LMCache worker equals LMCache's own lookup of the same
tokens. Only the GPU copy is mocked (LMCache's MockGPUConnector)."""

from __future__ import annotations

import asyncio
import random

import pytest

from kvwire.consumer.ingest import IndexMember, IngestConfig
from kvwire.producer.lmcache_source import LMCacheSource
from kvwire.schemas.events import WorkerId

pytestmark = [pytest.mark.lmcache, pytest.mark.integration]


async def test_index_score_equals_lmcache_lookup(h, engine, kafka_bootstrap, new_topic):
    torch = h.require("torch")
    from kvwire.producer.publisher import KafkaPublisher, PublisherConfig

    topic = new_topic(partitions=2)
    rng = random.Random(7)
    shared = [rng.randrange(30000) for _ in range(48)]
    prompts = [
        list(range(1000, 1100)),  # 6 full chunks + an unfull tail (not saved)
        shared + [rng.randrange(30000) for _ in range(40)],
        shared + [rng.randrange(30000) for _ in range(70)],  # diverges after the shared 3 chunks
        [rng.randrange(30000) for _ in range(64)],
    ]
    worker = WorkerId("lmc-e2e", 0, 0, 1, "tiny")
    pub = KafkaPublisher(PublisherConfig(bootstrap_servers=kafka_bootstrap, topic=topic, partitions=2))
    try:
        src = LMCacheSource(engine, pub.stream(worker, source="lmcache"))
        for p in prompts:
            engine.store(torch.tensor(p, dtype=torch.long))
            src.poll_once()
        # an incremental store: the first prompt grown to 140 tokens, its cached head masked out
        grown = prompts[0] + list(range(5000, 5040))
        mask = torch.ones(len(grown), dtype=torch.bool)
        mask[:96] = False
        engine.store(torch.tensor(grown, dtype=torch.long), mask=mask)
        src.poll_once()
    finally:
        await asyncio.to_thread(pub.close)
    assert src.repair.stats.parents_unrepaired == 0

    member = IndexMember(IngestConfig(kafka_bootstrap, topic))
    await member.start()
    try:
        for _ in range(600):
            if member.ready:
                break
            await asyncio.sleep(0.1)
        assert member.ready
        queries = prompts + [
            grown,
            grown[:77],
            prompts[1][:50],
            shared,
            shared[:20],
            prompts[2] + [1, 2, 3] * 20,
            [rng.randrange(30000) for _ in range(80)],
            prompts[3][:32] + prompts[0][32:64],
        ]
        checked = 0
        for q in queries:
            want = engine.lookup(torch.tensor(q, dtype=torch.long))
            got = {(s.instance_id, s.dp_rank): s.matched_tokens for s in member.applier.score(q)}
            assert got.get(("lmc-e2e", 0), 0) == want, (len(q), want, got)
            checked += want > 0
        assert checked >= 6, "most queries must hit something for this test to mean anything"
    finally:
        await member.stop()
