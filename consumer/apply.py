"""Records → index: decode, fence, apply. The one code path for live ingest,
cold start and replay — they differ only in where records come from.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import Any, Generic, NamedTuple, Protocol, TypeVar, cast, overload

import msgspec

from kvwire import _core
from kvwire.schemas import codec
from kvwire.schemas.codec import DecodeError
from kvwire.schemas.events import EventBatch, WorkerId

from .index import Index, IndexOverflow, MalformedEvent, PrefixIndex, WorkerScore
from .metrics import IngestMetrics
from .rank_state import RankState, RankTable, Verdict


class FeedOrigin(NamedTuple):
    """Where the applier files workers read from a topic other than kvwire's (LMCache's
    coordinator topic): never equal to a kvwire partition number, so a rebalance of the kvwire
    topic (``drop_partitions``) never drops them and its snapshots never hold them."""

    source: str
    partition: int


# What the applier files a worker under: a kvwire-topic partition, or another feed's origin.
Origin = int | FeedOrigin


class DeadLetter(msgspec.Struct, frozen=True):
    """A record that could not be applied, kept whole for the dead-letter topic."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    error: str
    timestamp_ms: int


# How long one core call may hold the event loop: heartbeats and HTTP readers run between
# slices, so this bounds how long a query waits behind ingest (~1,000 blocks per slice).
APPLY_BUDGET_US = 200


class _Record(Protocol):
    offset: int
    key: bytes | None
    value: bytes | None
    timestamp: int


class AppliedObserver(Protocol):
    """Told what the Applier applied, after the index has it (``consumer.event_streams``).

    Called on ingest's loop, once per slice: it must stay as bounded as the slice. It is told
    every record of the slice, applied or not (a duplicate, a stale epoch, a dead letter): it
    asks the index what the worker holds now, so a record that changed nothing changes
    nothing there either."""

    def records_applied(self, values: Sequence[bytes | None]) -> None: ...

    def batch_applied(self, batch: EventBatch) -> None: ...

    def workers_dropped(self, workers: Iterable[tuple[str, int]]) -> None: ...


# The index an Applier holds: the core's (``PrefixIndex``) unless a test hands it a model.
IndexT = TypeVar("IndexT", bound=Index)


class Applier(Generic[IndexT]):
    """Owns the index and the rank table for the partitions it is fed.

    One asyncio task feeds it (ingest's loop). Its Python-side state (ranks,
    positions, dead letters, counters) is read only on that loop, between feeds;
    scores may come from other threads (``consumer.http.HttpWorkers``) because
    they read only the core, whose lock lets a reader see a whole core call
    applied or none of it.
    """

    index: IndexT

    @overload
    def __init__(
        self: Applier[PrefixIndex],
        index: None = None,
        metrics: IngestMetrics | None = None,
        schema_ids: codec.SchemaIds = codec.SCHEMA_IDS,
    ) -> None: ...

    @overload
    def __init__(
        self, index: IndexT, metrics: IngestMetrics | None = None, schema_ids: codec.SchemaIds = codec.SCHEMA_IDS
    ) -> None: ...

    def __init__(
        self,
        index: IndexT | None = None,
        metrics: IngestMetrics | None = None,
        schema_ids: codec.SchemaIds = codec.SCHEMA_IDS,
    ) -> None:
        self.index = index if index is not None else cast(IndexT, PrefixIndex())
        # Registry ids of Confluent-framed records, resolved before they are applied
        # (kvwire.kafka.registry.resolver fills the process-wide cache by default).
        self.schema_ids = schema_ids
        self.ranks = RankTable()
        self.metrics = metrics if metrics is not None else IngestMetrics()
        # origin -> workers seen there, to drop them when it is revoked
        self.workers_by_partition: dict[Origin, set[tuple[str, int]]] = defaultdict(set)
        # partition -> next offset to read (everything before it is applied)
        self.positions: dict[int, int] = {}
        self.dead_letters: list[DeadLetter] = []
        self.records = 0
        self.events = 0
        self.blocks = 0
        # Records the core's fast decoder declined, which the reference decoder took.
        self.declined = 0
        # The event streams, when ``kvwire index --event-streams`` serves them; None costs nothing.
        self.observer: AppliedObserver | None = None

    # ------------------------------------------------------------ feeding

    def apply_records(
        self, topic: str, partition: int, recs: Sequence[_Record], start: int = 0, budget_us: int = APPLY_BUDGET_US
    ) -> int:
        """Apply ``recs[start:]`` (one partition's, in log order) until done or
        ``budget_us`` is spent; returns the index of the first record not yet
        applied. The core decodes, fences and applies them in one call per
        slice; a record its fast decoder declines goes through ``apply_record``
        (fastavro) in its place in the order. Never raises for bad input."""
        t0 = time.perf_counter()
        i, n = start, len(recs)
        rl = recs if isinstance(recs, list) else list(recs)
        shipped = self.schema_ids.shipped()
        while i < n:
            left = budget_us - int((time.perf_counter() - t0) * 1e6)
            if left <= 0:
                break
            done = self.index.apply_poll(self.ranks, rl, i, left, time.time_ns() // 1000, shipped)
            self._account(done.tally)
            if done.seen:
                self.workers_by_partition[partition].update(done.seen)
            for d in done.dead:
                r = rl[d.index]
                self._dead(topic, partition, r.offset, r.key, r.value, d.reason, r.timestamp)
            nxt = done.next
            if nxt > i:
                self.positions[partition] = rl[nxt - 1].offset + 1
                if self.observer is not None:
                    self.observer.records_applied([r.value for r in rl[i:nxt]])
            if done.declined:
                r = rl[nxt]
                self.declined += 1
                self.apply_record(topic, partition, r.offset, r.key, r.value, r.timestamp)
                nxt += 1
            i = nxt
        return i

    def _account(self, t: _core.Tally) -> None:
        m = self.metrics
        if t.records:
            self.records += t.records
            m.records.inc(t.records)
        if t.duplicates:
            m.skipped.labels(Verdict.DUPLICATE.label).inc(t.duplicates)
        if t.stale:
            m.skipped.labels(Verdict.STALE_EPOCH.label).inc(t.stale)
        if t.gaps:
            m.gaps.inc(t.gaps)
        if t.resets:
            m.resets.inc(t.resets)
        if t.blocks:
            self.blocks += t.blocks
            m.blocks.inc(t.blocks)
        self.events += t.events
        if t.max_lag_us is not None:
            # Once per slice: the oldest record's lag, the one an operator cares about.
            m.observe_lag_us(t.max_lag_us)

    def apply_record(
        self, topic: str, partition: int, offset: int, key: bytes | None, value: Any, timestamp_ms: int
    ) -> None:
        """Apply one Kafka record through the reference decoder (fastavro, which also resolves a
        writer schema kvwire does not ship). Never raises for bad input: it dead-letters it with
        the reference's reason."""
        self.positions[partition] = offset + 1
        try:
            batch = codec.decode(value, ids=self.schema_ids)
        except DecodeError as e:
            self._dead(topic, partition, offset, key, value, e.reason, timestamp_ms)
            return
        try:
            self.apply_batch(batch, partition)
        except Exception as e:  # a decodable batch the index cannot take
            self._dead(topic, partition, offset, key, value, f"apply failed: {type(e).__name__}: {e}", timestamp_ms)

    def apply_batch(self, batch: EventBatch, partition: Origin = 0) -> Verdict:
        """Fence and apply one decoded record, whole or not at all. Raises
        MalformedEvent (nothing applied, seq not consumed) or IndexOverflow
        (nothing applied, seq consumed, the rank untrusted).

        The batch is encoded in the current version and takes the core's path,
        the one every record's bytes take: one implementation of decoding,
        fencing, the malformed-store rule and context hashing."""
        try:
            value = codec.encode(batch)
        except codec.EncodeError as e:
            raise MalformedEvent(f"a batch the wire cannot carry: {e}") from None
        done = self.index.apply_poll(self.ranks, [value], 0, 1 << 62, time.time_ns() // 1000)
        if done.declined:  # the index decodes everything the codec encodes: a bug, not bad input
            raise RuntimeError(f"the index declined a record the codec wrote: {_core.decline_reason(value)}")
        tally = done.tally
        self._account(tally)
        if done.seen:
            self.workers_by_partition[partition].update(done.seen)
        if self.observer is not None:
            self.observer.batch_applied(batch)
        if done.dead:
            d = done.dead[0]
            if d.kind == _core.DeadKind.OVERFLOW:
                raise IndexOverflow(d.message)
            raise MalformedEvent(d.message)
        if tally.duplicates:
            return Verdict.DUPLICATE
        if tally.stale:
            return Verdict.STALE_EPOCH
        return Verdict.RESET if tally.resets else Verdict.APPLY

    def _dead(
        self,
        topic: str,
        partition: int,
        offset: int,
        key: bytes | None,
        value: bytes | None,
        error: str,
        timestamp_ms: int,
    ) -> None:
        self.dead_letters.append(DeadLetter(topic, partition, offset, key, value, error, timestamp_ms))
        self.metrics.dead_letters.inc()

    def take_dead_letters(self) -> list[DeadLetter]:
        out, self.dead_letters = self.dead_letters, []
        return out

    # ------------------------------------------------------------ ownership

    def drop_partitions(self, partitions: Iterable[int]) -> None:
        """A partition moved to another member: forget what it held."""
        for p in partitions:
            dropped = self.workers_by_partition.pop(p, set())
            for worker in dropped:
                self.index.drop_worker(worker)
                self.ranks.forget_worker(worker)
            self.positions.pop(p, None)
            if dropped and self.observer is not None:
                self.observer.workers_dropped(dropped)

    def expire(self, now_us: int, timeout_us: int) -> list[tuple[str, int, int]]:
        """Drop ranks silent past the heartbeat timeout (dead workers)."""
        gone = self.ranks.expired(now_us, timeout_us)
        tps = self.ranks.tp_size if gone else {}
        for rank_key in gone:
            inst, dp, tp = rank_key
            tp_size = tps.get((inst, dp), 1)
            self.index.drop_rank(WorkerId(inst, dp, tp, tp_size))
            self.ranks.forget(rank_key)
        if gone:
            self.metrics.expired.inc(len(gone))
            if self.observer is not None:
                self.observer.workers_dropped({(inst, dp) for inst, dp, _ in gone})
        return gone

    # ------------------------------------------------------------ queries

    def score(self, token_ids: Any, lora_name: str | None = None, **kw: Any) -> list[WorkerScore]:
        """Scores of trusted workers only: a worker with a gap scores nothing."""
        out = self.index.score(token_ids, lora_name=lora_name, exclude=self.ranks.untrusted_workers(), **kw)
        approx = self.ranks.approximate_workers()
        if not approx:
            return out
        return [
            msgspec.structs.replace(s, approximate=True) if (s.instance_id, s.dp_rank) in approx else s for s in out
        ]

    def score_json(
        self,
        token_ids: Any,
        lora_name: str | None = None,
        block_size: int | None = None,
        top_k: int | None = None,
        extra_keys: Sequence[Any] | None = None,
    ) -> bytes:
        """``score`` as the JSON list /v1/score returns, hashed, walked, ordered and encoded in the core.
        ``extra_keys``: one entry per block, as vLLM publishes them (``kvwire.consumer.tenants``)."""
        return self.index.score_trusted_json(self.ranks, token_ids, lora_name, block_size, top_k, extra_keys)

    def score_keys_json(self, keys: Any, block_size: int | None = None, top_k: int | None = None) -> bytes:
        """``score_json`` of a prompt given as its blocks' keys (``keys.sequence_keys``)."""
        return self.index.score_trusted_keys_json(self.ranks, keys, block_size, top_k)

    def workers(self) -> list[dict[str, Any]]:
        """Per worker: blocks, epochs, last seqs, trust, last seen (for /v1/workers)."""
        stats = self.index.workers()
        out = []
        by_worker: dict[tuple[str, int], list[tuple[int, RankState]]] = defaultdict(list)
        tps = self.ranks.tp_size
        approx = self.ranks.approximate_workers()
        for (inst, dp, tp), st in self.ranks.ranks.items():
            by_worker[(inst, dp)].append((tp, st))
        for worker, ranks in sorted(by_worker.items()):
            s = stats.get(worker)
            by_medium = dict(s.blocks) if s is not None else {}
            out.append(
                {
                    "instance_id": worker[0],
                    "dp_rank": worker[1],
                    "tp_size": tps.get(worker, 1),
                    "blocks": sum(by_medium.values()),
                    "blocks_by_medium": by_medium,
                    "orphans": s.orphans if s is not None else 0,
                    "trusted": self.ranks.worker_trusted(worker),
                    "approximate": worker in approx,
                    "ranks": [
                        {
                            "tp_rank": tp,
                            "model": st.model,
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
