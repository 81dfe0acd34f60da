"""LMCache's coordinator topic -> kvwire ``EventBatch``es: the adapter at the edge.

LMCache 0.5.6's multi-process server publishes its cache events to Kafka with
``KafkaCacheEventSink`` (``lmcache/v1/mp_coordinator/cache_events.py``): one JSON
``CacheEventsRequest`` per record, ``{"batches": [CacheEventBatch]}``, keyed by
``instance_id``. This module turns those records into the contract's
``EventBatch`` so they go through the same fencing and index as every other
source (``Applier.apply_batch``); LMCache's format never goes further in.
What each piece becomes (docs/engines/lmcache-coordinator.md has the why):

* **Worker** = the LMCache instance: ``WorkerId(instance_id, dp_rank=0)``. Each
  entry's ``kv_rank`` packs (world size, global rank, ...): the global rank is
  the kvwire TP rank and the world size its ``tp_size``, so a chunk counts for
  the instance only once every rank holds it, as the engine needs.
* **Fencing**: ``epoch`` = ``incarnation``, ``seq`` = LMCache's ``seq`` (from 1,
  contiguous per incarnation: a batch the sink failed to deliver leaves a hole,
  which ``RankTable`` reports as a gap). ``reset`` on seq 1, the first batch of a
  process, which holds nothing before it. Every LMCache batch becomes one
  record for *every* rank of the instance (a heartbeat where it has nothing for
  that rank), so each rank's sequence stays contiguous. A lower incarnation
  than one already seen is dropped (LMCache's own gate does the same).
* **STORE** -> ``BlockRemoved`` then ``BlockStored`` of the entry's chunk: LMCache
  placements are a set (a repeated store of one key is one placement), the
  index counts references, so each store first takes back whatever the same
  placement held. **DELETE** -> ``BlockRemoved``. **ACCESS** and **CONFIG**
  carry no placement: heartbeats. Placements on a *shared* backend (one pool
  mounted by several instances) are skipped: every instance reaches them, so
  they cannot tell workers apart, and a delete reported by one instance would
  leave the others credited.
* **Medium**: L1 ``dram`` -> ``CPU``; any other (tier, backend) -> ``"l2:fs"``,
  ``"l1:gds"``, ...: one medium per placement identity, which the
  remove-then-store rule needs.
* **Chains**: entries carry the chunk's tokens and ``token_offset`` but not the
  parent's hash. Offset 0 is a root. For a later chunk the parent is found by
  recomputing LMCache's chunk hash (``hasher(parent, tokens) == chunk_hash``)
  over the chunks that end where it starts; one that cannot be proven gets a
  parent nobody holds, so it is kept as an orphan (never a false prefix match).
  The chunk hash does not cover ``cache_salt`` or the model, so the id the index
  gets is the hash with both appended; a salt goes into the first chunk's extra
  keys the way vLLM puts it there.
* Entries without tokens (LMCache's token-binding cache no longer had them) are
  indexed in engine-hash mode (``block_size`` 0).

Losses are never hidden: a record that is not a ``CacheEventsRequest`` raises
``TopicRecordError`` (the caller dead-letters it) and its instance's next record
carries a gap; a batch or entry that cannot be converted (unknown event type,
bad hex, a second world size) makes that batch carry a gap.
"""

from __future__ import annotations

import logging
import sys
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import msgspec

from kvwire.schemas.events import CPU, BlockRemoved, BlockStored, EventBatch, KVEvent, WorkerId, token_array

log = logging.getLogger(__name__)

SOURCE = "lmcache-mp"
UNKNOWN_TOKEN_OFFSET = -1  # lmcache.v1.mp_coordinator.api.UNKNOWN_TOKEN_OFFSET
# The fleet's chunk hash: ``hasher(parent_hash or None, tokens) -> chunk_hash``.
ChunkHasher = Callable[[bytes | None, Sequence[int]], bytes]


class TopicRecordError(ValueError):
    """A record that is not an LMCache ``CacheEventsRequest``."""


# ------------------------------------------------------------ wire (LMCache's JSON)


class _Key(msgspec.Struct):
    chunk_hash_hex: str
    model_name: str
    kv_rank: int
    object_group_id: int = 0
    cache_salt: str = ""


class _Entry(msgspec.Struct):
    key: _Key
    size_bytes: int = 0
    token_ids: list[int] = []
    token_offset: int = UNKNOWN_TOKEN_OFFSET


class _Batch(msgspec.Struct):
    instance_id: str
    incarnation: int
    seq: int
    event_type: str
    tier: str
    backend: str = ""
    entries: list[_Entry] = []
    shared: bool = False
    ts: float = 0.0


class _Request(msgspec.Struct):
    batches: list[_Batch] = []


_DECODER = msgspec.json.Decoder(_Request)


def decode_record(value: bytes | None) -> list[_Batch]:
    """One record's batches. Raises TopicRecordError only."""
    try:
        return _DECODER.decode(value or b"").batches
    except msgspec.DecodeError as e:
        raise TopicRecordError(f"not an LMCache CacheEventsRequest: {e}") from None


# ------------------------------------------------------------ hashes


def blake3_hasher() -> ChunkHasher | None:
    """LMCache MP's default chunk hash (``TokenHasher(hash_algorithm="blake3")``):
    blake3(parent digest + tokens as big-endian uint32), parent of the first chunk
    = blake3 of (0 as 8 signed big-endian bytes, token 0). None without ``blake3``."""
    try:
        import blake3
    except ImportError:
        return None
    none_hash = blake3.blake3(b"\0" * 8 + b"\0" * 4).digest()

    def h(parent: bytes | None, tokens: Sequence[int]) -> bytes:
        d = blake3.blake3(none_hash if parent is None else parent)
        d.update(_be_u32(tokens))
        return d.digest()

    return h


def _be_u32(tokens: Sequence[int]) -> bytes:
    a = token_array(tokens)[:]  # a copy: byteswap is in place
    if sys.byteorder == "little":
        a.byteswap()
    return a.tobytes()


def lmcache_hasher(hash_algorithm: str, chunk_size: int = 256) -> ChunkHasher:
    """The fleet's hash through LMCache's own ``TokenHasher`` (needs lmcache, and
    vLLM for vLLM's algorithms): for fleets not on the blake3 default."""
    from lmcache.v1.multiprocess.token_hasher import TokenHasher

    th = TokenHasher(chunk_size=chunk_size, hash_algorithm=hash_algorithm)

    def h(parent: bytes | None, tokens: Sequence[int]) -> bytes:
        prefix = (
            None if parent is None else (int.from_bytes(parent, "big", signed=True) if len(parent) == 8 else parent)
        )
        return TokenHasher.hash_to_bytes(th.hash_tokens(list(tokens), prefix))

    return h


def engine_id(chunk_hash: bytes, salt: str, model: str) -> bytes:
    """The id the index keeps for a chunk: LMCache's chunk hash does not cover the
    salt or the model, and two tenants' or models' chunks must never be one entry."""
    if not salt and not model:
        return chunk_hash
    return chunk_hash + b"\0" + salt.encode() + b"\0" + model.encode()


def unknown_parent(chunk_hash: bytes) -> bytes:
    """A parent id no store ever carries: the index keeps the chunk as an orphan."""
    return b"\xff?parent-of:" + chunk_hash


def medium_of(tier: str, backend: str) -> str:
    if tier == "l1" and backend == "dram":
        return CPU
    return f"{tier}:{backend}"


def unpack_kv_rank(kv_rank: int) -> tuple[int, int]:
    """(world size, global rank) from LMCache's ``ObjectKey.ComputeKVRank`` packing."""
    return (kv_rank >> 24) & 0xFF, (kv_rank >> 16) & 0xFF


# ------------------------------------------------------------ converter


@dataclass
class ConverterStats:
    records: int = 0
    batches: int = 0
    bad_records: int = 0
    stale: int = 0
    duplicates: int = 0
    stores: int = 0
    deletes: int = 0
    heartbeats: int = 0
    shared_skipped: int = 0
    other_model_skipped: int = 0
    tokenless: int = 0
    chained: int = 0
    orphaned: int = 0
    unconvertible: int = 0
    errors: dict[str, int] = field(default_factory=dict)


@dataclass
class _Instance:
    incarnation: int
    last_seq: int = 0
    # Every batch of this incarnation since seq 1 went through this converter: a rank it
    # has not emitted yet provably holds nothing, so its first record may carry a reset.
    complete: bool = False
    world: int = 0
    world_from_store: bool = False
    ranks: set[int] = field(default_factory=set)
    pending_gap: int = 0
    # Candidate parents: chunk hashes by the token offset they end at (insertion-ordered), and
    # the same (end, hash) pairs in least-recently-stored order, to bound them.
    by_end: dict[int, dict[bytes, None]] = field(default_factory=dict)
    lru: OrderedDict[tuple[int, bytes], None] = field(default_factory=OrderedDict)


# Candidate parents kept per instance (~150 bytes each): a continuation whose parent was stored
# longer ago than this many chunks is kept as an orphan (under-credited, never falsely credited).
MAX_CANDIDATES = 65536


class LmcacheTopicConverter:
    """Stateful per instance (fencing, world size, candidate parents); the output for
    a record depends only on the records of its instance before it in the log.

    ``model``: keep only this model's entries (an index serves one model; entries of
    others are not this index's business, so skipping them is not a loss).
    ``hasher``: the fleet's chunk hash (``blake3_hasher()`` by default, LMCache MP's
    default); None chains nothing past the first chunk.
    ``tp_size_hint(instance_id)``: the world size already known elsewhere (the
    index's rank table after a snapshot), used until a store says it.
    ``max_candidates``: candidate parents kept per instance (see ``MAX_CANDIDATES``).
    """

    def __init__(
        self,
        model: str | None = None,
        hasher: ChunkHasher | str | None = "blake3",
        tp_size_hint: Callable[[str], int | None] | None = None,
        max_candidates: int = MAX_CANDIDATES,
    ):
        self.model = model
        self.max_candidates = max_candidates
        self.hasher: ChunkHasher | None = blake3_hasher() if hasher == "blake3" else hasher  # type: ignore[assignment]
        if hasher == "blake3" and self.hasher is None:
            log.warning("blake3 is not installed: LMCache chunks past the first are kept as orphans")
        self.hasher_ok = self.hasher is not None
        self.tp_size_hint = tp_size_hint
        self.instances: dict[str, _Instance] = {}
        self.stats = ConverterStats()

    # ------------------------------------------------------------ records

    def convert_record(self, key: bytes | None, value: bytes | None) -> list[EventBatch]:
        """One Kafka record -> EventBatches (possibly none). Raises TopicRecordError for
        a record that is not a CacheEventsRequest, after marking its instance's gap."""
        self.stats.records += 1
        try:
            batches = decode_record(value)
        except TopicRecordError:
            self.stats.bad_records += 1
            inst = key.decode("utf-8", "replace") if key else None
            if inst and inst in self.instances:
                self.instances[inst].pending_gap += 1
            raise
        out: list[EventBatch] = []
        for b in batches:
            out.extend(self.convert_batch(b))
        return out

    def mark_lost(self, instance_id: str, n: int = 1) -> None:
        """Batches of this instance were lost after conversion (e.g. the index refused
        them): its next record carries the gap."""
        st = self.instances.get(instance_id)
        if st is not None:
            st.pending_gap += n

    def convert_batch(self, b: _Batch) -> list[EventBatch]:
        s = self.stats
        s.batches += 1
        if not b.instance_id or b.seq < 1 or b.incarnation < 0:
            self._error("invalid batch header")
            st = self.instances.get(b.instance_id)
            if st is not None:
                st.pending_gap += 1
            return []
        st = self.instances.get(b.instance_id)
        if st is not None and b.incarnation < st.incarnation:
            s.stale += 1
            return []
        if st is None or b.incarnation > st.incarnation:
            st = _Instance(b.incarnation, complete=b.seq == 1)
            hint = self.tp_size_hint(b.instance_id) if self.tp_size_hint else None
            st.world = hint or 0
            self.instances[b.instance_id] = st
        elif b.seq <= st.last_seq:
            s.duplicates += 1
            return []
        if b.seq != st.last_seq + 1:
            st.complete = False  # RankTable sees the hole in seq and reports it
        st.last_seq = b.seq

        gap = st.pending_gap
        st.pending_gap = 0
        by_rank: dict[int, list[KVEvent]] = {}
        kind = b.event_type
        if kind in ("store", "delete"):
            if b.shared:
                s.shared_skipped += 1
            elif b.tier not in ("l1", "l2") or not b.backend:
                self._error(f"{kind} batch on tier {b.tier!r} backend {b.backend!r}")
                gap += 1
            else:
                gap += self._placements(st, b, by_rank)
        elif kind in ("access", "config"):
            s.heartbeats += 1
        else:
            self._error(f"unknown event type {kind!r}")
            gap += 1
        return self._emit(b, st, by_rank, gap)

    # ------------------------------------------------------------ placements

    def _placements(self, st: _Instance, b: _Batch, by_rank: dict[int, list[KVEvent]]) -> int:
        """Convert a STORE/DELETE batch's entries; returns how many could not be."""
        bad = 0
        store = b.event_type == "store"
        medium = medium_of(b.tier, b.backend)
        # Candidate parents proven inside this batch (a store's chunks arrive in order).
        for e in b.entries:
            k = e.key
            if self.model is not None and k.model_name != self.model:
                self.stats.other_model_skipped += 1
                continue
            world, rank = unpack_kv_rank(k.kv_rank)
            world = max(world, 1)
            if not st.world_from_store:
                st.world, st.world_from_store = world, True
            if world != st.world or rank >= world:
                # A second parallel layout under one instance cannot be one worker's ranks.
                self._error(f"kv_rank {k.kv_rank:#x}: world size {world}, rank {rank} under world size {st.world}")
                bad += 1
                continue
            try:
                chunk = bytes.fromhex(k.chunk_hash_hex)
            except ValueError:
                self._error("chunk_hash_hex is not hex")
                bad += 1
                continue
            eid = engine_id(chunk, k.cache_salt, k.model_name)
            events = by_rank.setdefault(rank, [])
            group = k.object_group_id
            if not store:
                self.stats.deletes += 1
                events.append(BlockRemoved((eid,), medium, group))
                continue
            self.stats.stores += 1
            try:
                ev = self._stored(st, e, chunk, eid, medium, group)
            except ValueError as err:
                self._error(f"store entry: {err}")
                bad += 1
                continue
            events.append(BlockRemoved((eid,), medium, group))
            events.append(ev)
        return bad

    def _stored(self, st: _Instance, e: _Entry, chunk: bytes, eid: bytes, medium: str, group: int) -> BlockStored:
        k = e.key
        tokens = e.token_ids
        if not tokens or e.token_offset == UNKNOWN_TOKEN_OFFSET:
            self.stats.tokenless += 1
            return BlockStored((eid,), None, token_array(()), 0, None, medium, None, None, group)
        if e.token_offset < 0:
            raise ValueError(f"token_offset {e.token_offset}")
        toks = token_array(tokens)
        extra = None
        if e.token_offset == 0:
            parent = None
            if k.cache_salt:
                extra = ((k.cache_salt,),)
            if self.hasher_ok and self.hasher is not None and self.hasher(None, toks) != chunk:
                # Not the fleet's hash: nothing past a first chunk can be proven from here on.
                log.warning("LMCache chunk hashes do not match the configured hash; later chunks become orphans")
                self.hasher_ok = False
        else:
            parent = self._parent(st, e.token_offset, toks, chunk)
            if parent is None:
                self.stats.orphaned += 1
                parent = unknown_parent(chunk)
            else:
                self.stats.chained += 1
                parent = engine_id(parent, k.cache_salt, k.model_name)
        self._remember(st, e.token_offset + len(toks), chunk)
        return BlockStored((eid,), parent, toks, len(toks), None, medium, None, extra, group)

    def _parent(self, st: _Instance, offset: int, toks, chunk: bytes) -> bytes | None:
        if not self.hasher_ok or self.hasher is None:
            return None
        # Every chunk ending here is a candidate: the hash decides, newest first.
        for cand in reversed(st.by_end.get(offset, {})):
            if self.hasher(cand, toks) == chunk:
                return cand
        return None

    def _remember(self, st: _Instance, end: int, chunk: bytes) -> None:
        k = (end, chunk)
        if k in st.lru:
            st.lru.move_to_end(k)
            return
        st.lru[k] = None
        st.by_end.setdefault(end, {})[chunk] = None
        if len(st.lru) > self.max_candidates:
            (e0, h0), _ = st.lru.popitem(last=False)
            hs = st.by_end[e0]
            del hs[h0]
            if not hs:
                del st.by_end[e0]

    # ------------------------------------------------------------ output

    def _emit(self, b: _Batch, st: _Instance, by_rank: dict[int, list[KVEvent]], gap: int) -> list[EventBatch]:
        world = max(st.world, 1, *(r + 1 for r in by_rank))
        ts_us = int(b.ts * 1e6) if b.ts > 0 else time.time_ns() // 1000
        out = []
        for r in range(world):
            reset = b.seq == 1 or (st.complete and r not in st.ranks)
            st.ranks.add(r)
            out.append(
                EventBatch(
                    WorkerId(b.instance_id, 0, r, world, self.model or ""),
                    b.incarnation,
                    b.seq,
                    ts_us,
                    tuple(by_rank.get(r, ())),
                    b.ts or None,
                    reset,
                    gap,
                    SOURCE,
                )
            )
        return out

    def _error(self, why: str) -> None:
        s = self.stats
        s.unconvertible += 1
        s.errors[why] = s.errors.get(why, 0) + 1
        if s.errors[why] == 1:
            log.warning("LMCache coordinator event not converted: %s", why)


__all__ = [
    "SOURCE",
    "ChunkHasher",
    "ConverterStats",
    "LmcacheTopicConverter",
    "TopicRecordError",
    "blake3_hasher",
    "decode_record",
    "engine_id",
    "lmcache_hasher",
    "medium_of",
    "unknown_parent",
    "unpack_kv_rank",
]
