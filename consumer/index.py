"""The prefix-cache index: which worker holds how many leading tokens of a prompt.

Pure in-memory, single-threaded, and ignorant of Kafka, epochs and sequence
numbers: the ingest layer fences, dedups and detects gaps, then calls
``store`` / ``remove`` / ``clear`` / ``drop_rank`` / ``drop_worker``.

Semantics (``tests/oracle.py`` is the executable spec):

- Block keys are our chained XXH3 over token ids (``kvwire.consumer.keys``); engine
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
- **Engine-hash mode.** Events with ``block_size == 0`` or no token ids (vLLM
  OffloadingConnector without ``self_describing_kv_events``) are indexed under
  their engine hashes. ``score`` never sees them; ``score_engine_hashes`` does,
  and it is only meaningful for a router that computes the engine's own block
  hashes: same hash algorithm, same PYTHONHASHSEED/NONE_HASH, same
  ``hash_block_size`` and extra keys as the engines.
- Scoring: each block size present is scored separately (keys are seeded by
  block size); a worker's ``matched_tokens`` is its longest run of leading
  blocks held on any medium, ``by_medium`` the run per medium, ``score`` the
  sum over matched blocks of block_size x the best weight among the media
  holding that block; across block sizes each field takes its maximum.
  Results: workers with matched_tokens > 0, best first by (score,
  matched_tokens), then (instance_id, dp_rank).
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Mapping

import msgspec
import numpy as np
import xxhash

from kvwire.schemas.events import CPU, GPU, STORAGE, AllBlocksCleared, BlockRemoved, BlockStored, WorkerId

from . import table as T
from .keys import ROOT, block_contexts, context_seed, engine_hash_u64, engine_hashes, engine_keys, orphan_root

DEFAULT_WEIGHTS = {GPU: 1.0, CPU: 0.8, STORAGE: 0.5}
_KNOWN_MEDIA = {GPU, CPU, STORAGE}


class MalformedEvent(ValueError):
    """A BlockStored whose token ids do not cover its blocks: nothing was applied."""


class IndexOverflow(RuntimeError):
    """A reference count hit its ceiling (>16k duplicate stores of one hash)."""


class WorkerScore(msgspec.Struct, frozen=True):
    instance_id: str
    dp_rank: int
    matched_tokens: int
    by_medium: dict[str, int]
    score: float


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


def normalize_medium(medium) -> str:
    if medium is None:
        return GPU
    m = medium if isinstance(medium, str) else str(medium)
    u = m.upper()
    return u if u in _KNOWN_MEDIA else m


class _RTable:
    __slots__ = ("eh", "key", "limit", "meta", "rank", "rm", "st")

    def __init__(self, rm: int, rank: int, cap: int = T.MIN_CAP):
        self.rm = rm
        self.rank = rank
        self._alloc(cap)
        self.st = np.zeros(4, np.int64)

    def _alloc(self, cap: int) -> None:
        self.eh = np.zeros(cap, np.uint64)
        self.key = np.zeros(cap, np.uint64)
        self.meta = np.zeros(cap, np.uint16)
        self.limit = T.limit(cap)

    def reserve(self, need: int) -> None:
        cap = T.next_cap(need, self.eh.shape[0])
        if cap != self.eh.shape[0]:
            old = (self.eh, self.key, self.meta)
            self._alloc(cap)
            T.r_rehash(*old, self.eh, self.key, self.meta)

    def reset(self) -> None:
        unknown, dups = self.st[T.ST_UNKNOWN], self.st[T.ST_DUPS]
        self._alloc(T.MIN_CAP)
        self.st[:] = 0
        self.st[T.ST_UNKNOWN], self.st[T.ST_DUPS] = unknown, dups

    def nbytes(self) -> int:
        return self.eh.nbytes + self.key.nbytes + self.meta.nbytes + self.st.nbytes


class _Worker:
    __slots__ = ("idx", "key", "ranks", "tp_size")

    def __init__(self, idx: int, key: tuple[str, int], tp_size: int):
        self.idx = idx
        self.key = key
        self.tp_size = tp_size
        self.ranks: dict[int, dict[tuple[int, int], _RTable]] = {}  # tp_rank -> (medium, group) -> table


def _grown(a: np.ndarray, n: int, fill=0) -> np.ndarray:
    if n <= a.shape[0]:
        return a
    b = np.full(max(n, 2 * a.shape[0]), fill, a.dtype)
    b[: a.shape[0]] = a
    return b


class _Segment:
    """Consecutive events bound for one table, as the arrays ``table.apply_run`` takes."""

    __slots__ = ("blk_ctx", "evu", "hashes", "nblk", "ntok", "ops", "stores", "toks")

    def __init__(self):
        self.ops: list[int] = []
        self.evu: list[int] = []
        self.hashes: list = []
        self.toks: list = []
        self.blk_ctx: list = []
        self.nblk = 0
        self.ntok = 0
        self.stores = 0

    def add(self, kind, hashes, n, bs, tokens, fl, ctx, peh, blk_ctx) -> None:
        self.ops += (kind, self.nblk, n, bs, self.ntok, fl)
        self.evu += (ctx, peh)
        self.hashes += hashes
        if blk_ctx is not None:
            self.blk_ctx.append((self.nblk, blk_ctx))
        if tokens is not None:
            self.toks.append(tokens)
            self.ntok += len(tokens)
        self.nblk += n


_CTX: dict[tuple[int, str | None], int] = {}


def _ctx_seed(bs: int, lora_name: str | None) -> int:
    c = _CTX.get((bs, lora_name))
    if c is None:
        c = context_seed(bs, lora_name)
        if len(_CTX) < 4096:
            _CTX[(bs, lora_name)] = c
    return c


_CTX_ARR: dict[tuple[int, str | None], np.ndarray] = {}


def _ctx_array(bs: int, lora_name: str | None) -> np.ndarray:
    """``block_contexts`` without extra keys, cached (read-only in the kernels)."""
    c = _CTX_ARR.get((bs, lora_name))
    if c is None:
        c = np.array([_ctx_seed(bs, lora_name)], np.uint64)
        if len(_CTX_ARR) < 4096:
            _CTX_ARR[(bs, lora_name)] = c
    return c


_MASK64 = (1 << 64) - 1


class PrefixIndex:
    """See the module docstring. Not thread-safe: one writer, queries between writes."""

    def __init__(self, weights: Mapping[str, float] | None = None, default_weight: float = 0.5, capacity: int = 0):
        self._media: dict[str, int] = {}
        self._media_names: list[str] = []
        self._weights = dict(DEFAULT_WEIGHTS if weights is None else weights)
        self._default_weight = float(default_weight)
        self._warr = np.zeros(0)
        self._workers: dict[tuple[str, int], _Worker] = {}
        self._worker_list: list[_Worker] = []
        self._rm: dict[tuple[int, int, int], int] = {}  # (worker idx, tp_rank, medium id) -> rm
        self._wm: dict[tuple[int, int], int] = {}  # (worker idx, medium id) -> wm
        self.rm_wm = np.zeros(16, np.int64)
        self.wm_tp = np.ones(16, np.int64)
        self.wm_worker = np.zeros(16, np.int64)
        self.wm_medium = np.zeros(16, np.int64)
        self.wm_blocks = np.zeros(16, np.int64)
        self._n_wm = 0
        cap = T.next_cap(capacity, T.MIN_CAP)
        self.s_key = np.zeros(cap, np.uint64)
        self.s_meta = np.zeros(cap, np.uint32)
        self.s_st = np.zeros(4, np.int64)
        self._s_limit = T.limit(cap)
        self._tables: dict[tuple, tuple[_RTable, _Worker]] = {}  # (WorkerId, raw medium, group) -> table (a cache)
        self._block_sizes: set[int] = set()
        self._reserve_hint = 0
        self._all = np.ones(0, np.bool_)
        self._nr = np.zeros(0, np.int64)

    # ------------------------------------------------------------ registry

    def _medium_id(self, name: str) -> int:
        mid = self._media.get(name)
        if mid is None:
            mid = self._media[name] = len(self._media_names)
            self._media_names.append(name)
            self._warr = self._weight_array(None)
        return mid

    def _weight_array(self, weights: Mapping[str, float] | None) -> np.ndarray:
        w = self._weights if weights is None else weights
        arr = np.array([float(w.get(m, self._default_weight)) for m in self._media_names], np.float64)
        if (arr < 0).any():
            raise ValueError("medium weights must be >= 0")
        return arr

    def _worker(self, rank: WorkerId) -> _Worker:
        wk = self._workers.get(rank.worker)
        if wk is None:
            wk = _Worker(len(self._worker_list), rank.worker, max(1, rank.tp_size))
            self._workers[rank.worker] = wk
            self._worker_list.append(wk)
        elif wk.tp_size != max(1, rank.tp_size):
            # Ranks disagree on the TP degree: the latest word wins, and every
            # holder count of the worker must be recomputed under it.
            self._set_tp(wk, max(1, rank.tp_size))
        return wk

    def _set_tp(self, wk: _Worker, tp: int) -> None:
        wk.tp_size = tp
        self._sync_tp(wk)
        T.recount(self.s_key, self.s_meta, self.rm_wm, self.wm_tp, self.wm_blocks)

    def _sync_tp(self, wk: _Worker) -> None:
        tp = 0 if wk.tp_size == 1 and len(wk.ranks) <= 1 else wk.tp_size
        for (w, _m), wm in self._wm.items():
            if w == wk.idx:
                self.wm_tp[wm] = tp

    def _table(self, rank: WorkerId, medium, group) -> _RTable:
        ck = (rank, medium, group)
        hit = self._tables.get(ck)
        if hit is not None:
            if hit[1].tp_size == rank.tp_size or rank.tp_size < 1:
                return hit[0]
            self._set_tp(hit[1], max(1, rank.tp_size))
            return hit[0]
        wk = self._worker(rank)
        mid = self._medium_id(normalize_medium(medium))
        g = 0 if group is None else int(group)
        tables = wk.ranks.setdefault(rank.tp_rank, {})
        t = tables.get((mid, g))
        if t is None:
            wmk = (wk.idx, mid)
            wm = self._wm.get(wmk)
            if wm is None:
                wm = self._wm[wmk] = self._n_wm
                self._n_wm += 1
                n = self._n_wm
                self.wm_tp = _grown(self.wm_tp, n, 1)
                self.wm_worker = _grown(self.wm_worker, n)
                self.wm_medium = _grown(self.wm_medium, n)
                self.wm_blocks = _grown(self.wm_blocks, n)
                self.wm_worker[wm] = wk.idx
                self.wm_medium[wm] = mid
            rmk = (wk.idx, rank.tp_rank, mid)
            rm = self._rm.get(rmk)
            if rm is None:
                rm = self._rm[rmk] = len(self._rm)
                if rm > T.MAX_RM:
                    raise IndexOverflow("too many (rank, medium) pairs")
                self.rm_wm = _grown(self.rm_wm, rm + 1)
                self.rm_wm[rm] = wm
            t = tables[(mid, g)] = _RTable(rm, rank.tp_rank)
            self._sync_tp(wk)
        self._tables[ck] = (t, wk)
        return t

    def _s_reserve(self, extra: int) -> None:
        need = int(self.s_st[T.ST_COUNT]) + extra
        if need > self._s_limit:
            cap = T.next_cap(need, self.s_key.shape[0])
            nk, nm = np.zeros(cap, np.uint64), np.zeros(cap, np.uint32)
            T.s_rehash(self.s_key, self.s_meta, nk, nm)
            self.s_key, self.s_meta, self._s_limit = nk, nm, T.limit(cap)

    # ------------------------------------------------------------ writes

    def store(self, rank: WorkerId, event: BlockStored) -> None:
        self.apply_batch(rank, (event,))

    def apply_batch(self, rank: WorkerId, events: Iterable) -> int:
        """Apply one rank's events in order (BlockStored, BlockRemoved,
        AllBlocksCleared; anything else is ignored): the same result as
        ``store``/``remove``/``clear`` one by one, errors included (events
        before a malformed one or an overflow stay applied, later ones are not
        applied). Returns the blocks the store and remove events named.

        Consecutive events on one (medium, group) table go to the kernel in one
        call: a record's events usually share a table, and per-call and
        per-event Python costs, not the table work, bounded the apply rate."""
        blocks = 0
        seg = None
        mk = None
        t = None
        for ev in events:
            tp = type(ev)
            if tp is BlockStored:
                hashes = ev.block_hashes
                n = len(hashes)
                if n == 0:
                    continue
                tokens = ev.token_ids
                bs = ev.block_size
                fl = 0
                ctx = 0
                peh = 0
                blk_ctx = None
                if bs <= 0 or len(tokens) == 0:
                    bs = 0
                else:
                    if len(tokens) != bs * n:
                        if seg is not None:
                            self._flush(rank, t, seg)
                        raise MalformedEvent(f"{len(tokens)} token ids for {n} blocks of {bs}")
                    if ev.extra_keys is None:
                        ctx = _ctx_seed(bs, ev.lora_name)
                    else:
                        c = block_contexts(bs, ev.lora_name, ev.extra_keys, n)
                        if c.shape[0] == 1:
                            ctx = int(c[0])
                        else:
                            blk_ctx = c
                            fl = T.F_BLKCTX
                    if bs not in self._block_sizes:
                        self._block_sizes.add(bs)
                    parent = ev.parent_block_hash
                    if parent is not None:
                        fl |= T.F_PARENT
                        peh = parent & _MASK64 if type(parent) is int else engine_hash_u64(parent)
                key = (ev.medium, ev.group_idx)
                if key != mk or seg is None:
                    if seg is not None:
                        self._flush(rank, t, seg)
                    t = self._table(rank, ev.medium, ev.group_idx)
                    mk = key
                    seg = _Segment()
                seg.add(T.KIND_STORE, hashes, n, bs, tokens if bs else None, fl, ctx, peh, blk_ctx)
                seg.stores += n
                blocks += n
            elif tp is BlockRemoved:
                hashes = ev.block_hashes
                n = len(hashes)
                if n == 0:
                    continue
                key = (ev.medium, ev.group_idx)
                if key != mk or seg is None:
                    if seg is not None:
                        self._flush(rank, t, seg)
                    t = self._table(rank, ev.medium, ev.group_idx)
                    mk = key
                    seg = _Segment()
                seg.add(T.KIND_REMOVE, hashes, n, 0, None, 0, 0, 0, None)
                blocks += n
            elif tp is AllBlocksCleared:
                if seg is not None:
                    self._flush(rank, t, seg)
                    seg = None
                self.clear(rank)
        if seg is not None:
            self._flush(rank, t, seg)
        return blocks

    def _flush(self, rank: WorkerId, t: _RTable, seg: _Segment) -> None:
        if seg.stores:
            if int(t.st[T.ST_COUNT]) + seg.stores > t.limit:
                t.reserve(int(t.st[T.ST_COUNT]) + seg.stores)
            if int(self.s_st[T.ST_COUNT]) + seg.stores > self._s_limit:
                self._s_reserve(seg.stores)
        ehs = engine_hashes(seg.hashes)
        tok = np.frombuffer(b"".join(seg.toks), np.uint32) if seg.toks else _NO_TOKENS
        ops = np.array(seg.ops, np.int64).reshape(-1, T.OP_COLS)
        evu = np.array(seg.evu, np.uint64).reshape(-1, 2)
        if seg.blk_ctx:
            bc = np.zeros(seg.nblk, np.uint64)
            for off, c in seg.blk_ctx:
                bc[off : off + c.shape[0]] = c
        else:
            bc = _NO_CTX
        ctl = np.array([t.rm, 0, 0, 0, 0, 0], np.int64)
        while True:
            T.apply_run(
                t.eh,
                t.key,
                t.meta,
                t.st,
                self.s_key,
                self.s_meta,
                self.s_st,
                self.rm_wm,
                self.wm_tp,
                self.wm_blocks,
                ops,
                evu,
                ehs,
                tok,
                bc,
                ctl,
            )
            status = ctl[T.CTL_STATUS]
            if status == T.NEED_PARENT:
                e = int(ctl[T.CTL_EVENT])
                pkey, orphan = self._resolve_parent(rank, t, int(evu[e, 1]))
                evu[e, 1] = pkey
                ctl[T.CTL_START] = e
                ctl[T.CTL_RESOLVED] = 1
                ctl[T.CTL_ORPHAN] = orphan
                continue
            if status == T.OVERFLOW:
                raise IndexOverflow("reference count ceiling reached; some duplicates were not counted")
            return

    def _resolve_parent(self, rank: WorkerId, own: _RTable, peh: int) -> tuple[int, bool]:
        wk = self._workers[rank.worker]
        out = np.zeros(2, np.uint64)
        order = [rank.tp_rank] + [r for r in wk.ranks if r != rank.tp_rank]
        for r in order:
            for t in wk.ranks.get(r, {}).values():
                if t is own:
                    continue
                if T.r_lookup(t.eh, t.key, t.meta, np.uint64(peh), out):
                    meta = int(out[1])
                    if meta & T.ENGINE:
                        continue
                    return int(out[0]), bool(meta & T.ORPHAN)
        return orphan_root(peh), True

    def remove(self, rank: WorkerId, event: BlockRemoved) -> None:
        self.apply_batch(rank, (event,))

    def clear(self, rank: WorkerId) -> None:
        """AllBlocksCleared: O(that rank's entries), counters kept."""
        wk = self._workers.get(rank.worker)
        if wk is None:
            return
        for t in wk.ranks.get(rank.tp_rank, {}).values():
            self._clear_table(t)

    def _clear_table(self, t: _RTable) -> None:
        if t.st[T.ST_COUNT]:
            T.clear(t.key, t.meta, self.s_key, self.s_meta, self.s_st, self.rm_wm, self.wm_tp, self.wm_blocks, t.rm)
        t.reset()

    def drop_rank(self, rank: WorkerId) -> None:
        """Forget a rank entirely (expiry, reset): its blocks and its counters."""
        wk = self._workers.get(rank.worker)
        if wk is None:
            return
        tables = wk.ranks.pop(rank.tp_rank, None)
        if tables:
            for t in tables.values():
                self._clear_table(t)
        self._tables = {
            k: v for k, v in self._tables.items() if not (k[0].worker == rank.worker and k[0].tp_rank == rank.tp_rank)
        }
        self._sync_tp(wk)

    def drop_worker(self, worker: tuple[str, int] | WorkerId) -> None:
        """Forget every rank of a worker (partition revoked, worker gone)."""
        key = worker.worker if isinstance(worker, WorkerId) else tuple(worker)
        wk = self._workers.get(key)
        if wk is None:
            return
        for tables in wk.ranks.values():
            for t in tables.values():
                self._clear_table(t)
        wk.ranks.clear()
        self._tables = {k: v for k, v in self._tables.items() if k[0].worker != key}
        self._sync_tp(wk)

    # ------------------------------------------------------------ queries

    def score(
        self,
        token_ids,
        lora_name: str | None = None,
        block_size: int | None = None,
        weights: Mapping[str, float] | None = None,
        workers: Iterable[tuple[str, int]] | None = None,
        extra_keys=None,
    ) -> list[WorkerScore]:
        """Workers holding a prefix of ``token_ids``, best first."""
        if isinstance(token_ids, np.ndarray):
            tok = np.ascontiguousarray(token_ids, np.uint32)
        elif hasattr(token_ids, "typecode") and token_ids.typecode == "I":
            tok = np.frombuffer(token_ids, np.uint32) if len(token_ids) else _NO_TOKENS
        else:
            tok = np.asarray(token_ids, np.uint32)
        sizes = (block_size,) if block_size else sorted(self._block_sizes)
        if not self.s_st[T.ST_COUNT] or not self._n_wm:
            return []
        wmask, warr = self._query_args(weights, workers)
        best = None
        for bs in sizes:
            n = tok.shape[0] // bs
            if n == 0:
                continue
            ctx = _ctx_array(bs, lora_name) if extra_keys is None else block_contexts(bs, lora_name, extra_keys, n)
            res = self._run(tok, bs, n, ctx, _ROOT_KEYS, wmask, warr)
            best = res if best is None else _merge(best, res)
        return self._results(best)

    def score_keys(
        self,
        keys: np.ndarray,
        block_size: int,
        weights: Mapping[str, float] | None = None,
        workers: Iterable[tuple[str, int]] | None = None,
    ) -> list[WorkerScore]:
        """Score precomputed ``prompt_keys(tokens, block_size, ...)`` (a router
        that caches a conversation's keys skips rehashing its prefix)."""
        keys = np.ascontiguousarray(keys, np.uint64)
        if keys.shape[0] == 0 or not self.s_st[T.ST_COUNT] or not self._n_wm:
            return []
        wmask, warr = self._query_args(weights, workers)
        return self._results(self._run(_NO_TOKENS, 0, keys.shape[0], _NO_CTX, keys, wmask, warr, scale=block_size))

    def score_engine_hashes(
        self,
        hashes,
        block_size: int = 1,
        weights: Mapping[str, float] | None = None,
        workers: Iterable[tuple[str, int]] | None = None,
    ) -> list[WorkerScore]:
        """Score a prompt given as the engine's own chained block hashes (engine-hash mode;
        see the module docstring for when that is sound). Tokens = blocks x ``block_size``."""
        keys = engine_keys(hashes)
        if keys.shape[0] == 0 or not self.s_st[T.ST_COUNT] or not self._n_wm:
            return []
        wmask, warr = self._query_args(weights, workers)
        return self._results(self._run(_NO_TOKENS, 0, keys.shape[0], _NO_CTX, keys, wmask, warr, scale=block_size))

    def _query_args(self, weights, workers):
        nw = len(self._worker_list)
        if workers is None:
            wmask = self._all
            if wmask.shape[0] != nw:  # read-only in the kernel: one array serves every query
                wmask = self._all = np.ones(nw, np.bool_)
        else:
            wmask = np.zeros(nw, np.bool_)
            for w in workers:
                wk = self._workers.get(w.worker if isinstance(w, WorkerId) else tuple(w))
                if wk is not None:
                    wmask[wk.idx] = True
        warr = self._warr if weights is None else self._weight_array({**self._weights, **weights})
        return wmask, warr

    def _run(self, tok, bs, n, ctx, keys, wmask, warr, scale=None):
        nw, nwm = len(self._worker_list), self._n_wm
        run_w = np.zeros(nw, np.int64)
        score_w = np.zeros(nw, np.float64)
        run_wm = np.zeros(nwm, np.int64)
        T.score(
            tok,
            bs,
            n,
            ctx,
            keys,
            self.s_key,
            self.s_meta,
            self.rm_wm,
            self.wm_tp,
            self.wm_worker,
            self.wm_medium,
            warr,
            wmask,
            run_w,
            score_w,
            run_wm,
        )
        mul = bs if scale is None else scale
        return run_w * mul, score_w * mul, run_wm * mul

    def _results(self, res) -> list[WorkerScore]:
        if res is None:
            return []
        run_w, score_w, run_wm = res
        hit = np.flatnonzero(run_w)
        if hit.shape[0] == 0:
            return []
        # Order in numpy (score, matched desc, then the worker's name rank) and
        # build each result once, in that order: a Python sort with a key
        # function and per-element numpy scalar access cost ~1-2 us per
        # matched worker, which dominated queries matching 100+ workers.
        run = run_w[hit]
        sc = score_w[hit]
        order = np.lexsort((self._name_ranks()[hit], -run, -sc))
        hit, run, sc = hit[order], run[order], sc[order]
        hw = hit.tolist()
        by: dict[int, dict[str, int]] = {w: {} for w in hw}
        wms = np.flatnonzero(run_wm)
        names = self._media_names
        for w, m, r in zip(
            self.wm_worker[wms].tolist(), self.wm_medium[wms].tolist(), run_wm[wms].tolist(), strict=False
        ):
            by[w][names[m]] = r
        wl = self._worker_list
        keys = [wl[w].key for w in hw]
        return [
            WorkerScore(k[0], k[1], r, by[w], x)
            for k, w, r, x in zip(keys, hw, run.tolist(), sc.tolist(), strict=False)
        ]

    def _name_ranks(self) -> np.ndarray:
        """Position of each worker in (instance_id, dp_rank) order, the results' tie-break."""
        n = len(self._worker_list)
        nr = self._nr
        if nr.shape[0] != n:
            keys = [wk.key for wk in self._worker_list]
            nr = np.empty(n, np.int64)
            nr[sorted(range(n), key=keys.__getitem__)] = np.arange(n)
            self._nr = nr
        return nr

    # ------------------------------------------------------------ snapshots

    def export_workers(self, workers: Iterable[tuple[str, int]]) -> bytes:
        """The R-table entries of these workers' ranks (engine hash, key,
        refcount|flags) plus what names them, as one blob for ``import_workers``.

        Layout: ``b"KVWI" | u16 version | u16 0 | u32 header length | msgpack
        header | pad to 8 | u64 engine hashes | u64 keys | u16 metas``; the
        header lists tables as (instance_id, dp_rank, tp_size, tp_rank, medium,
        group, entries, unknown_removes, duplicate_stores) in array order. S is
        not exported: it is derived (one count per entry), and rebuilding it
        costs about what reading it would.
        """
        tables, ehs, keys, metas = [], [], [], []
        for w in sorted({tuple(w) for w in workers}):
            wk = self._workers.get(w)
            if wk is None:
                continue
            # Dict order, not sorted: a parent found in several of a worker's
            # tables resolves to the first one, so order is part of the state.
            for tp_rank, ts in wk.ranks.items():
                for (mid, g), t in ts.items():
                    live = np.flatnonzero(t.meta)
                    tables.append(
                        [
                            w[0],
                            w[1],
                            wk.tp_size,
                            tp_rank,
                            self._media_names[mid],
                            g,
                            int(live.shape[0]),
                            int(t.st[T.ST_UNKNOWN]),
                            int(t.st[T.ST_DUPS]),
                        ]
                    )
                    ehs.append(t.eh[live])
                    keys.append(t.key[live])
                    metas.append(t.meta[live])
        head = msgspec.msgpack.encode({"block_sizes": sorted(self._block_sizes), "tables": tables})
        pad = -(_EXPORT_HEAD.size + len(head)) % 8  # aligned arrays: numba reads them in place
        parts = [_EXPORT_HEAD.pack(_EXPORT_MAGIC, _EXPORT_VERSION, 0, len(head)), head, b"\0" * pad]
        for arrs, dt in ((ehs, np.uint64), (keys, np.uint64), (metas, np.uint16)):
            parts.append((np.concatenate(arrs) if arrs else np.zeros(0, dt)).tobytes())
        return b"".join(parts)

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
        if magic != _EXPORT_MAGIC or version != _EXPORT_VERSION:
            raise ValueError(f"not an index blob of version {_EXPORT_VERSION}")
        try:
            head = msgspec.msgpack.decode(mv[hs : hs + hlen])
            tables = head["tables"]
            block_sizes = [int(b) for b in head["block_sizes"]]
            n = sum(int(t[6]) for t in tables)
        except (msgspec.DecodeError, KeyError, TypeError, IndexError, ValueError) as e:
            raise ValueError(f"index blob header: {e}") from None
        off = hs + hlen + (-(hs + hlen) % 8)
        if len(mv) != off + n * 18:
            raise ValueError(f"index blob is {len(mv)} bytes, expected {off + n * 18}")
        eh_all = np.frombuffer(mv, np.uint64, n, off)
        key_all = np.frombuffer(mv, np.uint64, n, off + 8 * n)
        meta_all = np.frombuffer(mv, np.uint16, n, off + 16 * n)
        self._s_reserve(n)
        self._block_sizes.update(b for b in block_sizes if b > 0)
        i = 0
        for inst, dp, tp_size, tp_rank, medium, g, cnt, unknown, dups in tables:
            t = self._table(WorkerId(str(inst), int(dp), int(tp_rank), int(tp_size)), medium, int(g))
            t.reserve(int(t.st[T.ST_COUNT]) + cnt)
            ok = T.r_import(
                t.eh,
                t.key,
                t.meta,
                t.st,
                self.s_key,
                self.s_meta,
                self.s_st,
                self.rm_wm,
                self.wm_tp,
                self.wm_blocks,
                t.rm,
                eh_all[i : i + cnt],
                key_all[i : i + cnt],
                meta_all[i : i + cnt],
            )
            if not ok:
                raise ValueError(f"index blob: inconsistent entries for {inst}/{dp} rank {tp_rank}")
            t.st[T.ST_UNKNOWN] += unknown
            t.st[T.ST_DUPS] += dups
            i += cnt
        return n

    def digest(self, workers: Iterable[tuple[str, int]] | None = None) -> str:
        """Hex digest of the set of holder-blocks (worker, medium, key): equal
        for two indexes holding the same blocks, whatever their history, table
        capacity or insertion order. ``workers`` restricts it to those."""
        n = self._n_wm
        seeds = np.zeros(max(n, 1), np.uint64)
        only = None if workers is None else {tuple(w) for w in workers}
        for wm in range(n):
            inst, dp = self._worker_list[int(self.wm_worker[wm])].key
            if only is not None and (inst, dp) not in only:
                continue
            name = msgspec.msgpack.encode([inst, dp, self._media_names[int(self.wm_medium[wm])]])
            seeds[wm] = xxhash.xxh3_64_intdigest(name) | 1  # 0 marks an excluded wm
        out = np.zeros(2, np.uint64)
        if n:
            T.digest(self.s_key, self.s_meta, self.rm_wm, self.wm_tp, seeds, out)
        return f"{int(out[0]):016x}{int(out[1]):016x}"

    # ------------------------------------------------------------ stats

    def workers(self) -> dict[tuple[str, int], WorkerStats]:
        out = {}
        for wk in self._worker_list:
            if not wk.ranks:
                continue
            blocks = {}
            for (w, mid), wm in self._wm.items():
                if w == wk.idx and self.wm_blocks[wm]:
                    blocks[self._media_names[mid]] = int(self.wm_blocks[wm])
            st = np.zeros(4, np.int64)
            for tables in wk.ranks.values():
                for t in tables.values():
                    st += t.st
            out[wk.key] = WorkerStats(
                wk.key[0],
                wk.key[1],
                wk.tp_size,
                len(wk.ranks),
                blocks,
                int(st[T.ST_COUNT]),
                int(st[T.ST_ORPHANS]),
                int(st[T.ST_UNKNOWN]),
                int(st[T.ST_DUPS]),
            )
        return out

    def holder_blocks(self) -> dict[tuple[tuple[str, int], str], set[int]]:
        """(worker, medium) -> block keys it holds: for tests and debugging (O(table))."""
        live = np.flatnonzero(self.s_meta)
        keys = self.s_key[live]
        wm = self.rm_wm[(self.s_meta[live].astype(np.int64) >> T.CNT_BITS) - 1]
        counts: dict[tuple[int, int], int] = {}
        for k, m in zip(keys.tolist(), wm.tolist(), strict=False):
            counts[(k, m)] = counts.get((k, m), 0) + 1
        out: dict = {}
        for (k, m), c in counts.items():
            if c >= max(1, int(self.wm_tp[m])):
                wk = self._worker_list[int(self.wm_worker[m])]
                out.setdefault((wk.key, self._media_names[int(self.wm_medium[m])]), set()).add(k)
        return out

    def block_sizes(self) -> list[int]:
        return sorted(self._block_sizes)

    def __len__(self) -> int:
        return int(self.wm_blocks[: self._n_wm].sum())

    def entries(self) -> int:
        """Engine-hash entries over all ranks (what BlockRemoved can address)."""
        return sum(int(t.st[T.ST_COUNT]) for wk in self._worker_list for ts in wk.ranks.values() for t in ts.values())

    def nbytes(self) -> int:
        n = self.s_key.nbytes + self.s_meta.nbytes + self.s_st.nbytes
        n += (
            self.rm_wm.nbytes
            + self.wm_tp.nbytes
            + self.wm_worker.nbytes
            + self.wm_medium.nbytes
            + self.wm_blocks.nbytes
        )
        for wk in self._worker_list:
            for ts in wk.ranks.values():
                for t in ts.values():
                    n += t.nbytes()
        return n


def _rank_key(s: WorkerScore):
    return (-s.score, -s.matched_tokens, s.instance_id, s.dp_rank)


def _merge(a, b):
    return np.maximum(a[0], b[0]), np.maximum(a[1], b[1]), np.maximum(a[2], b[2])


_NO_TOKENS = np.zeros(0, np.uint32)
_NO_CTX = np.zeros(1, np.uint64)
_ROOT_KEYS = np.array([ROOT], np.uint64)
_U0 = np.uint64(0)
_EXPORT_MAGIC = b"KVWI"
_EXPORT_VERSION = 1
_EXPORT_HEAD = struct.Struct("<4sHHI")
_UROOT = np.uint64(ROOT)

__all__ = [
    "DEFAULT_WEIGHTS",
    "IndexOverflow",
    "MalformedEvent",
    "PrefixIndex",
    "WorkerScore",
    "WorkerStats",
    "normalize_medium",
]
