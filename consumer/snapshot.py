"""Snapshots: per partition, the index state of its workers plus the next
offset to read, so a member that restarts or takes over a partition loads the
snapshot and replays only the tail of the log (cold start = snapshot + tail,
through the same apply path as live ingest).

Format (version 2), all integers little-endian:

    b"KVWS" | u16 format version | u16 flags | u64 body length | u64 checksum | body

``checksum`` is xxh3-64 over the first 16 header bytes and the body, so a
flipped flag or length is caught like a flipped body byte. ``body`` is msgpack
of :class:`SnapshotBody`, zlib-compressed when flag bit 0 is set (off by
default: the index is engine hashes and chained keys, random bits zlib cannot
shrink, and compressing 180 MB costs seconds). ``SnapshotBody.index`` is
``PrefixIndex.export_workers`` (18 bytes per engine-hash entry, 17 per entry of a
worker's memo of removed parents), a blob with its own version: a body whose
blob predates the memos (blob version 1) loads with empty memos, which
under-credits a child of a parent removed before it, never over-credits, so it
is no reason to replay (the body's container is unchanged, so this format's
version is too). A snapshot whose magic, version, flags, length, checksum or
content is wrong is ignored, logged and counted, and the partition is replayed
from the log start: a snapshot is never trusted unverified.

Stores: a compacted Kafka topic ``<topic>.snapshots`` with as many partitions
as the source topic (partition p's snapshot lives in partition p mod n, so a
cold start reads one partition, not every partition's snapshots), chunked
under the broker's message size, keys ``<topic>/<partition>/<chunk>``: the
newest snapshot per partition survives compaction; or a directory (atomic
rename). When to write: every ``interval_s`` or ``every_records`` records of
the partition, whichever comes first, once the member has caught up; and when
a partition is revoked or the member stops cleanly.

Retention: a snapshot is useful only while the log still holds the records
after its offset. The newest snapshot of a partition is at most
``interval_s`` old while a member owns the partition, plus however long the
partition then goes unowned (member down, rebalance, restart). So the source
topic's ``retention.ms`` must exceed ``interval_s`` + the longest outage to
ride out, with margin: with the default 60 s interval, 1 h of retention rides
out any restart and 24 h an outage of a day; ``retention.bytes`` (if set) must
hold that much traffic too. The snapshot topic itself is compacted only (never
deleted by time) and holds about one snapshot per partition. When a snapshot's
offset is already gone from the log, the snapshot is still loaded (it is the
best we have), the lost range is logged, and every worker in it is marked
untrusted (scores nothing) until its next reset; ranks first seen in the tail
without a reset are untrusted the same way (``RankTable``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import struct
import time
import uuid
import zlib
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Protocol

import msgspec
import xxhash

from kvwire.kafka.options import admin_options, consumer_options
from kvwire.kafka.positions import seek_to_beginning
from kvwire.kafka.topics import Replication, partition_count

from .apply import Applier
from .rank_state import RankState

log = logging.getLogger(__name__)

MAGIC = b"KVWS"
# 2: block keys are the routers' v1 sequence hashes (docs/DESIGN.md). A version 1 snapshot holds
# keys of the chain before them, which no query computes any more: it is refused, and the
# partition is replayed from the log, which rebuilds the same state under the new keys.
FORMAT_VERSION = 2
_HEADER = struct.Struct("<4sHHQQ")
_CHECKED = 16  # header bytes the checksum covers: all but the checksum itself
FLAG_ZLIB = 1
_KNOWN_FLAGS = FLAG_ZLIB
# Under the broker's default message.max.bytes (1 MiB) with room for headers.
CHUNK_BYTES = 768 * 1024
_CHUNK_HEADER = struct.Struct("<16sII")  # generation uuid, chunk index, chunk count


class SnapshotError(ValueError):
    """A snapshot that must not be trusted."""


class RankRecord(msgspec.Struct, array_like=True):
    instance_id: str
    dp_rank: int
    tp_rank: int
    tp_size: int
    epoch: int
    last_seq: int
    trusted: bool
    untrusted_reason: str
    last_seen_us: int
    retired: list[int]
    records: int
    gaps: int
    # Appended later: a snapshot without it decodes as False, and a reader that predates it
    # ignores the trailing field.
    approximate: bool = False
    # Appended later too: a snapshot without it restores the rank's model as "" until its next record.
    model: str = ""


class SnapshotBody(msgspec.Struct, array_like=True):
    topic: str
    partition: int
    next_offset: int
    created_us: int
    ranks: list[RankRecord]
    index: bytes


def _checksum(header16: bytes, body) -> int:
    h = xxhash.xxh3_64(header16)
    h.update(body)
    return h.intdigest()


def encode_snapshot(body: SnapshotBody, compress: bool = False) -> bytes:
    raw = msgspec.msgpack.encode(body)
    flags = 0
    if compress:
        raw, flags = zlib.compress(raw, 1), FLAG_ZLIB
    head16 = _HEADER.pack(MAGIC, FORMAT_VERSION, flags, len(raw), 0)[:_CHECKED]
    return head16 + struct.pack("<Q", _checksum(head16, raw)) + raw


def decode_snapshot(data: bytes) -> SnapshotBody:
    if len(data) < _HEADER.size:
        raise SnapshotError("truncated header")
    magic, version, flags, length, checksum = _HEADER.unpack_from(data)
    if magic != MAGIC:
        raise SnapshotError(f"bad magic {magic!r}")
    if version != FORMAT_VERSION:
        why = " (its block keys predate the v1 hashes)" if version == 1 else ""
        raise SnapshotError(f"unsupported snapshot format version {version}{why}; replaying the partition instead")
    if flags & ~_KNOWN_FLAGS:
        raise SnapshotError(f"unknown flags {flags:#x}")
    raw: bytes | memoryview = memoryview(data)[_HEADER.size :]
    if len(raw) != length:
        raise SnapshotError(f"body is {len(raw)} bytes, header says {length}")
    if _checksum(bytes(data[:_CHECKED]), raw) != checksum:
        raise SnapshotError("checksum mismatch")
    try:
        if flags & FLAG_ZLIB:
            raw = zlib.decompress(raw)
        return msgspec.msgpack.decode(raw, type=SnapshotBody)
    except (zlib.error, msgspec.DecodeError) as e:
        raise SnapshotError(f"undecodable body: {e}") from None


# ---------------------------------------------------------------- capture / load


def capture(applier: Applier, topic: str, partition: int) -> SnapshotBody:
    """The state of one partition's workers, consistent with its position
    (call it between two records: it is synchronous, the loop cannot apply)."""
    workers = set(applier.workers_by_partition.get(partition, ()))
    tps = applier.ranks.tp_size
    ranks = [
        RankRecord(
            i,
            d,
            t,
            tps.get((i, d), 1),
            s.epoch,
            s.last_seq,
            s.trusted,
            s.untrusted_reason,
            s.last_seen_us,
            list(s.retired),
            s.records,
            s.gaps,
            s.approximate,
            s.model,
        )
        for (i, d, t), s in sorted(applier.ranks.ranks.items())
        if (i, d) in workers
    ]
    return SnapshotBody(
        topic,
        partition,
        applier.positions.get(partition, 0),
        time.time_ns() // 1000,
        ranks,
        applier.index.export_workers(sorted(workers)),
    )


def _forget(applier: Applier, workers: Iterable[tuple[str, int]]) -> None:
    for w in workers:
        applier.index.drop_worker(w)
        applier.ranks.forget_worker(w)


def load(applier: Applier, body: SnapshotBody, untrusted_reason: str | None = None) -> None:
    """Install a snapshot's workers into the applier (replacing what it had of
    them). Raises SnapshotError, with none of them left behind, when the index
    part does not load."""
    workers = {(r.instance_id, r.dp_rank) for r in body.ranks}
    _forget(applier, workers)
    try:
        applier.index.import_workers(body.index)
    except ValueError as e:
        # The checksum matched, so a writer bug wrote this: half an import is worse than none.
        _forget(applier, workers | set(applier.index.workers()) - _held_elsewhere(applier, body.partition))
        raise SnapshotError(f"index does not load: {e}") from None
    for r in body.ranks:
        st = RankState.of(r)
        if untrusted_reason:
            st.trusted, st.untrusted_reason = False, untrusted_reason
        applier.ranks.restore((r.instance_id, r.dp_rank, r.tp_rank), st, r.tp_size)
    applier.workers_by_partition[body.partition] = set(workers)
    applier.positions[body.partition] = body.next_offset


def _held_elsewhere(applier: Applier, partition: int) -> set[tuple[str, int]]:
    return {w for p, ws in applier.workers_by_partition.items() if p != partition for w in ws}


# ---------------------------------------------------------------- stores


class SnapshotStore(Protocol):
    async def load(self, topic: str, partition: int) -> bytes | None: ...
    async def save(self, topic: str, partition: int, data: bytes) -> None: ...
    async def close(self) -> None: ...


class DirectoryStore:
    def __init__(self, directory: str | os.PathLike):
        self.root = Path(directory)

    def path(self, topic: str, partition: int) -> Path:
        return self.root / topic / f"{partition}.snap"

    async def load(self, topic, partition):
        p = self.path(topic, partition)
        return await asyncio.to_thread(lambda: p.read_bytes() if p.exists() else None)

    async def save(self, topic, partition, data):
        await asyncio.to_thread(self._write, self.path(topic, partition), data)

    @staticmethod
    def _write(p: Path, data: bytes) -> None:
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_suffix(f".tmp-{uuid.uuid4().hex[:8]}")
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())  # a crash after the rename must not leave a renamed empty file
        os.replace(tmp, p)  # readers see the old snapshot or the new one, never half

    async def close(self):
        pass


class KafkaStore:
    """Snapshots in a compacted topic, one key per (partition, chunk).

    A snapshot is a *generation* of chunks; a reader takes the newest complete
    one, so a writer that died mid-snapshot (or compaction that has only kept
    some chunks of an older generation) is never mistaken for a snapshot."""

    def __init__(
        self,
        bootstrap_servers: str,
        topic: str,
        source_topic: str | None = None,
        client_options: dict | None = None,
        chunk_bytes: int = CHUNK_BYTES,
        replication: Replication | None = None,
    ):
        self.replication = replication
        self.bootstrap = bootstrap_servers
        self.topic = topic
        self.source_topic = source_topic
        self.opts = dict(client_options or {})
        self.chunk_bytes = chunk_bytes
        self._producer: Any = None  # AIOKafkaProducer, imported when first needed
        self._partitions: int | None = None
        self._chunks: dict[tuple[str, int], int] = {}  # chunks of the last generation written, for tombstones

    async def _admin(self):
        from aiokafka.admin import AIOKafkaAdminClient

        admin = AIOKafkaAdminClient(bootstrap_servers=self.bootstrap, **admin_options(self.opts))
        await admin.start()
        return admin

    async def _ensure_topic(self, create: bool) -> int | None:
        if self._partitions is not None:
            return self._partitions
        admin = await self._admin()
        try:
            # Describe only what exists: a metadata request for a missing topic auto-creates it
            # on a broker that allows that, with the broker's defaults instead of ours.
            existing = set(await admin.list_topics())
            n = await partition_count(admin, self.topic) if self.topic in existing else None
            src = self.source_topic
            want = (await partition_count(admin, src) if src and src in existing else None) or 1
        finally:
            await admin.close()
        if n is None and create:
            from kvwire.kafka.topics import ensure_topic

            # Replicated like the events (kvwire.kafka.topics): a snapshot lost with one broker costs
            # every member a replay from the log start.
            n = await ensure_topic(
                self.bootstrap,
                self.topic,
                want,
                {
                    "cleanup.policy": "compact",
                    # Roll and clean often: the topic's size should stay about one snapshot per partition.
                    "segment.ms": "600000",
                    "min.cleanable.dirty.ratio": "0.1",
                    "max.message.bytes": str(self.chunk_bytes + 64 * 1024),
                },
                replication=self.replication,
                client_options=self.opts,
            )
        self._partitions = n
        return n

    async def save(self, topic, partition, data):
        from aiokafka import AIOKafkaProducer

        n = await self._ensure_topic(create=True)
        if self._producer is None:
            producer = AIOKafkaProducer(
                bootstrap_servers=self.bootstrap,
                enable_idempotence=True,
                acks="all",
                max_request_size=self.chunk_bytes + 64 * 1024,
                linger_ms=5,
                **self.opts,
            )
            await producer.start()
            self._producer = producer
        producer = self._producer
        gen = uuid.uuid4().bytes
        cb = self.chunk_bytes
        chunks = [data[i : i + cb] for i in range(0, len(data), cb)] or [b""]
        sp = partition % n
        futs = [
            await producer.send(
                self.topic,
                _CHUNK_HEADER.pack(gen, i, len(chunks)) + c,
                key=f"{topic}/{partition}/{i}".encode(),
                partition=sp,
            )
            for i, c in enumerate(chunks)
        ]
        # Chunks a longer older generation left under higher keys: tombstones, or
        # compaction would keep them (harmless, never complete, but dead weight).
        for i in range(len(chunks), self._chunks.get((topic, partition), 0)):
            futs.append(await producer.send(self.topic, None, key=f"{topic}/{partition}/{i}".encode(), partition=sp))
        await asyncio.gather(*futs)
        self._chunks[(topic, partition)] = len(chunks)

    async def load(self, topic, partition):
        from aiokafka import AIOKafkaConsumer, TopicPartition

        n = await self._ensure_topic(create=False)
        if not n:
            return None
        prefix = f"{topic}/{partition}/".encode()
        c = AIOKafkaConsumer(
            bootstrap_servers=self.bootstrap,
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            fetch_max_bytes=32 * 1024 * 1024,
            max_partition_fetch_bytes=8 * 1024 * 1024,
            **consumer_options(self.opts),
        )
        try:
            await c.start()  # in the try: a client whose start failed must still be stopped
            tp = TopicPartition(self.topic, partition % n)
            c.assign([tp])
            end = (await c.end_offsets([tp]))[tp]
            await seek_to_beginning(c, tp)
            # Only generations still being assembled and the newest complete one
            # are kept: an uncompacted topic may hold many old snapshots.
            building: dict[bytes, dict[int, bytes]] = {}
            counts: dict[bytes, int] = {}
            newest: list[bytes] | None = None
            while await c.position(tp) < end:
                for recs in (await c.getmany(tp, timeout_ms=1000)).values():
                    for r in recs:
                        v = r.value
                        if r.key is None or not r.key.startswith(prefix) or v is None or len(v) < _CHUNK_HEADER.size:
                            continue
                        gen, i, cnt = _CHUNK_HEADER.unpack_from(v)
                        if cnt == 0 or i >= cnt:
                            continue
                        if counts.setdefault(gen, cnt) != cnt:
                            continue
                        parts = building.setdefault(gen, {})
                        parts[i] = v[_CHUNK_HEADER.size :]
                        if len(parts) == cnt:
                            newest = [parts[k] for k in range(cnt)]
                            # generations older than this one can never be the answer
                            building.clear()
                            counts = {}
            return b"".join(newest) if newest is not None else None
        finally:
            await c.stop()

    async def close(self):
        if self._producer is not None:
            await self._producer.stop()
            self._producer = None


# ---------------------------------------------------------------- policy


class Snapshots:
    """When to write snapshots, and how to cold-start a partition from one."""

    def __init__(
        self, store: SnapshotStore, interval_s: float = 60.0, every_records: int = 200_000, compress: bool = False
    ):
        self.store = store
        self.interval_s = interval_s
        self.every_records = every_records
        self.compress = compress
        self._last: dict[int, tuple[float, int]] = {}  # partition -> (time, offset) of its last snapshot
        self.loaded = 0
        self.rejected = 0
        self.saved = 0
        self.gaps = 0  # snapshots whose next offset retention had already deleted

    async def restore(
        self, applier: Applier, topic: str, partition: int, log_start: int, log_end: int | None = None
    ) -> int:
        """Load the newest snapshot of ``partition``; return the offset to read from."""
        try:
            data = await self.store.load(topic, partition)
        except Exception as e:  # an unreachable store costs a longer replay, not the partition
            log.warning("snapshot of %s/%d unreadable (%r): replaying from the log", topic, partition, e)
            return log_start
        if data is None:
            return log_start
        try:
            body = await asyncio.to_thread(decode_snapshot, data)
            del data
            if body.topic != topic or body.partition != partition:
                raise SnapshotError(f"snapshot is of {body.topic}/{body.partition}")
            if log_end is not None and body.next_offset > log_end:
                # The topic was recreated (offsets restarted): this state is of another log.
                raise SnapshotError(f"snapshot offset {body.next_offset} is past the log end {log_end}")
            reason = None
            if body.next_offset < log_start:
                reason = f"records {body.next_offset}..{log_start - 1} deleted by retention before replay"
                log.warning("%s/%d: %s; its workers are untrusted until their next reset", topic, partition, reason)
            load(applier, body, reason)
        except SnapshotError as e:
            self.rejected += 1
            log.warning("snapshot of %s/%d rejected (%s): replaying from the log", topic, partition, e)
            return log_start
        if reason:
            self.gaps += 1
        self.loaded += 1
        start = max(body.next_offset, log_start)
        self._last[partition] = (time.monotonic(), start)
        log.info(
            "%s/%d: loaded snapshot at offset %d (%d ranks), reading from %d",
            topic,
            partition,
            body.next_offset,
            len(body.ranks),
            start,
        )
        return start

    async def save(self, applier: Applier, topic: str, partition: int) -> None:
        body = capture(applier, topic, partition)  # on the loop: consistent with the position
        # encoding a large index takes a while: keep the loop (heartbeats, HTTP) free
        data = await asyncio.to_thread(encode_snapshot, body, self.compress)
        await self.store.save(topic, partition, data)
        self._last[partition] = (time.monotonic(), body.next_offset)
        self.saved += 1

    async def maybe_save(
        self,
        applier: Applier,
        topic: str,
        partitions: Iterable[int],
        owned: Callable[[int], bool] | None = None,
    ) -> None:
        """Save each partition that is due. ``owned(p)`` is asked right before each capture: the
        saves before it awaited, and the partition may have been revoked meanwhile."""
        now = time.monotonic()
        for p in partitions:
            if owned is not None and not owned(p):
                continue
            pos = applier.positions.get(p)
            if pos is None:
                continue
            t, off = self._last.setdefault(p, (now, pos))
            if pos != off and (now - t >= self.interval_s or pos - off >= self.every_records):
                await self.save(applier, topic, p)

    async def close(self) -> None:
        await self.store.close()


def snapshot_store(
    bootstrap: str,
    topic: str,
    directory: str | None = None,
    client_options: dict | None = None,
    interval_s: float = 60.0,
    every_records: int = 200_000,
) -> Snapshots:
    store = (
        DirectoryStore(directory) if directory else KafkaStore(bootstrap, f"{topic}.snapshots", topic, client_options)
    )
    return Snapshots(store, interval_s, every_records)
