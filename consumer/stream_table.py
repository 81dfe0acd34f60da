"""What vLLM's event wire says about a block that the index does not keep, for the event streams.

The index keeps, per entry, an engine hash, a key and a count: enough to score and to apply
removals, not enough to tell a router what a block is. A router reading vLLM's wire wants each
block's token ids (it hashes them itself), its parent, LoRA name, extra keys, group and the
KV-cache spec of the group. This table takes those from the records the Applier applied
(decoded with the reference decoder, ``kvwire.schemas.codec``) and takes *who holds what* only
from the index (``PrefixIndex.worker_holding``): TP aggregation, the counts of duplicate
physical copies and orphans stay the core's rules, trust the fence's. A record the fence
skipped (a duplicate, a stale epoch) still names candidate blocks here; asking the index
afterwards makes it change nothing.

Keys are the core's (``kvwire.consumer.keys``): a store's blocks chained from its parent's key,
the parent found by engine hash among the blocks the worker's ranks have. The core looks in the
storing rank's own table first; a parent found differently here gives a key the index does not
hold, so the block is not published: the streams may under-credit, never over-credit. A store
the index keeps as an orphan (unknown parent), a sparse group's store and engine-hash mode get
no key here: no router can match them.

Memory is bounded by what the workers' ranks have: a worker's entry for a block goes as soon as
the index says no rank of it has the block, and a block's description goes with the last
worker's entry. A member restored from a snapshot has blocks no record here described: the
streams cannot publish those (``kvwire index --event-streams`` replays its partitions instead).
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import msgspec
import numpy as np

from kvwire.schemas import codec
from kvwire.schemas.codec import DecodeError
from kvwire.schemas.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch

from .index import PrefixIndex
from .keys import ROOT, block_keys, engine_hash_u64

Worker = tuple[str, int]
# (medium as the index names it, KV-cache group)
Place = tuple[str, int]


class Block(msgspec.Struct):
    """One block as vLLM's BlockStored describes it, under its key."""

    parent: int | None  # the parent's key; None at the root of a sequence
    depth: int  # blocks before it in its sequence: parents go out before children
    token_ids: array
    block_size: int
    lora_id: int | None
    lora_name: str | None
    extra_keys: tuple[Any, ...] | None
    workers: int = 0  # workers whose entries name it


class Change(NamedTuple):
    place: Place
    key: int
    held: bool  # now held there; False: no longer
    depth: int  # of the block in its sequence, kept for removals whose block is forgotten


class GroupSpec(msgspec.Struct, frozen=True):
    """What a worker's stores said about one KV-cache group."""

    kind: str | None
    window: int | None
    # vLLM sends group_idx only when it has one: a stream says it exactly when the engine did.
    named: bool


@dataclass
class WorkerBlocks:
    """One worker's view: its ranks' blocks and what the index says it holds."""

    by_hash: dict[int, int] = field(default_factory=dict)  # engine hash -> key
    hashes: dict[int, set[int]] = field(default_factory=dict)  # key -> its engine hashes
    held: dict[Place, set[int]] = field(default_factory=dict)
    specs: dict[int, GroupSpec] = field(default_factory=dict)
    block_size: int = 0
    # Keys the records since the last refresh named, or all of them (a clear, a reset, a drop).
    pending: set[int] = field(default_factory=set)
    everything: bool = False


class StreamTable:
    def __init__(self, index: PrefixIndex, schema_ids: codec.SchemaIds = codec.SCHEMA_IDS) -> None:
        self.index = index
        self.schema_ids = schema_ids
        self.blocks: dict[int, Block] = {}
        self.workers: dict[Worker, WorkerBlocks] = {}
        self._touched: set[Worker] = set()

    # ------------------------------------------------------------ feeding

    def observe_values(self, values: Sequence[bytes | None]) -> None:
        for v in values:
            if v is None:
                continue
            try:
                batch = codec.decode(v, ids=self.schema_ids)
            except DecodeError:
                continue  # dead-lettered by the Applier; it changed nothing
            self.observe(batch)

    def observe(self, batch: EventBatch) -> None:
        worker = batch.worker.worker
        w = self.workers.get(worker)
        if w is None:
            w = self.workers[worker] = WorkerBlocks()
        self._touched.add(worker)
        if batch.reset:
            w.everything = True
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                self._store(w, ev)
            elif isinstance(ev, BlockRemoved):
                for h in ev.block_hashes:
                    k = w.by_hash.get(engine_hash_u64(h))
                    if k is not None:
                        w.pending.add(k)
            elif isinstance(ev, AllBlocksCleared):
                w.everything = True

    def dropped(self, workers: Iterable[Worker]) -> None:
        for worker in workers:
            w = self.workers.get(worker)
            if w is not None:
                w.everything = True
                self._touched.add(worker)

    def _store(self, w: WorkerBlocks, ev: BlockStored) -> None:
        n, bs = len(ev.block_hashes), ev.block_size
        if n == 0 or bs <= 0 or len(ev.token_ids) != n * bs:
            return  # engine-hash mode, a sparse group's store, or malformed: no key a router can match
        group = ev.group_idx or 0
        if ev.kv_cache_spec_kind is not None or group not in w.specs:
            w.specs[group] = GroupSpec(ev.kv_cache_spec_kind, ev.kv_cache_spec_sliding_window, ev.group_idx is not None)
        w.block_size = bs
        if ev.parent_block_hash is None:
            parent, depth = None, 0
        else:
            parent = w.by_hash.get(engine_hash_u64(ev.parent_block_hash))
            if parent is None:
                return  # an orphan in the index: chained from a root no query reaches
            pb = self.blocks.get(parent)
            depth = pb.depth + 1 if pb is not None else 1
        keys = block_keys(ev.token_ids, bs, parent if parent is not None else ROOT, ev.lora_name, ev.extra_keys, n)
        for i, (h, k) in enumerate(zip(ev.block_hashes, keys.tolist(), strict=True)):
            eh = engine_hash_u64(h)
            old = w.by_hash.get(eh)
            if old is not None and old != k:
                self._unmap(w, eh, old)
            if k not in w.hashes:
                w.hashes[k] = set()
                b = self.blocks.get(k)
                if b is None:
                    b = self.blocks[k] = Block(
                        parent,
                        depth + i,
                        ev.token_ids[i * bs : (i + 1) * bs],
                        bs,
                        ev.lora_id,
                        ev.lora_name,
                        ev.extra_keys[i] if ev.extra_keys is not None and i < len(ev.extra_keys) else None,
                    )
                b.workers += 1
            w.hashes[k].add(eh)
            w.by_hash[eh] = k
            w.pending.add(k)
            parent = k

    def _unmap(self, w: WorkerBlocks, eh: int, key: int) -> None:
        w.by_hash.pop(eh, None)
        hs = w.hashes.get(key)
        if hs is not None:
            hs.discard(eh)

    def _forget(self, w: WorkerBlocks, key: int) -> None:
        for eh in w.hashes.pop(key, ()):
            if w.by_hash.get(eh) == key:
                del w.by_hash[eh]
        b = self.blocks.get(key)
        if b is not None:
            b.workers -= 1
            if b.workers <= 0:
                del self.blocks[key]

    # ------------------------------------------------------------ asking the index

    def refresh(self) -> dict[Worker, list[Change]]:
        """Bring every worker the records named since the last call in line with the index;
        returns, per such worker, what it now holds that it did not and what it no longer holds.
        The work is the keys the records named (all of a worker's after a clear or a reset)."""
        touched, self._touched = self._touched, set()
        out: dict[Worker, list[Change]] = {}
        for worker in touched:
            w = self.workers[worker]
            keys = list(w.hashes) if w.everything else [k for k in w.pending if k in w.hashes]
            w.pending.clear()
            w.everything = False
            out[worker] = self._ask(worker, w, keys) if keys else []
        return out

    def _ask(self, worker: Worker, w: WorkerBlocks, keys: list[int]) -> list[Change]:
        rows = self.index.worker_holding(worker, np.array(keys, np.uint64))
        had = [False] * len(keys)
        now: dict[int, set[Place]] = {}
        for r in rows:
            had[r.position] = True
            if r.held:
                now.setdefault(r.position, set()).add((r.medium, r.group))
        changes: list[Change] = []
        for i, k in enumerate(keys):
            places = now.get(i, set())
            b = self.blocks.get(k)
            d = b.depth if b is not None else 0
            for place, s in w.held.items():
                if place in places:
                    if k not in s:
                        s.add(k)
                        changes.append(Change(place, k, True, d))
                elif k in s:
                    s.discard(k)
                    changes.append(Change(place, k, False, d))
            for place in places - w.held.keys():
                w.held[place] = {k}
                changes.append(Change(place, k, True, d))
        # Forgotten only once the changes are read: a removal still describes its block.
        for i, k in enumerate(keys):
            if not had[i]:
                self._forget(w, k)
        return changes

    # ------------------------------------------------------------ reading

    def held(self, worker: Worker) -> dict[Place, set[int]]:
        w = self.workers.get(worker)
        return {} if w is None else {p: set(s) for p, s in w.held.items() if s}

    def block_size(self, worker: Worker) -> int:
        w = self.workers.get(worker)
        return 0 if w is None else w.block_size

    def spec(self, worker: Worker, group: int) -> GroupSpec | None:
        w = self.workers.get(worker)
        return None if w is None else w.specs.get(group)
