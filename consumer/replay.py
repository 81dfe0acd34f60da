"""Rebuild an index from the log: the ingest apply path fed by a consumer
that owns every partition and stops at a target offset, instead of a group
member that runs forever.

``start``: "earliest" (log start), "snapshot" (each partition's newest
snapshot, then the tail), or a datetime (the first offset at or after it —
ranks then join mid-stream and are untrusted until their next reset, which is
the truth: their earlier state is not in the replay).
``until``: None (the end offsets seen when the replay starts) or a datetime.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime

from aiokafka import AIOKafkaConsumer, TopicPartition

from kvwire.kafka.options import consumer_options
from kvwire.kafka.registry.resolver import IdResolver

from .apply import Applier
from .snapshot import Snapshots


@dataclass
class ReplayResult:
    applier: Applier
    records: int
    events: int
    blocks: int
    seconds: float
    dead_letters: int

    def summary(self) -> dict:
        idx = self.applier.index
        per_worker = {w: sum(st.blocks.values()) for w, st in idx.workers().items()}
        return {
            "records": self.records,
            "events": self.events,
            "workers": [{"instance_id": i, "dp_rank": d, "blocks": n} for (i, d), n in sorted(per_worker.items())],
            "digest": idx.digest(),
            "holder_blocks": len(idx),
            "dead_letters": self.dead_letters,
            "seconds": round(self.seconds, 3),
            "blocks_per_s": round(self.blocks / self.seconds) if self.seconds > 0 else None,
        }


# Replay owns its loop, but a progress callback or a signal handler should still get a turn.
REPLAY_SLICE_US = 50_000


async def replay(
    bootstrap_servers: str,
    topic: str,
    start: str | datetime = "earliest",
    until: datetime | None = None,
    snapshots: Snapshots | None = None,
    client_options: dict | None = None,
    progress: Callable[[int, int, int], None] | None = None,
    applier: Applier | None = None,
    max_records: int = 5000,
    schema_ids: IdResolver | None = None,
) -> ReplayResult:
    """Rebuild an index of ``topic``; ``progress(done, total, blocks)`` is called as it goes."""
    if start == "snapshot" and snapshots is None:
        raise ValueError('start="snapshot" needs a snapshot store')
    a = applier if applier is not None else Applier()
    # Confluent-framed records: their registry ids are resolved per poll, before decoding.
    ids = schema_ids if schema_ids is not None else IdResolver.from_env()
    c = AIOKafkaConsumer(
        bootstrap_servers=bootstrap_servers,
        enable_auto_commit=False,
        auto_offset_reset="earliest",
        max_partition_fetch_bytes=4 * 1024 * 1024,
        **consumer_options(client_options),
    )
    t0 = time.perf_counter()
    try:
        await c.start()  # in the try: a client whose start failed must still be stopped
        parts = sorted(c.partitions_for_topic(topic) or await _partitions(c, topic))
        tps = [TopicPartition(topic, p) for p in parts]
        c.assign(tps)
        begins = await c.beginning_offsets(tps)
        ends = log_ends = await c.end_offsets(tps)
        if until is not None:
            found = await c.offsets_for_times({tp: int(until.timestamp() * 1000) for tp in tps})
            ends = {tp: (found[tp].offset if found[tp] is not None else ends[tp]) for tp in tps}
        starts = {}
        for tp in tps:
            if start == "snapshot":
                assert snapshots is not None  # checked above
                starts[tp] = await snapshots.restore(a, topic, tp.partition, begins[tp], log_ends[tp])
            elif isinstance(start, datetime):
                found = await c.offsets_for_times({tp: int(start.timestamp() * 1000)})
                starts[tp] = found[tp].offset if found[tp] is not None else ends[tp]
            else:
                starts[tp] = begins[tp]
            c.seek(tp, starts[tp])
        total = sum(max(0, ends[tp] - starts[tp]) for tp in tps)
        done = 0
        blocks0 = a.blocks
        pending = {tp for tp in tps if starts[tp] < ends[tp]}
        while pending:
            batches = await c.getmany(*pending, timeout_ms=1000, max_records=max_records)
            await ids.prefetch_retrying((r.value for recs in batches.values() for r in recs), deadline_s=60.0)
            for tp, recs in batches.items():
                end = ends[tp]
                cut = len(recs)
                while cut and recs[cut - 1].offset >= end:
                    cut -= 1
                todo = recs[:cut]
                i = 0
                while i < cut:  # one core call per slice: decode, fence, apply
                    i = a.apply_records(tp.topic, tp.partition, todo, i, budget_us=REPLAY_SLICE_US)
                done += cut
                if a.positions.get(tp.partition, starts[tp]) >= end or (recs and recs[-1].offset >= end - 1):
                    pending.discard(tp)
            for tp in list(pending):
                if await c.position(tp) >= ends[tp]:
                    pending.discard(tp)
            if progress is not None:
                progress(done, total, a.blocks - blocks0)
        blocks = a.blocks - blocks0
        return ReplayResult(a, a.records, a.events, blocks, time.perf_counter() - t0, len(a.take_dead_letters()))
    finally:
        await c.stop()


async def _partitions(c: AIOKafkaConsumer, topic: str) -> set[int]:
    await c._client.force_metadata_update()  # a fresh consumer has no metadata for the topic yet
    parts = c.partitions_for_topic(topic)
    if not parts:
        raise ValueError(f"topic {topic!r} does not exist or has no partitions")
    return parts
