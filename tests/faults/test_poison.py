"""Fault 6: poison records. Over 10,000 malformed records (random bytes, truncations, bit flips of
valid records, wrong schema fingerprints, huge claimed lengths, empty values and tombstones,
decodable batches the index cannot apply) interleaved with a simulated fleet's good ones.

Every bad record lands in the dead-letter topic, with its source partition and offset; the member
stays alive and keeps applying; the index equals the oracle fed the good records."""

from __future__ import annotations

import random
import time
from array import array

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from oracle_feed import (
    applier_scores,
    assert_scores,
    build_expected,
    diff_index,
    read_log,
    record_result,
    score_requests,
    sim_blocks,
    wait_until,
)

from kvwire.consumer.ingest import IndexMember, IngestConfig
from kvwire.producer.partitioner import default_partition
from kvwire.producer.publisher import HEADERS, AckInfo
from kvwire.producer.simulator import SimConfig, Simulator
from kvwire.schemas import codec
from kvwire.schemas.events import AllBlocksCleared, BlockStored, EventBatch, WorkerId

pytestmark = pytest.mark.integration

PARTITIONS = 3
BAD_TARGET = 10_500


def _zigzag_varint(n: int) -> bytes:
    n = (n << 1) ^ (n >> 63)
    out = bytearray()
    while True:
        b, n = n & 0x7F, n >> 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


# Where the events array's count sits in a record: found by diffing two encodings, so the
# "huge claimed count" poison follows the schema without hard-coding it.
_E0 = codec.encode(EventBatch(WorkerId("p"), 1, 1, 1, ()))
_E1 = codec.encode(EventBatch(WorkerId("p"), 1, 1, 1, (AllBlocksCleared(),)))
_EVENTS_AT = next(i for i in range(len(_E0)) if _E0[i] != _E1[i])


def _rejected(value) -> bool:
    try:
        codec.decode(value)
    except codec.DecodeError:
        return True
    return False


class Poison:
    """Bad values of every kind; the kinds are counted so the result says what was thrown."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.kinds: dict[str, int] = {}

    def _count(self, kind: str, v):
        self.kinds[kind] = self.kinds.get(kind, 0) + 1
        return v

    def make(self, valid: bytes):
        rng = self.rng
        kind = rng.choice(
            [
                "random",
                "truncated",
                "bitflip",
                "fingerprint",
                "huge_len",
                "huge_count",
                "empty",
                "tombstone",
                "inapplicable",
                "magic_only",
                "trailing",
            ]
        )
        if kind == "random":
            v = rng.randbytes(rng.randrange(0, 300))
            if rng.random() < 0.5:
                v = codec.MAGIC + v  # past the first check
        elif kind == "truncated":
            v = valid[: rng.randrange(0, len(valid))]
        elif kind == "bitflip":
            # A flip that still decodes is a different valid record, not poison: the format has
            # no checksum (Kafka's CRC covers transport). Only flips the decoder rejects count.
            for _ in range(50):
                b = bytearray(valid)
                for _ in range(rng.randint(1, 3)):
                    i = rng.randrange(len(b))
                    b[i] ^= 1 << rng.randrange(8)
                if _rejected(bytes(b)):
                    break
            else:
                b = bytearray(valid[:-1])
            v = bytes(b)
        elif kind == "fingerprint":
            v = valid[:2] + rng.randbytes(8) + valid[10:]
        elif kind == "huge_len":
            v = valid[:10] + _zigzag_varint(rng.choice([2**62, 2**40, 2**31, 10**9, -7])) + valid[11:]
        elif kind == "huge_count":
            v = _E0[:_EVENTS_AT] + _zigzag_varint(rng.choice([2**62, 2**40, 2**31, 10**9])) + _E0[_EVENTS_AT + 1 :]
        elif kind == "empty":
            v = b""
        elif kind == "tombstone":
            v = None
        elif kind == "magic_only":
            v = valid[:10]
        elif kind == "trailing":
            v = valid + rng.randbytes(rng.randint(1, 8))
        else:  # decodes, but its BlockStored has fewer token ids than its blocks need
            w = WorkerId(f"poison-{rng.randrange(1 << 30)}")
            ev = BlockStored((1, 2), None, array("I", range(17)), 16)
            v = codec.encode(EventBatch(w, rng.randrange(1, 1 << 62), 0, 1, (ev,), reset=True))
            return self._count(kind, v)
        assert v is None or _rejected(v), kind
        return self._count(kind, v)


async def _read_dlq(bootstrap: str, topic: str, n: int):
    c = AIOKafkaConsumer(topic, bootstrap_servers=bootstrap, auto_offset_reset="earliest", enable_auto_commit=False)
    await c.start()
    got = []
    try:
        t0 = time.monotonic()
        while len(got) < n and time.monotonic() - t0 < 120:
            for recs in (await c.getmany(timeout_ms=1000, max_records=5000)).values():
                got.extend(recs)
        # anything beyond n would be a good record dead-lettered: give it a moment to show up
        for recs in (await c.getmany(timeout_ms=500)).values():
            got.extend(recs)
    finally:
        await c.stop()
    return got


async def test_poison_records_all_dead_lettered_index_equals_oracle(kafka_bootstrap, new_topic):
    topic = new_topic(partitions=PARTITIONS)
    dlq = f"{topic}.dlq"
    member = IndexMember(IngestConfig(kafka_bootstrap, topic, dlq_topic=dlq, heartbeat_timeout_s=600))
    await member.start()
    producer = AIOKafkaProducer(bootstrap_servers=kafka_bootstrap, linger_ms=5, max_batch_size=256 * 1024)
    await producer.start()
    poison = Poison(61)
    seqs: dict[tuple, int] = {}
    epochs: dict[tuple, list[int]] = {}
    good_values: list[bytes] = []
    pending: list[tuple] = []  # (future, kind, worker/epoch/seq or bad value)
    rng = random.Random(62)

    def sink(rank: WorkerId, events) -> None:
        # The good records, framed exactly as the publisher frames them (epoch, seq, reset).
        k = rank.rank
        if k not in seqs:
            epochs[k] = [rng.randrange(1, 1 << 62)]
            seqs[k] = 0
        b = EventBatch(
            rank, epochs[k][-1], seqs[k], time.time_ns() // 1000, tuple(events), reset=seqs[k] == 0, source="simulator"
        )
        seqs[k] += 1
        good_values.append(codec.encode(b))
        pending.append(("good", rank, b))

    sim = Simulator(SimConfig(workers=6, tp_size=2, capacity_blocks=150, p_clear=0.01, p_restart=0.0, seed=63), sink)
    t_write = time.monotonic()
    try:
        acks: list[AckInfo] = []
        bad_at: dict[tuple[int, int], bytes | None] = {}
        sent = []
        bad_total = 0
        while bad_total < BAD_TARGET:
            sim.step()
            goods, pending[:] = list(pending), []
            for _, rank, b in goods:
                value = codec.encode(b)
                p = default_partition(rank.kafka_key(), PARTITIONS)
                sent.append(
                    ("good", b, await producer.send(topic, value, key=rank.kafka_key(), partition=p, headers=HEADERS))
                )
            for _ in range(rng.randint(3, 12)):
                v = poison.make(good_values[rng.randrange(len(good_values))] if good_values else _E1)
                key = rng.choice([None, b"bad", rng.randbytes(rng.randint(0, 40))])
                part = rng.randrange(PARTITIONS)
                if v is None and key is None:
                    # aiokafka refuses null key + null value, but Kafka stores it and other clients
                    # (the Java producer, kcat) write it: append it below the guard.
                    await producer.client._wait_on_metadata(topic)
                    fut = await producer._message_accumulator.add_message(
                        TopicPartition(topic, part), None, None, 30.0, timestamp_ms=None, headers=[]
                    )
                else:
                    fut = await producer.send(topic, v, key=key, partition=part)
                sent.append(("bad", v, fut))
                bad_total += 1
        for kind, obj, fut in sent:
            md = await fut
            if kind == "good":
                acks.append(AckInfo(obj.worker, obj.epoch, obj.seq, 0, md.partition, md.offset))
            else:
                bad_at[(md.partition, md.offset)] = obj
        # A last good record after all the poison: the member is alive and still applying.
        sim.run(5)
        for _, rank, b in pending:
            md = await producer.send_and_wait(
                topic,
                codec.encode(b),
                key=rank.kafka_key(),
                partition=default_partition(rank.kafka_key(), PARTITIONS),
                headers=HEADERS,
            )
            acks.append(AckInfo(b.worker, b.epoch, b.seq, 0, md.partition, md.offset))
        t_written = time.monotonic()

        records = await read_log(kafka_bootstrap, topic)
        exp = build_expected(records, acks, epochs)
        assert exp.acked_lost == 0 and exp.acked_records == len(acks) == len(records) - len(bad_at)
        assert exp.blocks_per_worker() == sim_blocks(sim)
        await wait_until(
            lambda: member.ready and diff_index(member.applier.index, exp) is None, 180, "member equal to the oracle"
        )
        converge_s = time.monotonic() - t_written
        assert member._task is not None and not member._task.done(), "the ingest task died"
        assert member.applier.index.digest() == exp.digest()
        assert_scores(applier_scores(member.applier), exp, score_requests(sim, 30))
        good_workers = {w for w in exp.workers}
        assert all(w["trusted"] for w in member.applier.workers() if (w["instance_id"], w["dp_rank"]) in good_workers)
        await wait_until(
            lambda: member.applier.metrics.dead_letters._value.get() >= len(bad_at), 60, "dead letters counted"
        )
        await member.stop()  # flushes the last dead letters before its final commit

        got = await _read_dlq(kafka_bootstrap, dlq, len(bad_at))
        where = {}
        for r in got:
            h = dict(r.headers)
            assert h["kvwire-source-topic"].decode() == topic and h["kvwire-error"]
            where[(int(h["kvwire-source-partition"]), int(h["kvwire-source-offset"]))] = r.value
        assert len(got) == len(bad_at), (len(got), len(bad_at))
        assert set(where) == set(bad_at)
        assert where == bad_at  # the very bytes, tombstones as tombstones
        record_result(
            "poison_records",
            records_in_flight_at_fault=len(bad_at),
            bad_records=len(bad_at),
            bad_by_kind=dict(sorted(poison.kinds.items())),
            good_records=len(acks),
            dead_lettered=len(got),
            acked_records_lost=exp.acked_lost,
            write_s=t_written - t_write,
            converge_s_after_written=converge_s,
        )
    finally:
        await producer.stop()
        await member.stop()
        from aiokafka.admin import AIOKafkaAdminClient

        admin = AIOKafkaAdminClient(bootstrap_servers=kafka_bootstrap)
        await admin.start()
        try:
            await admin.delete_topics([dlq])
        except Exception:
            pass
        finally:
            await admin.close()
