"""The prefix-cache index: which worker holds how many leading tokens of a prompt.

Pure in-memory, single-threaded, and ignorant of Kafka, epochs and sequence
numbers: the ingest layer fences, dedups and detects gaps, then calls
``apply_batch`` / ``store`` / ``remove`` / ``clear`` / ``drop_rank`` /
``drop_worker``. The tables, the key chain and the score walk are the Rust core
(``kvwire._core.Index``, ``rust/src/index.rs``); this module is its typed
Python face and the one place the semantics are written down.

Semantics (``tests/oracle.py`` is the executable spec):

- Block keys are the routers' v1 sequence hashes over token ids (``kvwire.consumer.keys``); engine
  hashes are only ids for BlockRemoved, per (rank, medium, group).
- A rank's duplicate stores of one engine hash are reference-counted; the
  entry keeps the key of its first store. Removing an unknown hash is ignored
  and counted (``WorkerStats.unknown_removes``).
- A worker (instance_id, dp_rank) holds a block on a medium when all its
  ``tp_size`` ranks hold it on that medium, whatever batches they reported
  it in. ``len(index)`` counts these holder-blocks.
- **Unknown parent.** A BlockStored whose ``parent_block_hash`` is not found
  (this rank's tables for any medium/group, same medium+group first, then the
  worker's other ranks) is *kept*, chained from a root derived from the
  unknown parent's engine hash and flagged ``orphan``. Dropping it (llm-d
  #372) would lose blocks for good after a consumer restart or a lost batch;
  chaining it from ROOT would claim prefix matches for tokens whose real
  prefix is unknown. Under an orphan root the key can never equal a query key
  (no false match), BlockRemoved still finds it by engine hash, children of an
  orphan inherit the flag, and ``WorkerStats.orphans`` shows how many are live.
  A parent found only in engine-hash mode counts as unknown.
- **A parent just removed.** Engine hashes are prefix-chained, so the key a
  hash was last stored under is still its key once it is removed: each worker
  remembers the keys of its last ``_core.PARENT_MEMO`` removed hashes (not
  engine-hash mode), and a parent found in none of its tables is looked up
  there before it makes an orphan. LMCache evicts a chunk's parent just before
  it stores the chunk, and vLLM can free a parent block before a child is
  stored; without the memo such a child stayed an orphan even after its parent
  came back. ``drop_worker`` forgets the memo; snapshots carry it, its order
  included (``export_workers``), so a restored index fed the log's tail is the
  index it was taken from fed the same tail.
- **Engine-hash mode.** Events with ``block_size == 0`` or no token ids (vLLM
  OffloadingConnector without ``self_describing_kv_events``) are indexed under
  their engine hashes. ``score`` never sees them; ``score_engine_hashes`` does,
  and it is only meaningful for a router that computes the engine's own block
  hashes: same hash algorithm, same PYTHONHASHSEED/NONE_HASH, same
  ``hash_block_size`` and extra keys as the engines.
- **Whole or nothing.** A call that hits a reference-count ceiling (>16k
  duplicate stores of one hash, or >1k entries of one rank under one key)
  applies none of its events and raises ``IndexOverflow``. A malformed store
  (token ids that do not cover its blocks) raises ``MalformedEvent``: with
  ``apply_batch(..., atomic=True)`` (the ingest path) nothing is applied,
  without it the events before it stay applied.
- **KV-cache groups (hybrid models).** A block is held per (worker, medium,
  group): one group's blocks never stand in for another's, and ``len(index)``
  and ``WorkerStats.blocks`` count a block once per group holding it. A worker
  whose stores named several groups, or a sparse one, is scored group by group:
  a prefix of L tokens is usable when every full-attention group (or group of
  a kind we do not know) holds all its blocks, every sliding-window group the
  ``cdiv(window - 1, block_size)`` blocks before L, every Mamba group the block
  before L (vLLM's hybrid coordinator); L is the longest such, a multiple of
  each group's block size. ``by_medium`` is the same with one medium's blocks,
  ``score`` gives each token of the prefix the best weight w such that the
  media weighing >= w alone serve it. A group's kind comes from the stores'
  ``kv_cache_spec_kind``/``kv_cache_spec_sliding_window`` (snapshots keep it).
  A store whose token ids cover more whole blocks than it has hashes (vLLM
  skips a sparse group's null or masked blocks in ``block_hashes`` only) keeps
  its hashes as orphans: removable, never matched.
- Scoring: each block size present is scored separately (keys are seeded by
  block size); a worker's ``matched_tokens`` is its longest run of leading
  blocks held on any medium, ``by_medium`` the run per medium, ``score`` the
  sum over matched blocks of block_size x the best weight among the media
  holding that block (summed as tokens x weight per distinct weight, highest
  first, so that a prefix has one float on every path); across block sizes each
  field takes its maximum.
  Results: workers with matched_tokens > 0, best first by (score,
  matched_tokens), then (instance_id, dp_rank); ``top_k`` keeps the first k.

- **Trust** (decided by the fence, ``rank_state.py`` / ``rust/src/fence.rs``;
  ``Applier.score`` excludes untrusted workers): a rank is untrusted once its
  view may be incomplete (joined mid-stream, new epoch without its reset, seq
  hole, producer gap, a record refused whole, e.g. by a refcount overflow,
  which is also dead-lettered) and trusted again at the next point its full
  state is known: a reset record, or an AllBlocksCleared of that rank (it holds
  nothing then; events after the clear in the same record apply normally, and a
  gap carried by the same record happened before it). A worker is trusted when
  all its ``tp_size`` ranks are. ``tests/oracle.py``'s ``FenceOracle`` is the spec.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Annotated, Any, NamedTuple, Protocol

import msgspec
import numpy as np
import xxhash

from kvwire import _core
from kvwire.schemas import codec
from kvwire.schemas.events import CPU, GPU, STORAGE, AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, WorkerId

from .keys import engine_keys, token_words

if TYPE_CHECKING:
    from .rank_state import RankTable

DEFAULT_WEIGHTS = {GPU: 1.0, CPU: 0.8, STORAGE: 0.5}


class MalformedEvent(ValueError):
    """A BlockStored whose token ids do not cover its blocks: nothing was applied."""


class IndexOverflow(RuntimeError):
    """A reference count hit its ceiling: none of the call's events were applied."""


class WorkerScore(msgspec.Struct, frozen=True, omit_defaults=True):
    instance_id: str
    dp_rank: int
    matched_tokens: Annotated[int, msgspec.Meta(ge=0)]
    by_medium: dict[str, Annotated[int, msgspec.Meta(ge=0)]]
    score: float
    approximate: Annotated[
        bool,
        msgspec.Meta(
            description="Present (true) when the worker's source cannot observe removals: the credit may "
            "name blocks it no longer holds."
        ),
    ] = False


class WorkerStats(msgspec.Struct, frozen=True):
    instance_id: str
    dp_rank: int
    tp_size: int
    ranks: int
    blocks: dict[str, int]  # holder-blocks per medium (all TP ranks hold them)
    entries: int  # engine-hash entries over all ranks, media and groups
    orphans: int  # live entries under an orphan chain
    unknown_removes: int
    duplicate_stores: int


class KeyHolding(NamedTuple):
    """One row of ``PrefixIndex.worker_holding``."""

    position: int  # in the keys asked about
    medium: str
    group: int
    held: bool  # every TP rank of the worker has it


class ScoreArrays(msgspec.Struct, frozen=True):
    """Scores as arrays, best first (the fast path: no object per worker).
    ``by_medium`` of result i is ``media[by_medium[by_off[i]:by_off[i+1]]]`` with
    ``by_tokens`` of the same slice."""

    worker: np.ndarray  # uint32 worker ids (``PrefixIndex.worker_key``)
    matched_tokens: np.ndarray  # int64
    score: np.ndarray  # float64
    by_off: np.ndarray  # uint32, len(worker) + 1
    by_medium: np.ndarray  # uint32 medium ids (``PrefixIndex.media``)
    by_tokens: np.ndarray  # int64


# What one apply_poll call did (the core's class: next, declined, tally, dead, seen).
Poll = _core.Poll


class Index(Protocol):
    """What ``consumer.apply.Applier`` asks of an index, and all it asks: ``PrefixIndex`` (the
    core) and the tests' brute-force model (``tests/oracle.py``) both implement it, so the
    Applier has one path whichever it holds.

    ``apply_poll`` decodes, fences with ``ranks`` (the fence rule's one home is the core,
    ``rust/src/fence.rs``) and applies ``records[start:]``, in order, until one is declined
    or ``budget_us`` is spent; with ``declined``, ``records[next]`` is the declined one, not
    consumed (the Applier decodes it with the reference decoder). The read side scores with
    ``exclude`` (the untrusted workers) left out."""

    def apply_poll(
        self,
        ranks: RankTable,
        records: list[Any],
        start: int,
        budget_us: int,
        now_us: int,
        schema_ids: dict[int, int] | None = None,
    ) -> Poll: ...

    def drop_rank(self, rank: WorkerId) -> None: ...

    def drop_worker(self, worker: tuple[str, int] | WorkerId) -> None: ...

    def score(
        self,
        token_ids: Any,
        lora_name: str | None = None,
        block_size: int | None = None,
        weights: Mapping[str, float] | None = None,
        workers: Iterable[tuple[str, int]] | None = None,
        extra_keys: Sequence[Any] | None = None,
        top_k: int | None = None,
        exclude: Iterable[tuple[str, int]] | None = None,
    ) -> list[WorkerScore]: ...

    def score_trusted_json(
        self,
        ranks: RankTable,
        token_ids: Any,
        lora_name: str | None = None,
        block_size: int | None = None,
        top_k: int | None = None,
        extra_keys: Sequence[Any] | None = None,
    ) -> bytes: ...

    def score_trusted_keys_json(
        self, ranks: RankTable, keys: np.ndarray, block_size: int | None = None, top_k: int | None = None
    ) -> bytes: ...

    def workers(self) -> dict[tuple[str, int], WorkerStats]: ...


# What apply_batch indexes; any other event is ignored.
_INDEX_EVENTS = (BlockStored, BlockRemoved, AllBlocksCleared)
_EMPTY = np.zeros(0, np.uint32)


class PrefixIndex:
    """See the module docstring. One writer thread; scores from any thread, also while it
    writes: the core scores without the GIL and each sees the index between two write
    calls (``rust/src/py_index.rs``, ``Shared``)."""

    # Slots of one key before the core keeps its holder set (None: the core's default). Tests
    # set 1 so that every key, not only shared prompts, goes through the holder-set path.
    holder_sets_at: int | None = None

    def __init__(self, weights: Mapping[str, float] | None = None, default_weight: float = 0.5, capacity: int = 0):
        self._weights = dict(DEFAULT_WEIGHTS if weights is None else weights)
        self._default_weight = float(default_weight)
        self.core = _core.Index(self._weights, self._default_weight, capacity, self.holder_sets_at)
        self._names: list[tuple[str, int]] = []
        self._media: list[str] = []

    # ------------------------------------------------------------ writes

    def apply_poll(
        self,
        ranks: RankTable,
        records: list[Any],
        start: int,
        budget_us: int,
        now_us: int,
        schema_ids: dict[int, int] | None = None,
    ) -> Poll:
        """``Index.apply_poll``: one core call (``rust/src/pipeline.rs``) for the slice."""
        return _core.apply_poll(self.core, ranks.core, records, start, budget_us, now_us, schema_ids)

    def store(self, rank: WorkerId, event: BlockStored) -> None:
        self.apply_batch(rank, (event,))

    def remove(self, rank: WorkerId, event: BlockRemoved) -> None:
        self.apply_batch(rank, (event,))

    def apply_batch(self, rank: WorkerId, events: Iterable[Any], atomic: bool = False) -> int:
        """Apply one rank's events in order (BlockStored, BlockRemoved,
        AllBlocksCleared; anything else is ignored). Returns the blocks the
        store and remove events named. See the module docstring for errors.

        The events take the path of a record's bytes (encoded, then decoded
        and applied by the core), so there is one implementation of what an
        event does to the index. Events the wire cannot carry raise
        MalformedEvent, nothing applied."""
        evs = tuple(e for e in events if type(e) in _INDEX_EVENTS)
        try:
            value = codec.encode(EventBatch(rank, 0, 0, 0, evs))
        except codec.EncodeError as e:
            raise MalformedEvent(f"events the wire cannot carry: {e}") from None
        done = _core.apply_events(self.core, value, atomic)
        if done.status == _core.ApplyStatus.APPLIED:
            return done.blocks
        if done.status == _core.ApplyStatus.MALFORMED:
            raise MalformedEvent(done.message)
        raise IndexOverflow(done.message)

    def clear(self, rank: WorkerId) -> None:
        """AllBlocksCleared, counters kept: the rank's tables are retired at once and their slots
        swept by later applies (see `unswept`)."""
        self.core.clear(rank.instance_id, rank.dp_rank, rank.tp_rank)

    def drop_rank(self, rank: WorkerId) -> None:
        """Forget a rank entirely (expiry): its blocks and its counters."""
        self.core.drop_rank(rank.instance_id, rank.dp_rank, rank.tp_rank)

    def drop_worker(self, worker: tuple[str, int] | WorkerId) -> None:
        """Forget every rank of a worker (partition revoked, worker gone)."""
        inst, dp = worker.worker if isinstance(worker, WorkerId) else worker
        self.core.drop_worker(str(inst), int(dp))

    # ------------------------------------------------------------ queries

    def score(
        self,
        token_ids: Any,
        lora_name: str | None = None,
        block_size: int | None = None,
        weights: Mapping[str, float] | None = None,
        workers: Iterable[tuple[str, int]] | None = None,
        extra_keys: Sequence[Any] | None = None,
        top_k: int | None = None,
        exclude: Iterable[tuple[str, int]] | None = None,
    ) -> list[WorkerScore]:
        """Workers holding a prefix of ``token_ids``, best first."""
        return self.results(
            self.score_arrays(token_ids, lora_name, block_size, weights, workers, extra_keys, top_k, exclude)
        )

    def _queries(
        self, token_ids: Any, lora_name: str | None, block_size: int | None, extra_keys: Sequence[Any] | None
    ) -> list[_core.ScoreQuery]:
        tok = _tokens(token_ids)
        # Contexts are hashed in the core, from the values themselves; a list, read once per size.
        extra_keys = None if extra_keys is None else list(extra_keys)
        # Size 0: every block size the index holds, read by the core under the score's own lock.
        return [_core.ScoreQuery.Tokens(tok, block_size or 0, extra_keys, lora_name)]

    def score_arrays(
        self,
        token_ids: Any,
        lora_name: str | None = None,
        block_size: int | None = None,
        weights: Mapping[str, float] | None = None,
        workers: Iterable[tuple[str, int]] | None = None,
        extra_keys: Sequence[Any] | None = None,
        top_k: int | None = None,
        exclude: Iterable[tuple[str, int]] | None = None,
    ) -> ScoreArrays:
        """``score`` as arrays: the hashing, walk and ordering all in the core."""
        qs = self._queries(token_ids, lora_name, block_size, extra_keys)
        return _arrays(self.core.score(qs, _wdict(weights), _wlist(workers), _wlist(exclude), top_k))

    def score_json(
        self,
        token_ids: Any,
        lora_name: str | None = None,
        block_size: int | None = None,
        top_k: int | None = None,
        exclude: Iterable[tuple[str, int]] | None = None,
        extra_keys: Sequence[Any] | None = None,
    ) -> bytes:
        """The scores as the JSON list ``/v1/score`` returns, encoded by the core."""
        qs = self._queries(token_ids, lora_name, block_size, extra_keys)
        out: bytes = self.core.score(qs, None, None, _wlist(exclude), top_k, True)
        return out

    def score_trusted_json(
        self,
        ranks: RankTable,
        token_ids: Any,
        lora_name: str | None = None,
        block_size: int | None = None,
        top_k: int | None = None,
        extra_keys: Sequence[Any] | None = None,
    ) -> bytes:
        """``score_json`` of the workers ``ranks`` trusts, those it marks approximate marked so,
        with the fence read in the same core call as the index (``_core.score_trusted``)."""
        qs = self._queries(token_ids, lora_name, block_size, extra_keys)
        out: bytes = _core.score_trusted(self.core, ranks.core, qs, top_k, True)
        return out

    def score_trusted_keys_json(
        self, ranks: RankTable, keys: np.ndarray, block_size: int | None = None, top_k: int | None = None
    ) -> bytes:
        """``score_trusted_json`` of precomputed keys, each worth ``block_size`` tokens (or, without
        it, the block size of the worker holding it)."""
        k = np.ascontiguousarray(keys, np.uint64)
        out: bytes = _core.score_trusted(
            self.core, ranks.core, [_core.ScoreQuery.Keys(k, block_size or 0)], top_k, True
        )
        return out

    def score_keys(
        self,
        keys: np.ndarray,
        block_size: int,
        weights: Mapping[str, float] | None = None,
        workers: Iterable[tuple[str, int]] | None = None,
        top_k: int | None = None,
    ) -> list[WorkerScore]:
        """Score precomputed ``prompt_keys(tokens, block_size, ...)`` (a router
        that caches a conversation's keys skips rehashing its prefix)."""
        k = np.ascontiguousarray(keys, np.uint64)
        return self.results(
            _arrays(
                self.core.score([_core.ScoreQuery.Keys(k, block_size)], _wdict(weights), _wlist(workers), None, top_k)
            )
        )

    def score_keys_arrays(self, keys: np.ndarray, block_size: int, top_k: int | None = None) -> ScoreArrays:
        """``score_keys`` as arrays (the fast path without hashing)."""
        k = np.ascontiguousarray(keys, np.uint64)
        return _arrays(self.core.score([_core.ScoreQuery.Keys(k, block_size)], None, None, None, top_k))

    def score_media(
        self,
        media: Sequence[str],
        token_ids: Any = None,
        lora_name: str | None = None,
        extra_keys: Sequence[Any] | None = None,
        keys: np.ndarray | None = None,
        block_size: int | None = None,
        workers: Iterable[tuple[str, int]] | None = None,
    ) -> ScoreArrays:
        """``score_arrays`` (of ``token_ids``, or of precomputed ``keys``) counting only the
        blocks that ``media`` hold: one tier's view of the prefix, e.g. held on the device, or on
        the device or the host. A key is worth ``block_size`` tokens, or, without it, the block
        size of the worker holding it (a block's key names its tokens, so it only matches a
        worker of the block size it was hashed in)."""
        if keys is not None:
            k = np.ascontiguousarray(keys, np.uint64)
            qs: list[_core.ScoreQuery] = [_core.ScoreQuery.Keys(k, block_size or 0)]
        else:
            qs = self._queries(token_ids, lora_name, block_size, extra_keys)
        return _arrays(self.core.score_media(qs, list(media), _wlist(workers)))

    def score_engine_hashes(
        self,
        hashes: Iterable[Any],
        block_size: int = 1,
        weights: Mapping[str, float] | None = None,
        workers: Iterable[tuple[str, int]] | None = None,
    ) -> list[WorkerScore]:
        """Score a prompt given as the engine's own chained block hashes (engine-hash mode;
        see the module docstring for when that is sound). Tokens = blocks x ``block_size``."""
        k = engine_keys(hashes)
        return self.results(
            _arrays(self.core.score([_core.ScoreQuery.Keys(k, block_size)], _wdict(weights), _wlist(workers)))
        )

    def worker_key(self, w: int) -> tuple[str, int]:
        names = self._names
        if w >= len(names):
            names = self._names = [tuple(x) for x in self.core.worker_names()]  # type: ignore[misc]
        return names[w]

    def media(self) -> list[str]:
        if len(self._media) != len(self.core.media()):
            self._media = list(self.core.media())
        return self._media

    def results(self, a: ScoreArrays) -> list[WorkerScore]:
        n = a.worker.shape[0]
        if n == 0:
            return []
        media = self.media()
        off = a.by_off.tolist()
        bm = a.by_medium.tolist()
        bt = a.by_tokens.tolist()
        out = []
        for i, (w, m, s) in enumerate(zip(a.worker.tolist(), a.matched_tokens.tolist(), a.score.tolist(), strict=True)):
            inst, dp = self.worker_key(w)
            out.append(WorkerScore(inst, dp, m, {media[bm[j]]: bt[j] for j in range(off[i], off[i + 1])}, s))
        return out

    # ------------------------------------------------------------ snapshots

    def export_workers(self, workers: Iterable[tuple[str, int]]) -> bytes:
        """The R-table entries of these workers' ranks (engine hash, key,
        refcount|flags) plus what names them, and each worker's memo of removed
        parents, as one blob for ``import_workers``.

        Layout (version 2): ``b"KVWI" | u16 version | u16 0 | u32 header length
        | msgpack header | pad to 8 | u64 engine hashes | u64 keys | u16 metas |
        pad to 8 | u64 memo engine hashes | u64 memo keys | u8 memo orphan
        flags``; the header lists tables as (instance_id, dp_rank, tp_size,
        tp_rank, medium, group, entries, unknown_removes, duplicate_stores) in
        array order, and memos as (instance_id, dp_rank, tp_size, entries) in
        array order, each oldest first. The scoring table is not exported: it is
        derived (one count per entry), and rebuilding it costs about what reading
        it would. Tables come in the index's own order (a parent found in several
        of a worker's tables resolves to the first, so order is part of the
        state); so does each memo's line (it decides which hash is pushed out
        next), so the log's tail applies to the import as to this index.

        Version 1 (the layout from the numba index until the memo) is version 2
        without the memo arrays and header key; ``import_workers`` still reads
        it, with empty memos.
        """
        ws = sorted({(str(w[0]), int(w[1])) for w in workers})
        ex = self.core.export_workers(ws)
        head = msgspec.msgpack.encode(
            {
                "block_sizes": self.core.block_sizes(),
                "tables": [
                    [
                        t.instance_id,
                        t.dp_rank,
                        t.tp_size,
                        t.tp_rank,
                        t.medium,
                        t.group,
                        t.entries,
                        t.unknown_removes,
                        t.duplicate_stores,
                    ]
                    for t in ex.tables
                ],
                # KV-cache groups and their reach (tail blocks, 0 = every block); an older
                # reader ignores the key, a blob without it restores groups as full attention.
                "groups": [[g.instance_id, g.dp_rank, g.group, g.tail] for g in self.core.export_groups(ws)],
                "memos": [list(m) for m in ex.memos],
            }
        )
        pad = -(_EXPORT_HEAD.size + len(head)) % 8
        return b"".join(
            [
                _EXPORT_HEAD.pack(_EXPORT_MAGIC, _EXPORT_VERSION, 0, len(head)),
                head,
                b"\0" * pad,
                ex.ehs,
                ex.keys,
                ex.metas,
                b"\0" * (-len(ex.metas) % 8),
                ex.memo_ehs,
                ex.memo_keys,
                ex.memo_orphans,
            ]
        )

    def import_workers(self, blob: bytes) -> int:
        """Install what ``export_workers`` wrote; returns the entries imported.

        Workers in the blob must not be in this index (drop them first): the
        entries are added, not merged. Raises ``ValueError`` for a blob that
        does not parse; the caller then discards the index state it touched.
        """
        mv = memoryview(blob)
        hs = _EXPORT_HEAD.size
        if len(mv) < hs:
            raise ValueError("index blob truncated")
        magic, version, _, hlen = _EXPORT_HEAD.unpack_from(mv)
        if magic != _EXPORT_MAGIC or version not in _EXPORT_READS:
            raise ValueError(f"not an index blob of version {', '.join(map(str, _EXPORT_READS))}")
        try:
            head = msgspec.msgpack.decode(mv[hs : hs + hlen])
            tables = head["tables"]
            block_sizes = [int(b) for b in head["block_sizes"]]
            groups = [(str(i), int(d), int(g), int(t)) for i, d, g, t in head.get("groups", ())]
            # Version 1 has no memos: its workers start with empty ones, which under-credits a
            # child of a parent removed before the snapshot, never over-credits.
            memos = [(str(i), int(d), int(tp), int(c)) for i, d, tp, c in head["memos"]] if version >= 2 else []
            n = sum(int(t[6]) for t in tables)
            m = sum(c for *_, c in memos)
            if any(int(t[6]) < 0 for t in tables) or any(c < 0 for *_, c in memos):
                raise ValueError("a negative count")
        except (msgspec.DecodeError, KeyError, TypeError, IndexError, ValueError) as e:
            raise ValueError(f"index blob header: {e}") from None
        off = hs + hlen + (-(hs + hlen) % 8)
        moff = off + n * 18 + (-(n * 2) % 8) if version >= 2 else off + n * 18
        if len(mv) != moff + m * 17:
            raise ValueError(f"index blob is {len(mv)} bytes, expected {moff + m * 17}")
        self.core.add_block_sizes(block_sizes)
        i = 0
        for inst, dp, tp_size, tp_rank, medium, g, cnt, unknown, dups in tables:
            cnt = int(cnt)
            self.core.import_table(
                str(inst),
                int(dp),
                int(tp_size),
                int(tp_rank),
                str(medium),
                int(g),
                mv[off + 8 * i : off + 8 * (i + cnt)],
                mv[off + 8 * n + 8 * i : off + 8 * n + 8 * (i + cnt)],
                mv[off + 16 * n + 2 * i : off + 16 * n + 2 * (i + cnt)],
                int(unknown),
                int(dups),
            )
            i += cnt
        for inst, dp, g, tail in groups:
            self.core.import_group(inst, dp, g, tail)
        j = 0
        for inst, dp, tp, cnt in memos:
            self.core.import_memo(
                inst,
                dp,
                tp,
                mv[moff + 8 * j : moff + 8 * (j + cnt)],
                mv[moff + 8 * m + 8 * j : moff + 8 * m + 8 * (j + cnt)],
                mv[moff + 16 * m + j : moff + 16 * m + j + cnt],
            )
            j += cnt
        return n

    def digest(self, workers: Iterable[tuple[str, int]] | None = None) -> str:
        """Hex digest of the set of holder-blocks (worker, medium, key): equal
        for two indexes holding the same blocks, whatever their history, table
        capacity or insertion order. ``workers`` restricts it to those.

        Memos of removed parents are left out: they are history, not held
        blocks, and two indexes that hold the same blocks answer every score
        alike whatever they remember; a memo that decides a later child shows
        here as soon as it does (the child's key is held or not). Comparing the
        digest with ``kvwire replay``'s, a brute-force model's or a member's
        restored from a pre-memo snapshot stays a statement about held blocks."""
        names = self.core.wm_names()
        only = None if workers is None else {tuple(w) for w in workers}
        seeds = np.zeros(max(len(names), 1), np.uint64)
        for wm, (inst, dp, medium) in enumerate(names):
            if only is not None and (inst, dp) not in only:
                continue
            name = msgspec.msgpack.encode([inst, dp, medium])
            seeds[wm] = xxhash.xxh3_64_intdigest(name) | 1  # 0 marks an excluded wm
        total, count = self.core.digest(seeds) if names else (0, 0)
        return f"{int(total):016x}{int(count):016x}"

    # ------------------------------------------------------------ stats

    def workers(self) -> dict[tuple[str, int], WorkerStats]:
        return {
            (s.instance_id, s.dp_rank): WorkerStats(
                s.instance_id,
                s.dp_rank,
                s.tp_size,
                s.ranks,
                dict(s.blocks),
                s.entries,
                s.orphans,
                s.unknown_removes,
                s.duplicate_stores,
            )
            for s in self.core.stats()
        }

    def holder_blocks(self) -> dict[tuple[tuple[str, int], str], set[int]]:
        """(worker, medium) -> block keys it holds: for tests and debugging (O(table))."""
        names = self.core.wm_names()
        wms, keys = self.core.holder_keys()
        out: dict[tuple[tuple[str, int], str], set[int]] = {}
        for wm, k in zip(np.frombuffer(wms, np.uint32).tolist(), np.frombuffer(keys, np.uint64).tolist(), strict=True):
            inst, dp, medium = names[wm]
            out.setdefault(((inst, dp), medium), set()).add(k)
        return out

    def worker_holding(self, worker: tuple[str, int], keys: np.ndarray) -> list[KeyHolding]:
        """Of ``keys``, where the worker's ranks have each: one row per (key, medium, group) some
        rank has, ``held`` when all its TP ranks do (the rule ``len(index)`` counts). A key no
        rank of the worker has gets no row. For the event streams (``consumer.stream_table``),
        which must ask the index who holds what instead of keeping a rule of their own."""
        k = np.ascontiguousarray(keys, np.uint64)
        idx, med, grp, held = self.core.worker_holding(worker[0], int(worker[1]), k)
        media = self.media()
        return [
            KeyHolding(i, media[m], g, bool(h))
            for i, m, g, h in zip(
                np.frombuffer(idx, np.uint32).tolist(),
                np.frombuffer(med, np.uint32).tolist(),
                np.frombuffer(grp, np.int64).tolist(),
                held,
                strict=True,
            )
        ]

    def worker_held(self, worker: tuple[str, int]) -> dict[tuple[str, int], set[int]]:
        """(medium, group) -> keys the worker holds (all TP ranks), orphans and engine-hash
        entries left out: O(the worker's entries)."""
        keys, med, grp = self.core.worker_held(worker[0], int(worker[1]))
        media = self.media()
        out: dict[tuple[str, int], set[int]] = {}
        for k, m, g in zip(
            np.frombuffer(keys, np.uint64).tolist(),
            np.frombuffer(med, np.uint32).tolist(),
            np.frombuffer(grp, np.int64).tolist(),
            strict=True,
        ):
            out.setdefault((media[m], g), set()).add(k)
        return out

    def block_sizes(self) -> list[int]:
        return list(self.core.block_sizes())

    def __len__(self) -> int:
        return len(self.core)

    def entries(self) -> int:
        """Engine-hash entries over all ranks (what BlockRemoved can address)."""
        return int(self.core.entries())

    def nbytes(self) -> int:
        return int(self.core.nbytes())

    def unswept(self) -> tuple[int, int]:
        """Cleared tables whose slots the core still has to sweep, and their entries: an
        AllBlocksCleared retires a table at once, and later applies purge its slots a bounded
        number at a time."""
        tables, entries = self.core.unswept()
        return int(tables), int(entries)


def _tokens(token_ids: Any) -> np.ndarray:
    if isinstance(token_ids, np.ndarray) and token_ids.dtype == np.uint32 and token_ids.flags.c_contiguous:
        return token_ids
    if hasattr(token_ids, "typecode") and token_ids.typecode == "I":
        return np.frombuffer(token_ids, np.uint32) if len(token_ids) else _EMPTY
    return token_words(token_ids)


def _wdict(weights: Mapping[str, float] | None) -> dict[str, float] | None:
    return None if weights is None else {str(k): float(v) for k, v in weights.items()}


def _wlist(workers: Iterable[Any] | None) -> list[tuple[str, int]] | None:
    if workers is None:
        return None
    return [w.worker if isinstance(w, WorkerId) else (str(w[0]), int(w[1])) for w in workers]


def _arrays(b: _core.ScoreResult) -> ScoreArrays:
    """The core's six result arrays (``_core.Index.score``), in ``ScoreArrays``' field order."""
    return ScoreArrays(*b)


_EXPORT_MAGIC = b"KVWI"
# 2: each worker's memo of removed parents, after the tables. Version 1 blobs (no memos) still load,
# with empty memos: that under-credits a child of a parent removed before the export, never
# over-credits, so refusing them (a replay of the partition) would cost more than it saves.
_EXPORT_VERSION = 2
_EXPORT_READS = (1, 2)
_EXPORT_HEAD = struct.Struct("<4sHHI")

__all__ = [
    "DEFAULT_WEIGHTS",
    "Index",
    "IndexOverflow",
    "KeyHolding",
    "MalformedEvent",
    "Poll",
    "PrefixIndex",
    "ScoreArrays",
    "WorkerScore",
    "WorkerStats",
]
