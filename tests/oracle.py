"""Brute-force reference model of ``kvwire.consumer.index.PrefixIndex``.

Plain dicts, no incremental counters: every answer is recomputed from the raw
per-(rank, medium, group) engine-hash entries, so it is slow and obviously
right. Block keys are chained here with the ``xxhash`` package, one call per
block, and the Python reference of the key rules (``keys_oracle.py``), independently
of the Rust core (``kvwire._core``). The medium names are the core's own rule
(``_core.normalize_medium``): the oracle models the index, not how media are spelt.

Semantics mirrored (see consumer/index.py's docstring): refcounted duplicate
stores that keep their first key, unknown removals counted, TP aggregation
(a worker holds a key on a medium when >= tp_size of its ranks do), parent
resolution order (own table, this rank's other tables, then the worker's other
ranks, in creation order; engine-hash entries skipped; then the worker's memo of
removed engine hashes), orphans, engine-hash mode, several block sizes, weighted
scores.

The memo: an engine hash names its whole prefix, so the key it was last stored
under stays its key once it is removed. Per worker, the last ``PARENT_MEMO``
engine hashes whose last reference a BlockRemoved took (engine-hash entries
not), first in first out (an update keeps its place); a parent found in no
table is looked up there before it makes an orphan. Clears and ``drop_rank``
keep it, ``drop_worker`` forgets it (snapshots, which carry it, are the
index's business: the oracle has none).

Hybrid models (several KV-cache groups, ``group_idx`` with vLLM's
``kv_cache_spec_kind``/``kv_cache_spec_sliding_window``): a worker with more
than one group, or a sparse one, is scored group by group. A usable prefix of
L tokens needs every full-attention group (or group of unknown kind) to hold
all blocks before L, a sliding-window group the ``cdiv(window - 1, block_size)``
blocks before L, a Mamba group the block before L (vLLM's hybrid coordinator).
Written here as a search over every candidate L.
"""

from __future__ import annotations

import msgspec
import xxhash
from keys_oracle import ENGINE_NS, ROOT, block_context, chain_step, context_seed, engine_hash_u64, orphan_root

from kvwire._core import PARENT_MEMO, DeadKind, DeadRecord, Poll, Tally, Verdict, normalize_medium
from kvwire.consumer.index import DEFAULT_WEIGHTS, MalformedEvent, WorkerScore, WorkerStats
from kvwire.schemas import codec

M64 = (1 << 64) - 1


def chain(tokens, bs: int, parent: int, lora_name=None, extra_keys=None, n: int | None = None) -> list[int]:
    n = len(tokens) // bs if n is None else n
    base = context_seed(lora_name)
    keys, key = [], parent
    for i in range(n):
        ctx = block_context(base, extra_keys[i], lora_name) if extra_keys is not None and i < len(extra_keys) else base
        data = b"".join(int(t).to_bytes(4, "little") for t in tokens[i * bs : (i + 1) * bs])
        key = chain_step(key, xxhash.xxh3_64_intdigest(data, seed=ctx))
        keys.append(key)
    return keys


def reach_of(kind, window, bs):
    """Blocks a group needs before a prefix's end; None: all of them."""
    if kind in ("sliding_window", "sliding_window_mla"):
        return max(1, -(-(window - 1) // bs)) if window and window > 0 and bs > 0 else None
    return 1 if kind == "mamba" else None


def _weighted(served) -> float:
    """A score from (weight, tokens) pairs: tokens x weight summed highest weight first, equal
    weights merged, so that a prefix's score is one float however its blocks were counted."""
    by: dict[float, int] = {}
    for t, n in served:
        by[t] = by.get(t, 0) + n
    score = 0.0
    for t in sorted(by, reverse=True):
        score += by[t] * t
    return score


def _lcm(a: int, b: int) -> int:
    from math import gcd

    return a // gcd(a, b) * b


class _Entry:
    __slots__ = ("engine", "key", "orphan", "ref")

    def __init__(self, key, orphan, engine):
        self.key, self.ref, self.orphan, self.engine = key, 1, orphan, engine


class Oracle:
    """The model, as ``kvwire.consumer.index.Index``: an ``Applier(index=Oracle())`` feeds it
    records the way it feeds the core, fenced by the same (Rust) ``RankTable``."""

    def __init__(self, weights=None, default_weight: float = 0.5):
        self.weights = dict(DEFAULT_WEIGHTS if weights is None else weights)
        self.default_weight = default_weight
        self.tp: dict[tuple, int] = {}
        # worker -> tp_rank -> (medium, group) -> {engine hash u64: _Entry}
        self.ranks: dict[tuple, dict[int, dict[tuple, dict[int, _Entry]]]] = {}
        # counters per (worker, tp_rank, medium, group); survive clear, not drop
        self.unknown: dict[tuple, int] = {}
        self.dups: dict[tuple, int] = {}
        self.block_sizes: set[int] = set()
        # worker -> group -> reach (None: every block); learned from token-keyed stores
        self.groups: dict[tuple, dict[int, int | None]] = {}
        # worker -> {removed engine hash: (key, orphan)}, oldest first (dicts keep insertion order)
        self.memo: dict[tuple, dict[int, tuple[int, bool]]] = {}

    def _tables(self, rank, medium, group):
        w = rank.worker
        self.tp[w] = max(1, rank.tp_size)
        t = self.ranks.setdefault(w, {}).setdefault(rank.tp_rank, {})
        k = (normalize_medium(medium), 0 if group is None else int(group))
        return t.setdefault(k, {}), (w, rank.tp_rank) + k

    @staticmethod
    def _shape(ev) -> tuple[bool, bool]:
        """(engine-hash mode, sparse) of a store; MalformedEvent when its tokens do not cover its blocks."""
        n = len(ev.block_hashes)
        engine = ev.block_size <= 0 or len(ev.token_ids) == 0
        nt = len(ev.token_ids)
        sparse = not engine and nt != ev.block_size * n and nt % ev.block_size == 0 and nt // ev.block_size > n
        if n and not engine and nt != ev.block_size * n and not sparse:
            raise MalformedEvent("token count")
        return engine, sparse

    def store(self, rank, ev) -> None:
        n = len(ev.block_hashes)
        if n == 0:
            return
        engine, sparse = self._shape(ev)
        if not engine:
            self.block_sizes.add(ev.block_size)
            gs = self.groups.setdefault(rank.worker, {})
            g = 0 if ev.group_idx is None else int(ev.group_idx)
            if ev.kv_cache_spec_kind is not None:
                gs[g] = reach_of(ev.kv_cache_spec_kind, ev.kv_cache_spec_sliding_window, ev.block_size)
            else:
                gs.setdefault(g, None)
        table, cid = self._tables(rank, ev.medium, ev.group_idx)
        ehs = [engine_hash_u64(h) for h in ev.block_hashes]
        if engine:
            keys, orphan = [h ^ ENGINE_NS for h in ehs], False
        elif sparse:
            # which covered blocks the hashes are is not in the event: orphans, never matched
            keys, orphan = [orphan_root(h) for h in ehs], True
        else:
            parent, orphan = ROOT, False
            if ev.parent_block_hash is not None:
                parent, orphan = self._parent(rank, table, engine_hash_u64(ev.parent_block_hash))
            keys = chain(list(ev.token_ids), ev.block_size, parent, ev.lora_name, ev.extra_keys, n)
        for eh, key in zip(ehs, keys, strict=False):
            e = table.get(eh)
            if e is not None:
                e.ref += 1
                self.dups[cid] = self.dups.get(cid, 0) + 1
            else:
                table[eh] = _Entry(key, orphan, engine)

    def _parent(self, rank, own, peh):
        e = own.get(peh)
        if e is not None and not e.engine:
            return e.key, e.orphan
        ranks = self.ranks[rank.worker]
        order = [rank.tp_rank] + [r for r in ranks if r != rank.tp_rank]
        for r in order:
            for t in ranks.get(r, {}).values():
                if t is own:
                    continue
                e = t.get(peh)
                if e is not None and not e.engine:
                    return e.key, e.orphan
        gone = self.memo.get(rank.worker, {}).get(peh)
        if gone is not None:
            return gone
        return orphan_root(peh), True

    def apply_poll(self, ranks, records, start, budget_us, now_us, schema_ids=None):
        """``Index.apply_poll`` over the model: the reference decoder (a record it cannot decode
        is declined, so the Applier's own reference path dead-letters it), the model's
        malformed-store rule before the fence, the core's fence (``ranks``), then the model.
        Without ceilings it never overflows; it ignores the budget."""
        from kvwire.schemas.events import AllBlocksCleared, BlockStored

        t = dict(records=0, duplicates=0, stale=0, gaps=0, resets=0, blocks=0, events=0, max_lag_us=None)
        dead, seen = [], []
        for i in range(start, len(records)):
            r = records[i]
            try:
                batch = codec.decode(r if isinstance(r, bytes) else r.value)
            except codec.DecodeError:
                return Poll(next=i, declined=True, tally=Tally(**t), dead=dead, seen=seen)
            try:
                for ev in batch.events:
                    if isinstance(ev, BlockStored):
                        self._shape(ev)
            except MalformedEvent as e:
                dead.append(DeadRecord(i, DeadKind.MALFORMED, str(e)))
                continue
            rank = batch.worker
            verdict = ranks.admit(batch)
            t["records"] += 1
            if verdict in (Verdict.DUPLICATE, Verdict.STALE_EPOCH):
                t["duplicates" if verdict == Verdict.DUPLICATE else "stale"] += 1
                continue
            t["gaps"] += batch.gap
            if verdict == Verdict.RESET:
                t["resets"] += 1
                self.clear(rank)
            t["blocks"] += self.apply_batch(rank, batch.events)
            t["events"] += len(batch.events)
            if any(type(e) is AllBlocksCleared for e in batch.events):
                ranks.core.state_known(rank.instance_id, rank.dp_rank, rank.tp_rank)
            lag = now_us - batch.ts_us
            t["max_lag_us"] = lag if t["max_lag_us"] is None else max(t["max_lag_us"], lag)
            if rank.worker not in seen:
                seen.append(rank.worker)
        return Poll(next=len(records), declined=False, tally=Tally(**t), dead=dead, seen=seen)

    def apply_batch(self, rank, events, atomic: bool = False) -> int:
        """PrefixIndex.apply_batch's contract, one event at a time (with ``atomic``, a malformed
        store anywhere applies nothing)."""
        from kvwire.schemas.events import AllBlocksCleared, BlockRemoved, BlockStored

        if atomic:
            for ev in events:
                if isinstance(ev, BlockStored):
                    self._shape(ev)
        blocks = 0
        for ev in events:
            if isinstance(ev, BlockStored):
                self.store(rank, ev)
                blocks += len(ev.block_hashes)
            elif isinstance(ev, BlockRemoved):
                self.remove(rank, ev)
                blocks += len(ev.block_hashes)
            elif isinstance(ev, AllBlocksCleared):
                self.clear(rank)
        return blocks

    def remove(self, rank, ev) -> None:
        if not ev.block_hashes:
            return
        table, cid = self._tables(rank, ev.medium, ev.group_idx)
        for h in ev.block_hashes:
            eh = engine_hash_u64(h)
            e = table.get(eh)
            if e is None:
                self.unknown[cid] = self.unknown.get(cid, 0) + 1
            elif e.ref > 1:
                e.ref -= 1
            else:
                del table[eh]
                if not e.engine:
                    memo = self.memo.setdefault(rank.worker, {})
                    memo[eh] = (e.key, e.orphan)
                    if len(memo) > PARENT_MEMO:
                        del memo[next(iter(memo))]

    def clear(self, rank) -> None:
        for t in self.ranks.get(rank.worker, {}).get(rank.tp_rank, {}).values():
            t.clear()

    def drop_rank(self, rank) -> None:
        ranks = self.ranks.get(rank.worker)
        if ranks is not None and ranks.pop(rank.tp_rank, None) is not None:
            self._forget(lambda c: c[:2] == (rank.worker, rank.tp_rank))

    def drop_worker(self, worker) -> None:
        w = worker.worker if hasattr(worker, "worker") else tuple(worker)
        self.memo.pop(w, None)
        if w in self.ranks:
            self.ranks[w] = {}
            self._forget(lambda c: c[0] == w)

    def _forget(self, pred):
        for d in (self.unknown, self.dups):
            for c in [c for c in d if pred(c)]:
                del d[c]

    # ---------------------------------------------------------------- derived state

    def group_holders(self) -> dict[tuple, set[int]]:
        """(worker, medium, group) -> keys held by >= tp_size ranks (groups never mix)."""
        out = {}
        for w, ranks in self.ranks.items():
            per: dict[tuple, dict[int, set]] = {}
            for r, tables in ranks.items():
                for (m, g), entries in tables.items():
                    for e in entries.values():
                        per.setdefault((m, g), {}).setdefault(e.key, set()).add(r)
            for (m, g), keys in per.items():
                held = {k for k, rs in keys.items() if len(rs) >= self.tp[w]}
                if held:
                    out[(w, m, g)] = held
        return out

    def holders(self) -> dict[tuple, set[int]]:
        """(worker, medium) -> keys held, over the worker's groups."""
        out: dict[tuple, set[int]] = {}
        for (w, m, _g), keys in self.group_holders().items():
            out.setdefault((w, m), set()).update(keys)
        return out

    def holder_blocks(self) -> dict[tuple, set[int]]:
        return {k: set(v) for k, v in self.holders().items()}

    def __len__(self) -> int:
        return sum(len(v) for v in self.group_holders().values())

    def workers(self) -> dict[tuple, WorkerStats]:
        ghold = self.group_holders()
        out = {}
        for w, ranks in self.ranks.items():
            if not ranks:
                continue
            entries = [e for tables in ranks.values() for t in tables.values() for e in t.values()]
            cids = [(w, r) + k for r, tables in ranks.items() for k in tables]
            out[w] = WorkerStats(
                w[0],
                w[1],
                self.tp[w],
                len(ranks),
                {
                    m: sum(len(k) for (ww, mm, _g), k in ghold.items() if ww == w and mm == m)
                    for m in {mm for (ww, mm, _g) in ghold if ww == w}
                },
                len(entries),
                sum(e.orphan for e in entries),
                sum(self.unknown.get(c, 0) for c in cids),
                sum(self.dups.get(c, 0) for c in cids),
            )
        return out

    def score(
        self,
        token_ids,
        lora_name=None,
        block_size=None,
        weights=None,
        workers=None,
        extra_keys=None,
        top_k=None,
        exclude=None,
    ):
        sizes = [block_size] if block_size else sorted(self.block_sizes)
        toks = list(token_ids)
        per_bs = [(bs, chain(toks, bs, ROOT, lora_name, extra_keys)) for bs in sizes]
        out = self._score(per_bs, weights, workers)
        if exclude is not None:
            ex = {tuple(w) for w in exclude}
            out = [s for s in out if (s.instance_id, s.dp_rank) not in ex]
        return out if top_k is None else out[:top_k]

    def score_trusted_json(self, ranks, token_ids, lora_name=None, block_size=None, top_k=None, extra_keys=None):
        scores = self.score(
            token_ids, lora_name, block_size, extra_keys=extra_keys, top_k=top_k, exclude=ranks.untrusted_workers()
        )
        return self._trusted_json(ranks, scores)

    def score_trusted_keys_json(self, ranks, keys, block_size=None, top_k=None):
        sizes = [block_size] if block_size else sorted(self.block_sizes)
        ks = [int(k) for k in keys]
        untrusted = {tuple(w) for w in ranks.untrusted_workers()}
        scores = [
            s
            for s in self._score([(bs, ks) for bs in sizes], None, None)
            if (s.instance_id, s.dp_rank) not in untrusted
        ]
        return self._trusted_json(ranks, scores if top_k is None else scores[:top_k])

    @staticmethod
    def _trusted_json(ranks, scores):
        approx = ranks.approximate_workers()
        out = [
            msgspec.structs.replace(s, approximate=True) if (s.instance_id, s.dp_rank) in approx else s for s in scores
        ]
        return msgspec.json.encode(out)

    def score_engine_hashes(self, hashes, block_size=1, weights=None, workers=None):
        return self._score([(block_size, [engine_hash_u64(h) ^ ENGINE_NS for h in hashes])], weights, workers)

    def _score(self, per_bs, weights, workers):
        wts = {**self.weights, **(weights or {})}
        hold = self.holders()
        allowed = None if workers is None else {tuple(w) for w in workers}
        out = []
        for w in self.ranks:
            if allowed is not None and w not in allowed:
                continue
            gs = self.groups.get(w, {})
            if len(gs) > 1 or any(r is not None for r in gs.values()):
                got = self._score_grouped(w, per_bs, wts)
                if got is not None:
                    out.append(got)
                continue
            media = [m for (ww, m) in hold if ww == w]
            best_run, best_score, best_by = 0, 0.0, {}
            for bs, keys in per_bs:
                run = 0
                served: dict[float, int] = {}  # the best weight of each matched block -> its tokens
                by = {m: 0 for m in media}
                alive = set(media)
                for k in keys:
                    on = [m for m in media if k in hold[(w, m)]]
                    if not on:
                        break
                    run += 1
                    t = max(wts.get(m, self.default_weight) for m in on)
                    served[t] = served.get(t, 0) + bs
                    for m in list(alive):
                        if m in on:
                            by[m] += 1
                        else:
                            alive.discard(m)
                best_run = max(best_run, run * bs)
                best_score = max(best_score, _weighted(served.items()))
                for m, v in by.items():
                    if v:
                        best_by[m] = max(best_by.get(m, 0), v * bs)
            if best_run:
                out.append(WorkerScore(w[0], w[1], best_run, best_by, best_score))
        out.sort(key=lambda s: (-s.score, -s.matched_tokens, s.instance_id, s.dp_rank))
        return out

    def _score_grouped(self, w, per_bs, wts):
        ghold = self.group_holders()
        media = sorted({m for tables in self.ranks[w].values() for (m, _g) in tables})
        groups = []  # (block size, keys, reach, {medium: held keys})
        for g, reach in self.groups[w].items():
            by_m = {m: ghold.get((w, m, g), set()) for m in media}
            counts = [sum(any(k in h for h in by_m.values()) for k in keys) for _bs, keys in per_bs]
            if not counts or max(counts) == 0:
                return None  # a group holding nothing of the prompt: nothing usable
            bs, keys = per_bs[counts.index(max(counts))]
            groups.append((bs, keys, reach, by_m))

        def usable(ok_media) -> int:
            step, top = 1, None
            for bs, keys, _r, _h in groups:
                step = _lcm(step, bs)
                top = len(keys) * bs if top is None else min(top, len(keys) * bs)
            best = 0
            for L in range(0, top + 1, step):
                fits = True
                for bs, keys, reach, by_m in groups:
                    nb = L // bs
                    need = range(nb) if reach is None else range(max(0, nb - reach), nb)
                    if not all(any(keys[i] in by_m[m] for m in ok_media) for i in need):
                        fits = False
                        break
                if fits:
                    best = L
            return best

        served, prev = [], 0
        for t in sorted({wts.get(m, self.default_weight) for m in media}, reverse=True):
            L = usable([m for m in media if wts.get(m, self.default_weight) >= t])
            served.append((t, max(0, L - prev)))
            prev = max(prev, L)
        score = _weighted(served)
        if prev == 0:
            return None
        by = {m: v for m in media if (v := usable([m]))}
        return WorkerScore(w[0], w[1], prev, by, score)


# ---------------------------------------------------------------- fencing and trust


class FenceOracle:
    """Reference model of the ingest's fencing and trust (``rank_state`` docstring),
    written from the definition instead of as a state machine: per rank it keeps
    the records admitted in the current epoch and recomputes trust from them.

    A rank is trusted when its view since the last point its full state was
    known is complete. Such a point is a reset record (known unless the reset
    itself reports a gap) or an applied record holding an AllBlocksCleared (the
    rank then holds nothing, whatever gap that record carries: the gap happened
    before the clear). After it, every admitted record must follow by one seq,
    carry no gap and have been applied. A worker is trusted when all its
    ``tp_size`` ranks are known and trusted.

    ``feed`` also drives an ``Oracle`` index with the records it admits, so a
    test can compare both the trust and the blocks with the real pipeline."""

    def __init__(self, retired_epochs: int = 32):
        self.retired_epochs = retired_epochs
        self.index = Oracle()
        self.epochs: dict[tuple, list[int]] = {}  # rank -> epochs in arrival order (last = current)
        self.history: dict[tuple, list[dict]] = {}  # rank -> admitted records of the current epoch
        self.tp: dict[tuple, int] = {}

    def feed(self, batch, applied: bool = True) -> str:
        """One record in log order; ``applied=False`` models a record fenced but
        then refused whole (a refcount overflow). Returns the verdict's value."""
        from kvwire.schemas.events import AllBlocksCleared

        w = batch.worker
        r = w.rank
        self.tp[w.worker] = w.tp_size
        eps = self.epochs.setdefault(r, [])
        hist = self.history.setdefault(r, [])
        if not eps or batch.epoch != eps[-1]:
            if batch.epoch in eps[:-1][-self.retired_epochs :]:
                return "stale_epoch"
            eps.append(batch.epoch)
            hist.clear()
            verdict = "reset"
        elif batch.seq <= hist[-1]["seq"]:
            return "duplicate"
        else:
            verdict = "reset" if batch.reset else "apply"
        cleared = any(type(e) is AllBlocksCleared for e in batch.events)
        hist.append({"seq": batch.seq, "reset": batch.reset, "gap": batch.gap, "applied": applied, "clear": cleared})
        if applied:
            if verdict == "reset":
                self.index.clear(w)
            self.index.apply_batch(w, batch.events)
        return verdict

    def rank_trusted(self, r) -> bool:
        hist = self.history.get(r, [])
        known = None
        for i, h in enumerate(hist):
            if h["applied"] and h["clear"]:
                known = i
            elif h["reset"]:
                # A reset that owns up to a gap, or was refused, leaves nothing known.
                known = i if h["gap"] == 0 and h["applied"] else None
        if known is None:
            return False
        prev = hist[known]["seq"]
        for h in hist[known + 1 :]:
            if h["seq"] != prev + 1 or h["gap"] or not h["applied"]:
                return False
            prev = h["seq"]
        return True

    def untrusted_workers(self) -> set[tuple[str, int]]:
        workers = {r[:2] for r in self.history}
        out = set()
        for w in workers:
            ranks = [r for r in self.history if r[:2] == w]
            if len(ranks) < self.tp.get(w, 1) or not all(self.rank_trusted(r) for r in ranks):
                out.add(w)
        return out
