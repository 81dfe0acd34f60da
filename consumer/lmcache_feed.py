"""Feed LMCache's coordinator topic into an index: read, convert at the edge, apply.

The topic's records become ``EventBatch``es in ``lmcache_topic`` and go through
``Applier.apply_batch``, the path every kvwire record takes, so fencing, gaps,
trust and scoring are the same as for any other source.

The feed reads every partition from the log start and commits nothing (its consumer
group is its own and only makes Kafka assign it every partition, as they appear): the
converter is rebuilt from the log, as LMCache's own coordinator rebuilds its
directory from the topic. Its workers are filed under an origin of their own
(``FeedOrigin(SOURCE, partition)``), so a rebalance of the kvwire topic
(``Applier.drop_partitions``) never drops them and snapshots of the kvwire
topic never hold them. A record that cannot be converted or applied is
dead-lettered through the applier (``IndexMember`` writes it to the DLQ) and
its instance's next record carries a gap.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

from aiokafka import AIOKafkaConsumer, ConsumerRebalanceListener

from kvwire.kafka.options import consumer_options
from kvwire.kafka.positions import seek_to_beginning
from kvwire.producer.lmcache_topic import SOURCE, LmcacheTopicConverter, TopicRecordError

from .apply import Applier, DeadLetter, FeedOrigin

log = logging.getLogger(__name__)


class _FromWhereWeWere(ConsumerRebalanceListener):
    """A partition seen before continues where the feed was (the converter has its past);
    a new one is read from its start."""

    def __init__(self, feed: LmcacheTopicFeed):
        self.feed = feed

    async def on_partitions_revoked(self, revoked) -> None:
        pass

    async def on_partitions_assigned(self, assigned) -> None:
        c = self.feed._consumer
        assert c is not None
        for tp in assigned:
            pos = self.feed.positions.get(tp.partition)
            if pos is None:
                await seek_to_beginning(c, tp)
            else:
                c.seek(tp, pos)


class LmcacheTopicFeed:
    def __init__(
        self,
        applier: Applier,
        bootstrap_servers: str,
        topic: str,
        converter: LmcacheTopicConverter | None = None,
        client_options: dict | None = None,
        model: str | None = None,
    ):
        self.applier = applier
        self.bootstrap_servers = bootstrap_servers
        self.topic = topic
        self.converter = (
            converter if converter is not None else LmcacheTopicConverter(model=model, tp_size_hint=self._tp_size)
        )
        self.client_options = dict(client_options or {})
        self.positions: dict[int, int] = {}
        self.records = 0
        self.dead = 0
        self._consumer: AIOKafkaConsumer | None = None
        self._task: asyncio.Task | None = None
        self._stop = asyncio.Event()

    def _tp_size(self, instance_id: str) -> int | None:
        return self.applier.ranks.tp_size.get((instance_id, 0))

    # ------------------------------------------------------------ one record

    def apply_record(self, partition: int, offset: int, key: bytes | None, value: bytes | None, ts_ms: int) -> int:
        """Convert and apply one record; returns the EventBatches applied. Never raises
        for bad input: the record is dead-lettered and a gap recorded."""
        self.records += 1
        self.positions[partition] = offset + 1
        try:
            batches = self.converter.convert_record(key, value)
        except TopicRecordError as e:
            self._dead(partition, offset, key, value, str(e), ts_ms)
            return 0
        applied = 0
        for b in batches:
            try:
                self.applier.apply_batch(b, FeedOrigin(SOURCE, partition))
                applied += 1
            except Exception as e:  # the index refused it: lost to this worker's view
                self.converter.mark_lost(b.worker.instance_id)
                self._dead(partition, offset, key, value, f"apply failed: {type(e).__name__}: {e}", ts_ms)
                break
        return applied

    def _dead(self, partition: int, offset: int, key, value, error: str, ts_ms: int) -> None:
        self.dead += 1
        log.warning("LMCache coordinator record %s[%d]@%d dead-lettered: %s", self.topic, partition, offset, error)
        self.applier.dead_letters.append(DeadLetter(self.topic, partition, offset, key, value, error, ts_ms))
        self.applier.metrics.dead_letters.inc()

    # ------------------------------------------------------------ consuming

    async def start(self) -> None:
        # A group of its own, never committing: it only makes Kafka hand this feed every
        # partition, including a topic created after the index started and partitions added later.
        c = AIOKafkaConsumer(
            bootstrap_servers=self.bootstrap_servers,
            group_id=f"kvwire-lmcache-feed-{uuid.uuid4().hex[:12]}",
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            # A topic LMCache creates later is only seen at a metadata refresh.
            **consumer_options(self.client_options),
        )
        await c.start()
        self._consumer = c
        c.subscribe([self.topic], listener=_FromWhereWeWere(self))
        self._task = asyncio.create_task(self._run(), name=f"kvwire-lmcache-feed-{self.topic}")

    async def _run(self) -> None:
        c = self._consumer
        assert c is not None
        while not self._stop.is_set():
            try:
                got = await c.getmany(timeout_ms=200, max_records=2000)
            except Exception as e:
                log.warning("LMCache coordinator topic poll failed, retrying: %r", e)
                await asyncio.sleep(0.5)
                continue
            for tp, recs in got.items():
                for r in recs:
                    self.apply_record(tp.partition, r.offset, r.key, r.value, r.timestamp)
                await asyncio.sleep(0)  # let HTTP readers in between partitions

    async def caught_up(self, timeout_s: float = 60.0) -> bool:
        """Wait until every partition is read up to the end offsets seen once assigned."""
        c = self._consumer
        assert c is not None
        deadline = time.monotonic() + timeout_s
        while not c.assignment() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        tps = sorted(c.assignment())
        if not tps:
            return False
        ends = await c.end_offsets(tps)
        while time.monotonic() < deadline:
            if all(self.positions.get(tp.partition, 0) >= end for tp, end in ends.items() if end > 0):
                return True
            await asyncio.sleep(0.05)
        return False

    async def stop(self) -> None:
        self._stop.set()
        if self._task is not None:
            try:
                await asyncio.wait_for(self._task, 10)
            except (TimeoutError, Exception) as e:  # stopping must not raise
                log.warning("LMCache feed ended badly: %r", e)
        if self._consumer is not None:
            try:
                await self._consumer.stop()
            except Exception as e:
                log.warning("LMCache feed consumer stop failed: %r", e)


async def feed_member(member, topic: str, model: str | None = None) -> LmcacheTopicFeed:
    """Start feeding an ``IndexMember``'s applier from LMCache's coordinator topic too, with
    the member's broker and client options; its dead letters go out through the member's DLQ."""
    cfg = member.config
    feed = LmcacheTopicFeed(
        member.applier, cfg.bootstrap_servers, topic, client_options=cfg.client_options, model=model
    )
    await feed.start()
    return feed


__all__ = ["LmcacheTopicFeed", "feed_member"]
