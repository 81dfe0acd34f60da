"""KafkaPublisher against a real broker: placement, order, epochs, heartbeats, loss accounting."""

from __future__ import annotations

import asyncio
import threading
import time
import uuid

import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.partitioner import DefaultPartitioner

from kvwire.kafka.positions import seek_to_beginning
from kvwire.producer.partitioner import default_partition
from kvwire.producer.publisher import KafkaPublisher, PublisherConfig
from kvwire.schemas.codec import CONTENT_TYPE, CURRENT, decode
from kvwire.schemas.events import AllBlocksCleared, BlockRemoved, WorkerId, stored

pytestmark = pytest.mark.integration


def one_block(i: int):
    # The block hash doubles as the test's batch id: order and duplicates are checked on it.
    return [stored([i], [i % 1000] * 16, 16, medium="GPU")]


def fresh_topic() -> str:
    return f"t-pub-{uuid.uuid4().hex[:10]}"


async def read_all(bootstrap: str, topic: str, partitions: int) -> list:
    """Every record of the topic: (partition, offset, headers, EventBatch), by partition/offset."""
    c = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False, auto_offset_reset="earliest")
    await c.start()
    try:
        tps = [TopicPartition(topic, p) for p in range(partitions)]
        c.assign(tps)
        await seek_to_beginning(c, *tps)
        end = await c.end_offsets(tps)
        out = []
        async with asyncio.timeout(60):
            while [tp for tp in tps if await c.position(tp) < end[tp]]:
                for tp, recs in (await c.getmany(timeout_ms=500)).items():
                    out.extend((tp.partition, r.offset, dict(r.headers), decode(r.value)) for r in recs)
        return sorted(out, key=lambda r: (r[0], r[1]))
    finally:
        await c.stop()


def by_rank(records) -> dict:
    out: dict = {}
    for part, _off, _h, b in records:
        out.setdefault(b.worker.rank, []).append((part, b))
    return out


def wait_for(pred, timeout=60.0, what="condition"):
    # A guard against hangs, not a timing assertion: the condition itself is what is tested.
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up waiting for {what}")
        time.sleep(0.02)


def config(bootstrap: str, topic: str, **kw) -> PublisherConfig:
    kw.setdefault("heartbeat_interval_s", 3600)  # no heartbeats unless a test wants them
    return PublisherConfig(bootstrap_servers=bootstrap, topic=topic, **kw)


def check_stream(batches, *, epochs=1):
    """Within each epoch: seq 0.. contiguous, reset exactly on seq 0."""
    seen_epochs = []
    for b in batches:
        if not seen_epochs or seen_epochs[-1][0] != b.epoch:
            seen_epochs.append((b.epoch, []))
        seen_epochs[-1][1].append(b)
    assert len(seen_epochs) == epochs
    for _, bs in seen_epochs:
        assert [b.seq for b in bs] == list(range(len(bs)))
        assert [b.reset for b in bs] == [True] + [False] * (len(bs) - 1)


async def test_explicit_partition_order_reset_headers(kafka_bootstrap):
    topic = fresh_topic()
    pub = KafkaPublisher(config(kafka_bootstrap, topic, partitions=4, partition=2))
    workers = [WorkerId("inst-x", 0, tp, 2) for tp in range(2)]
    streams = [pub.stream(w, source="test") for w in workers]
    for i in range(300):
        for s in streams:
            assert s.publish(one_block(i), engine_ts=float(i))
    pub.close()
    recs = await read_all(kafka_bootstrap, topic, 4)
    assert {p for p, *_ in recs} == {2}
    for _p, _o, headers, _b in recs:
        assert headers == {
            "content-type": CONTENT_TYPE.encode(),
            "schema": CURRENT.name.encode(),
            "fingerprint": CURRENT.fingerprint_hex.encode(),
        }
    ranks = by_rank(recs)
    for s, w in zip(streams, workers, strict=False):
        batches = [b for _, b in ranks[w.rank]]
        check_stream(batches)
        assert batches[0].events == () and batches[0].epoch == s.epoch  # the epoch announcement
        assert [b.events[0].block_hashes[0] for b in batches[1:]] == list(range(300))
        assert [b.engine_ts for b in batches[1:]] == [float(i) for i in range(300)]
        assert all(b.gap == 0 and b.source == "test" and b.worker == w for b in batches)
        st = s.stats()
        assert (st.published, st.sent, st.acked, st.dropped, st.queued) == (300, 301, 301, 0, 0)


async def test_default_partition_is_kafka_murmur2(kafka_bootstrap, new_topic):
    topic = new_topic(partitions=7)  # pre-created: the publisher must use what exists
    pub = KafkaPublisher(config(kafka_bootstrap, topic, partitions=3))
    workers = [WorkerId(f"inst-{i}", dp) for i in range(6) for dp in range(2)]
    for w in workers:
        s = pub.stream(w)
        for i in range(5):
            s.publish(one_block(i))
    pub.close()
    ranks = by_rank(await read_all(kafka_bootstrap, topic, 7))
    used = set()
    for w in workers:
        parts = {p for p, _ in ranks[w.rank]}
        expect = default_partition(w.kafka_key(), 7)
        assert parts == {expect}
        assert expect == DefaultPartitioner()(w.kafka_key(), list(range(7)), list(range(7)))
        used.add(expect)
        check_stream([b for _, b in ranks[w.rank]])
    assert len(used) > 1


async def test_new_epoch_resets_seq(kafka_bootstrap):
    topic = fresh_topic()
    pub = KafkaPublisher(config(kafka_bootstrap, topic, partitions=1))
    s = pub.stream(WorkerId("restarts", 0))
    first = s.epoch
    for i in range(5):
        s.publish(one_block(i))
    second = s.new_epoch()
    assert second != first and s.epoch == second
    for i in range(5, 8):
        s.publish(one_block(i))
    pub.close()
    batches = [b for _, b in by_rank(await read_all(kafka_bootstrap, topic, 1))[("restarts", 0, 0)]]
    check_stream(batches, epochs=2)
    assert [b.epoch for b in batches] == [first] * 6 + [second] * 4
    assert batches[6].reset and batches[6].seq == 0 and batches[6].events == ()


async def test_stream_with_unknown_state_announces_a_gap(kafka_bootstrap):
    # A source beside an engine already running (the ZMQ bridge) must not be credited with an
    # empty cache while it learns the engine's state: its first record carries a gap; a source
    # that starts with the engine announces a clean reset; the next epoch (state established)
    # is clean again.
    topic = fresh_topic()
    pub = KafkaPublisher(config(kafka_bootstrap, topic, partitions=1))
    late = pub.stream(WorkerId("late", 0), state_known=False)
    fresh = pub.stream(WorkerId("fresh", 0))
    late.publish(one_block(1))
    late.new_epoch()
    fresh.publish(one_block(2))
    pub.close()
    ranks = {r: [b for _, b in bs] for r, bs in by_rank(await read_all(kafka_bootstrap, topic, 1)).items()}
    late_b, fresh_b = ranks[("late", 0, 0)], ranks[("fresh", 0, 0)]
    assert (late_b[0].reset, late_b[0].gap, late_b[0].events) == (True, 1, ())
    assert [b.gap for b in late_b[1:]] == [0, 0] and late_b[2].reset and late_b[2].epoch != late_b[0].epoch
    assert [(b.reset, b.gap) for b in fresh_b] == [(True, 0), (False, 0)]
    assert late.stats().gaps_reported == 1 and fresh.stats().gaps_reported == 0


async def test_heartbeats_when_idle(kafka_bootstrap):
    topic = fresh_topic()
    pub = KafkaPublisher(config(kafka_bootstrap, topic, partitions=1, heartbeat_interval_s=0.2))
    s = pub.stream(WorkerId("idle", 0))
    s.publish(one_block(1))
    wait_for(lambda: s.stats().acked >= 5, what="heartbeats")
    s.report_gap(3)  # upstream loss while idle: the next heartbeat owns up to it
    wait_for(lambda: s.stats().gap_sent == 3, what="gap on a heartbeat")
    pub.close()
    batches = [b for _, b in by_rank(await read_all(kafka_bootstrap, topic, 1))[("idle", 0, 0)]]
    check_stream(batches)
    assert batches[1].events and all(not b.events for b in batches[2:])
    assert all(b.is_heartbeat for b in batches[2:] if not b.gap)
    assert sum(b.gap for b in batches) == 3


async def test_overflow_is_dropped_and_counted_into_gap(kafka_bootstrap):
    topic = fresh_topic()
    pub = KafkaPublisher(config(kafka_bootstrap, topic, partitions=1, queue_size=3))
    s = pub.stream(WorkerId("busy", 0))
    wait_for(lambda: s.stats().acked == 1, what="epoch announcement")
    # Hold the loop thread so nothing drains: exactly queue_size batches fit, the rest drop.
    gate = threading.Event()
    pub._loop.call_soon_threadsafe(gate.wait)
    results = [s.publish(one_block(i)) for i in range(10)]
    results += [s.publish(one_block(10))]
    gate.set()
    wait_for(lambda: s.stats().queued == 0, what="drain")
    results += [s.publish(one_block(11))]
    pub.close()
    assert results == [True] * 3 + [False] * 8 + [True]
    batches = [b for _, b in by_rank(await read_all(kafka_bootstrap, topic, 1))[("busy", 0, 0)]]
    check_stream(batches)
    assert [b.events[0].block_hashes[0] for b in batches[1:]] == [0, 1, 2, 11]
    assert [b.gap for b in batches] == [0, 0, 0, 0, 8]
    st = s.stats()
    assert st.dropped == 8 and st.gap_sent == 8 and st.published == 4


async def test_losses_at_the_very_end_are_carried_by_a_last_record_at_close(kafka_bootstrap):
    # Dropped after the last accepted batch, with nothing published later: without a record
    # of its own the loss would never reach the log, and a consumer would trust the stream.
    topic = fresh_topic()
    pub = KafkaPublisher(config(kafka_bootstrap, topic, partitions=1, queue_size=2))
    s = pub.stream(WorkerId("tail", 0))
    wait_for(lambda: s.stats().acked == 1, what="epoch announcement")
    gate = threading.Event()
    pub._loop.call_soon_threadsafe(gate.wait)
    results = [s.publish(one_block(i)) for i in range(7)]
    s.report_gap(2)
    gate.set()
    pub.close()
    assert results == [True] * 2 + [False] * 5
    batches = [b for _, b in by_rank(await read_all(kafka_bootstrap, topic, 1))[("tail", 0, 0)]]
    check_stream(batches)
    assert [len(b.events) for b in batches] == [0, 1, 1, 0]
    assert [b.gap for b in batches] == [0, 0, 0, 7]
    assert s.stats().gap_sent == 7


async def test_publish_never_raises_on_garbage(kafka_bootstrap):
    topic = fresh_topic()
    pub = KafkaPublisher(config(kafka_bootstrap, topic, partitions=1))
    s = pub.stream(WorkerId("garbage", 0))

    class Exploding:
        def __iter__(self):
            raise RuntimeError("boom")

    garbage = [
        (None, None),
        (5, None),
        (Exploding(), None),
        ([1, 2], None),
        ("abc", None),
        (one_block(1), "not-a-float"),
        ([stored([-1, 1 << 64], [0] * 32, 16)], None),  # hashes fit neither int64 nor uint64
        ([BlockRemoved(("mixed", 1))], None),
    ]
    for events, ts in garbage:
        assert s.publish(events, engine_ts=ts) in (True, False)
    s.report_gap("x")
    assert s.publish([AllBlocksCleared()]) is True
    pub.close()
    batches = [b for _, b in by_rank(await read_all(kafka_bootstrap, topic, 1))[("garbage", 0, 0)]]
    check_stream(batches)
    assert len(batches) == 2 and batches[1].events == (AllBlocksCleared(),)
    st = s.stats()
    assert st.dropped + st.lost == len(garbage) == batches[1].gap


async def test_close_flushes_and_is_idempotent(kafka_bootstrap):
    topic = fresh_topic()
    pub = KafkaPublisher(config(kafka_bootstrap, topic, partitions=2, linger_ms=50))
    s = pub.stream(WorkerId("flush", 0))
    for i in range(2000):
        assert s.publish(one_block(i))
    pub.close()
    pub.close()
    assert s.publish(one_block(0)) is False
    batches = [b for _, b in by_rank(await read_all(kafka_bootstrap, topic, 2))[("flush", 0, 0)]]
    assert [b.events[0].block_hashes[0] for b in batches[1:]] == list(range(2000))
    assert s.stats().acked == 2001


def test_close_with_no_broker_returns_and_counts():
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # closed once the with-block ends: nothing listens
    pub = KafkaPublisher(
        PublisherConfig(
            bootstrap_servers=f"127.0.0.1:{port}", topic="nowhere", retry_backoff_s=0.05, unreachable_timeout_s=0.3
        )
    )
    s = pub.stream(WorkerId("lonely", 0))
    assert s.publish(one_block(1)) is True
    wait_for(lambda: pub.unreachable, what="unreachable")
    assert s.publish(one_block(2)) is False
    pub.close(timeout=0.5)
    st = s.stats()
    assert (st.published, st.dropped, st.sent, st.lost, st.queued) == (1, 1, 0, 2, 0)


async def test_acks_name_each_records_own_partition_and_offset(kafka_bootstrap):
    """Records go to aiokafka a batch per partition: each ack's offset is its base offset plus
    the record's place in the batch, and must be where the broker holds that very record."""
    topic = fresh_topic()
    acks = []
    pub = KafkaPublisher(config(kafka_bootstrap, topic, partitions=3), on_ack=acks.append)
    streams = [pub.stream(WorkerId(f"ack{w}", w % 2)) for w in range(6)]
    for i in range(1500):  # faster than the pump's passes: batches of many records each
        assert streams[i % 6].publish(one_block(i))
    pub.close()
    records = await read_all(kafka_bootstrap, topic, 3)
    held = {(part, off): (b.worker.rank, b.epoch, b.seq) for part, off, _h, b in records}
    assert len(acks) == len(records) == 1500 + 6  # each stream's reset record first
    assert {(a.partition, a.offset): (a.worker.rank, a.epoch, a.seq) for a in acks} == held
    for s in streams:
        st = s.stats()
        assert (st.published, st.sent, st.acked, st.failed, st.queued) == (250, 251, 251, 0, 0)


@pytest.mark.parametrize("compression", [None, "zstd"])
async def test_every_codec_round_trips_in_order(kafka_bootstrap, compression):
    """Uncompressed is the default (producer/config.py says why); zstd stays one setting away,
    and either way the consumer sees every record, in order, as published."""
    assert PublisherConfig().compression_type is None
    topic = fresh_topic()
    pub = KafkaPublisher(config(kafka_bootstrap, topic, partitions=1, compression_type=compression))
    s = pub.stream(WorkerId("inst-c", 0, 0, 1), source="test")
    for i in range(200):
        assert s.publish(one_block(i))
    pub.close()
    batches = [b for *_, b in await read_all(kafka_bootstrap, topic, 1)]
    check_stream(batches)
    assert [b.events[0].block_hashes[0] for b in batches[1:]] == list(range(200))
    assert s.stats().acked == 201


def test_an_unknown_codec_is_refused_when_configured():
    with pytest.raises(ValueError, match="compression_type must be one of"):
        PublisherConfig(compression_type="brotli")
