"""The sender: one background thread, one asyncio loop, one idempotent ``AIOKafkaProducer``.

Everything that costs happens here, off the engine thread: numbering (through each rank's
ledger), encoding, sending, retrying, heartbeats, and noticing that the cluster is unreachable.

Ordering: one pump coroutine appends records to the producer in queue order; aiokafka keeps one
in-flight request per partition and the idempotent producer keeps order across its retries, so a
rank's records land in seq order.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvwire.schemas.codec import encode
from kvwire.schemas.events import WorkerId

from .config import PublisherConfig
from .connect import HEADERS, connect
from .ledger import RankLedger
from .stream import Handoff

if TYPE_CHECKING:
    from aiokafka import AIOKafkaProducer

log = logging.getLogger("kvwire.producer")

# aiokafka's default max_request_size; a bigger record would be refused by the producer anyway,
# better to count it here than to let it fail after a seq was spent on it.
MAX_RECORD = 1024 * 1024 - 1024
# Queued items taken into batches per pass; the loop's other tasks run between passes.
MAX_TAKE = 4096

# A record in a batch: its rank's ledger, epoch, seq and gap.
_Sent = tuple[RankLedger, int, int, int]


class _Batch:
    """One partition's batch being filled, and the records in it in offset order."""

    __slots__ = ("builder", "records")

    def __init__(self, builder: Any) -> None:
        self.builder = builder
        self.records: list[_Sent] = []

    def add(self, key: bytes, value: bytes, ts_us: int, headers: Any) -> bool:
        return self.builder.append(timestamp=ts_us // 1000, key=key, value=value, headers=headers) is not None


@dataclass(frozen=True)
class AckInfo:
    worker: WorkerId
    epoch: int
    seq: int
    gap: int
    partition: int
    offset: int


class Sender:
    """Drains the hand-off into Kafka. ``ledgers`` is the publisher's list: it grows as streams
    are made, and the loop reads it as it is."""

    def __init__(
        self,
        config: PublisherConfig,
        handoff: Handoff,
        ledgers: list[RankLedger],
        on_ack: Callable[[AckInfo], None] | None,
    ) -> None:
        self.config = config
        self._handoff = handoff
        self._ledgers = ledgers
        self._on_ack = on_ack
        self.unreachable = False
        self._started = False
        self._producer: AIOKafkaProducer | None = None
        self._num_partitions: int | None = None
        # Confluent framing: the registry's id for CURRENT, resolved before the first send.
        self._schema_id: int | None = None
        self._headers = HEADERS
        self._unacked = 0
        self._acked_total = 0
        self._tasks: list[asyncio.Task] = []
        self._deadline = float("inf")
        self.loop = asyncio.new_event_loop()
        # Made in the loop thread (an Event binds to its loop); set before any task runs.
        self._wake_ev: asyncio.Event = None  # type: ignore[assignment]
        self._thread = threading.Thread(target=self._thread_main, name="kvwire-publisher", daemon=True)
        self._ready = threading.Event()

    def start(self) -> None:
        """Start the thread; returns once the loop can be woken and its tasks are running."""
        self._thread.start()
        self._ready.wait()

    def stop(self, deadline: float) -> None:
        """Flush until ``deadline`` (time.monotonic()), then end the loop and its thread. The
        hand-off must be closed first, so nothing new arrives meanwhile."""
        try:
            fut = asyncio.run_coroutine_threadsafe(self._shutdown(deadline), self.loop)
            fut.result(timeout=max(0.0, deadline - time.monotonic()) + 10.0)
        except Exception:
            log.exception("publisher shutdown did not finish cleanly")
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=10.0)

    # ---------------------------------------------------------------- the loop thread

    def _wake(self) -> None:
        try:
            self.loop.call_soon_threadsafe(self._wake_ev.set)
        except RuntimeError:  # loop already closed
            pass

    def _thread_main(self) -> None:
        asyncio.set_event_loop(self.loop)

        async def setup() -> None:
            self._wake_ev = asyncio.Event()
            self._handoff.waker = self._wake
            self._progress_at = time.monotonic()
            self._tasks = [
                asyncio.create_task(self._pump(), name="kvwire-pump"),
                asyncio.create_task(self._heartbeats(), name="kvwire-heartbeats"),
                asyncio.create_task(self._watchdog(), name="kvwire-watchdog"),
            ]

        self.loop.run_until_complete(setup())
        self._ready.set()
        try:
            self.loop.run_forever()
        finally:
            try:
                pending = asyncio.all_tasks(self.loop)
                for t in pending:
                    t.cancel()
                if pending:
                    self.loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            finally:
                self.loop.close()

    async def _start_producer(self) -> None:
        conn = await connect(self.config, lambda: self._handoff.closing)
        if conn is None:
            return
        self._producer, self._num_partitions = conn.producer, conn.num_partitions
        self._headers, self._schema_id = conn.headers, conn.schema_id
        self._started = True

    async def _pump(self) -> None:
        await self._start_producer()
        if not self._started:
            return  # closed before Kafka ever answered; _shutdown counts the queue as lost
        handoff = self._handoff
        q = handoff.items
        ev = self._wake_ev
        poll, deep = self.config.poll_interval_s, self.config.sleep_after_idle_s
        idle_since = None
        final: set[RankLedger] = set()
        while True:
            if not q:
                if handoff.closing:
                    # Batches dropped at the very end have no later record to carry their gap:
                    # one last empty record per such stream owns up to them (once: if that one
                    # is lost too, close() has nothing left to say it with).
                    owing = [led for led in self._ledgers if led not in final and led.owes_gap()]
                    if not owing:
                        return
                    now_us = time.time_ns() // 1000
                    for led in owing:
                        final.add(led)
                        q.append(led.stream.final_item(now_us))
                    continue
                now = time.monotonic()
                if idle_since is None:
                    idle_since = now
                if now - idle_since < deep:
                    await asyncio.sleep(poll)
                    continue
                handoff.idle = True
                if not q:  # re-check after raising the flag: publish() appends, then reads it
                    await ev.wait()
                ev.clear()
                handoff.idle = False
                idle_since = None
                continue
            idle_since = None
            await self._send_queued()

    async def _send_queued(self) -> None:
        """What is queued now, as one batch per partition handed to aiokafka whole: its
        per-record send() costs ~9 us of CPU a record (a future each, metadata checks), a batch
        ~3 us (40k records to a local broker, zstd, idempotent, linger 1 ms), all of it on the
        engine's GIL. An item leaves the queue once its record is in a batch; a batch
        that never reaches aiokafka (refused for good, or close()'s deadline) fails its records
        as a broker refusal would: each leaves a seq hole that the next record's gap owns."""
        q = self._handoff.items
        assert self._producer is not None and self._num_partitions is not None  # set before the pump runs
        producer, n_parts, fixed = self._producer, self._num_partitions, self.config.partition
        open_: dict[int, _Batch] = {}
        try:
            for _ in range(min(len(q), MAX_TAKE)):
                # Peek, pop only once in a batch: the head still counts against the bound meanwhile.
                item = q[0]
                led = item.ledger
                rec = led.next_record(item)
                try:
                    value = encode(rec, schema_id=self._schema_id)
                    if len(value) > MAX_RECORD:
                        raise ValueError(f"record of {len(value)} bytes exceeds {MAX_RECORD}")
                except Exception as e:
                    led.lose(item, rec.gap, f"unencodable batch ({type(e).__name__}: {e})")
                else:
                    part = led.partition(n_parts, fixed)
                    b = open_.get(part)
                    if b is None or not b.add(led.stream.key, value, item.ts_us, self._headers):
                        if b is not None:  # full: it goes now, and a new one takes the record
                            del open_[part]
                            await self._submit(b, part)
                        b = open_[part] = _Batch(producer.create_batch())
                        if not b.add(led.stream.key, value, item.ts_us, self._headers):
                            # aiokafka's builder takes any first record; should one ever
                            # refuse it, the record is lost, and counted.
                            led.lose(item, rec.gap, "producer refused the record")
                            b = None
                    if b is not None:
                        led.spent(item, rec)
                        self._unacked += 1
                        b.records.append((led, rec.epoch, rec.seq, rec.gap))
                q.popleft()
                led.taken()
            while open_:
                part, b = open_.popitem()
                await self._submit(b, part)
        except BaseException:
            for b in open_.values():
                self._fail(b.records, "close() came before the batch reached the producer")
            raise

    async def _submit(self, b: _Batch, partition: int) -> None:
        """Hands a batch to aiokafka; retries what is retriable until close() gives up on it."""
        from aiokafka.errors import KafkaError, KafkaTimeoutError

        cfg = self.config
        b.builder.close()
        while True:
            assert self._producer is not None  # the pump starts it before sending
            try:
                fut = await self._producer.send_batch(b.builder, cfg.topic, partition=partition)
                break
            except (KafkaTimeoutError, KafkaError) as e:
                if not (isinstance(e, KafkaTimeoutError) or getattr(e, "retriable", False)):
                    self._fail(b.records, f"batch refused: {type(e).__name__}: {e}")
                    return
                if self._handoff.closing and time.monotonic() > self._deadline:
                    self._fail(b.records, "close() came before the batch reached the producer")
                    return
                await asyncio.sleep(cfg.retry_backoff_s)
            except asyncio.CancelledError:
                self._fail(b.records, "close() came before the batch reached the producer")
                raise
            except Exception as e:
                self._fail(b.records, f"batch refused: {type(e).__name__}: {e}")
                return
        fut.add_done_callback(functools.partial(self._delivered, records=b.records))

    def _fail(self, records: list[_Sent], why: str) -> None:
        for led, epoch, seq, _gap in records:
            self._unacked -= 1
            led.delivery_failed()
            log.error("%s: record epoch=%d seq=%d failed: %s", led.stream.worker.rank, epoch, seq, why)
        records.clear()

    def _delivered(self, fut: asyncio.Future[Any], *, records: list[_Sent]) -> None:
        if fut.cancelled() or fut.exception() is not None:
            # Only non-retriable broker errors get here (idempotent batches never expire while a
            # leader is known).
            self._fail(records, repr(None if fut.cancelled() else fut.exception()))
            return
        md = fut.result()
        for i, (led, epoch, seq, gap) in enumerate(records):
            self._unacked -= 1
            led.acked += 1
            self._acked_total += 1
            if self._on_ack is not None:
                try:
                    # A batch's records take consecutive offsets from its base offset.
                    self._on_ack(AckInfo(led.stream.worker, epoch, seq, gap, md.partition, md.offset + i))
                except Exception:
                    log.exception("on_ack hook failed")

    async def _heartbeats(self) -> None:
        interval_us = int(self.config.heartbeat_interval_s * 1e6)
        tick = min(self.config.heartbeat_interval_s / 4, 1.0)
        while True:
            await asyncio.sleep(tick)
            if self.unreachable or self._handoff.closing:
                continue
            now = time.time_ns() // 1000
            added = False
            for led in list(self._ledgers):
                if led.heartbeat_due(now, interval_us):
                    led.stream.enqueue_empty(now)
                    added = True
            if added:
                self._wake_ev.set()

    async def _watchdog(self) -> None:
        # Unreachable = work waiting and no acknowledgement for unreachable_timeout_s. Records
        # already accepted stay queued (bounded) and go out when the cluster is back.
        timeout = self.config.unreachable_timeout_s
        handoff = self._handoff
        seen = -1
        while True:
            await asyncio.sleep(min(0.1, timeout / 4))
            now = time.monotonic()
            busy = bool(handoff.items) or self._unacked > 0 or not self._started
            if not busy or self._acked_total != seen:
                seen = self._acked_total
                self._progress_at = now
            stalled = busy and now - self._progress_at > timeout
            if stalled != self.unreachable:
                self.unreachable = stalled
                if stalled:
                    log.error("Kafka unreachable for %.1fs: dropping new batches", timeout)
                else:
                    log.warning("Kafka reachable again: accepting batches")
            handoff.accepting = not stalled and not handoff.closing

    async def _shutdown(self, deadline: float) -> None:
        handoff = self._handoff
        self._deadline = deadline
        handoff.accepting = False
        handoff.closing = True
        self._wake_ev.set()
        pump = self._tasks[0]
        remaining = lambda: max(0.0, deadline - time.monotonic())
        try:
            await asyncio.wait_for(asyncio.shield(pump), remaining())
        except (TimeoutError, Exception):
            pump.cancel()
            await asyncio.gather(pump, return_exceptions=True)
        # Whatever is still queued could not be sent in time: count it, there is no next record.
        while handoff.items:
            handoff.items.popleft().ledger.taken(lost=True)
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
