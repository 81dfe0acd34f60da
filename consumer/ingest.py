"""A consumer-group member that keeps a prefix-cache index of its partitions.

Two deployment modes, same code:
- each router its own group (``group_id`` unique per router): every member
  is assigned every partition and holds the full index;
- several members in one group: each indexes the partitions Kafka gives it,
  and a scatter-gather score (see ``kvwire.consumer.http``) merges their answers.

State is rebuilt from the log on assignment (from the partition's newest
snapshot when a snapshot store is configured, else from the beginning), so a
member that restarts or takes over a partition converges to the same index.
Offsets are committed only after the records before them are applied, and
dead letters are written before the commit that passes them.

Supervision: the member never freezes silently. Snapshots are written by their own task,
so a slow or failing store never stops ingest; a failed snapshot is retried with exponential
backoff, and after ``snapshot_failure_limit`` failures in a row (or if the ingest task
itself ends) ``failure`` says why, ``/healthz`` answers 503, ``kvwire_index_failed{reason}``
is 1, and ``kvwire index`` exits non-zero so that an orchestrator restarts it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRebalanceListener, TopicPartition
from aiokafka.structs import OffsetAndMetadata

from kvwire.kafka.options import SUBSCRIBER_METADATA_MAX_AGE_MS
from kvwire.kafka.registry.resolver import IdResolver

from .apply import Applier, DeadLetter

log = logging.getLogger(__name__)

DEFAULT_GROUP_PREFIX = "kvwire-index"


def default_group_id(topic: str, http_port: int | None = None, host: str | None = None) -> str:
    """The group a router joins when given none: ``kvwire-index.<topic>.<host>[.<port>]``.

    Stable across restarts (lag exporters and ACLs can follow it; ACLs can match the
    ``kvwire-index.`` prefix), and still one group per router: two routers on one host differ
    by their HTTP port, so neither silently takes half of the other's partitions."""
    name = host or socket.gethostname()
    return f"{DEFAULT_GROUP_PREFIX}.{topic}.{name}" + (f".{http_port}" if http_port else "")


@dataclass
class IngestConfig:
    bootstrap_servers: str
    topic: str
    # None: a group of its own (full index). Same id on several members: shared.
    group_id: str | None = None
    dlq_topic: str | None = None  # default "<topic>.dlq"
    heartbeat_timeout_s: float = 60.0
    max_records: int = 2000
    commit_interval_s: float = 1.0
    # The broker holds a fetch until this long when a partition is quiet;
    # aiokafka's 500 ms default would be the index's lag floor.
    fetch_max_wait_ms: int = 10
    client_options: dict = field(default_factory=dict)
    # Snapshot supervision: first retry after this long, doubling up to the max; this many
    # failed snapshot attempts in a row make the member unhealthy.
    snapshot_retry_s: float = 1.0
    snapshot_retry_max_s: float = 60.0
    snapshot_failure_limit: int = 5
    # A snapshot round that has not finished by then counts as failed (a store that hangs,
    # e.g. a partition without a leader, must not leave the member healthy forever).
    snapshot_timeout_s: float = 300.0
    # Replication of the dead-letter topic (None: kvwire.kafka.topics' configuration/defaults).
    replication_factor: int | None = None
    min_insync_replicas: int | None = None
    # Where Confluent-framed records' schema ids are resolved (None: $KVWIRE_SCHEMA_REGISTRY_URL).
    schema_registry_url: str | None = None

    def resolved_group(self) -> str:
        # Embedded members (tests, the demo) without a group each get a fresh one; `kvwire index`
        # passes default_group_id() instead, which is stable.
        return self.group_id or f"kvwire-index-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"

    def resolved_dlq(self) -> str:
        return self.dlq_topic or f"{self.topic}.dlq"


class _Rebalance(ConsumerRebalanceListener):
    def __init__(self, member: IndexMember):
        self.member = member

    async def on_partitions_revoked(self, revoked):
        await self.member._on_revoked({tp.partition for tp in revoked})

    async def on_partitions_assigned(self, assigned):
        await self.member._on_assigned({tp.partition for tp in assigned})


class IndexMember:
    def __init__(self, config: IngestConfig, applier: Applier | None = None, snapshots=None):
        self.config = config
        self.applier = applier if applier is not None else Applier()
        self.snapshots = snapshots
        self.group_id = config.resolved_group()
        self.schema_ids = IdResolver.from_env(config.schema_registry_url)
        self.assigned: set[int] = set()
        self._pending_revoke: set[int] = set()
        self._targets: dict[int, int] = {}  # end offsets seen at assignment
        self._starts: dict[int, int] = {}  # log start offsets at assignment
        self._assigning = False
        self._ready = False
        self._consumer: AIOKafkaConsumer | None = None
        self._producer: AIOKafkaProducer | None = None
        self._task: asyncio.Task | None = None
        self._stopping = asyncio.Event()
        self._last_commit = 0.0
        self._committed: dict[int, int] = {}
        self._snap_task: asyncio.Task | None = None
        self._snap_failures = 0  # failed snapshot attempts in a row
        self.failure: str | None = None  # why this member is unhealthy; None while healthy
        self._failures: dict[str, str] = {}  # reason -> detail
        self._failed = asyncio.Event()

    # ------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        opts = dict(self.config.client_options)
        self._consumer = AIOKafkaConsumer(
            bootstrap_servers=self.config.bootstrap_servers,
            group_id=self.group_id,
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            # bench/kafka_side.py: 500-10,000 records x 1-32 MiB fetch at the same CPU per block
            # within noise (aiokafka's per-record objects dominate), so these stay.
            max_partition_fetch_bytes=4 * 1024 * 1024,
            fetch_max_wait_ms=self.config.fetch_max_wait_ms,
            # A member may start before any producer created its topic.
            **{"metadata_max_age_ms": SUBSCRIBER_METADATA_MAX_AGE_MS, **opts},
        )
        self._producer = AIOKafkaProducer(
            bootstrap_servers=self.config.bootstrap_servers, enable_idempotence=True, **opts
        )
        try:
            await self._producer.start()
            await self._ensure_dlq()
            await self._consumer.start()
        except BaseException:
            # aiokafka leaves a client whose start failed open, and reports it unclosed when collected.
            await asyncio.gather(self._producer.stop(), self._consumer.stop(), return_exceptions=True)
            raise
        self._consumer.subscribe([self.config.topic], listener=_Rebalance(self))
        self._task = asyncio.create_task(self._run(), name=f"kvwire-ingest-{self.group_id}")
        self._task.add_done_callback(lambda t: self._task_ended("ingest", t))
        if self.snapshots is not None:
            self._snap_task = asyncio.create_task(self._snapshot_loop(), name=f"kvwire-snapshots-{self.group_id}")
            self._snap_task.add_done_callback(lambda t: self._task_ended("snapshots", t))

    # ------------------------------------------------------------ supervision

    @property
    def healthy(self) -> bool:
        return self.failure is None

    async def wait_failed(self) -> str:
        """Returns the reason once the member has become unhealthy."""
        await self._failed.wait()
        return self.failure or "unknown"

    def _set_failure(self, reason: str, detail: str) -> None:
        if reason not in self._failures:
            log.error("index member unhealthy (%s): %s", reason, detail)
        self._failures[reason] = detail
        self.applier.metrics.failed.labels(reason).set(1)
        self.failure = "; ".join(f"{r}: {d}" for r, d in self._failures.items())
        self._failed.set()

    def _clear_failure(self, reason: str) -> None:
        if self._failures.pop(reason, None) is not None:
            log.info("index member recovered from %s", reason)
            self.applier.metrics.failed.labels(reason).set(0)
            self.failure = "; ".join(f"{r}: {d}" for r, d in self._failures.items()) or None
            if self.failure is None:
                self._failed.clear()

    def _task_ended(self, name: str, task: asyncio.Task) -> None:
        if self._stopping.is_set():
            return
        if task.cancelled():
            detail = f"{name} task cancelled"
        elif task.exception() is not None:
            detail = f"{name} task died: {task.exception()!r}"
        else:
            detail = f"{name} task returned"
        self._set_failure("ingest_task_dead" if name == "ingest" else "snapshot_task_dead", detail)

    async def _snapshot_loop(self) -> None:
        """Periodic snapshots beside ingest, never inside it: a save that hangs or fails costs
        snapshots (a longer replay after a restart), not freshness."""
        cfg = self.config
        retry_at = 0.0
        while not self._stopping.is_set():
            try:
                await asyncio.wait_for(self._stopping.wait(), 0.2)
                return
            except TimeoutError:
                pass
            if time.monotonic() < retry_at or not self.ready or self._assigning:
                continue
            try:
                await asyncio.wait_for(
                    self.snapshots.maybe_save(self.applier, self.config.topic, sorted(self.assigned), owned=self._owns),
                    cfg.snapshot_timeout_s,
                )
            except Exception as e:
                self._snap_failures += 1
                self.applier.metrics.snapshot_failures.inc()
                delay = min(cfg.snapshot_retry_max_s, cfg.snapshot_retry_s * 2 ** (self._snap_failures - 1))
                retry_at = time.monotonic() + delay
                log.warning("snapshot failed (%d in a row), retrying in %.1fs: %r", self._snap_failures, delay, e)
                if self._snap_failures >= cfg.snapshot_failure_limit:
                    self._set_failure("snapshots_failing", f"{self._snap_failures} snapshot attempts failed: {e!r}")
            else:
                if self._snap_failures:
                    log.info("snapshot succeeded after %d failure(s)", self._snap_failures)
                self._snap_failures = 0
                self._clear_failure("snapshots_failing")

    def _owns(self, partition: int) -> bool:
        """Checked right before a snapshot is captured: a partition revoked meanwhile must not be
        written (its state is gone, an empty snapshot would skip its records for the next owner)."""
        return partition in self.assigned and not self._assigning

    async def stop(self) -> None:
        self._stopping.set()
        for task in (self._task, self._snap_task):
            if task is None:
                continue
            try:
                await asyncio.wait_for(task, 10)
            except asyncio.CancelledError:
                if not task.cancelled():
                    raise  # we are being cancelled ourselves, not just reaping a cancelled task
            except (TimeoutError, Exception) as e:  # stopping must not raise
                log.warning("%s ended badly: %r", task.get_name(), e)
        try:
            await self._flush_and_commit(force=True)
        except Exception as e:
            log.warning("final commit failed: %r", e)
        if self.snapshots is not None:
            await self._write_snapshots(self.assigned)
            try:
                await self.snapshots.close()
            except Exception as e:
                log.warning("snapshot store close failed: %r", e)
        for c in (self._consumer, self._producer):
            if c is not None:
                try:
                    await c.stop()
                except Exception as e:
                    log.warning("client stop failed: %r", e)

    async def _ensure_dlq(self) -> None:
        """Create the dead-letter topic up front (replicated like the events: a dead letter is
        the only copy of a record once the commit passes it) so the first bad record is not
        also the first metadata miss; a broker that forbids it gets a warning."""
        from kvwire.kafka.topics import Replication, ensure_topic

        cfg = self.config
        try:
            await ensure_topic(
                cfg.bootstrap_servers,
                cfg.resolved_dlq(),
                1,
                replication=Replication.from_env(
                    replication_factor=cfg.replication_factor, min_insync_replicas=cfg.min_insync_replicas
                ),
                client_options=cfg.client_options,
            )
        except Exception as e:
            log.warning("cannot create dead-letter topic: %r", e)

    @property
    def ready(self) -> bool:
        """Caught up with the end offsets seen when the partitions were assigned."""
        if not self._ready and self.assigned and not self._assigning:
            pos = self.applier.positions
            if all(pos.get(p, self._starts.get(p, 0)) >= t for p, t in self._targets.items()):
                self._ready = True
        return self._ready

    # ------------------------------------------------------------ rebalance

    async def _on_revoked(self, partitions: set[int]) -> None:
        # Eager rebalancing revokes everything; keep state until we know
        # which partitions really moved away.
        try:
            await self._flush_and_commit(force=True)
        except Exception as e:
            log.warning("commit on revoke failed: %r", e)
        self._pending_revoke |= partitions

    async def _on_assigned(self, partitions: set[int]) -> None:
        # Not ready until the new assignment's targets are known and reached:
        # /healthz must never say 200 in the window while we are still seeking.
        self._ready = False
        self._assigning = True
        c = self._consumer
        assert c is not None  # start() made it; rebalances only happen after
        # aiokafka installs the assignment before calling us, so it is already
        # fetching while we await the snapshot store; records it hands to _run
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
                    await self._write_snapshots(gone)
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
            self._assigning = False
            if tps:
                c.resume(*tps)
        log.info(
            "member %s assigned %s (new %s, dropped %s)", self.group_id, sorted(partitions), sorted(new), sorted(gone)
        )

    async def _restore(self, partition: int, log_start: int, log_end: int | None = None) -> int:
        """Where to start reading a newly assigned partition (snapshot or log start)."""
        if self.snapshots is None:
            return log_start
        return await self.snapshots.restore(self.applier, self.config.topic, partition, log_start, log_end)

    async def _write_snapshots(self, partitions: Iterable[int]) -> None:
        for p in sorted(partitions):
            try:
                await self.snapshots.save(self.applier, self.config.topic, p)
            except Exception as e:
                log.warning("snapshot of partition %d failed: %r", p, e)

    # ------------------------------------------------------------ loop

    async def _run(self) -> None:
        c = self._consumer
        assert c is not None  # started by start() before this task
        a = self.applier
        expire_every = max(1.0, self.config.heartbeat_timeout_s / 4)
        last_expire = time.monotonic()
        while not self._stopping.is_set():
            try:
                batches = await c.getmany(timeout_ms=200, max_records=self.config.max_records)
            except Exception as e:
                log.warning("poll failed, retrying: %r", e)
                await asyncio.sleep(0.5)
                continue
            # Confluent-framed records name registry ids: fetch the unknown ones now, so that
            # decode never does I/O. Until the registry answers nothing of this poll is applied.
            values = [r.value for recs in batches.values() for r in recs]
            if values and self.schema_ids.ids.missing(values):
                try:
                    await self.schema_ids.prefetch_retrying(values, self._stopping)
                except Exception as e:  # stopping with the registry down: left for the next owner
                    log.warning("stopping before the schema registry answered: %r", e)
                    break
            for tp, recs in batches.items():
                if tp.partition not in self.assigned:
                    continue
                i = 0
                while i < len(recs) and tp.partition in self.assigned:
                    # One core call per slice of the poll (decode, fence, apply, a few ms at most).
                    i = a.apply_records(tp.topic, tp.partition, recs, i)
                    await asyncio.sleep(0)  # let heartbeats and HTTP readers in
            now = time.monotonic()
            if now - last_expire >= expire_every and self.ready:
                last_expire = now
                a.expire(time.time_ns() // 1000, int(self.config.heartbeat_timeout_s * 1e6))
            try:
                await self._flush_and_commit()
            except Exception as e:
                log.warning("commit failed, will retry: %r", e)
            try:
                self._update_gauges()
            except Exception as e:  # a gauge is not worth the ingest task
                log.warning("metrics update failed: %r", e)

    async def _flush_and_commit(self, force: bool = False) -> None:
        dead = self.applier.take_dead_letters()
        if dead:
            try:
                await self._send_dead_letters(dead)
            except BaseException:
                # Not all delivered: keep them for the next flush (a retry may duplicate some in
                # the DLQ, never lose one) and do not commit past them.
                self.applier.dead_letters[:0] = dead
                raise
        now = time.monotonic()
        if not force and now - self._last_commit < self.config.commit_interval_s:
            return
        self._last_commit = now
        offsets = {
            TopicPartition(self.config.topic, p): OffsetAndMetadata(off, "")
            for p, off in self.applier.positions.items()
            if p in self.assigned and self._committed.get(p) != off
        }
        if offsets and self._consumer is not None:
            await self._consumer.commit(offsets)
            self._committed.update({tp.partition: om.offset for tp, om in offsets.items()})

    async def _send_dead_letters(self, dead: list[DeadLetter]) -> None:
        futs = []
        for d in dead:
            headers = [
                ("kvwire-error", d.error.encode()[:4096]),
                ("kvwire-source-topic", d.topic.encode()),
                ("kvwire-source-partition", str(d.partition).encode()),
                ("kvwire-source-offset", str(d.offset).encode()),
                ("kvwire-source-timestamp", str(d.timestamp_ms).encode()),
            ]
            assert self._producer is not None  # started with the consumer
            futs.append(
                # A null-key tombstone is a legal record that our client refuses to write back:
                # an empty key (the source coordinates are in the headers anyway).
                await self._producer.send(
                    self.config.resolved_dlq(),
                    d.value,
                    key=d.key if d.key is not None or d.value is not None else b"",
                    headers=headers,
                )
            )
        # the commit that passes these offsets waits for the dead letters to land
        await asyncio.gather(*futs)
        log.warning("dead-lettered %d record(s); last: %s", len(dead), dead[-1].error)

    def _update_gauges(self) -> None:
        m = self.applier.metrics
        idx = self.applier.index
        m.index_holder_blocks.set(len(idx))
        m.index_bytes.set(idx.nbytes())
        untrusted = self.applier.ranks.untrusted_workers()
        known = self.applier.ranks.known_workers()
        m.workers.labels("true").set(len(known - untrusted))
        m.workers.labels("false").set(len(untrusted & known))
        # During an eager rebalance aiokafka has already dropped the partitions we keep in
        # self.assigned until the new assignment is known, and its highwater() asserts on them.
        c = self._consumer
        if c is None:
            return
        held = c.assignment()
        for p in self.assigned:
            tp = TopicPartition(self.config.topic, p)
            hw = c.highwater(tp) if tp in held else None
            if hw is not None:
                m.consumer_lag.labels(str(p)).set(max(0, hw - self.applier.positions.get(p, 0)))
