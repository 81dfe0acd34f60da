"""Engines publishing through a real broker to a member that serves event streams, with the
engines' caches kept beside them as the oracle.

``Fleet`` drives TP ranks through kvwire's own publisher (``kvwire.producer``) the way vLLM's
events would: a store names a prompt's leading blocks (engine hashes derived from the block's
whole prefix, as vLLM's chain is), a removal drops a prompt's last held blocks (children first,
as vLLM evicts), a clear drops everything. It remembers what each rank holds, so the engines'
caches are known independently of kvwire: ``truth()`` is, per worker and medium, the v1
sequence hashes (``tests/keys_oracle.py``, not the core) of the blocks every rank holds.
``serve`` runs an ``IndexMember`` with ``EventStreams`` attached before ingest starts, as
``kvwire index --event-streams`` does."""

from __future__ import annotations

import asyncio
import contextlib
import random
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import xxhash
from kafka_admin import create_topics, delete_topics
from keys_oracle import ROOT, chain_step, context_seed

from kvwire.consumer.event_streams import EventStreams
from kvwire.consumer.ingest import IndexMember, IngestConfig
from kvwire.producer.publisher import KafkaPublisher, PublisherConfig
from kvwire.schemas.events import AllBlocksCleared, BlockRemoved, WorkerId, stored

BS = 16
M64 = (1 << 64) - 1


def prompts(n: int, blocks: int = 8, shared: int = 2, seed: int = 1) -> list[list[int]]:
    """``n`` prompts of ``blocks`` blocks; pairs share their first ``shared`` blocks (a system prompt)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        head = [rng.randrange(50_000) for _ in range(shared * BS)] if i % 2 == 0 else out[-1][: shared * BS]
        out.append(head + [rng.randrange(50_000) for _ in range((blocks - shared) * BS)])
    return out


def engine_hash(tokens: list[int]) -> int:
    """What vLLM's chain gives a block: a function of its whole prefix (here of its tokens)."""
    return xxhash.xxh3_64_intdigest(repr(tokens).encode(), seed=7)


def v1_keys(tokens: list[int], lora: str | None = None) -> list[int]:
    """The routers' v1 sequence hashes of the full blocks, computed without kvwire's core."""
    seed, parent, out = context_seed(lora), ROOT, []
    for i in range(len(tokens) // BS):
        block = b"".join(t.to_bytes(4, "little") for t in tokens[i * BS : (i + 1) * BS])
        parent = chain_step(parent, xxhash.xxh3_64_intdigest(block, seed=seed))
        out.append(parent)
    return out


@dataclass
class Fleet:
    bootstrap: str
    topic: str
    prompts: list[list[int]]
    # One publisher per engine (instance), as each engine's bridge has its own: closing one is
    # that engine dying, heartbeats and all.
    pubs: dict[str, KafkaPublisher] = field(default_factory=dict)
    streams: dict[WorkerId, object] = field(default_factory=dict)
    # rank -> medium -> prompt -> leading blocks held
    held: dict[WorkerId, dict[str, dict[int, int]]] = field(default_factory=dict)
    records: int = 0
    heartbeat_interval_s: float = 5.0

    def publisher(self, instance_id: str) -> KafkaPublisher:
        if instance_id not in self.pubs:
            self.pubs[instance_id] = KafkaPublisher(
                PublisherConfig(
                    bootstrap_servers=self.bootstrap,
                    topic=self.topic,
                    partitions=1,
                    linger_ms=1,
                    heartbeat_interval_s=self.heartbeat_interval_s,
                )
            )
        return self.pubs[instance_id]

    def rank(self, rank: WorkerId):
        if rank not in self.streams:
            self.streams[rank] = self.publisher(rank.instance_id).stream(rank, "test")
            self.held[rank] = {}
            self.records += 1
        return self.streams[rank]

    def store(self, rank: WorkerId, p: int, n: int, medium: str = "GPU") -> None:
        """The rank now holds prompt ``p``'s first ``n`` blocks (it stores those it lacked)."""
        stream = self.rank(rank)
        have = self.held[rank].setdefault(medium, {}).get(p, 0)
        toks = self.prompts[p]
        if n > have:
            ehs = [engine_hash(toks[: (i + 1) * BS]) for i in range(have, n)]
            parent = engine_hash(toks[: have * BS]) if have else None
            ev = stored(ehs, toks[have * BS : n * BS], BS, parent_block_hash=parent, medium=medium)
            assert stream.publish([ev])
            self.records += 1
            self.held[rank][medium][p] = n

    def evict(self, rank: WorkerId, p: int, keep: int, medium: str = "GPU") -> None:
        """The rank keeps only prompt ``p``'s first ``keep`` blocks (last ones removed first)."""
        stream = self.rank(rank)
        have = self.held[rank].setdefault(medium, {}).get(p, 0)
        if keep < have:
            toks = self.prompts[p]
            ehs = [engine_hash(toks[: (i + 1) * BS]) for i in reversed(range(keep, have))]
            assert stream.publish([BlockRemoved(tuple(ehs), medium=medium)])
            self.records += 1
            self.held[rank][medium][p] = keep

    def clear(self, rank: WorkerId) -> None:
        assert self.rank(rank).publish([AllBlocksCleared()])
        self.records += 1
        self.held[rank] = {}

    def gap(self, rank: WorkerId) -> None:
        """Records of the rank were lost upstream: kvwire must stop trusting it."""
        s = self.rank(rank)
        s.report_gap(1)
        assert s.publish([])
        self.records += 1

    def restart(self, rank: WorkerId) -> None:
        """The engine restarted: a new epoch whose first record is a reset (it holds nothing)."""
        self.rank(rank).new_epoch()
        self.records += 1
        self.held[rank] = {}

    def truth(self, ranks: list[WorkerId]) -> dict[tuple[str, int], dict[str, set[int]]]:
        """(instance, dp) -> medium -> v1 keys of the blocks every one of its ranks holds."""
        by_worker: dict[tuple[str, int], list[WorkerId]] = {}
        for r in ranks:
            by_worker.setdefault(r.worker, []).append(r)
        out: dict[tuple[str, int], dict[str, set[int]]] = {}
        for w, rs in by_worker.items():
            media: dict[str, set[int]] = {}
            for medium in {m for r in rs for m in self.held.get(r, {})}:
                blocks: set[tuple[int, ...]] | None = None
                for r in rs:
                    mine = {
                        tuple(self.prompts[p][: (i + 1) * BS])
                        for p, n in self.held.get(r, {}).get(medium, {}).items()
                        for i in range(n)
                    }
                    blocks = mine if blocks is None else blocks & mine
                keys = {v1_keys(list(b))[-1] for b in blocks or ()}
                if keys:
                    media[medium] = keys
            out[w] = media
        return out

    def longest(self, ranks: list[WorkerId], tokens: list[int]) -> dict[tuple[str, int], int]:
        """(instance, dp) -> leading tokens of ``tokens`` its engines' caches hold (any medium)."""
        keys = v1_keys(tokens)
        out = {}
        for w, media in self.truth(ranks).items():
            held = set().union(*media.values()) if media else set()
            n = 0
            while n < len(keys) and keys[n] in held:
                n += 1
            out[w] = n * BS
        return out

    def delivered(self) -> bool:
        return all(st.queued == 0 and st.acked == st.sent for p in self.pubs.values() for st in p.stats())

    async def kill(self, instance_id: str) -> None:
        """The engine dies: its publisher stops, and its heartbeats with it."""
        await asyncio.to_thread(self.pubs[instance_id].close)

    async def close(self) -> None:
        for p in self.pubs.values():
            await asyncio.to_thread(p.close)


@contextlib.asynccontextmanager
async def topic(bootstrap: str) -> AsyncIterator[str]:
    name = f"t-streams-{uuid.uuid4().hex[:8]}"
    await create_topics(bootstrap, [name], 1)
    try:
        yield name
    finally:
        await delete_topics(bootstrap, [name, f"{name}.dlq"])


def free_base(span: int = 64) -> int:
    """A first port whose next ``span`` ports look free (the streams skip any taken later)."""
    import socket

    for _ in range(100):
        base = random.randrange(20_000, 60_000 - span, 2)
        ok = True
        for p in range(base, base + 8):
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", p))
                except OSError:
                    ok = False
                    break
        if ok:
            return base
    raise RuntimeError("no free port range")


@contextlib.asynccontextmanager
async def serve(
    bootstrap: str, topic_name: str, heartbeat_timeout_s: float = 60.0, **streams_kw
) -> AsyncIterator[tuple[IndexMember, EventStreams]]:
    member = IndexMember(IngestConfig(bootstrap, topic_name, heartbeat_timeout_s=heartbeat_timeout_s))
    streams = EventStreams(member.applier, "127.0.0.1", streams_kw.pop("port", None) or free_base(), **streams_kw)
    await streams.start()
    await member.start()
    try:
        await until(lambda: member.ready, "the member caught up")
        yield member, streams
    finally:
        await member.stop()
        await streams.stop()


async def until(cond: Callable[[], bool], what: str, limit_s: float = 60.0, step_s: float = 0.05) -> None:
    """Wait for a condition; the limit only bounds a hang (nothing is asserted about time)."""
    for _ in range(int(limit_s / step_s)):
        if cond():
            return
        await asyncio.sleep(step_s)
    raise AssertionError(f"never happened: {what}")


async def caught_up(member: IndexMember, fleet: Fleet) -> None:
    """Every record the fleet published is applied (so the streams have sent what it changed)."""
    await until(fleet.delivered, "every record acked")
    ends = await _end_offset(fleet.bootstrap, fleet.topic)
    await until(lambda: member.applier.positions.get(0, 0) >= ends, f"offset {ends} applied")


async def _end_offset(bootstrap: str, topic_name: str) -> int:
    from aiokafka import AIOKafkaConsumer, TopicPartition

    c = AIOKafkaConsumer(bootstrap_servers=bootstrap)
    await c.start()
    try:
        tp = TopicPartition(topic_name, 0)
        return (await c.end_offsets([tp]))[tp]
    finally:
        await c.stop()
