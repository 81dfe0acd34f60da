"""The engine side of a rank's stream: what an engine thread calls, and the hand-off it feeds.

:meth:`RankStream.publish` runs on the engine's scheduler thread, so it never blocks (a stall
there is lost throughput for every request) and never raises (our bug must not become the
engine's). It only appends to the bounded :class:`Handoff` and returns. What it cannot hand over
is counted, never hidden: the rank's next record carries it as ``gap``
(:mod:`kvwire.producer.ledger` does that arithmetic, on the loop thread).
"""

from __future__ import annotations

import collections
import logging
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

from kvwire.schemas.events import KVEvent, WorkerId

from .ledger import RankLedger, StreamStats

log = logging.getLogger("kvwire.producer")


def _new_epoch_id() -> int:
    # 63 bits: positive and safe as a signed Java/Avro long. secrets, not random: forked engine
    # processes must not share an incarnation.
    return secrets.randbits(63)


class Epoch:
    __slots__ = ("base_lost", "id")

    def __init__(self, base_lost: int) -> None:
        self.id = _new_epoch_id()
        # Losses before the epoch began are moot: the reset record replaces the rank's state.
        self.base_lost = base_lost


class QueueItem(NamedTuple):
    """One batch waiting for the sender. Built on the engine thread under the stream's lock."""

    ledger: RankLedger
    events: tuple[KVEvent, ...]
    engine_ts: float | None
    ts_us: int
    epoch: Epoch
    # The stream's upstream-loss count when this item was queued: losses counted after it
    # belong to the gap of a later record.
    lost_snap: int


class Handoff:
    """The bounded queue from engine threads to the sender's loop, and the gate in front of it.

    The flags are plain attributes written by the loop and read by engine threads without a
    lock: a stale read lets one batch in or keeps one out, and either way it is counted."""

    def __init__(self, cap: int) -> None:
        self.items: collections.deque[QueueItem] = collections.deque()
        self.cap = cap
        self.accepting = True  # False while the cluster is unreachable, and from close() on
        self.closing = False
        self.idle = False  # the loop sleeps until woken, instead of polling
        # Set by the sender once its loop can be woken; until then wake() has nothing to do.
        self.waker: Callable[[], None] | None = None

    def offer(self, item: QueueItem, *, bounded: bool) -> bool:
        """Queue an item unless closing or, when bounded, full or not accepting. Callers hold
        the item's stream lock, so the item's lost_snap is consistent."""
        if self.closing or (bounded and (not self.accepting or len(self.items) >= self.cap)):
            return False
        self.items.append(item)
        return True

    def wake_if_idle(self) -> None:
        # While traffic flows the loop polls: waking it would be a syscall on the engine thread.
        if self.idle:
            self.wake()

    def wake(self) -> None:
        self.idle = False
        waker = self.waker
        if waker is not None:
            waker()


class RankStream:
    """One TP rank's stream: its own epoch and contiguous seq. Get one from
    :meth:`KafkaPublisher.stream`."""

    def __init__(self, handoff: Handoff, worker: WorkerId, source: str) -> None:
        self._handoff = handoff
        self.worker = worker
        self.source = source
        self.key = worker.kafka_key()
        self._lock = threading.Lock()
        # Under _lock. _lost counts every batch lost upstream of the queue (drops and
        # report_gap); each queued item snapshots it so the loss lands in the gap of the first
        # record *after* it in stream order, not of one queued before it.
        self._lost = 0
        self._epoch = Epoch(0)
        self.enqueued = 0  # items ever queued; the ledger counts those it has taken
        self.last_ts_us = 0  # when the last item was queued: heartbeats fill the silences
        self.published = 0
        self.dropped = 0
        self.gaps_reported = 0
        self._garbage_logged = False
        # The loop thread's half of this rank; the engine thread never touches it.
        self.ledger = RankLedger(self)

    @property
    def epoch(self) -> int:
        return self._epoch.id

    def publish(self, events: Sequence[KVEvent], engine_ts: float | None = None) -> bool:
        """Hand a batch over; True if it will be sent. Never blocks, never raises."""
        try:
            ts = time.time_ns() // 1000
            handoff = self._handoff
            try:
                events = tuple(events)
            except Exception:
                self._drop_garbage(events)
                return False
            with self._lock:
                item = QueueItem(self.ledger, events, engine_ts, ts, self._epoch, self._lost)
                if not handoff.offer(item, bounded=True):
                    self._lost += 1
                    self.dropped += 1
                    return False
                self.last_ts_us = ts
                self.published += 1
                self.enqueued += 1
            handoff.wake_if_idle()
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
            handoff = self._handoff
            ts = time.time_ns() // 1000
            with self._lock:
                self._epoch = ep = Epoch(self._lost)
                # Past the bound on purpose: one per restart, and the reset record is what
                # tells consumers to drop the old incarnation's blocks.
                if handoff.offer(QueueItem(self.ledger, (), None, ts, ep, self._lost), bounded=False):
                    self.enqueued += 1
                    self.last_ts_us = ts
            handoff.wake()
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

    def stats(self) -> StreamStats:
        return self.ledger.stats()

    # ------------------------------------- called by the loop thread; they need the lock

    def enqueue_empty(self, now_us: int) -> None:
        """Queue a record with no events (epoch announcement or heartbeat), past the bound."""
        with self._lock:
            if self._handoff.offer(QueueItem(self.ledger, (), None, now_us, self._epoch, self._lost), bounded=False):
                self.enqueued += 1
                self.last_ts_us = now_us

    def final_item(self, now_us: int) -> QueueItem:
        """An empty record past close()'s gate, carrying every loss so far."""
        with self._lock:
            self.enqueued += 1
            return QueueItem(self.ledger, (), None, now_us, self._epoch, self._lost)

    def losses(self) -> tuple[int, Epoch]:
        """Every upstream loss so far and the epoch they count against, read together."""
        with self._lock:
            return self._lost, self._epoch
