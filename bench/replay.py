"""Replay and cold-start benchmark: how fast an index is rebuilt from the log,
and how long a member takes to come back from a snapshot plus the log's tail.

Workload (synthetic, straight into a topic through aiokafka with the
publisher's record format, headers and compression): 256 workers, each
storing conversations as BlockStored events of 64 blocks x 16 tokens chained
from the previous event, random tokens and 64-bit engine hashes, no
evictions, so holder-blocks = blocks stored. Sizes: 1M holder-blocks
(``--quick``) and 10M. Per size:

- ``replay``: a full replay from the earliest offset (``kvwire.consumer.replay``:
  fetch, decode, fence, apply) -> blocks/s;
- ``snapshot``: every partition's snapshot written to a directory store, with
  size and time;
- ``cold start``: 1% more records are appended, then a fresh applier loads
  every partition's snapshot and replays the tail (``replay --from
  snapshot``, the same path as ``IndexMember`` on assignment) -> seconds, also
  per million holder-blocks; the snapshot load alone is reported too.

Writes ``bench/results/replay.json``. Needs a broker (``kvwire kafka start``
or KAFKA_BOOTSTRAP_SERVERS).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import tempfile
import time
import uuid
from array import array

import numpy as np

from .common import write_result

BS = 16
EV_BLOCKS = 64
N_WORKERS = 256
PARTITIONS = 8


def _records(n_blocks: int, seed: int, epoch_base: int, first: bool):
    """(key, value) records holding ``n_blocks`` blocks over N_WORKERS workers."""
    from kvwire.schemas import codec
    from kvwire.schemas.events import EventBatch, WorkerId, stored

    rng = np.random.default_rng(seed)
    workers = [WorkerId(f"vllm-{i}", 0, 0, 1, "m") for i in range(N_WORKERS)]
    seq = [0] * N_WORKERS
    parent: list[int | None] = [None] * N_WORKERS
    n_ev = max(1, n_blocks // EV_BLOCKS)
    toks = rng.integers(0, 128_000, (n_ev, EV_BLOCKS * BS), dtype=np.uint32)
    hashes = rng.integers(0, 2**63, (n_ev, EV_BLOCKS), dtype=np.int64)
    conv_events = 8  # 512-block conversations, then a new one
    for e in range(n_ev):
        w = e % N_WORKERS
        if (e // N_WORKERS) % conv_events == 0:
            parent[w] = None
        t = array("I")
        t.frombytes(toks[e].tobytes())
        hs = hashes[e].tolist()
        ev = stored(hs, t, BS, parent_block_hash=parent[w])
        parent[w] = hs[-1]
        s = seq[w]
        seq[w] += 1
        b = EventBatch(
            workers[w],
            epoch_base + w,
            s + (0 if first else 1_000_000),
            time.time_ns() // 1000,
            (ev,),
            reset=first and s == 0,
        )
        yield workers[w].kafka_key(), codec.encode(b)


async def _produce(bootstrap: str, topic: str, records) -> int:
    from aiokafka import AIOKafkaProducer

    from kvwire.producer.config import PublisherConfig
    from kvwire.producer.publisher import HEADERS

    p = AIOKafkaProducer(
        bootstrap_servers=bootstrap,
        linger_ms=20,
        max_batch_size=1024 * 1024,
        compression_type=PublisherConfig().compression_type,
        enable_idempotence=True,
    )
    await p.start()
    n = 0
    try:
        futs = []
        for key, value in records:
            futs.append(await p.send(topic, value, key=key, headers=HEADERS))
            n += 1
            if len(futs) >= 2000:
                await asyncio.gather(*futs)
                futs = []
        await asyncio.gather(*futs)
    finally:
        await p.stop()
    return n


async def _create(bootstrap: str, topic: str) -> None:
    from kvwire.kafka.topics import ensure_topic

    await ensure_topic(bootstrap, topic, PARTITIONS)


async def _delete(bootstrap: str, topic: str) -> None:
    from aiokafka.admin import AIOKafkaAdminClient

    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        await admin.delete_topics([topic])
    except Exception:
        pass
    finally:
        await admin.close()


async def run_size(bootstrap: str, n_blocks: int, tmp: str) -> dict:
    from kvwire.consumer.apply import Applier
    from kvwire.consumer.replay import replay
    from kvwire.consumer.snapshot import DirectoryStore, Snapshots

    topic = f"bench-replay-{n_blocks}-{uuid.uuid4().hex[:6]}"
    await _create(bootstrap, topic)
    try:
        t = time.perf_counter()
        records = await _produce(bootstrap, topic, _records(n_blocks, 1, 1000, True))
        produce_s = time.perf_counter() - t
        print(f"[{n_blocks:,}] produced {records:,} records in {produce_s:.1f} s", flush=True)

        full = await replay(bootstrap, topic)
        holder = len(full.applier.index)
        replay_s, replayed = full.seconds, full.blocks
        print(
            f"[{n_blocks:,}] replay: {full.blocks:,} blocks in {full.seconds:.1f} s = {full.blocks / full.seconds:,.0f} blocks/s",
            flush=True,
        )

        snap_dir = os.path.join(tmp, topic)
        snaps = Snapshots(DirectoryStore(snap_dir))
        t = time.perf_counter()
        for p in range(PARTITIONS):
            await snaps.save(full.applier, topic, p)
        save_s = time.perf_counter() - t
        snap_bytes = sum(os.path.getsize(os.path.join(dp, f)) for dp, _, fs in os.walk(snap_dir) for f in fs)
        del full

        tail_blocks = max(EV_BLOCKS, n_blocks // 100)
        tail_records = await _produce(bootstrap, topic, _records(tail_blocks, 2, 1000, False))

        # Snapshot load alone: every partition into one fresh applier.
        a = Applier()
        t = time.perf_counter()
        for p in range(PARTITIONS):
            await Snapshots(DirectoryStore(snap_dir)).restore(a, topic, p, 0)
        load_s = time.perf_counter() - t
        loaded = len(a.index)
        del a

        # Cold start: snapshot + tail, as a member does on assignment.
        t = time.perf_counter()
        cold = await replay(bootstrap, topic, "snapshot", snapshots=Snapshots(DirectoryStore(snap_dir)))
        cold_s = time.perf_counter() - t
        cold_holder = len(cold.applier.index)
        assert loaded == holder and cold.records == tail_records, (loaded, holder, cold.records, tail_records)
        print(
            f"[{n_blocks:,}] snapshot {snap_bytes / 1e6:.0f} MB saved in {save_s:.1f} s, loaded in {load_s:.2f} s; "
            f"cold start (load + {tail_records:,} tail records) {cold_s:.2f} s",
            flush=True,
        )
        shutil.rmtree(snap_dir, ignore_errors=True)
        return {
            "records": records,
            "holder_blocks": holder,
            "produce_s": round(produce_s, 2),
            "replay_s": round(replay_s, 2),
            "replay_blocks_per_s": round(replayed / replay_s),
            "snapshot_bytes": snap_bytes,
            "snapshot_bytes_per_holder_block": round(snap_bytes / holder, 2),
            "snapshot_save_s": round(save_s, 2),
            "snapshot_load_s": round(load_s, 2),
            "tail_records": tail_records,
            "cold_start_s": round(cold_s, 2),
            "cold_start_holder_blocks": cold_holder,
            "cold_start_s_per_million_blocks": round(cold_s / (cold_holder / 1e6), 3),
        }
    finally:
        await _delete(bootstrap, topic)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="1M holder-blocks only (< 2 min)")
    ap.add_argument("--bootstrap-servers", default=os.environ.get("KAFKA_BOOTSTRAP_SERVERS", "127.0.0.1:19092"))
    args = ap.parse_args(argv)
    sizes = [1_000_000] if args.quick else [1_000_000, 10_000_000]
    out: dict = {
        "workload": {"workers": N_WORKERS, "block_size": BS, "blocks_per_event": EV_BLOCKS, "partitions": PARTITIONS}
    }
    # Only sizes measured now: a --quick run never presents an older run's 10M row as its own.
    out["mode"] = "quick" if args.quick else "full"
    with tempfile.TemporaryDirectory(prefix="kvwire-bench-replay-") as tmp:
        for n in sizes:
            out[f"{n // 1_000_000}M"] = asyncio.run(run_size(args.bootstrap_servers, n, tmp))
    big = out[max((k for k in out if k.endswith("M")), key=lambda k: int(k[:-1]))]
    out.pop("_machine", None)
    out["replay_blocks_per_s"] = big["replay_blocks_per_s"]
    out["cold_start_s_per_million_blocks"] = big["cold_start_s_per_million_blocks"]
    print(write_result("replay", out))


if __name__ == "__main__":
    main()
