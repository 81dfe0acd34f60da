"""The Kafka side of apply: what aiokafka's fetch delivers, and what coalescing steps per record buys.

Three measurements against a real broker, each short (the box is shared):

- ``fetch_grid``: a topic pre-filled with kvwire records (the index_memory workload, ~32 blocks
  per record, compressed as the publisher does) is read with ``getmany`` over a grid of ``max_records`` ×
  fetch size (``max_partition_fetch_bytes`` = ``fetch_max_bytes``) × ``fetch_max_wait_ms``,
  without decoding: the client's ceiling.
- ``fetch_and_apply``: the same reads with each poll fed to ``Applier.apply_records`` the way
  the member does (consumer/ingest.py), so fetch and core can be compared at each setting.
- ``codecs``: aiokafka's batch builder and reader over ``bench.lag``'s records (16 blocks each)
  with each codec the publisher can be set to (``PublisherConfig.compression_type``), in batches
  of 4, 8 and 16 records, the sizes the sender's passes make under load: CPU µs a record to build
  and to parse, and the compression ratio. No broker: what each codec costs both ends.
- ``coalesce``: records of 1, 4 and 16 engine steps (8 blocks each) sent with the publisher's
  producer settings (producer/config.py: linger, batch size, compression, idempotence), then
  applied: records/s and bytes per block on the producer, apply µs per block on the consumer.

Every rate is given per wall second and per CPU second of this process (``time.process_time``):
on a loaded box the second is the steadier figure.

aiokafka has no public raw-batch API: ``getmany`` always builds one ``ConsumerRecord`` per record
after decompressing the batch, so "decode from the raw batch" is not available without patching
the client; the per-record object cost is inside ``fetch_grid``'s figures.

    python -m bench.kafka_side [--quick] [--blocks N]

Writes bench/results/kafka_side.json (or under $KVWIRE_BENCH_RESULTS).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import time
import uuid
from typing import Any

import msgspec

from kvwire.kafka.positions import seek_to_beginning
from kvwire.schemas import codec
from kvwire.schemas.events import BlockStored, EventBatch

from .apply_rate import PARTITIONS, fill, make_records
from .common import write_result
from .index_memory import CONV_BLOCKS, N_WORKERS, Workload

MiB = 1024 * 1024
STEP_BLOCKS = 8


async def _read(bootstrap: str, topic: str, n: int, max_records: int, fetch_bytes: int, wait_ms: int, apply: bool):
    from aiokafka import AIOKafkaConsumer, TopicPartition

    from kvwire.consumer.apply import Applier

    applier = Applier() if apply else None
    c = AIOKafkaConsumer(
        bootstrap_servers=bootstrap,
        enable_auto_commit=False,
        auto_offset_reset="earliest",
        max_partition_fetch_bytes=fetch_bytes,
        fetch_max_bytes=max(fetch_bytes, 52428800),
        fetch_max_wait_ms=wait_ms,
    )
    await c.start()
    try:
        tps = [TopicPartition(topic, p) for p in range(PARTITIONS)]
        c.assign(tps)
        await seek_to_beginning(c, *tps)
        got = nbytes = polls = 0
        t0, c0 = time.perf_counter(), time.process_time()
        while got < n:
            batches = await c.getmany(timeout_ms=1000, max_records=max_records)
            polls += 1
            for tp, recs in batches.items():
                if applier is not None:
                    i = 0
                    while i < len(recs):
                        i = applier.apply_records(tp.topic, tp.partition, recs, i)
                        await asyncio.sleep(0)
                got += len(recs)
                nbytes += sum(len(r.value) for r in recs)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    finally:
        await c.stop()
    if applier is not None:
        assert applier.records == n and not applier.dead_letters, (applier.records, len(applier.dead_letters))
    return wall, cpu, nbytes, polls


def _rates(n_records: int, n_blocks: int, nbytes: int, wall: float, cpu: float) -> dict[str, float]:
    return {
        "records_per_s": n_records / wall,
        "blocks_per_s": n_blocks / wall,
        "mb_per_s": nbytes / wall / 1e6,
        "blocks_per_cpu_s": n_blocks / cpu if cpu > 0 else float("nan"),
        "cpu_util": cpu / wall,
    }


def _steps(events: list[BlockStored]) -> list[BlockStored]:
    """Split the workload's 16-block events into 8-block engine steps, chained."""
    out: list[BlockStored] = []
    for e in events:
        for s in range(0, len(e.block_hashes), STEP_BLOCKS):
            hs = e.block_hashes[s : s + STEP_BLOCKS]
            parent = e.parent_block_hash if s == 0 else e.block_hashes[s - 1]
            toks = e.token_ids[s * e.block_size : (s + len(hs)) * e.block_size]
            out.append(msgspec.structs.replace(e, block_hashes=hs, parent_block_hash=parent, token_ids=toks))
    return out


def coalesced_records(blocks: int, steps_per_record: int, seed: int = 1) -> list[tuple[bytes, bytes]]:
    """One record per ``steps_per_record`` 8-block steps of one worker, fleet interleaved."""
    wl = Workload(seed, "vllm")
    seqs = [0] * N_WORKERS
    out: list[tuple[bytes, bytes]] = []
    done, c, ts = 0, 0, 1_700_000_000_000_000
    per_conv = CONV_BLOCKS // STEP_BLOCKS
    while done < blocks:
        convs = [_steps(list(wl.conversation(w, c))) for w in range(N_WORKERS)]
        for r in range(0, per_conv, steps_per_record):
            for w in range(N_WORKERS):
                evs = tuple(convs[w][r : r + steps_per_record])
                wid = wl.workers[w]
                b = EventBatch(wid, 0x5EED, seqs[w], ts, evs, reset=seqs[w] == 0)
                seqs[w] += 1
                ts += 1
                t0 = time.process_time()
                out.append((wid.kafka_key(), codec.encode(b)))
                ENCODE_CPU[0] += time.process_time() - t0
                done += sum(len(e.block_hashes) for e in evs)
                if done >= blocks:
                    return out
        c += 1
    return out


ENCODE_CPU = [0.0]


async def _produce(bootstrap: str, topic: str, records: list[tuple[bytes, bytes]]) -> tuple[float, float]:
    """Send with the publisher's own producer settings; (wall s, cpu s) until all are acked."""
    from aiokafka import AIOKafkaProducer

    from kvwire.kafka.topics import ensure_topic
    from kvwire.producer.config import PublisherConfig
    from kvwire.producer.partitioner import default_partition

    cfg = PublisherConfig(bootstrap_servers=bootstrap, topic=topic)
    await ensure_topic(bootstrap, topic, PARTITIONS)
    p = AIOKafkaProducer(
        bootstrap_servers=bootstrap,
        enable_idempotence=True,
        linger_ms=cfg.linger_ms,
        max_batch_size=cfg.max_batch_size,
        compression_type=cfg.compression_type,
    )
    await p.start()
    try:
        # A fresh topic's leaders settle on the first sends (NotLeaderForPartition, retried): send
        # each partition's first record before the clock starts. Each is its partition's oldest,
        # so no key's order changes.
        parts = [default_partition(k, PARTITIONS) for k, _ in records]
        first = {q: i for i, q in reversed(list(enumerate(parts)))}
        for i in sorted(first.values()):
            await (await p.send(topic, records[i][1], key=records[i][0], partition=parts[i]))
        rest = [i for i in range(len(records)) if i not in set(first.values())]
        t0, c0 = time.perf_counter(), time.process_time()
        futs = [await p.send(topic, records[i][1], key=records[i][0], partition=parts[i]) for i in rest]
        await asyncio.gather(*futs)
        return time.perf_counter() - t0, time.process_time() - c0
    finally:
        await p.stop()


def _blocks(records: list[tuple[bytes, bytes]]) -> int:
    return sum(codec.decode(v).block_count() for _, v in records)


def codecs(quick: bool) -> dict[str, Any]:
    """CPU a record to build and to parse a produce batch, and the ratio, per codec and batch
    size (best of a few reps by CPU: a neighbour's burst only ever adds)."""
    from aiokafka.record.default_records import DefaultRecordBatchBuilder
    from aiokafka.record.memory_records import MemoryRecords

    from kvwire.producer.config import COMPRESSION_TYPES

    from .lag import WORKERS, _worker_events

    wl = Workload(seed=7)
    values = []
    for w in range(WORKERS // 4):
        for i, e in enumerate(_worker_events(wl, w)[1][:64]):
            values.append(codec.encode(EventBatch(wl.workers[w], 1, i, 0, (e,))))
    code = {None: 0, "gzip": 1, "snappy": 2, "lz4": 3, "zstd": 4}
    reps = 3 if quick else 10
    out: dict[str, Any] = {"records": len(values), "value_bytes_mean": sum(map(len, values)) / len(values), "rows": []}
    for per in (4, 8, 16):
        for name in COMPRESSION_TYPES:
            build = parse = float("inf")
            for _ in range(reps):
                t0, bufs = time.process_time(), []
                for s in range(0, len(values), per):
                    b = DefaultRecordBatchBuilder(2, code[name], False, 0, 0, 0, 512 * 1024)
                    for j, v in enumerate(values[s : s + per]):
                        b.append(j, timestamp=None, key=b"k", value=v, headers=[])
                    bufs.append(bytes(b.build()))
                build = min(build, time.process_time() - t0)
                t0, n = time.process_time(), 0
                for buf in bufs:
                    mr = MemoryRecords(buf)
                    while mr.has_next():
                        n += sum(1 for _ in mr.next_batch())  # type: ignore[union-attr]
                parse = min(parse, time.process_time() - t0)
                assert n == len(values)
            out["rows"].append(
                {
                    "codec": name or "none",
                    "records_per_batch": per,
                    "ratio": sum(map(len, values)) / sum(map(len, bufs)),
                    "build_cpu_us_per_record": build / len(values) * 1e6,
                    "parse_cpu_us_per_record": parse / len(values) * 1e6,
                }
            )
    return out


def run(bootstrap: str, blocks: int, quick: bool) -> dict[str, Any]:
    out: dict[str, Any] = {"bootstrap_blocks": blocks, "partitions": PARTITIONS}
    out["codecs"] = codecs(quick)
    records = make_records(blocks, events_per_record=2)
    n, nblocks = len(records), _blocks(records)
    out["records"], out["blocks"] = n, nblocks
    out["blocks_per_record"] = nblocks / n
    topic = f"bench-kafka-side-{uuid.uuid4().hex[:8]}"
    asyncio.run(fill(bootstrap, topic, records))

    grid = {
        "max_records": [500, 2000, 10000],
        "fetch_bytes": [1 * MiB, 8 * MiB, 32 * MiB] if not quick else [1 * MiB, 32 * MiB],
        "fetch_max_wait_ms": [10, 100] if not quick else [10],
    }
    out["grid"] = grid
    reps = 1 if quick else 3

    def measure(mr: int, fb: int, wait: int, apply: bool) -> dict[str, Any]:
        # Median of reps by CPU cost: one rep that a neighbour's burst slowed says nothing.
        runs = []
        for _ in range(reps):
            wall, cpu, nbytes, polls = asyncio.run(_read(bootstrap, topic, n, mr, fb, wait, apply=apply))
            runs.append(dict(polls=polls, **_rates(n, nblocks, nbytes, wall, cpu)))
        runs.sort(key=lambda r: r["blocks_per_cpu_s"])
        row: dict[str, Any] = {"max_records": mr, "fetch_bytes": fb, "fetch_max_wait_ms": wait, "reps": reps}
        row.update(runs[len(runs) // 2])
        row["blocks_per_s_best"] = max(r["blocks_per_s"] for r in runs)
        print("apply" if apply else "fetch", {k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()})
        return row

    rows = [measure(mr, fb, w, False) for mr, fb, w in itertools.product(*grid.values())]
    out["fetch_grid"] = rows
    best = max(rows, key=lambda r: r["blocks_per_cpu_s"])
    out["fetch_best"] = best

    # Fetch + apply at the member's old default, at larger polls, and at the fetch's best setting.
    settings = {
        "max_records_2000_4MiB": (2000, 4 * MiB, 10),
        "max_records_10000_8MiB": (10000, 8 * MiB, 10),
        "fetch_best": (best["max_records"], best["fetch_bytes"], best["fetch_max_wait_ms"]),
    }
    applied = {label: measure(*s_, True) for label, s_ in settings.items()}
    out["fetch_and_apply"] = applied
    # The core alone on the same bytes: what apply would reach if the fetch cost nothing.
    from kvwire import _core
    from kvwire.consumer.apply import Applier

    class _R:
        __slots__ = ("key", "offset", "timestamp", "value")

        def __init__(self, k: bytes, v: bytes, o: int) -> None:
            self.key, self.value, self.offset, self.timestamp = k, v, o, 0

    recs = [_R(k, v, i) for i, (k, v) in enumerate(records)]
    a = Applier()
    t0, c0 = time.perf_counter(), time.process_time()
    i = 0
    while i < n:
        i = _core.apply_poll(a.index.core, a.ranks.core, recs, i, 1 << 40, time.time_ns() // 1000).next
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    out["core_only"] = {"blocks_per_s": nblocks / wall, "blocks_per_cpu_s": nblocks / cpu}
    # Where the fetch alone spends a CPU second per block, apply can at best reach 1/(fetch+core).
    f_cpu = 1 / best["blocks_per_cpu_s"]
    c_cpu = 1 / out["core_only"]["blocks_per_cpu_s"]
    out["one_core_ceiling_blocks_per_s"] = 1 / (f_cpu + c_cpu)
    out["fetch_share_of_cpu"] = f_cpu / (f_cpu + c_cpu)
    # The same bound if the core met its 5M blocks/s target: what the fetch alone leaves.
    out["one_core_ceiling_at_core_target_blocks_per_s"] = 1 / (f_cpu + 1 / 5e6)

    # Producer coalescing.
    co_blocks = min(blocks, 300_000) // (2 if quick else 1)
    co = {}
    for k in (1, 4, 16):
        ENCODE_CPU[0] = 0.0
        recs_k = coalesced_records(co_blocks, k)
        enc = ENCODE_CPU[0]
        nb = _blocks(recs_k)
        t = f"bench-kafka-coalesce-{k}-{uuid.uuid4().hex[:8]}"
        pw, pc = asyncio.run(_produce(bootstrap, t, recs_k))
        vbytes = sum(len(v) for _, v in recs_k)
        wall, cpu, _, _ = asyncio.run(_read(bootstrap, t, len(recs_k), 2000, 8 * MiB, 10, apply=True))
        co[str(k)] = {
            "steps_per_record": k,
            "blocks_per_record": nb / len(recs_k),
            "records": len(recs_k),
            "value_bytes_per_block": vbytes / nb,
            "produce_records_per_s": len(recs_k) / pw,
            "produce_blocks_per_s": nb / pw,
            "produce_cpu_us_per_block": pc / nb * 1e6,
            "encode_cpu_us_per_block": enc / nb * 1e6,
            "apply_blocks_per_s": nb / wall,
            "apply_cpu_us_per_block": cpu / nb * 1e6,
        }
        print("coalesce", k, {x: round(y, 3) if isinstance(y, float) else y for x, y in co[str(k)].items()}, flush=True)
    out["coalesce"] = co
    out["load_avg_1m"] = os.getloadavg()[0]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--blocks", type=int, default=None)
    args = ap.parse_args(argv)
    bootstrap = os.environ.get("KAFKA_BOOTSTRAP_SERVERS", "127.0.0.1:19092")
    # The full run's topic (~37k records, ~30 MB compressed) spans several fetches even at the
    # largest fetch size, so the grid sees steady state, not one fetch.
    blocks = args.blocks or (100_000 if args.quick else 1_200_000)
    res = run(bootstrap, blocks, args.quick)
    print(write_result("kafka_side", res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
