"""Jitted open-addressing tables behind ``PrefixIndex`` (numba, ``cache=True``).

Two kinds of table, both linear probing over parallel numpy arrays, deleted
with backward shift (no tombstones, so a long-lived index never degrades),
sized to any capacity (``fastrange`` instead of a power-of-two mask, so
growing by 1.5x keeps the load between 0.58 and 0.875):

- **S** (one per index), the scoring table: (block key, rm) -> count, where
  ``rm`` is a (rank, medium) pair and the count is how many of that rank's
  engine-hash entries (groups, distinct engine hashes) map to the key. Slots:
  ``s_key`` u64 + ``s_meta`` u32 = ``(rm + 1) << 10 | count`` (0 = empty),
  12 bytes. The home slot depends on the block key only, so every holder of
  a key sits in the probe run that starts at its home: one contiguous scan
  lists a key's holders without a per-key node or pointer.
- **R** (one per rank x medium x group), the removal table: engine hash ->
  (block key, refcount, flags). Slots: ``r_eh`` u64 + ``r_key`` u64 +
  ``r_meta`` u16 = ``refcount | ORPHAN | ENGINE`` (0 = empty), 18 bytes.
  Being per rank, it needs no owner field, ``clear(rank)`` walks only that
  rank's tables, and BlockRemoved lookups never collide across ranks.

A worker x medium (``wm``) holds a key when the number of distinct ranks with
an S entry for (key, its rm) reaches the worker's ``tp_size``; ``wm_blocks``
counts those holder-blocks incrementally. ``wm_tp`` is 0 for a worker with
tp_size 1 and a single rank: then no probe-run scan is needed to count ranks.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from .keys import ENGINE_NS, xxh3_64
from .keys import ROOT as _ROOT

U64 = np.uint64
MAX_LOAD = 0.875
GROW = 1.5
MIN_CAP = 16

REF_MASK = 0x3FFF
ORPHAN = 0x4000
ENGINE = 0x8000
CNT_BITS = 10
CNT_MASK = (1 << CNT_BITS) - 1
MAX_RM = (1 << (32 - CNT_BITS)) - 2

# r_st / s_st slots
ST_COUNT = 0
ST_ORPHANS = 1
ST_UNKNOWN = 2
ST_DUPS = 3

# store() results
OK = 0
NEED_PARENT = 1
OVERFLOW = 2


@njit(cache=True, inline="always")
def _home(x, cap):
    # fmix64 then fastrange: engine hashes in tests are small ints, and keys
    # are xxh3 output, both must spread over any capacity.
    h = x
    h ^= h >> U64(33)
    h *= U64(0xFF51AFD7ED558CCD)
    h ^= h >> U64(33)
    h *= U64(0xC4CEB9FE1A85EC53)
    h ^= h >> U64(33)
    return np.int64(((h >> U64(32)) * U64(cap)) >> U64(32))


def limit(cap: int) -> int:
    return min(int(cap * MAX_LOAD), cap - 1)


def next_cap(need: int, cap: int) -> int:
    while limit(cap) < need:
        cap = max(MIN_CAP, int(cap * GROW) + 1)
    return cap


# ---------------------------------------------------------------- S table


@njit(cache=True)
def _s_run_count(s_key, s_meta, key, wm, rm_wm):
    """Distinct ranks of ``wm`` holding ``key`` (each rm has at most one slot)."""
    cap = s_key.shape[0]
    j = _home(key, cap)
    n = 0
    while s_meta[j] != 0:
        if s_key[j] == key and rm_wm[(np.int64(s_meta[j]) >> CNT_BITS) - 1] == wm:
            n += 1
        j += 1
        if j == cap:
            j = 0
    return n


@njit(cache=True)
def s_inc(s_key, s_meta, s_st, key, rm, rm_wm, wm_tp, wm_blocks):
    cap = s_key.shape[0]
    tag = np.int64(rm + 1)
    j = _home(key, cap)
    while s_meta[j] != 0:
        m = np.int64(s_meta[j])
        if s_key[j] == key and (m >> CNT_BITS) == tag:
            if (m & CNT_MASK) == CNT_MASK:
                return False
            s_meta[j] = np.uint32(m + 1)
            return True
        j += 1
        if j == cap:
            j = 0
    s_key[j] = key
    s_meta[j] = np.uint32((tag << CNT_BITS) | 1)
    s_st[ST_COUNT] += 1
    wm = rm_wm[rm]
    tp = wm_tp[wm]
    if tp == 0 or _s_run_count(s_key, s_meta, key, wm, rm_wm) == tp:
        wm_blocks[wm] += 1
    return True


@njit(cache=True)
def _s_delete(s_key, s_meta, i):
    cap = s_key.shape[0]
    j = i
    while True:
        j += 1
        if j == cap:
            j = 0
        if s_meta[j] == 0:
            break
        h = _home(s_key[j], cap)
        # Move j back to the hole i unless j's home lies cyclically in (i, j].
        if i <= j:
            stay = i < h <= j
        else:
            stay = h > i or h <= j
        if not stay:
            s_key[i] = s_key[j]
            s_meta[i] = s_meta[j]
            i = j
    s_meta[i] = 0
    s_key[i] = 0


@njit(cache=True)
def s_dec(s_key, s_meta, s_st, key, rm, rm_wm, wm_tp, wm_blocks):
    cap = s_key.shape[0]
    tag = np.int64(rm + 1)
    j = _home(key, cap)
    while s_meta[j] != 0:
        m = np.int64(s_meta[j])
        if s_key[j] == key and (m >> CNT_BITS) == tag:
            if (m & CNT_MASK) > 1:
                s_meta[j] = np.uint32(m - 1)
                return
            wm = rm_wm[rm]
            tp = wm_tp[wm]
            if tp == 0 or _s_run_count(s_key, s_meta, key, wm, rm_wm) == tp:
                wm_blocks[wm] -= 1
            _s_delete(s_key, s_meta, j)
            s_st[ST_COUNT] -= 1
            return
        j += 1
        if j == cap:
            j = 0


@njit(cache=True)
def s_rehash(s_key, s_meta, n_key, n_meta):
    cap = n_key.shape[0]
    for i in range(s_key.shape[0]):
        if s_meta[i] != 0:
            j = _home(s_key[i], cap)
            while n_meta[j] != 0:
                j += 1
                if j == cap:
                    j = 0
            n_key[j] = s_key[i]
            n_meta[j] = s_meta[i]


@njit(cache=True)
def recount(s_key, s_meta, rm_wm, wm_tp, wm_blocks):
    """Recompute holder-block counts from scratch (after a worker's tp_size
    changed): each (key, wm) group is counted at its first slot in run order."""
    cap = s_key.shape[0]
    wm_blocks[:] = 0
    for i in range(cap):
        if s_meta[i] == 0:
            continue
        key = s_key[i]
        wm = rm_wm[(np.int64(s_meta[i]) >> CNT_BITS) - 1]
        j = _home(key, cap)
        first = True
        while j != i:
            if s_meta[j] != 0 and s_key[j] == key and rm_wm[(np.int64(s_meta[j]) >> CNT_BITS) - 1] == wm:
                first = False
                break
            j += 1
            if j == cap:
                j = 0
        if first and _s_run_count(s_key, s_meta, key, wm, rm_wm) >= max(wm_tp[wm], 1):
            wm_blocks[wm] += 1


# ---------------------------------------------------------------- R tables


@njit(cache=True)
def r_find(r_eh, r_meta, eh):
    cap = r_eh.shape[0]
    j = _home(eh, cap)
    while r_meta[j] != 0:
        if r_eh[j] == eh:
            return j
        j += 1
        if j == cap:
            j = 0
    return -1


@njit(cache=True)
def _r_delete(r_eh, r_key, r_meta, i):
    cap = r_eh.shape[0]
    j = i
    while True:
        j += 1
        if j == cap:
            j = 0
        if r_meta[j] == 0:
            break
        h = _home(r_eh[j], cap)
        if i <= j:
            stay = i < h <= j
        else:
            stay = h > i or h <= j
        if not stay:
            r_eh[i] = r_eh[j]
            r_key[i] = r_key[j]
            r_meta[i] = r_meta[j]
            i = j
    r_meta[i] = 0


@njit(cache=True)
def r_rehash(r_eh, r_key, r_meta, n_eh, n_key, n_meta):
    cap = n_eh.shape[0]
    for i in range(r_eh.shape[0]):
        if r_meta[i] != 0:
            j = _home(r_eh[i], cap)
            while n_meta[j] != 0:
                j += 1
                if j == cap:
                    j = 0
            n_eh[j] = r_eh[i]
            n_key[j] = r_key[i]
            n_meta[j] = r_meta[i]


@njit(cache=True)
def r_lookup(r_eh, r_key, r_meta, eh, out):
    """out = (key, meta) of ``eh``; returns whether it was found."""
    j = r_find(r_eh, r_meta, eh)
    if j < 0:
        return False
    out[0] = r_key[j]
    out[1] = U64(r_meta[j])
    return True


@njit(cache=True)
def store(
    r_eh,
    r_key,
    r_meta,
    r_st,
    s_key,
    s_meta,
    s_st,
    rm_wm,
    wm_tp,
    wm_blocks,
    rm,
    ehs,
    tok,
    bs,
    ctx,
    has_parent,
    parent_eh,
    parent_key,
    orphan,
):
    """Apply one BlockStored to a rank x medium x group table.

    ``bs == 0`` is engine-hash mode (keys = engine hashes in their namespace).
    With ``has_parent`` the parent engine hash is looked up in this table
    first; NEED_PARENT asks the caller to resolve it elsewhere (nothing has
    been changed yet). Capacity for len(ehs) new slots is the caller's job.
    """
    n = ehs.shape[0]
    flags = 0
    key = U64(parent_key)
    if bs == 0:
        flags = ENGINE
    else:
        if has_parent:
            j = r_find(r_eh, r_meta, U64(parent_eh))
            if j < 0 or (r_meta[j] & ENGINE) != 0:
                return NEED_PARENT
            key = r_key[j]
            if (r_meta[j] & ORPHAN) != 0:
                orphan = True
        if orphan:
            flags = ORPHAN
    W = np.empty(25, dtype=np.uint64)
    per_block = ctx.shape[0] > 1
    cap = r_eh.shape[0]
    status = OK
    for i in range(n):
        eh = ehs[i]
        if bs == 0:
            key = eh ^ U64(ENGINE_NS)
        else:
            c = ctx[i] if per_block else ctx[0]
            key = xxh3_64(tok, i * bs, bs * 4, key ^ c, W)
        j = _home(eh, cap)
        found = False
        while r_meta[j] != 0:
            if r_eh[j] == eh:
                found = True
                break
            j += 1
            if j == cap:
                j = 0
        if found:
            # vLLM can hold one hash in several physical blocks: count it, keep
            # the first key (a removal needs only the count to reach zero).
            m = np.int64(r_meta[j])
            if (m & REF_MASK) == REF_MASK:
                status = OVERFLOW
                continue
            r_meta[j] = np.uint16(m + 1)
            r_st[ST_DUPS] += 1
            continue
        if not s_inc(s_key, s_meta, s_st, key, rm, rm_wm, wm_tp, wm_blocks):
            status = OVERFLOW
            continue
        r_eh[j] = eh
        r_key[j] = key
        r_meta[j] = np.uint16(flags | 1)
        r_st[ST_COUNT] += 1
        if flags == ORPHAN:
            r_st[ST_ORPHANS] += 1
    return status


# apply_run ops columns and flags
OP_KIND, OP_BLK, OP_N, OP_BS, OP_TOK, OP_FLAGS = 0, 1, 2, 3, 4, 5
OP_COLS = 6
KIND_STORE, KIND_REMOVE = 0, 1
F_PARENT, F_BLKCTX = 1, 2
# apply_run ctl slots
CTL_RM, CTL_START, CTL_RESOLVED, CTL_ORPHAN, CTL_STATUS, CTL_EVENT = 0, 1, 2, 3, 4, 5


@njit(cache=True)
def apply_run(
    r_eh,
    r_key,
    r_meta,
    r_st,
    s_key,
    s_meta,
    s_st,
    rm_wm,
    wm_tp,
    wm_blocks,
    ops,
    evu,
    ehs,
    tok,
    blk_ctx,
    ctl,
):
    """Apply consecutive BlockStored/BlockRemoved events of one rank x medium x
    group table in one call (the per-call cost of a kernel with this many
    array arguments is several microseconds: paying it once per record, not
    once per event, is most of the apply rate).

    ``ops[e]`` = (kind, first block in ``ehs``/``blk_ctx``, blocks, block
    size, first token in ``tok``, flags); ``evu[e]`` = (context seed, parent
    engine hash). Events run from ``ctl[CTL_START]``. A parent not in this
    table stops the run with ``ctl[CTL_STATUS] = NEED_PARENT`` at
    ``ctl[CTL_EVENT]`` (nothing of that event applied): the caller resolves it,
    writes the parent's key into ``evu[e, 1]``, sets CTL_RESOLVED/CTL_ORPHAN
    and CTL_START = e, and calls again. An event that hits a count ceiling is
    finished and the run stops with OVERFLOW, as a sequence of ``store``
    calls would stop at the one that raised. Capacity is the caller's job.
    """
    rm = ctl[CTL_RM]
    W = np.empty(25, dtype=np.uint64)
    cap = r_eh.shape[0]
    ctl[CTL_STATUS] = OK
    for e in range(ctl[CTL_START], ops.shape[0]):
        off = ops[e, OP_BLK]
        n = ops[e, OP_N]
        if ops[e, OP_KIND] == KIND_REMOVE:
            for i in range(off, off + n):
                j = r_find(r_eh, r_meta, ehs[i])
                if j < 0:
                    r_st[ST_UNKNOWN] += 1
                    continue
                m = np.int64(r_meta[j])
                if (m & REF_MASK) > 1:
                    r_meta[j] = np.uint16(m - 1)
                    continue
                s_dec(s_key, s_meta, s_st, r_key[j], rm, rm_wm, wm_tp, wm_blocks)
                if (m & ORPHAN) != 0:
                    r_st[ST_ORPHANS] -= 1
                r_st[ST_COUNT] -= 1
                _r_delete(r_eh, r_key, r_meta, j)
            continue
        bs = ops[e, OP_BS]
        fl = ops[e, OP_FLAGS]
        flags = 0
        key = U64(_ROOT)
        if bs == 0:
            flags = ENGINE
        elif (fl & F_PARENT) != 0:
            if e == ctl[CTL_START] and ctl[CTL_RESOLVED] != 0:
                key = evu[e, 1]
                if ctl[CTL_ORPHAN] != 0:
                    flags = ORPHAN
            else:
                j = r_find(r_eh, r_meta, evu[e, 1])
                if j < 0 or (r_meta[j] & ENGINE) != 0:
                    ctl[CTL_STATUS] = NEED_PARENT
                    ctl[CTL_EVENT] = e
                    return
                key = r_key[j]
                if (r_meta[j] & ORPHAN) != 0:
                    flags = ORPHAN
        per_block = (fl & F_BLKCTX) != 0
        c = evu[e, 0]
        toff = ops[e, OP_TOK]
        over = False
        for i in range(n):
            eh = ehs[off + i]
            if bs == 0:
                key = eh ^ U64(ENGINE_NS)
            else:
                if per_block:
                    c = blk_ctx[off + i]
                key = xxh3_64(tok, toff + i * bs, bs * 4, key ^ c, W)
            j = _home(eh, cap)
            found = False
            while r_meta[j] != 0:
                if r_eh[j] == eh:
                    found = True
                    break
                j += 1
                if j == cap:
                    j = 0
            if found:
                m = np.int64(r_meta[j])
                if (m & REF_MASK) == REF_MASK:
                    over = True
                    continue
                r_meta[j] = np.uint16(m + 1)
                r_st[ST_DUPS] += 1
                continue
            if not s_inc(s_key, s_meta, s_st, key, rm, rm_wm, wm_tp, wm_blocks):
                over = True
                continue
            r_eh[j] = eh
            r_key[j] = key
            r_meta[j] = np.uint16(flags | 1)
            r_st[ST_COUNT] += 1
            if flags == ORPHAN:
                r_st[ST_ORPHANS] += 1
        if over:
            ctl[CTL_STATUS] = OVERFLOW
            ctl[CTL_EVENT] = e
            return


@njit(cache=True)
def remove(r_eh, r_key, r_meta, r_st, s_key, s_meta, s_st, rm_wm, wm_tp, wm_blocks, rm, ehs):
    for i in range(ehs.shape[0]):
        j = r_find(r_eh, r_meta, ehs[i])
        if j < 0:
            r_st[ST_UNKNOWN] += 1
            continue
        m = np.int64(r_meta[j])
        if (m & REF_MASK) > 1:
            r_meta[j] = np.uint16(m - 1)
            continue
        s_dec(s_key, s_meta, s_st, r_key[j], rm, rm_wm, wm_tp, wm_blocks)
        if (m & ORPHAN) != 0:
            r_st[ST_ORPHANS] -= 1
        r_st[ST_COUNT] -= 1
        _r_delete(r_eh, r_key, r_meta, j)


@njit(cache=True)
def clear(r_key, r_meta, s_key, s_meta, s_st, rm_wm, wm_tp, wm_blocks, rm):
    """Drop every entry of one R table from S; the caller replaces the R table."""
    for i in range(r_meta.shape[0]):
        if r_meta[i] != 0:
            s_dec(s_key, s_meta, s_st, r_key[i], rm, rm_wm, wm_tp, wm_blocks)


# ---------------------------------------------------------------- scoring


@njit(cache=True)
def score(
    tok,
    bs,
    n,
    ctx,
    keys,
    s_key,
    s_meta,
    rm_wm,
    wm_tp,
    wm_worker,
    wm_medium,
    weights,
    wmask,
    run_w,
    score_w,
    run_wm,
):
    """Longest consecutive held prefix per worker and per worker x medium.

    Keys are hashed lazily (``bs > 0``) or taken from ``keys`` (engine-hash
    mode) and the walk stops at the first block no eligible worker holds.
    run_w[w] / run_wm[wm]: matched blocks; score_w[w]: sum over matched blocks
    of the best medium weight holding each block (callers scale by tokens).
    """
    cap = s_key.shape[0]
    n_wm = run_wm.shape[0]
    n_w = run_w.shape[0]
    cnt = np.zeros(n_wm, dtype=np.int32)
    touched = np.empty(n_wm, dtype=np.int64)
    bestw = np.full(n_w, -1.0)
    wtouched = np.empty(n_w, dtype=np.int64)
    W = np.empty(25, dtype=np.uint64)
    per_block = ctx.shape[0] > 1
    key = U64(0)
    for i in range(n):
        if bs > 0:
            c = ctx[i] if per_block else ctx[0]
            key = xxh3_64(tok, i * bs, bs * 4, (key if i > 0 else U64(keys[0])) ^ c, W)
        else:
            key = keys[i]
        nt = 0
        j = _home(key, cap)
        while s_meta[j] != 0:
            if s_key[j] == key:
                wm = rm_wm[(np.int64(s_meta[j]) >> CNT_BITS) - 1]
                w = wm_worker[wm]
                if wmask[w] and run_w[w] == i:
                    if cnt[wm] == 0:
                        touched[nt] = wm
                        nt += 1
                    cnt[wm] += 1
            j += 1
            if j == cap:
                j = 0
        nw = 0
        for t in range(nt):
            wm = touched[t]
            if cnt[wm] >= wm_tp[wm]:
                if run_wm[wm] == i:
                    run_wm[wm] = i + 1
                w = wm_worker[wm]
                if bestw[w] < 0.0:
                    wtouched[nw] = w
                    nw += 1
                wt = weights[wm_medium[wm]]
                if wt > bestw[w]:
                    bestw[w] = wt
            cnt[wm] = 0
        for t in range(nw):
            w = wtouched[t]
            run_w[w] = i + 1
            score_w[w] += bestw[w]
            bestw[w] = -1.0
        if nw == 0:
            break


# ---------------------------------------------------------------- snapshots, digest


@njit(cache=True)
def r_import(
    r_eh,
    r_key,
    r_meta,
    r_st,
    s_key,
    s_meta,
    s_st,
    rm_wm,
    wm_tp,
    wm_blocks,
    rm,
    ehs,
    keys,
    metas,
):
    """Re-insert exported entries of one R table (refcounts and flags kept) and
    count each once in S, as ``store`` would have. Capacity is the caller's job.
    Returns False on a duplicate engine hash or an S count ceiling: the blob is
    not one ``export`` wrote, and the caller must not trust what was applied."""
    cap = r_eh.shape[0]
    for i in range(ehs.shape[0]):
        eh = ehs[i]
        j = _home(eh, cap)
        while r_meta[j] != 0:
            if r_eh[j] == eh:
                return False
            j += 1
            if j == cap:
                j = 0
        m = metas[i]
        if (m & REF_MASK) == 0:
            return False
        if not s_inc(s_key, s_meta, s_st, keys[i], rm, rm_wm, wm_tp, wm_blocks):
            return False
        r_eh[j] = eh
        r_key[j] = keys[i]
        r_meta[j] = m
        r_st[ST_COUNT] += 1
        if (m & ORPHAN) != 0:
            r_st[ST_ORPHANS] += 1
    return True


@njit(cache=True)
def digest(s_key, s_meta, rm_wm, wm_tp, wm_seed, out):
    """out = (sum mod 2^64 of xxh3(key, seed = wm_seed[wm]), count) over the
    holder-blocks (key, wm). Each (key, wm) is taken at its first slot in run
    order, as in ``recount``, so the result depends only on the set of
    holder-blocks, not on slot positions, capacity or insertion order."""
    cap = s_key.shape[0]
    W = np.empty(25, dtype=np.uint64)
    buf = np.empty(2, dtype=np.uint32)
    total = U64(0)
    n = 0
    for i in range(cap):
        if s_meta[i] == 0:
            continue
        key = s_key[i]
        wm = rm_wm[(np.int64(s_meta[i]) >> CNT_BITS) - 1]
        if wm_seed[wm] == U64(0):
            continue  # a (worker, medium) the caller excluded
        j = _home(key, cap)
        first = True
        while j != i:
            if s_meta[j] != 0 and s_key[j] == key and rm_wm[(np.int64(s_meta[j]) >> CNT_BITS) - 1] == wm:
                first = False
                break
            j += 1
            if j == cap:
                j = 0
        if first and _s_run_count(s_key, s_meta, key, wm, rm_wm) >= max(wm_tp[wm], 1):
            buf[0] = np.uint32(key & U64(0xFFFFFFFF))
            buf[1] = np.uint32(key >> U64(32))
            total += xxh3_64(buf, 0, 8, wm_seed[wm], W)
            n += 1
    out[0] = total
    out[1] = U64(n)
