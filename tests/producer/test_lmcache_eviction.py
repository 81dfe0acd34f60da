"""LMCache's own evictions reach the index (issue 13), and every loss in the LMCache source is a
gap the index sees (issue 14).

A real LMCacheEngine on CPU with a budget of ~50 chunks stores far more than that, so LMCache
evicts (LRU) while it stores; the source observes the engine's CPU tier and publishes through
the real publisher and broker; the consumer's apply path reads the topic. Every query compares
the index's credit with ``LMCacheEngine.lookup`` of the same tokens. Only the GPU copy is mocked
(LMCache's MockGPUConnector)."""

from __future__ import annotations

import random

import pytest

from kvwire.producer.lmcache_source import LMCacheSource
from kvwire.producer.publisher import KafkaPublisher, PublisherConfig
from kvwire.schemas.events import WorkerId

pytestmark = [pytest.mark.lmcache, pytest.mark.integration]

CHUNK = 16
WORKER = ("lmc-evict", 0)


def prompts(rng: random.Random, n: int) -> list[list[int]]:
    shared = [[rng.randrange(30000) for _ in range(CHUNK * rng.randint(1, 4))] for _ in range(6)]
    out = []
    for _ in range(n):
        p = rng.choice(shared) + [rng.randrange(30000) for _ in range(rng.randint(CHUNK, 5 * CHUNK))]
        if out and rng.random() < 0.3:
            p = rng.choice(out) + p[: rng.randint(CHUNK, 3 * CHUNK)]  # a later turn of a conversation
        out.append(p)
    return out


def test_index_equals_lookup_while_lmcache_evicts(h, small_engine, kafka_bootstrap, new_topic, index_reader):
    torch = h.require("torch")
    topic = new_topic()
    rng = random.Random(11)
    pub = KafkaPublisher(PublisherConfig(bootstrap_servers=kafka_bootstrap, topic=topic, linger_ms=1))
    stream = pub.stream(WorkerId(*WORKER, 0, 1, "tiny"), source="lmcache")
    src = LMCacheSource(small_engine, stream)
    reader = index_reader(topic)
    try:
        assert src.observer.hooked == ["LocalCPUBackend"] and not src.approximate
        stored = prompts(rng, 150)
        for p in stored:
            small_engine.store(torch.tensor(p, dtype=torch.long))
            src.poll_once()
        src.poll_once()
        reader.catch_up(stream)
        assert src.removals > 50 and src.duplicates > 0  # LMCache evicted, and re-stored held chunks
        assert src.gaps == 0 and reader.trusted(WORKER)
        queries = [q[: rng.randint(CHUNK, len(q))] if rng.random() < 0.4 else q for q in rng.sample(stored, 100)]
        queries += prompts(rng, 20)
        mismatches = hits = 0
        for q in queries:
            want = small_engine.lookup(torch.tensor(q, dtype=torch.long))
            got = reader.credit(WORKER, q)
            mismatches += got != want
            hits += want > 0
        assert hits >= 30, "the comparison must cover chunks LMCache still holds"
        assert mismatches == 0
    finally:
        src.stop()
        pub.close()


def test_unconvertible_event_distrusts_the_worker(h, engine, kafka_bootstrap, new_topic, index_reader):
    """An LMCache event the source cannot convert is a gap: the index stops crediting the worker."""
    torch = h.require("torch")
    topic = new_topic()
    pub = KafkaPublisher(PublisherConfig(bootstrap_servers=kafka_bootstrap, topic=topic, linger_ms=1))
    stream = pub.stream(WorkerId("lmc-bad", 0, 0, 1, "tiny"), source="lmcache")
    src = LMCacheSource(engine, stream)
    reader = index_reader(topic)
    try:
        tokens = list(range(100, 164))
        engine.store(torch.tensor(tokens, dtype=torch.long))
        src.poll_once()
        reader.catch_up(stream)
        assert reader.trusted(("lmc-bad", 0)) and reader.credit(("lmc-bad", 0), tokens) == 64
        real = engine.get_kv_events
        engine.get_kv_events = lambda: [object()] + list(real())  # a malformed event among real ones
        try:
            engine.store(torch.tensor(list(range(500, 532)), dtype=torch.long))
            src.poll_once()
        finally:
            del engine.get_kv_events
        reader.catch_up(stream)
        assert src.gaps == 1 and not reader.trusted(("lmc-bad", 0))
        assert reader.credit(("lmc-bad", 0), tokens) == 0
    finally:
        src.stop()
        pub.close()


class FailingOnce:
    """The real stream, except that one publish() raises: a source bug or a broken sink."""

    def __init__(self, stream):
        self.stream, self.armed = stream, False

    def publish(self, events, engine_ts=None):
        if self.armed and events:
            self.armed = False
            raise RuntimeError("publish broke")
        return self.stream.publish(events, engine_ts)

    def report_gap(self, n):
        self.stream.report_gap(n)

    def new_epoch(self):
        self.stream.new_epoch()


def test_failed_publish_distrusts_the_worker(h, engine, kafka_bootstrap, new_topic, index_reader):
    torch = h.require("torch")
    topic = new_topic()
    pub = KafkaPublisher(PublisherConfig(bootstrap_servers=kafka_bootstrap, topic=topic, linger_ms=1))
    stream = pub.stream(WorkerId("lmc-pubfail", 0, 0, 1, "tiny"), source="lmcache")
    sink = FailingOnce(stream)
    src = LMCacheSource(engine, sink)
    reader = index_reader(topic)
    try:
        tokens = list(range(700, 764))
        engine.store(torch.tensor(tokens, dtype=torch.long))
        src.poll_once()
        reader.catch_up(stream)
        assert reader.trusted(("lmc-pubfail", 0))
        sink.armed = True
        engine.store(torch.tensor(list(range(900, 932)), dtype=torch.long))
        src.poll_once()
        reader.catch_up(stream)
        assert src.gaps == 1 and not reader.trusted(("lmc-pubfail", 0))
        assert reader.credit(("lmc-pubfail", 0), tokens) == 0
    finally:
        src.stop()
        pub.close()


def test_source_started_after_stores_says_the_state_is_unknown(h, engine, sink):
    """Chunks inserted before the source existed were never published: a gap, not a silent hole."""
    torch = h.require("torch")
    engine.store(torch.arange(3, 67, dtype=torch.long))
    src = LMCacheSource(engine, sink)
    try:
        assert src.observer.held_at_start == 4
        src.poll_once()
        assert sink.gaps() == 1 and sink.kinds() == ["gap", "batch"] and sink.events() == []
    finally:
        src.stop()
