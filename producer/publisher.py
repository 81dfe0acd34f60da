"""Never-blocking Kafka publisher for KV-cache events.

An engine thread calls :meth:`RankStream.publish`; it only appends to a bounded
deque and returns. One background thread runs an asyncio loop with one
idempotent ``AIOKafkaProducer`` and does everything that costs: numbering,
encoding, sending, retrying, heartbeats. Loss is never hidden: whatever cannot
be sent (full buffer, cluster unreachable, unencodable input) is counted and
the next record of that rank carries it as ``gap``.

Ordering: one pump coroutine appends records to the producer in queue order;
aiokafka keeps one in-flight request per partition and the idempotent producer
keeps order across its retries, so a rank's records land in seq order.
"""

from __future__ import annotations

import asyncio
import atexit
import collections
import functools
import logging
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

from kvwire.schemas.codec import CONFLUENT, CONFLUENT_CONTENT_TYPE, CONTENT_TYPE, CURRENT, encode
from kvwire.schemas.events import EventBatch, KVEvent, WorkerId

from .config import PublisherConfig
from .partitioner import default_partition

if TYPE_CHECKING:
    from aiokafka import AIOKafkaProducer

__all__ = ["AckInfo", "KafkaPublisher", "PublisherConfig", "RankStream", "StreamStats"]

log = logging.getLogger("kvwire.producer")

HEADERS = [
    ("content-type", CONTENT_TYPE.encode()),
    ("schema", CURRENT.name.encode()),
    ("fingerprint", CURRENT.fingerprint_hex.encode()),
]
# aiokafka's default max_request_size; a bigger record would be refused by the producer anyway,
# better to count it here than to let it fail after a seq was spent on it.
_MAX_RECORD = 1024 * 1024 - 1024


def _new_epoch_id() -> int:
    # 63 bits: positive and safe as a signed Java/Avro long. secrets, not random: forked engine
    # processes must not share an incarnation.
    return secrets.randbits(63)


class _Epoch:
    __slots__ = ("base_lost", "id")

    def __init__(self, base_lost: int) -> None:
        self.id = _new_epoch_id()
        # Losses before the epoch began are moot: the reset record replaces the rank's state.
        self.base_lost = base_lost


class QueueItem(NamedTuple):
    """One batch waiting for the pump. Built on the engine thread under the stream's lock."""

    stream: RankStream
    events: tuple[KVEvent, ...]
    engine_ts: float | None
    ts_us: int
    epoch: _Epoch
    # The stream's upstream-loss count when this item was queued: losses counted after it
    # belong to the gap of a later record.
    lost_snap: int


@dataclass(frozen=True)
class AckInfo:
    worker: WorkerId
    epoch: int
    seq: int
    gap: int
    partition: int
    offset: int


@dataclass(frozen=True)
class StreamStats:
    worker: WorkerId
    source: str
    epoch: int
    published: int  # publish() calls that returned True
    sent: int  # records handed to the producer (seq numbers spent, heartbeats included)
    acked: int
    dropped: int  # publish() calls that returned False
    lost: int  # accepted but never sent: unencodable, refused, or cut off by close()
    failed: int  # sent but refused by the broker for good (leaves a seq hole, carried as gap)
    gaps_reported: int  # report_gap() totals
    gap_sent: int  # sum of `gap` over sent records
    queued: int
    next_seq: int


class RankStream:
    """One TP rank's stream: its own epoch and contiguous seq. Get one from
    :meth:`KafkaPublisher.stream`."""

    def __init__(self, pub: KafkaPublisher, worker: WorkerId, source: str) -> None:
        self._pub = pub
        self.worker = worker
        self.source = source
        self.key = worker.kafka_key()
        self._lock = threading.Lock()
        # Engine side, under _lock. _lost counts every batch lost upstream of the queue (drops
        # and report_gap); each queued item snapshots it so the loss lands in the gap of the
        # first record *after* it in stream order, not of one queued before it.
        self._lost = 0
        self._epoch = _Epoch(0)
        self._enq = 0
        self._last_ts_us = 0
        self.published = 0
        self.dropped = 0
        self.gaps_reported = 0
        self._garbage_logged = False
        # Loop side only.
        self._sent_epoch: _Epoch | None = None
        self._next_seq = 0
        self._accounted = 0
        self._carry = 0  # losses found in the loop, owed to the next record
        self._reset_due = False
        self._taken = 0
        self._partition: int | None = None
        self.sent = 0
        self.acked = 0
        self.lost = 0
        self.failed = 0
        self.gap_sent = 0

    @property
    def epoch(self) -> int:
        return self._epoch.id

    def publish(self, events: Sequence[KVEvent], engine_ts: float | None = None) -> bool:
        """Hand a batch over; True if it will be sent. Never blocks, never raises."""
        try:
            ts = time.time_ns() // 1000
            pub = self._pub
            try:
                events = tuple(events)
            except Exception:
                self._drop_garbage(events)
                return False
            with self._lock:
                if not pub.offer(QueueItem(self, events, engine_ts, ts, self._epoch, self._lost), bounded=True):
                    self._lost += 1
                    self.dropped += 1
                    return False
                self._last_ts_us = ts
                self.published += 1
                self._enq += 1
            pub.wake_if_idle()
            return True
        except Exception:  # the engine thread must never see our bugs
            log.exception("publish() failed internally; batch dropped")
            try:
                with self._lock:
                    self._lost += 1
                    self.dropped += 1
            except Exception:
                pass
            return False

    def _drop_garbage(self, events: object) -> None:
        with self._lock:
            self._lost += 1
            self.dropped += 1
        if not self._garbage_logged:
            self._garbage_logged = True
            log.warning(
                "%s: publish() got %s, not a sequence of events; dropped (logged once)",
                self.worker.rank,
                type(events).__name__,
            )

    def new_epoch(self) -> int:
        """The engine restarted: the next record opens a fresh epoch (reset, seq 0).
        Returns the new epoch id."""
        try:
            pub = self._pub
            ts = time.time_ns() // 1000
            with self._lock:
                self._epoch = ep = _Epoch(self._lost)
                # Past the bound on purpose: one per restart, and the reset record is what
                # tells consumers to drop the old incarnation's blocks.
                if pub.offer(QueueItem(self, (), None, ts, ep, self._lost), bounded=False):
                    self._enq += 1
                    self._last_ts_us = ts
            pub.wake()
            return ep.id
        except Exception:
            log.exception("new_epoch() failed internally")
            return self._epoch.id

    def report_gap(self, n: int = 1) -> None:
        """n batches were lost upstream (e.g. a ZMQ seq gap); the next record carries them."""
        try:
            n = int(n)
            if n <= 0:
                return
            with self._lock:
                self._lost += n
                self.gaps_reported += n
        except Exception:
            log.warning("report_gap(%r) ignored: not a count", n)

    # ------------------------------------------------ called by the publisher's loop thread

    def enqueue_empty(self, now_us: int, *, lost_snap: int | None = None) -> None:
        """Queue a record with no events (epoch announcement or heartbeat), past the bound."""
        with self._lock:
            snap = self._lost if lost_snap is None else lost_snap
            if self._pub.offer(QueueItem(self, (), None, now_us, self._epoch, snap), bounded=False):
                self._enq += 1
                self._last_ts_us = now_us

    def final_item(self, now_us: int) -> QueueItem:
        """An empty record past close()'s gate, carrying every loss so far (loop thread)."""
        with self._lock:
            self._enq += 1
            return QueueItem(self, (), None, now_us, self._epoch, self._lost)

    def owes_gap(self) -> bool:
        """Losses no sent record has owned up to yet (what the next record's gap would be)."""
        with self._lock:
            lost, epoch = self._lost, self._epoch
        if epoch is not self._sent_epoch:
            return lost > epoch.base_lost
        return lost - self._accounted + self._carry > 0

    def heartbeat_due(self, now_us: int, interval_us: int) -> bool:
        """Silent for an interval and nothing of ours still queued."""
        return now_us - self._last_ts_us >= interval_us and self._enq == self._taken

    def next_record(self, item: QueueItem) -> EventBatch:
        """Number the item: a new epoch restarts seq at 0 and owes a reset; the gap is every
        loss since the last record actually sent."""
        epoch = item.epoch
        if epoch is not self._sent_epoch:
            self._sent_epoch = epoch
            self._next_seq = 0
            self._accounted = epoch.base_lost
            self._carry = 0
            self._reset_due = True
        gap = item.lost_snap - self._accounted + self._carry
        return EventBatch(
            self.worker,
            epoch.id,
            self._next_seq,
            item.ts_us,
            item.events,
            item.engine_ts,
            self._reset_due,
            gap,
            self.source,
        )

    def spent(self, item: QueueItem, batch: EventBatch) -> None:
        """The record went to the producer: its seq is used and its gap delivered."""
        self._next_seq += 1
        self._reset_due = False
        self._accounted = item.lost_snap
        self._carry = 0
        self.sent += 1
        self.gap_sent += batch.gap

    def lose(self, item: QueueItem, gap: int, why: str) -> None:
        # The record's own loss plus the gap it would have carried move to the next record;
        # seq and the reset flag are not spent, so seq stays contiguous.
        self.lost += 1
        self._accounted = item.lost_snap
        self._carry = gap + 1
        log.warning("%s: batch lost: %s", self.worker.rank, why)

    def taken(self, *, lost: bool = False) -> None:
        """The pump is done with one queued item (lost: it will never be sent)."""
        self._taken += 1
        if lost:
            self.lost += 1

    def delivery_failed(self) -> None:
        # A non-retriable broker error after later records may already be out: a seq hole,
        # which the next record's gap also owns up to.
        self.failed += 1
        self._carry += 1

    def partition(self, num_partitions: int, fixed: int | None) -> int:
        if self._partition is None:
            self._partition = fixed if fixed is not None else default_partition(self.key, num_partitions)
        return self._partition

    def stats(self) -> StreamStats:
        return StreamStats(
            self.worker,
            self.source,
            self._epoch.id,
            self.published,
            self.sent,
            self.acked,
            self.dropped,
            self.lost,
            self.failed,
            self.gaps_reported,
            self.gap_sent,
            self._enq - self._taken,
            self._next_seq,
        )


class KafkaPublisher:
    """One background thread, one asyncio loop, one idempotent producer, many rank streams."""

    def __init__(
        self,
        config: PublisherConfig | None = None,
        *,
        on_ack: Callable[[AckInfo], None] | None = None,
    ) -> None:
        self.config = cfg = config or PublisherConfig()
        self._on_ack = on_ack
        self._q: collections.deque[QueueItem] = collections.deque()
        self._cap = cfg.queue_size
        self._streams: list[RankStream] = []
        self._accepting = True
        self._closing = False
        self._closed = False
        self._close_lock = threading.Lock()
        self._idle = False
        self._unreachable = False
        self._started = False
        self._producer: AIOKafkaProducer | None = None
        self._num_partitions: int | None = None
        # Confluent framing: the registry's id for CURRENT, resolved before the first send.
        self._schema_id: int | None = None
        self._registry_failures = 0
        self._headers = HEADERS
        self._unacked = 0
        self._acked_total = 0
        self._tasks: list[asyncio.Task] = []
        self._deadline = float("inf")
        self._loop = asyncio.new_event_loop()
        # Made in the loop thread (an Event binds to its loop); set before any task runs.
        self._wake_ev: asyncio.Event = None  # type: ignore[assignment]
        ready = threading.Event()
        self._thread = threading.Thread(target=self._thread_main, args=(ready,), name="kvwire-publisher", daemon=True)
        self._thread.start()
        ready.wait()
        atexit.register(self.close)

    # ---------------------------------------------------------------- public API

    def stream(self, worker: WorkerId, source: str = "", *, state_known: bool = True) -> RankStream:
        """A new rank stream; its first record (a reset) is queued at once.

        state_known=False is for a source that starts beside an engine already running (a bridge
        over ZMQ): the announcement then carries a gap, so consumers distrust the rank from its
        first record until the source has established the engine's state (a replay opening a new
        epoch, or a clear) instead of crediting it, for an instant, with an empty cache."""
        st = RankStream(self, worker, source)
        with self._close_lock:
            self._streams.append(st)
        if not state_known:
            st.report_gap(1)
        # Announce the epoch at once: consumers drop what this rank held before, even if the
        # engine stays idle.
        st.enqueue_empty(time.time_ns() // 1000)
        self.wake()
        return st

    def stats(self) -> list[StreamStats]:
        with self._close_lock:
            return [s.stats() for s in self._streams]

    @property
    def unreachable(self) -> bool:
        return self._unreachable

    def close(self, timeout: float | None = None) -> None:
        """Flush within the deadline, then stop the thread. Idempotent."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        atexit.unregister(self.close)
        budget = self.config.close_timeout_s if timeout is None else timeout
        deadline = time.monotonic() + max(0.0, budget)
        self._accepting = False
        self._closing = True
        try:
            fut = asyncio.run_coroutine_threadsafe(self._shutdown(deadline), self._loop)
            fut.result(timeout=max(0.0, deadline - time.monotonic()) + 10.0)
        except Exception:
            log.exception("publisher shutdown did not finish cleanly")
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10.0)

    def __enter__(self) -> KafkaPublisher:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------ called by RankStream (any thread)

    def offer(self, item: QueueItem, *, bounded: bool) -> bool:
        """Queue an item unless the publisher is closing or, when bounded, full or unreachable.
        Callers hold the item's stream lock, so the item's lost_snap is consistent."""
        if self._closing or (bounded and (not self._accepting or len(self._q) >= self._cap)):
            return False
        self._q.append(item)
        return True

    def wake_if_idle(self) -> None:
        if self._idle:
            self.wake()

    def wake(self) -> None:
        self._idle = False
        ev = self._wake_ev
        if ev is not None:
            try:
                self._loop.call_soon_threadsafe(ev.set)
            except RuntimeError:  # loop already closed
                pass

    def _thread_main(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self._loop)

        async def setup() -> None:
            self._wake_ev = asyncio.Event()
            self._progress_at = time.monotonic()
            self._tasks = [
                asyncio.create_task(self._pump(), name="kvwire-pump"),
                asyncio.create_task(self._heartbeats(), name="kvwire-heartbeats"),
                asyncio.create_task(self._watchdog(), name="kvwire-watchdog"),
            ]

        self._loop.run_until_complete(setup())
        ready.set()
        try:
            self._loop.run_forever()
        finally:
            try:
                pending = asyncio.all_tasks(self._loop)
                for t in pending:
                    t.cancel()
                if pending:
                    self._loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            finally:
                self._loop.close()

    async def _start_producer(self) -> None:
        from aiokafka import AIOKafkaProducer

        cfg = self.config
        failures = 0
        while not self._closing:
            producer = AIOKafkaProducer(
                bootstrap_servers=cfg.bootstrap_servers,
                enable_idempotence=True,
                linger_ms=cfg.linger_ms,
                max_batch_size=cfg.max_batch_size,
                compression_type=cfg.compression_type,
                **cfg.client_options,
            )
            try:
                if cfg.framing == CONFLUENT and self._schema_id is None:
                    await self._resolve_schema_id()
                await producer.start()
                await self._ensure_topic()
                parts = await producer.partitions_for(cfg.topic)
                self._num_partitions = len(parts)
                self._producer = producer
                self._started = True
                log.info(
                    "publisher connected to %s, topic %s (%d partitions)", cfg.bootstrap_servers, cfg.topic, len(parts)
                )
                return
            except Exception as e:
                failures += 1
                # Once loudly, then quietly: the watchdog reports the outage itself.
                log.log(
                    logging.WARNING if failures == 1 else logging.DEBUG,
                    "Kafka producer start failed (%s: %s); retrying",
                    type(e).__name__,
                    e,
                )
                try:
                    await asyncio.wait_for(producer.stop(), 5)
                except Exception:
                    pass
                await asyncio.sleep(cfg.retry_backoff_s)

    async def _resolve_schema_id(self) -> None:
        """Registers (or looks up) the current version under the subject; a refusal (409) is
        retried like an outage, so records wait in the bounded queue and then count as a gap."""
        from kvwire.registry.client import RegistryClient, RegistryConfig, topic_subject
        from kvwire.registry.shipped import writer_id

        cfg = self.config
        reg = RegistryConfig.from_env(cfg.schema_registry_url)
        if reg is None:
            raise ValueError("framing='confluent' needs schema_registry_url or KVWIRE_SCHEMA_REGISTRY_URL")
        subject = cfg.schema_subject or topic_subject(cfg.topic)
        try:
            sid = await asyncio.to_thread(writer_id, RegistryClient(reg), subject, CURRENT, cfg.auto_register_schema)
        except Exception as e:
            # Once loudly, then quietly (retried every retry_backoff_s, like the broker).
            self._registry_failures += 1
            level = logging.ERROR if self._registry_failures == 1 else logging.DEBUG
            log.log(level, "schema registry %s: no id for %s under %s: %s", reg.url, CURRENT.name, subject, e)
            raise
        self._headers = [
            ("content-type", CONFLUENT_CONTENT_TYPE.encode()),
            ("schema", CURRENT.name.encode()),
            ("schema-id", str(sid).encode()),
        ]
        self._schema_id = sid
        log.info("publisher frames records as Confluent, %s = schema id %d under %s", CURRENT.name, sid, subject)

    async def _ensure_topic(self) -> None:
        from kvwire.topics import Replication, ensure_topic

        cfg = self.config
        await ensure_topic(
            cfg.bootstrap_servers,
            cfg.topic,
            cfg.partitions,
            replication=Replication.from_env(
                replication_factor=cfg.replication_factor, min_insync_replicas=cfg.min_insync_replicas
            ),
            client_options=cfg.client_options,
        )

    async def _pump(self) -> None:
        await self._start_producer()
        if not self._started:
            return  # closed before Kafka ever answered; _shutdown counts the queue as lost
        q = self._q
        ev = self._wake_ev
        poll, deep = self.config.poll_interval_s, self.config.sleep_after_idle_s
        idle_since = None
        final: set[RankStream] = set()
        while True:
            if not q:
                if self._closing:
                    # Batches dropped at the very end have no later record to carry their gap:
                    # one last empty record per such stream owns up to them (once: if that one
                    # is lost too, close() has nothing left to say it with).
                    owing = [st for st in self._streams if st not in final and st.owes_gap()]
                    if not owing:
                        return
                    now_us = time.time_ns() // 1000
                    for st in owing:
                        final.add(st)
                        q.append(st.final_item(now_us))
                    continue
                now = time.monotonic()
                if idle_since is None:
                    idle_since = now
                if now - idle_since < deep:
                    await asyncio.sleep(poll)
                    continue
                self._idle = True
                if not q:  # re-check after raising the flag: publish() appends, then reads it
                    await ev.wait()
                ev.clear()
                self._idle = False
                idle_since = None
                continue
            idle_since = None
            # Peek, pop only once handled: the head still counts against the bound meanwhile.
            item = q[0]
            await self._send_item(item)
            q.popleft()
            item.stream.taken()

    async def _send_item(self, item: QueueItem) -> None:
        st = item.stream
        batch = st.next_record(item)
        try:
            value = encode(batch, schema_id=self._schema_id)
            if len(value) > _MAX_RECORD:
                raise ValueError(f"record of {len(value)} bytes exceeds {_MAX_RECORD}")
        except Exception as e:
            st.lose(item, batch.gap, f"unencodable batch ({type(e).__name__}: {e})")
            return
        assert self._num_partitions is not None  # set before the pump runs
        partition = st.partition(self._num_partitions, self.config.partition)
        fut = await self._append(value, st, partition, item.ts_us)
        if fut is None:
            st.lose(item, batch.gap, "producer refused the record")
            return
        st.spent(item, batch)
        self._unacked += 1
        fut.add_done_callback(
            functools.partial(self._delivered, st=st, epoch=batch.epoch, seq=batch.seq, gap=batch.gap)
        )

    async def _append(self, value: bytes, st: RankStream, partition: int, ts_us: int) -> asyncio.Future[Any] | None:
        """Appends to the producer; retries what is retriable until close() gives up on it."""
        from aiokafka.errors import KafkaError, KafkaTimeoutError

        cfg = self.config
        while True:
            assert self._producer is not None  # the pump starts it before sending
            try:
                return await self._producer.send(
                    cfg.topic, value, key=st.key, partition=partition, timestamp_ms=ts_us // 1000, headers=self._headers
                )
            except (KafkaTimeoutError, KafkaError) as e:
                if not (isinstance(e, KafkaTimeoutError) or getattr(e, "retriable", False)):
                    log.error("%s: record refused: %s: %s", st.worker.rank, type(e).__name__, e)
                    return None
                if self._closing and time.monotonic() > self._deadline:
                    return None
                await asyncio.sleep(cfg.retry_backoff_s)
            except Exception as e:
                log.error("%s: record refused: %s: %s", st.worker.rank, type(e).__name__, e)
                return None

    def _delivered(self, fut: asyncio.Future[Any], *, st: RankStream, epoch: int, seq: int, gap: int) -> None:
        self._unacked -= 1
        if fut.cancelled() or fut.exception() is not None:
            # Only non-retriable broker errors get here (idempotent batches never expire while a
            # leader is known).
            st.delivery_failed()
            log.error(
                "%s: record epoch=%d seq=%d failed: %r",
                st.worker.rank,
                epoch,
                seq,
                None if fut.cancelled() else fut.exception(),
            )
            return
        md = fut.result()
        st.acked += 1
        self._acked_total += 1
        if self._on_ack is not None:
            try:
                self._on_ack(AckInfo(st.worker, epoch, seq, gap, md.partition, md.offset))
            except Exception:
                log.exception("on_ack hook failed")

    async def _heartbeats(self) -> None:
        interval_us = int(self.config.heartbeat_interval_s * 1e6)
        tick = min(self.config.heartbeat_interval_s / 4, 1.0)
        while True:
            await asyncio.sleep(tick)
            if self._unreachable or self._closing:
                continue
            now = time.time_ns() // 1000
            added = False
            for st in list(self._streams):
                if st.heartbeat_due(now, interval_us):
                    st.enqueue_empty(now)
                    added = True
            if added:
                self._wake_ev.set()

    async def _watchdog(self) -> None:
        # Unreachable = work waiting and no acknowledgement for unreachable_timeout_s. Records
        # already accepted stay queued (bounded) and go out when the cluster is back.
        timeout = self.config.unreachable_timeout_s
        seen = -1
        while True:
            await asyncio.sleep(min(0.1, timeout / 4))
            now = time.monotonic()
            busy = bool(self._q) or self._unacked > 0 or not self._started
            if not busy or self._acked_total != seen:
                seen = self._acked_total
                self._progress_at = now
            stalled = busy and now - self._progress_at > timeout
            if stalled != self._unreachable:
                self._unreachable = stalled
                if stalled:
                    log.error("Kafka unreachable for %.1fs: dropping new batches", timeout)
                else:
                    log.warning("Kafka reachable again: accepting batches")
            self._accepting = not stalled and not self._closing

    async def _shutdown(self, deadline: float) -> None:
        self._deadline = deadline
        self._accepting = False
        self._closing = True
        self._wake_ev.set()
        pump = self._tasks[0]
        remaining = lambda: max(0.0, deadline - time.monotonic())
        try:
            await asyncio.wait_for(asyncio.shield(pump), remaining())
        except (TimeoutError, Exception):
            pump.cancel()
            await asyncio.gather(pump, return_exceptions=True)
        # Whatever is still queued could not be sent in time: count it, there is no next record.
        while self._q:
            self._q.popleft().stream.taken(lost=True)
        producer = self._producer
        if producer is not None:
            try:
                await asyncio.wait_for(producer.flush(), remaining())
            except (TimeoutError, Exception):
                log.error("close(): %d records unacknowledged at the deadline", self._unacked)
                # aiokafka's stop() waits for every pending batch forever and offers no public
                # way to abandon them (AIOKafkaProducer has no close(timeout) like the Java
                # client), so close()'s deadline can only be kept by failing the accumulator's
                # batches directly. Pinned aiokafka versions keep this attribute.
                from aiokafka.errors import KafkaTimeoutError

                producer._message_accumulator.fail_all(KafkaTimeoutError())
            try:
                await asyncio.wait_for(producer.stop(), max(remaining(), 2.0))
            except (TimeoutError, Exception):
                log.exception("producer.stop() did not finish")
        for t in self._tasks[1:]:
            t.cancel()
