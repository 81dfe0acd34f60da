"""Records → index: decode, fence, apply. The one code path for live ingest,
cold start and replay — they differ only in where records come from.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterable

import msgspec

from kvwire.schemas import codec
from kvwire.schemas.codec import DecodeError
from kvwire.schemas.events import BlockStored, EventBatch, WorkerId

from .index import MalformedEvent, PrefixIndex
from .metrics import IngestMetrics
from .rank_state import RankTable, Verdict


class DeadLetter(msgspec.Struct, frozen=True):
    """A record that could not be applied, kept whole for the dead-letter topic."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    error: str
    timestamp_ms: int


def check_batch(batch: EventBatch) -> None:
    """Raise MalformedEvent if any event of the record cannot be applied."""
    for ev in batch.events:
        if (
            type(ev) is BlockStored
            and ev.block_size > 0
            and len(ev.token_ids)
            and len(ev.token_ids) != ev.block_size * len(ev.block_hashes)
        ):
            raise MalformedEvent(
                f"BlockStored with {len(ev.block_hashes)} hashes of block_size {ev.block_size} "
                f"carries {len(ev.token_ids)} token ids"
            )


class Applier:
    """Owns the index and the rank table for the partitions it is fed.

    Not thread-safe: one asyncio task feeds it; HTTP readers run on the same
    loop between feeds, so they always see a whole record applied or none.
    """

    def __init__(self, index: PrefixIndex | None = None, metrics: IngestMetrics | None = None):
        self.index = index if index is not None else PrefixIndex()
        self.ranks = RankTable()
        self.metrics = metrics if metrics is not None else IngestMetrics()
        # partition -> workers seen there, to drop them when it is revoked
        self.workers_by_partition: dict[int, set[tuple[str, int]]] = defaultdict(set)
        # partition -> next offset to read (everything before it is applied)
        self.positions: dict[int, int] = {}
        self.dead_letters: list[DeadLetter] = []
        self.records = 0
        self.events = 0
        self.blocks = 0

    # ------------------------------------------------------------ feeding

    def apply_record(self, topic: str, partition: int, offset: int, key, value, timestamp_ms: int) -> None:
        """Apply one Kafka record. Never raises for bad input: it dead-letters it."""
        self.positions[partition] = offset + 1
        try:
            batch = codec.decode(value)
        except DecodeError as e:
            self._dead(topic, partition, offset, key, value, e.reason, timestamp_ms)
            return
        try:
            self.apply_batch(batch, partition)
        except Exception as e:  # a decodable batch the index cannot take
            self._dead(topic, partition, offset, key, value, f"apply failed: {type(e).__name__}: {e}", timestamp_ms)

    def apply_batch(self, batch: EventBatch, partition: int = 0) -> Verdict:
        # Whole record or nothing: a bad event found halfway would leave the
        # events before it applied and the sequence advanced, yet dead-lettered.
        check_batch(batch)
        rank = batch.worker
        verdict = self.ranks.admit(batch)
        self.records += 1
        m = self.metrics
        m.records.inc()
        if verdict is Verdict.DUPLICATE or verdict is Verdict.STALE_EPOCH:
            m.skipped.labels(verdict.value).inc()
            return verdict
        self.workers_by_partition[partition].add(rank.worker)
        if batch.gap:
            m.gaps.inc(batch.gap)
        if verdict is Verdict.RESET:
            self.index.clear(rank)
            m.resets.inc()
        # One call per record: the index batches a record's events into one kernel call per table.
        blocks = self.index.apply_batch(rank, batch.events)
        self.events += len(batch.events)
        if blocks:
            self.blocks += blocks
            m.blocks.inc(blocks)
        m.observe_lag_us(time.time_ns() // 1000 - batch.ts_us)
        return verdict

    def _dead(self, topic, partition, offset, key, value, error, timestamp_ms) -> None:
        self.dead_letters.append(DeadLetter(topic, partition, offset, key, value, error, timestamp_ms))
        self.metrics.dead_letters.inc()

    def take_dead_letters(self) -> list[DeadLetter]:
        out, self.dead_letters = self.dead_letters, []
        return out

    # ------------------------------------------------------------ ownership

    def drop_partitions(self, partitions: Iterable[int]) -> None:
        """A partition moved to another member: forget what it held."""
        for p in partitions:
            for worker in self.workers_by_partition.pop(p, set()):
                self.index.drop_worker(worker)
                self.ranks.forget_worker(worker)
            self.positions.pop(p, None)

    def expire(self, now_us: int, timeout_us: int) -> list[tuple[str, int, int]]:
        """Drop ranks silent past the heartbeat timeout (dead workers)."""
        gone = self.ranks.expired(now_us, timeout_us)
        for rank_key in gone:
            inst, dp, tp = rank_key
            tp_size = self.ranks.tp_size.get((inst, dp), 1)
            self.index.drop_rank(WorkerId(inst, dp, tp, tp_size))
            self.ranks.forget(rank_key)
        if gone:
            self.metrics.expired.inc(len(gone))
        return gone

    # ------------------------------------------------------------ queries

    def score(self, token_ids, lora_name=None, **kw):
        """Scores of trusted workers only: a worker with a gap scores nothing."""
        untrusted = self.ranks.untrusted_workers()
        return [
            s
            for s in self.index.score(token_ids, lora_name=lora_name, **kw)
            if (s.instance_id, s.dp_rank) not in untrusted
        ]

    def workers(self) -> list[dict]:
        """Per worker: blocks, epochs, last seqs, trust, last seen (for /v1/workers)."""
        stats = self.index.workers()
        out = []
        by_worker: dict[tuple[str, int], list] = defaultdict(list)
        for (inst, dp, tp), st in self.ranks.ranks.items():
            by_worker[(inst, dp)].append((tp, st))
        for worker, ranks in sorted(by_worker.items()):
            s = stats.get(worker)
            by_medium = dict(s.blocks) if s is not None else {}
            out.append(
                {
                    "instance_id": worker[0],
                    "dp_rank": worker[1],
                    "tp_size": self.ranks.tp_size.get(worker, 1),
                    "blocks": sum(by_medium.values()),
                    "blocks_by_medium": by_medium,
                    "orphans": s.orphans if s is not None else 0,
                    "trusted": self.ranks.worker_trusted(worker),
                    "ranks": [
                        {
                            "tp_rank": tp,
                            "epoch": st.epoch,
                            "last_seq": st.last_seq,
                            "trusted": st.trusted,
                            "untrusted_reason": st.untrusted_reason or None,
                            "last_seen_us": st.last_seen_us,
                            "records": st.records,
                            "gaps": st.gaps,
                        }
                        for tp, st in sorted(ranks)
                    ],
                }
            )
        return out
