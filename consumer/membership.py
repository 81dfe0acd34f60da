"""Consumer-group membership of an index member: which partitions it holds and where it reads.

On assignment a new partition's state is rebuilt from the log (from its newest snapshot when a
snapshot store is configured, else from the beginning); a partition that moved away is
snapshotted and dropped. Eager rebalancing revokes everything first, so state is kept until
the new assignment says which partitions really moved. Offsets are committed only after the
records before them are applied, and the dead letters before the commit that passes them.
Ready means caught up with the end offsets seen when the partitions were assigned.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from aiokafka import AIOKafkaConsumer, ConsumerRebalanceListener, TopicPartition
from aiokafka.structs import OffsetAndMetadata

from kvwire.kafka.options import consumer_options

from .apply import Applier
from .dead_letters import DeadLetterWriter

if TYPE_CHECKING:
    from .ingest import IngestConfig

log = logging.getLogger(__name__)


class _Rebalance(ConsumerRebalanceListener):
    def __init__(self, membership: Membership):
        self.membership = membership

    async def on_partitions_revoked(self, revoked):
        await self.membership.on_revoked({tp.partition for tp in revoked})

    async def on_partitions_assigned(self, assigned):
        await self.membership.on_assigned({tp.partition for tp in assigned})


class Membership:
    def __init__(
        self, config: IngestConfig, group_id: str, applier: Applier, dead_letters: DeadLetterWriter, snapshots: Any
    ):
        self.config = config
        self.group_id = group_id
        self.applier = applier
        self.dead_letters = dead_letters
        self.snapshots = snapshots
        self.assigned: set[int] = set()
        self.assigning = False
        self._pending_revoke: set[int] = set()
        self._targets: dict[int, int] = {}  # end offsets seen at assignment
        self._starts: dict[int, int] = {}  # log start offsets at assignment
        self._ready = False
        self._last_commit = 0.0
        self._committed: dict[int, int] = {}
        self.consumer: AIOKafkaConsumer | None = None

    def make_consumer(self) -> AIOKafkaConsumer:
        self.consumer = AIOKafkaConsumer(
            bootstrap_servers=self.config.bootstrap_servers,
            group_id=self.group_id,
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            # bench/kafka_side.py: 500-10,000 records x 1-32 MiB fetch at the same CPU per block
            # within noise (aiokafka's per-record objects dominate), so these stay.
            max_partition_fetch_bytes=4 * 1024 * 1024,
            fetch_max_wait_ms=self.config.fetch_max_wait_ms,
            # A member may start before any producer created its topic.
            **consumer_options(self.config.client_options),
        )
        return self.consumer

    def subscribe(self) -> None:
        assert self.consumer is not None
        self.consumer.subscribe([self.config.topic], listener=_Rebalance(self))

    @property
    def ready(self) -> bool:
        if not self._ready and self.assigned and not self.assigning:
            pos = self.applier.positions
            if all(pos.get(p, self._starts.get(p, 0)) >= t for p, t in self._targets.items()):
                self._ready = True
        return self._ready

    def owns(self, partition: int) -> bool:
        """Checked right before a snapshot is captured: a partition revoked meanwhile must not be
        written (its state is gone, an empty snapshot would skip its records for the next owner)."""
        return partition in self.assigned and not self.assigning

    # ------------------------------------------------------------ rebalance

    async def on_revoked(self, partitions: set[int]) -> None:
        # Eager rebalancing revokes everything; keep state until we know
        # which partitions really moved away.
        try:
            await self.commit(force=True)
        except Exception as e:
            log.warning("commit on revoke failed: %r", e)
        self._pending_revoke |= partitions

    async def on_assigned(self, partitions: set[int]) -> None:
        # Not ready until the new assignment's targets are known and reached:
        # /healthz must never say 200 in the window while we are still seeking.
        self._ready = False
        self.assigning = True
        c = self.consumer
        assert c is not None  # start() made it; rebalances only happen after
        # aiokafka installs the assignment before calling us, so it is already
        # fetching while we await the snapshot store; records it hands to the loop
        # now are dropped (not yet assigned) and would move the position past
        # what our seek set. Paused partitions hand out nothing.
        tps = [TopicPartition(self.config.topic, p) for p in sorted(partitions)]
        if tps:
            c.pause(*tps)
        gone = (self._pending_revoke | self.assigned) - partitions
        new = partitions - self.assigned
        try:
            if gone:
                if self.snapshots is not None:
                    await self.write_snapshots(gone)
                self.applier.drop_partitions(gone)
            self._pending_revoke.clear()
            ends = await c.end_offsets(tps) if tps else {}
            begins = await c.beginning_offsets(tps) if tps else {}
            self._starts = {tp.partition: off for tp, off in begins.items()}
            for tp in tps:
                p = tp.partition
                if p in new:
                    start = await self._restore(p, begins[tp], ends.get(tp))
                    c.seek(tp, start)
                    self.applier.positions[p] = start
                else:
                    # kept across the rebalance: continue where we were
                    c.seek(tp, self.applier.positions.get(p, begins[tp]))
            self._targets = {tp.partition: off for tp, off in ends.items()}
            self.assigned = set(partitions)
        finally:
            self.assigning = False
            if tps:
                c.resume(*tps)
        log.info(
            "member %s assigned %s (new %s, dropped %s)", self.group_id, sorted(partitions), sorted(new), sorted(gone)
        )

    async def _restore(self, partition: int, log_start: int, log_end: int | None = None) -> int:
        """Where to start reading a newly assigned partition (snapshot or log start)."""
        if self.snapshots is None:
            return log_start
        start: int = await self.snapshots.restore(self.applier, self.config.topic, partition, log_start, log_end)
        return start

    async def write_snapshots(self, partitions: Iterable[int]) -> None:
        for p in sorted(partitions):
            try:
                await self.snapshots.save(self.applier, self.config.topic, p)
            except Exception as e:
                log.warning("snapshot of partition %d failed: %r", p, e)

    # ------------------------------------------------------------ positions

    async def commit(self, force: bool = False) -> None:
        """Commit the applied positions (at most every ``commit_interval_s`` unless ``force``),
        after the dead letters before them are written."""
        await self.dead_letters.flush(self.applier)
        now = time.monotonic()
        if not force and now - self._last_commit < self.config.commit_interval_s:
            return
        self._last_commit = now
        offsets = {
            TopicPartition(self.config.topic, p): OffsetAndMetadata(off, "")
            for p, off in self.applier.positions.items()
            if p in self.assigned and self._committed.get(p) != off
        }
        if offsets and self.consumer is not None:
            await self.consumer.commit(offsets)
            self._committed.update({tp.partition: om.offset for tp, om in offsets.items()})

    def lag(self) -> dict[int, int]:
        """Records behind the high watermark, per held partition the client knows one for."""
        # During an eager rebalance aiokafka has already dropped the partitions we keep in
        # self.assigned until the new assignment is known, and its highwater() asserts on them.
        c = self.consumer
        if c is None:
            return {}
        held = c.assignment()
        out = {}
        for p in self.assigned:
            tp = TopicPartition(self.config.topic, p)
            hw = c.highwater(tp) if tp in held else None
            if hw is not None:
                out[p] = max(0, hw - self.applier.positions.get(p, 0))
        return out


__all__ = ["Membership"]
