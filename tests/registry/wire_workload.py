"""A deterministic workload of EventBatches (several workers and ranks, stores chained on their
parents, removals, a clear, a restart, a gap, every optional field and extra-key type somewhere),
and the helpers the registry wire tests share."""

from __future__ import annotations

import random
import time

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

from kvwire.consumer.apply import Applier
from kvwire.kafka.positions import seek_to_beginning
from kvwire.schemas.events import AllBlocksCleared, BlockRemoved, EventBatch, WorkerId, stored

BLOCK = 4
EXTRA = (b"\xff\x00digest", "sql-lora", ("mm-image", 8), 7, 2.5, True, None, b"utf8-bytes")


def workload(seed: int = 7, batches_per_rank: int = 25) -> list[EventBatch]:
    rng = random.Random(seed)
    ranks = [WorkerId("inst-a", 0, 0, 2, "m"), WorkerId("inst-a", 0, 1, 2, "m"), WorkerId("inst-b", 1, 0, 1, "m")]
    out: list[EventBatch] = []
    now_us = time.time_ns() // 1000  # members expire ranks silent past their heartbeat timeout
    for r_i, rank in enumerate(ranks):
        epoch = 1000 + r_i
        seq = 0
        held: list[int] = []
        next_hash = (r_i + 1) << 40
        for i in range(batches_per_rank):
            reset = seq == 0
            events: list = []
            roll = rng.random()
            if i == batches_per_rank // 2 and r_i == 2:  # an engine restart: new epoch, reset
                epoch += 1
                seq = 0
                reset = True
                held = []
            if roll < 0.7 or not held:
                n = rng.randint(1, 4)
                hashes = [next_hash + k for k in range(n)]
                next_hash += n
                tokens = [rng.randrange(1000) for _ in range(n * BLOCK)]
                parent = held[-1] if held and rng.random() < 0.7 else None
                extra = tuple((EXTRA[(i + k) % len(EXTRA)],) if k % 2 == 0 else None for k in range(n))
                events.append(
                    stored(
                        hashes,
                        tokens,
                        BLOCK,
                        parent_block_hash=parent,
                        medium=rng.choice(["GPU", "CPU"]),
                        lora_name=rng.choice([None, "sql-lora"]),
                        extra_keys=extra if rng.random() < 0.5 else None,
                        group_idx=rng.choice([None, 0]),
                        session_id=rng.choice([None, "s1"]),
                    )
                )
                held.extend(hashes)
            elif roll < 0.95:
                k = rng.randint(1, len(held))
                gone, held = held[-k:], held[:-k]
                events.append(BlockRemoved(tuple(gone), medium=rng.choice([None, "GPU"])))
            else:
                events.append(AllBlocksCleared())
                held = []
            gap = 1 if (r_i == 1 and i == 10) else 0  # an owned-up loss: the rank is untrusted
            out.append(EventBatch(rank, epoch, seq, now_us + i, tuple(events), reset=reset, gap=gap, source="t"))
            seq += 1
    return out


def reference(batches: list[EventBatch]) -> Applier:
    """The index the same batches give when applied directly, without Kafka or a codec."""
    a = Applier()
    for b in batches:
        a.apply_batch(b, partition=0)
    return a


async def produce(bootstrap: str, topic: str, values: list[tuple[bytes, bytes]]) -> None:
    """(key, value) records, in order, one partition (the order is the workload's)."""
    p = AIOKafkaProducer(bootstrap_servers=bootstrap, enable_idempotence=True)
    await p.start()
    try:
        for key, value in values:
            await p.send_and_wait(topic, value, key=key, partition=0)
    finally:
        await p.stop()


async def read_all(bootstrap: str, topic: str) -> list:
    c = AIOKafkaConsumer(bootstrap_servers=bootstrap, group_id=None, enable_auto_commit=False)
    await c.start()
    try:
        cluster = await c._client.fetch_all_metadata()
        tps = [TopicPartition(topic, p) for p in sorted(cluster.partitions_for_topic(topic) or ())]
        c.assign(tps)
        await seek_to_beginning(c, *tps)
        end = await c.end_offsets(tps)
        out: list = []
        while any([await c.position(tp) < end[tp] for tp in tps]):
            for recs in (await c.getmany(timeout_ms=1000)).values():
                out.extend(recs)
        return sorted(out, key=lambda r: (r.partition, r.offset))
    finally:
        await c.stop()
