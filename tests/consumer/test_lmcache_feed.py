"""LMCache's coordinator topic through the real broker into the index.

LMCache's own ``CacheEventSubscriber`` and ``KafkaCacheEventSink`` write the topic
(see lmcache_mp.py for what is stood in for: the storage engine raising the bus
events); ``LmcacheTopicFeed`` reads it into an ``Applier``. Every score is checked
against the placements LMCache's key directory would hold (``MpServer.truth``)."""

from __future__ import annotations

import asyncio
import random

import pytest
from lmcache_mp import MpServer, require

from kvwire.consumer.apply import Applier
from kvwire.consumer.lmcache_feed import LmcacheTopicFeed

pytestmark = pytest.mark.lmcache
CHUNK = 4


@pytest.fixture(autouse=True)
def _engines():
    require("lmcache.v1.mp_coordinator.cache_events")
    require("confluent_kafka")
    require("blake3")


def matched(applier: Applier, tokens, instance: str, **kw) -> int:
    for s in applier.score(tokens, **kw):
        if (s.instance_id, s.dp_rank) == (instance, 0):
            return s.matched_tokens
    return 0


def by_medium(applier: Applier, tokens, instance: str) -> dict[str, int]:
    for s in applier.score(tokens):
        if (s.instance_id, s.dp_rank) == (instance, 0):
            return dict(s.by_medium)
    return {}


async def fed(bootstrap: str, topic: str) -> tuple[Applier, LmcacheTopicFeed]:
    a = Applier()
    feed = LmcacheTopicFeed(a, bootstrap, topic)
    await feed.start()
    assert await feed.caught_up()
    return a, feed


def seqs(rng: random.Random, n: int, base: list[int] | None = None) -> list[int]:
    return (base or []) + [rng.randrange(1, 50_000) for _ in range(n)]


async def test_stores_deletes_and_tp_ranks_match_lmcache_placements(kafka_bootstrap, new_topic):
    topic = new_topic(2)
    rng = random.Random(7)
    srv = MpServer(kafka_bootstrap, topic, "lmc-a", incarnation=1_000, world=2, chunk=CHUNK)
    a_toks = seqs(rng, 3 * CHUNK)
    b_toks = a_toks[:CHUNK] + seqs(rng, 2 * CHUNK)  # shares chunk 0 with A
    c_toks = seqs(rng, 4 * CHUNK)
    srv.store(b_toks[: 2 * CHUNK])  # B's first two chunks ...
    srv.store(c_toks, l2="fs")
    srv.flush()
    # ... then, in one batch: A's whole sequence, and B's third chunk on its own (a
    # continuation store). A's second chunk ends where B's third begins: only the chunk
    # hash tells which one is B's parent.
    srv.store(a_toks)
    srv.store(b_toks, start=2 * CHUNK)
    srv.flush()
    srv.store(c_toks, l2="fs")  # stored again: LMCache keeps one placement ...
    srv.access(srv.hashes(c_toks)[:1])
    srv.evict(srv.hashes(c_toks)[2:3], l2="fs")  # ... so one delete removes it from L2
    # C's last chunk: rank 1 keeps it in L1 only, rank 0 in L2 only; no medium has both ranks.
    srv.evict(srv.hashes(c_toks)[3:4], ranks=[0])
    srv.evict(srv.hashes(c_toks)[3:4], ranks=[1], l2="fs")
    srv.evict(srv.hashes(a_toks)[2:3])  # A's last chunk leaves L1 on both ranks
    srv.close()

    applier, feed = await fed(kafka_bootstrap, topic)
    try:
        mixed = a_toks[: 2 * CHUNK] + b_toks[2 * CHUNK :]
        queries = [a_toks, b_toks, c_toks, mixed, b_toks[: 2 * CHUNK] + a_toks[2 * CHUNK :]]
        queries += [q[:n] for q in (a_toks, b_toks, c_toks) for n in range(1, len(q) + 1, 3)]
        for q in queries:
            assert matched(applier, q, "lmc-a") == srv.expected_tokens(q), q
        # the cases above, spelled out: nothing here is vacuous
        assert srv.expected_tokens(b_toks) == 3 * CHUNK
        assert srv.expected_tokens(mixed) == 2 * CHUNK  # B's third chunk is not chained under A's second
        assert srv.expected_tokens(a_toks) == 2 * CHUNK
        assert srv.expected_tokens(c_toks) == 3 * CHUNK
        for medium, placement in (("CPU", ("l1", "dram")), ("l2:fs", ("l2", "fs"))):
            for q in queries:
                assert by_medium(applier, q, "lmc-a").get(medium, 0) == srv.expected_tokens(q, placement), (medium, q)
        assert srv.expected_tokens(c_toks, ("l2", "fs")) == 2 * CHUNK  # one delete after two stores
        assert feed.converter.stats.chained > 0 and feed.converter.stats.orphaned == 0
        w = {x["instance_id"]: x for x in applier.workers()}["lmc-a"]
        assert w["trusted"] and w["tp_size"] == 2
        assert not applier.dead_letters
    finally:
        await feed.stop()


async def test_salts_are_isolated(kafka_bootstrap, new_topic):
    topic = new_topic()
    rng = random.Random(11)
    srv = MpServer(kafka_bootstrap, topic, "lmc-s", incarnation=5, chunk=CHUNK)
    toks = seqs(rng, 3 * CHUNK)
    srv.store(toks, salt="tenant-1")
    srv.close()
    applier, feed = await fed(kafka_bootstrap, topic)
    try:
        assert srv.expected_tokens(toks, salt="tenant-1") == 3 * CHUNK
        assert matched(applier, toks, "lmc-s", extra_keys=[("tenant-1",)]) == 3 * CHUNK
        assert matched(applier, toks, "lmc-s") == srv.expected_tokens(toks) == 0
        assert matched(applier, toks, "lmc-s", extra_keys=[("tenant-2",)]) == 0
    finally:
        await feed.stop()


async def test_restart_fences_the_old_incarnation(kafka_bootstrap, new_topic):
    topic = new_topic()
    rng = random.Random(3)
    old_toks, new_toks, late_toks = seqs(rng, 2 * CHUNK), seqs(rng, 2 * CHUNK), seqs(rng, 2 * CHUNK)
    old = MpServer(kafka_bootstrap, topic, "lmc-r", incarnation=100, chunk=CHUNK)
    old.store(old_toks)
    old.flush(delivered=True)
    new = MpServer(kafka_bootstrap, topic, "lmc-r", incarnation=200, chunk=CHUNK)
    new.store(new_toks)
    new.close()
    old.store(late_toks)  # a zombie of the old process flushing after the restart
    old.close()
    applier, feed = await fed(kafka_bootstrap, topic)
    try:
        # the restarted process's memory is empty: the old incarnation's L1 blocks are gone
        assert matched(applier, old_toks, "lmc-r") == 0
        assert matched(applier, late_toks, "lmc-r") == 0
        assert matched(applier, new_toks, "lmc-r") == new.expected_tokens(new_toks) == 2 * CHUNK
        assert feed.converter.stats.stale == 1
    finally:
        await feed.stop()


async def test_a_lost_batch_distrusts_the_instance_until_it_restarts(kafka_bootstrap, new_topic):
    from lmcache.v1.mp_coordinator.cache_events import CacheEventPublishError, KafkaCacheEventSink
    from lmcache.v1.multiprocess.config import KafkaCacheEventSinkConfig

    class Flaky(KafkaCacheEventSink):
        """LMCache's sink, refusing one publish (a full buffer): LMCache drops the batch
        and its seq number is spent, so the topic has a hole."""

        fail_next = False

        def publish(self, batches):
            if self.fail_next:
                self.fail_next = False
                raise CacheEventPublishError("buffer full")
            super().publish(batches)

    topic = new_topic()
    rng = random.Random(5)
    t1, t2, t3 = seqs(rng, 2 * CHUNK), seqs(rng, 2 * CHUNK), seqs(rng, 2 * CHUNK)
    sink = Flaky(KafkaCacheEventSinkConfig(kafka_bootstrap, topic))
    srv = MpServer(kafka_bootstrap, topic, "lmc-g", incarnation=1, chunk=CHUNK, sink=sink)
    srv.store(t1)
    srv.flush()
    sink.fail_next = True
    srv.store(t2)
    srv.flush()
    srv.store(t3)
    srv.close()
    applier, feed = await fed(kafka_bootstrap, topic)
    try:
        assert all(matched(applier, t, "lmc-g") == 0 for t in (t1, t2, t3))
        w = {x["instance_id"]: x for x in applier.workers()}["lmc-g"]
        assert not w["trusted"] and "missing" in w["ranks"][0]["untrusted_reason"]
        # the instance restarts: its new incarnation starts from nothing, and is trusted
        again = MpServer(kafka_bootstrap, topic, "lmc-g", incarnation=2, chunk=CHUNK)
        again.store(t3)
        again.close()
        assert await feed.caught_up()
        assert matched(applier, t3, "lmc-g") == again.expected_tokens(t3) == 2 * CHUNK
    finally:
        await feed.stop()


async def test_a_malformed_record_is_dead_lettered_and_reported_as_a_gap(kafka_bootstrap, new_topic):
    from aiokafka import AIOKafkaProducer

    topic = new_topic()
    rng = random.Random(9)
    t1, t2 = seqs(rng, 2 * CHUNK), seqs(rng, 2 * CHUNK)
    srv = MpServer(kafka_bootstrap, topic, "lmc-m", incarnation=1, chunk=CHUNK)
    srv.store(t1)
    srv.close()
    p = AIOKafkaProducer(bootstrap_servers=kafka_bootstrap)
    await p.start()
    try:
        await p.send_and_wait(topic, b'{"batches": [{"instance_id": "lmc-m", "seq": "x"}]}', key=b"lmc-m")
    finally:
        await p.stop()
    srv.sub._seq += 1  # the garbage took the place of one of this instance's batches
    srv.store(t2)
    srv.sub.flush()
    srv.sink.close()
    applier, feed = await fed(kafka_bootstrap, topic)
    try:
        assert len(applier.dead_letters) == 1 and applier.dead_letters[0].key == b"lmc-m"
        assert "CacheEventsRequest" in applier.dead_letters[0].error
        w = {x["instance_id"]: x for x in applier.workers()}["lmc-m"]
        assert not w["trusted"]
        assert matched(applier, t1, "lmc-m") == 0
    finally:
        await feed.stop()
    await asyncio.sleep(0)


async def test_an_index_member_serves_the_coordinator_topic_beside_its_own(kafka_bootstrap, new_topic):
    """What `kvwire index --lmcache-topic` runs: one applier, the member's own topic and the
    coordinator topic; a rebalance of the member's topic leaves LMCache's workers alone."""
    from aiokafka import AIOKafkaProducer

    from kvwire.consumer.ingest import IndexMember, IngestConfig
    from kvwire.consumer.lmcache_feed import feed_member
    from kvwire.schemas import codec
    from kvwire.schemas.events import EventBatch, WorkerId, stored

    events_topic, lm_topic = new_topic(), new_topic()
    rng = random.Random(13)
    lm_toks, vllm_toks = seqs(rng, 2 * CHUNK), seqs(rng, 3 * 16)
    srv = MpServer(kafka_bootstrap, lm_topic, "lmc-i", incarnation=1, chunk=CHUNK)
    srv.store(lm_toks)
    srv.close()
    w = WorkerId("vllm-i", 0, 0, 1)
    rec = EventBatch(w, 42, 0, 1, (stored([1, 2, 3], vllm_toks, 16),), reset=True)
    p = AIOKafkaProducer(bootstrap_servers=kafka_bootstrap)
    await p.start()
    try:
        await p.send_and_wait(events_topic, codec.encode(rec), key=w.kafka_key())
    finally:
        await p.stop()
    member = IndexMember(IngestConfig(kafka_bootstrap, events_topic))
    await member.start()
    feed = None
    try:
        feed = await feed_member(member, lm_topic)
        assert await feed.caught_up()
        for _ in range(600):
            if member.ready:
                break
            await asyncio.sleep(0.05)
        a = member.applier
        assert matched(a, lm_toks, "lmc-i") == srv.expected_tokens(lm_toks) == 2 * CHUNK
        assert matched(a, vllm_toks, "vllm-i") == 48
        a.drop_partitions({0})  # the member's partition 0 moves away
        assert matched(a, vllm_toks, "vllm-i") == 0
        assert matched(a, lm_toks, "lmc-i") == 2 * CHUNK
    finally:
        if feed is not None:
            await feed.stop()
        await member.stop()


async def test_a_coordinator_topic_created_after_the_feed_started_is_read(kafka_bootstrap):
    import uuid

    from kafka_admin import create_topics, delete_topics

    topic = f"t-lmcache-late-{uuid.uuid4().hex[:8]}"
    a = Applier()
    feed = LmcacheTopicFeed(a, kafka_bootstrap, topic)
    await feed.start()
    try:
        await asyncio.sleep(1)
        await create_topics(kafka_bootstrap, [topic], 1, None)
        toks = seqs(random.Random(1), 2 * CHUNK)
        srv = MpServer(kafka_bootstrap, topic, "lmc-late", incarnation=1, chunk=CHUNK)
        srv.store(toks)
        srv.close()
        assert await feed.caught_up(timeout_s=120)
        assert matched(a, toks, "lmc-late") == srv.expected_tokens(toks) == 2 * CHUNK
    finally:
        await feed.stop()
        await delete_topics(kafka_bootstrap, [topic])


def test_kvwire_index_serves_the_coordinator_topic(kafka_bootstrap, new_topic):
    """`kvwire index --lmcache-topic`: the real command, its HTTP API answering for LMCache's blocks."""
    import json
    import socket
    import subprocess
    import sys
    import time
    import urllib.request

    events_topic, lm_topic = new_topic(), new_topic()
    toks = seqs(random.Random(21), 3 * CHUNK)
    srv = MpServer(kafka_bootstrap, lm_topic, "lmc-cli", incarnation=1, chunk=CHUNK)
    srv.store(toks)
    srv.close()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "kvwire.cli", "index", "-b", kafka_bootstrap, "-t", events_topic]
    cmd += ["--http", f"127.0.0.1:{port}", "--no-snapshots", "--lmcache-topic", lm_topic, "--lmcache-model", "m"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        got, end = None, time.monotonic() + 120
        while time.monotonic() < end and proc.poll() is None:
            try:
                req = urllib.request.Request(
                    f"http://127.0.0.1:{port}/v1/score", data=json.dumps({"token_ids": toks}).encode(), method="POST"
                )
                scores = json.loads(urllib.request.urlopen(req, timeout=5).read())["scores"]
                got = {s["instance_id"]: s["matched_tokens"] for s in scores}.get("lmc-cli")
                if got:
                    break
            except OSError:
                pass
            time.sleep(0.2)
        assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
        assert got == srv.expected_tokens(toks) == 3 * CHUNK
    finally:
        proc.terminate()
        proc.wait(30)
