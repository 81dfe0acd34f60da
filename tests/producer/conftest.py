"""Helpers for the engine-source tests: an in-memory sink, guarded imports of the
optional engines, and a Kafka reader that decodes kvwire records."""

from __future__ import annotations

import threading
import time
import uuid
from dataclasses import dataclass, field

import pytest
from ci_env import require
from polling import free_port, wait_for


@dataclass
class Record:
    kind: str  # "batch" | "epoch" | "gap"
    events: tuple = ()
    engine_ts: float | None = None
    n: int = 0


@dataclass
class MemorySink:
    """The publisher's RankStream surface, in memory."""

    records: list = field(default_factory=list)
    accept: bool = True
    lock: threading.Lock = field(default_factory=threading.Lock)

    def publish(self, events, engine_ts=None) -> bool:
        with self.lock:
            self.records.append(Record("batch", tuple(events), engine_ts))
        return self.accept

    def new_epoch(self) -> None:
        with self.lock:
            self.records.append(Record("epoch"))

    def report_gap(self, n: int) -> None:
        with self.lock:
            self.records.append(Record("gap", n=n))

    def events(self) -> list:
        with self.lock:
            return [e for r in self.records if r.kind == "batch" for e in r.events]

    def kinds(self) -> list:
        with self.lock:
            return [r.kind for r in self.records]

    def gaps(self) -> int:
        with self.lock:
            return sum(r.n for r in self.records if r.kind == "gap")


@pytest.fixture
def sink() -> MemorySink:
    return MemorySink()


def read_batches(bootstrap: str, topic: str, until, timeout: float = 90.0) -> list:
    """Consume `topic` from the start, decoding each record, until `until(batches)` holds."""
    import asyncio

    from aiokafka import AIOKafkaConsumer

    from kvwire.schemas.codec import decode

    async def run():
        c = AIOKafkaConsumer(
            topic, bootstrap_servers=bootstrap, auto_offset_reset="earliest", enable_auto_commit=False, group_id=None
        )
        await c.start()
        out = []
        try:
            end = time.monotonic() + timeout
            while time.monotonic() < end:
                got = await c.getmany(timeout_ms=500)
                for recs in got.values():
                    for r in recs:
                        out.append((r, decode(r.value)))
                if until([b for _, b in out]):
                    return out
            raise AssertionError(f"timed out reading {topic}: {len(out)} records")
        finally:
            await c.stop()

    return asyncio.run(run())


@pytest.fixture
def h():
    """The helpers above, for test modules (tests/ has no packages to import them from)."""
    import types

    return types.SimpleNamespace(
        require=require, free_port=free_port, wait_for=wait_for, read_batches=read_batches, MemorySink=MemorySink
    )


LMCACHE_CHUNK = 16


@pytest.fixture
def engine(h):
    """A real LMCacheEngine on CPU (chunk size LMCACHE_CHUNK): only the GPU copy is LMCache's MockGPUConnector."""
    torch = h.require("torch")
    h.require("lmcache.v1.cache_engine")
    from lmcache.v1.cache_engine import LMCacheEngineBuilder
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.gpu_connector.mock_gpu_connector import MockGPUConnector
    from lmcache.v1.metadata import LMCacheMetadata

    cfg = LMCacheEngineConfig.from_defaults(
        chunk_size=LMCACHE_CHUNK, local_cpu=True, max_local_cpu_size=0.05, enable_kv_events=True
    )
    kv_shape = (2, 2, LMCACHE_CHUNK, 2, 8)
    md = LMCacheMetadata(
        model_name="tiny",
        world_size=1,
        local_world_size=1,
        worker_id=0,
        local_worker_id=0,
        kv_dtype=torch.float16,
        kv_shape=kv_shape,
    )
    name = f"kvwire-{uuid.uuid4().hex[:8]}"
    eng = LMCacheEngineBuilder.get_or_create(
        name, cfg, md, MockGPUConnector(kv_shape), lambda *a: None, lambda *a: None
    )
    eng.post_init()
    yield eng
    LMCacheEngineBuilder.destroy(name)


class IndexReader:
    """The consumer's apply path (an ``Applier``) fed from one partition of a real topic, on demand."""

    def __init__(self, bootstrap: str, topic: str, partition: int = 0):
        from kvwire.consumer.apply import Applier

        self.bootstrap, self.topic, self.partition = bootstrap, topic, partition
        self.applier = Applier()
        self.offset = 0

    def catch_up(self, *streams) -> None:
        """Apply every record the given publisher streams have had acknowledged so far."""

        def drained():
            return all(s.stats().queued == 0 and s.stats().acked == s.stats().sent for s in streams)

        wait_for(drained, "the publisher to drain")
        import asyncio

        asyncio.run(self._read())

    async def _read(self) -> None:
        from aiokafka import AIOKafkaConsumer, TopicPartition

        c = AIOKafkaConsumer(bootstrap_servers=self.bootstrap, enable_auto_commit=False, group_id=None)
        await c.start()
        try:
            tp = TopicPartition(self.topic, self.partition)
            c.assign([tp])
            end = (await c.end_offsets([tp]))[tp]
            c.seek(tp, self.offset)
            while self.offset < end:
                for recs in (await c.getmany(tp, timeout_ms=1000)).values():
                    for r in recs:
                        self.applier.apply_record(r.topic, r.partition, r.offset, r.key, r.value, r.timestamp)
                        self.offset = r.offset + 1
        finally:
            await c.stop()
        assert not self.applier.dead_letters, self.applier.dead_letters

    def credit(self, worker: tuple[str, int], tokens, block_size: int | None = None) -> int:
        """Tokens the index credits ``worker`` with for ``tokens`` (0 when untrusted)."""
        for s in self.applier.score(tokens, block_size=block_size):
            if (s.instance_id, s.dp_rank) == worker:
                return s.matched_tokens
        return 0

    def trusted(self, worker: tuple[str, int]) -> bool:
        return self.applier.ranks.worker_trusted(worker)


@pytest.fixture
def index_reader(kafka_bootstrap):
    """Factory: ``index_reader(topic)`` -> an IndexReader on partition 0 of ``topic``."""
    return lambda topic, partition=0: IndexReader(kafka_bootstrap, topic, partition)


@pytest.fixture
def small_engine(h):
    """A real LMCacheEngine on CPU whose budget holds ~50 chunks: storing more evicts (LRU)."""
    torch = h.require("torch")
    h.require("lmcache.v1.cache_engine")
    from lmcache.v1.cache_engine import LMCacheEngineBuilder
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.gpu_connector.mock_gpu_connector import MockGPUConnector
    from lmcache.v1.metadata import LMCacheMetadata

    cfg = LMCacheEngineConfig.from_defaults(
        chunk_size=LMCACHE_CHUNK, local_cpu=True, max_local_cpu_size=0.0001, enable_kv_events=True
    )
    kv_shape = (2, 2, LMCACHE_CHUNK, 2, 8)
    md = LMCacheMetadata(
        model_name="tiny",
        world_size=1,
        local_world_size=1,
        worker_id=0,
        local_worker_id=0,
        kv_dtype=torch.float16,
        kv_shape=kv_shape,
    )
    name = f"kvwire-small-{uuid.uuid4().hex[:8]}"
    eng = LMCacheEngineBuilder.get_or_create(
        name, cfg, md, MockGPUConnector(kv_shape), lambda *a: None, lambda *a: None
    )
    eng.post_init()
    yield eng
    LMCacheEngineBuilder.destroy(name)
