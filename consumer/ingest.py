"""A consumer-group member that keeps a prefix-cache index of its partitions.

It is the composition of three parts, each its own module: ``membership`` (the consumer
group, rebalances, positions and commits), ``supervision`` (health, the snapshot task,
expiry of silent ranks) and ``dead_letters`` (the DLQ writer); this module runs the loop
between them: poll, apply (``consumer.apply``), expire, commit.

Two deployment modes, same code:
- each router its own group (``group_id`` unique per router): every member
  is assigned every partition and holds the full index;
- several members in one group: each indexes the partitions Kafka gives it,
  and a scatter-gather score (see ``kvwire.consumer.http``) merges their answers.

State is rebuilt from the log on assignment, so a member that restarts or takes over a
partition converges to the same index (``membership``); the member never freezes silently
(``supervision``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
import uuid
from dataclasses import dataclass, field

from kvwire.kafka.registry.resolver import IdResolver

from .apply import Applier
from .dead_letters import DeadLetterWriter
from .membership import Membership
from .supervision import Supervisor

log = logging.getLogger(__name__)

DEFAULT_GROUP_PREFIX = "kvwire-index"
# Gauges (index size, trusted workers, consumer lag) are read by scrapes seconds apart; under
# load a member polls hundreds of times a second, and setting them after every poll was ~5%
# of its CPU at 512k blocks/s (py-spy, bench.lag). An idle poll still sets them at once.
GAUGE_INTERVAL_S = 0.25


def gauges_due(now: float, last: float | None, polled_records: bool) -> bool:
    """Whether the ingest loop sets its gauges after this poll."""
    return last is None or not polled_records or now - last >= GAUGE_INTERVAL_S


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


class IndexMember:
    """One index member: ``membership``, ``supervisor`` and ``dead_letters`` around an applier,
    and the ingest loop that feeds it."""

    def __init__(self, config: IngestConfig, applier: Applier | None = None, snapshots=None):
        self.config = config
        self.applier = applier if applier is not None else Applier()
        self.snapshots = snapshots
        self.group_id = config.resolved_group()
        self.schema_ids = IdResolver.from_env(config.schema_registry_url)
        self.dead_letters = DeadLetterWriter(config.bootstrap_servers, config.resolved_dlq(), config.client_options)
        self.membership = Membership(config, self.group_id, self.applier, self.dead_letters, snapshots)
        self.supervisor = Supervisor(self.applier, config.heartbeat_timeout_s)
        self._task: asyncio.Task | None = None
        self._snap_task: asyncio.Task | None = None
        self._stopping = asyncio.Event()

    # What callers read (kvwire index, the router, tests), from the part that knows it.
    @property
    def assigned(self) -> set[int]:
        return self.membership.assigned

    @property
    def ready(self) -> bool:
        """Caught up with the end offsets seen when the partitions were assigned."""
        return self.membership.ready

    @property
    def failure(self) -> str | None:
        """Why this member is unhealthy; None while healthy."""
        return self.supervisor.failure

    @property
    def healthy(self) -> bool:
        return self.supervisor.healthy

    async def wait_failed(self) -> str:
        """Returns the reason once the member has become unhealthy."""
        return await self.supervisor.wait_failed()

    # ------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        cfg = self.config
        consumer = self.membership.make_consumer()
        try:
            await self.dead_letters.start(cfg.replication_factor, cfg.min_insync_replicas)
            await consumer.start()
        except BaseException:
            # aiokafka leaves a client whose start failed open, and reports it unclosed when collected.
            await asyncio.gather(self.dead_letters.stop(), consumer.stop(), return_exceptions=True)
            raise
        self.membership.subscribe()
        self._task = asyncio.create_task(self._run(), name=f"kvwire-ingest-{self.group_id}")
        self.supervisor.watch("ingest", self._task, self._stopping)
        if self.snapshots is not None:
            m = self.membership
            loop = self.supervisor.snapshot_loop(
                lambda: self.snapshots.maybe_save(self.applier, cfg.topic, sorted(m.assigned), owned=m.owns),
                lambda: m.ready and not m.assigning,
                self._stopping,
                cfg.snapshot_retry_s,
                cfg.snapshot_retry_max_s,
                cfg.snapshot_failure_limit,
                cfg.snapshot_timeout_s,
            )
            self._snap_task = asyncio.create_task(loop, name=f"kvwire-snapshots-{self.group_id}")
            self.supervisor.watch("snapshots", self._snap_task, self._stopping)

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
            await self.membership.commit(force=True)
        except Exception as e:
            log.warning("final commit failed: %r", e)
        if self.snapshots is not None:
            await self.membership.write_snapshots(self.membership.assigned)
            try:
                await self.snapshots.close()
            except Exception as e:
                log.warning("snapshot store close failed: %r", e)
        consumer = self.membership.consumer
        for stop in ([consumer.stop] if consumer is not None else []) + [self.dead_letters.stop]:
            try:
                await stop()
            except Exception as e:
                log.warning("client stop failed: %r", e)

    # ------------------------------------------------------------ loop

    async def _run(self) -> None:
        m = self.membership
        c = m.consumer
        assert c is not None  # started by start() before this task
        a = self.applier
        gauges_at: float | None = None
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
                if tp.partition not in m.assigned:
                    continue
                i = 0
                while i < len(recs) and tp.partition in m.assigned:
                    # One core call per slice of the poll (decode, fence, apply, a few ms at most).
                    i = a.apply_records(tp.topic, tp.partition, recs, i)
                    await asyncio.sleep(0)  # let heartbeats and HTTP readers in
            self.supervisor.expire_silent(m.ready)
            try:
                await m.commit()
            except Exception as e:
                log.warning("commit failed, will retry: %r", e)
            now = time.monotonic()
            if not gauges_due(now, gauges_at, bool(batches)):
                continue
            gauges_at = now
            try:
                self._update_gauges()
            except Exception as e:  # a gauge is not worth the ingest task
                log.warning("metrics update failed: %r", e)

    def _update_gauges(self) -> None:
        m = self.applier.metrics
        idx = self.applier.index
        m.index_holder_blocks.set(len(idx))
        m.index_bytes.set(idx.nbytes())
        untrusted = self.applier.ranks.untrusted_workers()
        known = self.applier.ranks.known_workers()
        m.workers.labels("true").set(len(known - untrusted))
        m.workers.labels("false").set(len(untrusted & known))
        for p, lag in self.membership.lag().items():
            m.consumer_lag.labels(str(p)).set(lag)
