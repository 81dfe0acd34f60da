"""The loop side of a rank's stream: numbering and loss accounting, on the sender's thread only.

Per rank it holds the epoch being sent, the next seq, the reset still owed, and the carry: losses
found after an item left the engine (unencodable, refused, failed delivery) that the next record
sent must own up to. Seq numbers are spent only on records handed to the producer, so a rank's
seq stays contiguous and every loss shows up as ``gap`` instead of as a silent hole.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvwire.schemas.events import EventBatch, WorkerId

from .partitioner import default_partition

if TYPE_CHECKING:
    from .stream import Epoch, QueueItem, RankStream

log = logging.getLogger("kvwire.producer")


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


class RankLedger:
    """One rank's bookkeeping on the loop thread; its engine-side half is ``stream``."""

    def __init__(self, stream: RankStream) -> None:
        self.stream = stream
        self._sent_epoch: Epoch | None = None
        self._next_seq = 0
        self._accounted = 0  # the stream's loss count that the last record sent owned up to
        self._carry = 0  # losses found in the loop, owed to the next record
        self._reset_due = False
        self._taken = 0
        self._partition: int | None = None
        self.sent = 0
        self.acked = 0
        self.lost = 0
        self.failed = 0
        self.gap_sent = 0

    def owes_gap(self) -> bool:
        """Losses no sent record has owned up to yet (what the next record's gap would be)."""
        lost, epoch = self.stream.losses()
        if epoch is not self._sent_epoch:
            return lost > epoch.base_lost
        return lost - self._accounted + self._carry > 0

    def heartbeat_due(self, now_us: int, interval_us: int) -> bool:
        """Silent for an interval and nothing of ours still queued."""
        st = self.stream
        return now_us - st.last_ts_us >= interval_us and st.enqueued == self._taken

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
        st = self.stream
        return EventBatch(
            st.worker,
            epoch.id,
            self._next_seq,
            item.ts_us,
            item.events,
            item.engine_ts,
            self._reset_due,
            gap,
            st.source,
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
        log.warning("%s: batch lost: %s", self.stream.worker.rank, why)

    def taken(self, *, lost: bool = False) -> None:
        """The sender is done with one queued item (lost: it will never be sent)."""
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
            self._partition = fixed if fixed is not None else default_partition(self.stream.key, num_partitions)
        return self._partition

    def stats(self) -> StreamStats:
        st = self.stream
        return StreamStats(
            st.worker,
            st.source,
            st.epoch,
            st.published,
            self.sent,
            self.acked,
            st.dropped,
            self.lost,
            self.failed,
            st.gaps_reported,
            self.gap_sent,
            st.enqueued - self._taken,
            self._next_seq,
        )
