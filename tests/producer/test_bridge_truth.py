"""Routing truth through the ZMQ bridge, against a real vLLM engine's own cache (issue 13).

The engine is vLLM 0.33's own ``KVCacheManager`` (block pool, prefix cache, LRU eviction,
KV events) on CPU, publishing through vLLM's own ``ZmqEventPublisher`` exactly as
``EngineCore`` does (``take_events()`` after a step -> ``KVEventBatch`` -> ``publish``). Only the
model forward pass is absent: it does not touch the cache's bookkeeping. The bridge runs on its
own thread into the real publisher and a real broker; an ``Applier`` (the consumer's apply path)
reads the topic. Every query compares the index's credit for the worker with the number of
leading blocks the engine's block pool holds for the same prompt.

Bounds: each comparison is made after the consumer has applied every record the bridge had
published at that point (the index lags the engine by its apply lag, nothing more).
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import zmq
from vllm_engine import BS, Engine, Workload

from kvwire.consumer.apply import Applier
from kvwire.producer.publisher import KafkaPublisher, PublisherConfig
from kvwire.producer.zmq_bridge import BridgeConfig, ZmqBridge
from kvwire.schemas.events import WorkerId

pytestmark = [pytest.mark.vllm, pytest.mark.integration]

WORKER = ("vllm-a", 0)
QUERIES = 150


class Pipeline:
    """Bridge (own thread) -> KafkaPublisher -> topic -> Applier."""

    def __init__(self, bootstrap: str, topic: str, port: int, rport: int, **bridge_kw):
        self.bootstrap, self.topic = bootstrap, topic
        self.pub = KafkaPublisher(
            PublisherConfig(bootstrap_servers=bootstrap, topic=topic, linger_ms=1, heartbeat_interval_s=0.5)
        )
        self.stream = self.pub.stream(WorkerId(*WORKER, 0, 1, "m"), source="vllm-zmq")
        cfg = BridgeConfig(f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{rport}", **bridge_kw)
        self.bridge = ZmqBridge(cfg, self.stream, ctx=zmq.asyncio.Context())
        self.applier = Applier()
        self._offset = 0
        self.loop = asyncio.new_event_loop()
        self.stop: asyncio.Event | None = None
        started = threading.Event()

        def main():
            asyncio.set_event_loop(self.loop)
            self.stop = asyncio.Event()
            started.set()
            self.loop.run_until_complete(self.bridge.run(self.stop))

        self.thread = threading.Thread(target=main, daemon=True)
        self.thread.start()
        started.wait()

    def drained(self) -> bool:
        s = self.stream.stats()
        return s.queued == 0 and s.acked == s.sent

    def catch_up(self, h) -> None:
        """Apply every record the publisher has had acknowledged so far."""
        h.wait_for(self.drained, "publisher to drain")
        asyncio.run(self._read())

    async def _read(self) -> None:
        from aiokafka import AIOKafkaConsumer, TopicPartition

        c = AIOKafkaConsumer(bootstrap_servers=self.bootstrap, enable_auto_commit=False, group_id=None)
        await c.start()
        try:
            tp = TopicPartition(self.topic, 0)
            c.assign([tp])
            end = (await c.end_offsets([tp]))[tp]
            c.seek(tp, self._offset)
            while self._offset < end:
                for recs in (await c.getmany(tp, timeout_ms=1000)).values():
                    for r in recs:
                        self.applier.apply_record(r.topic, r.partition, r.offset, r.key, r.value, r.timestamp)
                        self._offset = r.offset + 1
        finally:
            await c.stop()
        assert not self.applier.dead_letters

    def credit(self, tokens) -> int:
        """Blocks the index credits the worker with for ``tokens`` (0 if untrusted)."""
        for s in self.applier.score(tokens, block_size=BS):
            if (s.instance_id, s.dp_rank) == WORKER:
                return s.matched_tokens // BS
        return 0

    def trusted(self) -> bool:
        return self.applier.ranks.worker_trusted(WORKER)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.stop.set)
        self.thread.join(30)
        self.pub.close()


def compare(pipe: Pipeline, engine: Engine | None, queries) -> tuple[int, int]:
    """(mismatches, false credits) over the queries; a dead engine (None) holds nothing."""
    mismatches = false = 0
    for q in queries:
        held = engine.held_blocks(q) if engine is not None else 0
        got = pipe.credit(q)
        mismatches += got != held
        false += got > held
    return mismatches, false


@pytest.fixture
def ports(h):
    return h.free_port(), h.free_port()


def test_late_bridge_over_an_idle_engine(h, kafka_bootstrap, new_topic, ports):
    """The engine served traffic, evicted, and went idle before the bridge started: the bridge
    reads the engine's state from its replay socket before the worker counts as trusted."""
    engine = Engine(h, *ports)
    wl = Workload(1)
    try:
        wl.run(engine, 80)
        engine.wait_sent(h)
        assert engine.mgr.block_pool.cached_block_hash_to_block, "the engine holds blocks"
        pipe = Pipeline(kafka_bootstrap, new_topic(), *ports)
        try:
            h.wait_for(lambda: pipe.bridge.known, "the bridge to sync")
            pipe.catch_up(h)
            assert pipe.trusted()
            queries = wl.queries(QUERIES)
            assert sum(engine.held_blocks(q) > 0 for q in queries) >= QUERIES // 3  # the check has teeth
            assert compare(pipe, engine, queries) == (0, 0)
            # Idle longer than the liveness interval: probes answer, nothing changes.
            time.sleep(pipe.bridge.cfg.liveness_interval_s * 2)
            pipe.catch_up(h)
            assert pipe.trusted() and compare(pipe, engine, queries) == (0, 0)
        finally:
            pipe.close()
    finally:
        engine.shutdown()


def test_engine_that_dies_and_stays_dead(h, kafka_bootstrap, new_topic, ports):
    """The engine's process goes away: the worker stops being credited at once, and stays
    uncredited while the bridge's heartbeats keep it listed."""
    engine = Engine(h, *ports)
    wl = Workload(2)
    pipe = Pipeline(kafka_bootstrap, new_topic(), *ports)
    try:
        h.wait_for(lambda: pipe.bridge.known, "the bridge to sync")
        wl.run(engine, 80)
        engine.wait_sent(h)
        h.wait_for(lambda: pipe.bridge._expected == engine.batches, "the bridge to see every batch")
        pipe.catch_up(h)
        queries = wl.queries(QUERIES)
        assert pipe.trusted() and compare(pipe, engine, queries) == (0, 0)  # alive: exact
        before = sum(pipe.credit(q) for q in queries)
        assert before > 0
        engine.shutdown()
        h.wait_for(lambda: not pipe.bridge.known, "the bridge to notice the engine is gone")
        pipe.catch_up(h)
        assert not pipe.trusted()
        assert compare(pipe, None, queries) == (0, 0)  # dead: no credit for anything
        # Stays dead past several heartbeats and liveness probes: still no credit, still listed.
        time.sleep(pipe.bridge.cfg.liveness_interval_s * 2)
        pipe.catch_up(h)
        assert [w["trusted"] for w in pipe.applier.workers() if (w["instance_id"], w["dp_rank"]) == WORKER] == [False]
        assert compare(pipe, None, queries) == (0, 0)
    finally:
        pipe.close()


def test_hung_engine_stops_being_credited(h, kafka_bootstrap, new_topic, ports):
    """The engine process lives and keeps its sockets open, but its publisher thread no longer
    answers (a hung engine): no disconnect to see, so the liveness probe must catch it."""
    engine = Engine(h, *ports)
    wl = Workload(6)
    pipe = Pipeline(kafka_bootstrap, new_topic(), *ports, liveness_interval_s=0.5, replay_timeout_s=1.0)
    release = threading.Event()
    try:
        h.wait_for(lambda: pipe.bridge.known, "the bridge to sync")
        wl.run(engine, 40)
        engine.wait_sent(h)
        h.wait_for(lambda: pipe.bridge._expected == engine.batches, "the bridge to see every batch")
        pipe.catch_up(h)
        queries = wl.queries(QUERIES)
        assert pipe.trusted() and compare(pipe, engine, queries) == (0, 0)
        # vLLM's publisher thread blocks on the next replay request it services.
        engine.pub._service_replay = lambda: release.wait()
        h.wait_for(lambda: not pipe.bridge.known, "the bridge to give up on the engine")
        assert pipe.bridge.stats.disconnects == 0 and pipe.bridge.stats.replay_timeouts >= 1
        pipe.catch_up(h)
        assert not pipe.trusted() and compare(pipe, None, queries) == (0, 0)
    finally:
        release.set()
        pipe.close()
        engine.shutdown()


def test_restarted_engine_is_trusted_again_with_its_state(h, kafka_bootstrap, new_topic, ports):
    """A new engine process on the same endpoints, idle after a few requests: exact again."""
    engine = Engine(h, *ports)
    wl = Workload(3)
    pipe = Pipeline(kafka_bootstrap, new_topic(), *ports)
    try:
        h.wait_for(lambda: pipe.bridge.known, "the bridge to sync")
        wl.run(engine, 40)
        engine.wait_sent(h)
        h.wait_for(lambda: pipe.bridge._expected == engine.batches, "the bridge to see every batch")
        engine.shutdown()
        h.wait_for(lambda: not pipe.bridge.known, "the bridge to notice the engine is gone")
        engine = h.wait_for(lambda: _rebind(h, *ports), "the old engine's ports to be released")
        wl2 = Workload(4)
        wl2.run(engine, 30)
        engine.wait_sent(h)
        h.wait_for(lambda: pipe.bridge.known and pipe.bridge._expected == engine.batches, "a sync with the new engine")
        pipe.catch_up(h)
        assert pipe.trusted()
        queries = wl.queries(QUERIES // 2) + wl2.queries(QUERIES // 2)
        assert compare(pipe, engine, queries) == (0, 0)
    finally:
        pipe.close()
        engine.shutdown()


def _rebind(h, port, rport):
    try:
        return Engine(h, port, rport)
    except zmq.ZMQError:
        return None


def test_unrecoverable_gap_then_clear(h, kafka_bootstrap, new_topic, ports):
    """The engine ran past its replay buffer before the bridge came: what it holds cannot be
    known, so the worker is untrusted; vLLM's reset_prefix_cache (AllBlocksCleared) makes its
    state known again (empty), and what it stores afterwards is indexed exactly."""
    engine = Engine(h, *ports, buffer_steps=8)
    wl = Workload(5)
    try:
        wl.run(engine, 40)  # 40 batches, the replay buffer keeps the last 8
        engine.wait_sent(h)
        pipe = Pipeline(kafka_bootstrap, new_topic(), *ports)
        try:
            h.wait_for(lambda: pipe.bridge.stats.syncs >= 1, "the bridge to read the replay buffer")
            pipe.catch_up(h)
            assert not pipe.bridge.known and not pipe.trusted()
            queries = wl.queries(QUERIES)
            assert compare(pipe, None, queries)[1] == 0  # untrusted: no credit at all
            engine.reset_prefix_cache()
            wl.run(engine, 30)
            engine.wait_sent(h)
            h.wait_for(lambda: pipe.bridge._expected == engine.batches, "the bridge to see every batch")
            pipe.catch_up(h)
            assert pipe.bridge.known and pipe.trusted()
            queries = wl.queries(QUERIES)
            assert sum(engine.held_blocks(q) > 0 for q in queries) >= QUERIES // 3
            assert compare(pipe, engine, queries) == (0, 0)
        finally:
            pipe.close()
    finally:
        engine.shutdown()
