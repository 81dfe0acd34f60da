//! The prefix-cache index: which worker holds how many leading tokens of a prompt.
//!
//! The semantics are those of `kvwire/consumer/index.py`'s docstring (the
//! Python wrapper) and `tests/oracle.py` (the executable spec); this module is
//! the one implementation. Registry: workers (instance_id, dp_rank) and media
//! are interned to small ids; `wm` = (worker, medium, KV-cache group), `rm` =
//! (worker, tp rank, medium, group). Tables: see `table.rs`.
//!
//! Writes are whole-or-nothing per call: every change an `apply` makes is
//! logged, and a call that hits a reference-count ceiling rolls the log back
//! before it returns, so a record is never left half applied. (Tables and
//! registry entries the call created stay: they are empty, hold no block, and
//! the record's rank exists anyway once it has been fenced.)

use std::collections::{BTreeSet, HashMap};

use crate::keys::{block_key_le, engine_key, orphan_root, Ctx, CtxCache, ROOT};
use crate::table::{Holders, RTable, STable, ENGINE, MAX_RM, ORPHAN, REF_MASK};

pub struct Rank {
    pub tp_rank: i64,
    pub tables: Vec<RTable>,
}

pub struct Worker {
    pub inst: String,
    pub dp: i64,
    pub tp_size: u32,
    pub ranks: Vec<Rank>,
    pub wms: Vec<u32>,
    /// The KV-cache groups its stores named, with what each needs for a hit.
    pub groups: Vec<GroupSpec>,
    /// Scored group by group (`score_grouped`): several groups, or a sparse one.
    pub grouped: bool,
}

/// What a KV-cache group must hold for a prefix of L blocks to be usable.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Reach {
    /// Every block of the prefix (full attention, MLA, and any kind we do not know).
    Full,
    /// Only the last `n` blocks before the prefix's end (sliding window: the
    /// blocks the window reaches; Mamba: the state block at the end).
    Tail(u32),
}

#[derive(Clone, Copy, Debug)]
pub struct GroupSpec {
    pub group: i64,
    pub reach: Reach,
}

/// A group's reach from vLLM's spec kind (an open set) and window in tokens.
/// vLLM's sliding-window hit needs `cdiv(window - 1, block_size)` contiguous
/// blocks ending at the hit (`SlidingWindowManager._contiguous_blocks_for_hit`);
/// a Mamba hit needs the block at its end. A kind we do not know, or a window
/// we are not told, is read as full attention: it can only under-credit.
pub fn reach_of(kind: &str, window: Option<i64>, bs: i64) -> Reach {
    match kind {
        "sliding_window" | "sliding_window_mla" => match window {
            Some(w) if w > 0 && bs > 0 => Reach::Tail(((w - 1 + bs - 1) / bs).max(1) as u32),
            _ => Reach::Full,
        },
        "mamba" => Reach::Tail(1),
        _ => Reach::Full,
    }
}

/// A rank as events name it.
#[derive(Clone, Copy)]
pub struct RankId<'a> {
    pub inst: &'a str,
    pub dp: i64,
    pub tp_rank: i64,
    pub tp_size: i64,
}

/// A BlockStored event's fields.
#[derive(Clone, Copy)]
pub struct Store<'a> {
    pub medium: Option<&'a str>,
    pub group: i64,
    pub ehs: &'a [u64],
    /// Token ids as little-endian u32 bytes (the wire form).
    pub tokens: &'a [u8],
    pub bs: i64,
    pub parent: Option<u64>,
    pub lora: Option<&'a str>,
    /// Per-block contexts when extra keys are present (else derived from bs, lora).
    pub blk_ctx: Option<&'a [u64]>,
    /// vLLM's `kv_cache_spec_kind` and `kv_cache_spec_sliding_window` of the group.
    pub kind: Option<&'a str>,
    pub window: Option<i64>,
}

/// One exported table of a rank, as `Index::import_table` installs it.
#[derive(Clone, Copy)]
pub struct TableBlob<'a> {
    pub medium: &'a str,
    pub group: i64,
    /// Per entry: engine hash, block key and refcount|flags.
    pub ehs: &'a [u64],
    pub keys: &'a [u64],
    pub metas: &'a [u16],
    pub unknown: i64,
    pub dups: i64,
}

/// What the general score walk fills per worker and per wm; `walk_one_medium` fills it too.
struct Runs<'r> {
    run_w: &'r mut [u32],
    score_w: &'r mut [f64],
    run_wm: &'r mut [u32],
    cnt: &'r mut [u32],
}

/// One event, borrowed from a decoded record or from Python objects.
pub enum Ev<'a> {
    Store(Store<'a>),
    Remove { medium: Option<&'a str>, group: i64, ehs: &'a [u64] },
    Clear,
}

#[derive(Debug, PartialEq)]
pub enum ApplyError {
    /// Event `.0`'s token ids do not cover its blocks.
    Malformed(usize, String),
    /// A reference count hit its ceiling; nothing of the call was applied.
    Overflow,
}

type Loc = (u32, usize, usize);

enum Undo {
    Insert(Loc, u64),
    Inc(Loc, u64),
    Dec(Loc, u64),
    Delete(Loc, u64, u64, u16),
    Unknown(Loc),
    Clear(Loc, Box<RTable>),
    BlockSize(i64),
    Groups(u32, Vec<GroupSpec>, bool),
}

/// The weight that marks a medium as not counted by a score (`score`'s tier views).
pub const EXCLUDED: f64 = -1.0;

pub fn normalize_medium(m: Option<&str>) -> std::borrow::Cow<'_, str> {
    match m {
        None => "GPU".into(),
        Some(s) => {
            let u = s.to_uppercase();
            if u == "GPU" || u == "CPU" || u == "STORAGE" {
                u.into()
            } else {
                s.into()
            }
        }
    }
}

#[derive(Clone, Copy, PartialEq, Debug)]
enum Shape {
    /// One block of `bs` tokens per hash.
    Dense,
    /// The tokens cover more whole blocks than there are hashes: vLLM's
    /// `cache_full_blocks` skips a sparse group's null or masked blocks (sliding
    /// window, Mamba) in `block_hashes` but not in `token_ids`.
    Sparse,
}

fn lcm(a: i64, b: i64) -> i64 {
    let (mut x, mut y) = (a, b);
    while y != 0 {
        (x, y) = (y, x % y);
    }
    a / x * b
}

/// Whether a worker is scored group by group: the plain walk credits a block
/// held by any group, right only for a worker with one full-attention group.
fn is_grouped(groups: &[GroupSpec]) -> bool {
    groups.len() > 1 || groups.iter().any(|g| g.reach != Reach::Full)
}

/// How a store's `tokens` cover its `n` hashes of `bs` tokens (None: malformed).
fn store_shape(tokens: usize, bs: i64, n: usize) -> Option<Shape> {
    let bs = bs as usize;
    if tokens == bs * n {
        Some(Shape::Dense)
    } else if tokens % bs == 0 && tokens / bs > n {
        Some(Shape::Sparse)
    } else {
        None
    }
}

/// Per-worker statistics (`WorkerStats` in Python).
pub struct Stats {
    pub inst: String,
    pub dp: i64,
    pub tp_size: u32,
    pub ranks: usize,
    pub blocks: Vec<(String, i64)>,
    pub entries: i64,
    pub orphans: i64,
    pub unknown: i64,
    pub dups: i64,
}

/// Where a query's block keys come from.
pub enum Query<'a> {
    /// Token ids hashed lazily in `bs`-token blocks under `ctx`.
    Tokens { tokens: &'a [u8], bs: usize, ctx: Ctx<'a> },
    /// Precomputed keys, each worth `scale` tokens.
    Keys { keys: &'a [u64], scale: i64 },
}

/// How many blocks ahead of the walk a query's keys are computed and their
/// table slots prefetched: enough to cover a memory miss at the walk's
/// per-block pace, few enough that a miss query hashes only a handful extra.
const AHEAD: usize = 8;
const RING: usize = 16;

/// A query's block keys in walk order, each computed `AHEAD` blocks before the
/// walk reads it, with its S slots prefetched then.
struct KeysAhead<'a, 'q> {
    q: &'a Query<'q>,
    n: usize,
    ring: [u64; RING],
    done: usize,
    last: u64,
}

impl<'a, 'q> KeysAhead<'a, 'q> {
    fn new(q: &'a Query<'q>, n: usize) -> Self {
        KeysAhead { q, n, ring: [0; RING], done: 0, last: ROOT }
    }

    /// Key of block `i`; blocks are asked for in order, 0, 1, 2, ...
    #[inline]
    fn at(&mut self, i: usize, s: &STable) -> u64 {
        let until = self.n.min(i + AHEAD + 1);
        while self.done < until {
            let b = self.done;
            let key = match self.q {
                Query::Tokens { tokens, bs, ctx } => {
                    block_key_le(&tokens[b * bs * 4..(b + 1) * bs * 4], self.last, ctx.at(b))
                }
                Query::Keys { keys, .. } => keys[b],
            };
            self.last = key;
            self.ring[b % RING] = key;
            s.prefetch(key);
            self.done += 1;
        }
        self.ring[i % RING]
    }
}

/// Scores as arrays, best first: worker ids, matched tokens, weighted score,
/// and per result a slice `by_off[i]..by_off[i+1]` of (medium id, tokens).
#[derive(Default, Debug)]
pub struct Scores {
    pub worker: Vec<u32>,
    pub matched: Vec<i64>,
    pub score: Vec<f64>,
    pub by_off: Vec<u32>,
    pub by_medium: Vec<u32>,
    pub by_tokens: Vec<i64>,
}

#[derive(Default)]
pub struct Index {
    pub workers: Vec<Worker>,
    worker_ids: HashMap<String, Vec<(i64, u32)>>,
    pub media: Vec<String>,
    media_ids: HashMap<String, u32>,
    raw_media: HashMap<String, u32>,
    wm_ids: HashMap<(u32, u32, i64), u32>,
    pub wm_worker: Vec<u32>,
    pub wm_medium: Vec<u32>,
    /// wm -> its KV-cache group: a wm is (worker, medium, group), so that one
    /// group's blocks never stand in for another's.
    pub wm_group: Vec<i64>,
    rm_ids: HashMap<(u32, i64, u32, i64), u32>,
    /// rm -> its worker (the score walk's one lookup per holder slot).
    rm_w: Vec<u32>,
    pub hd: Holders,
    pub s: STable,
    pub block_sizes: BTreeSet<i64>,
    ctx: CtxCache,
    undo: Vec<Undo>,
    name_rank: Vec<u32>,
    scratch: Vec<u64>,
}

impl Index {
    pub fn new() -> Self {
        Self::default()
    }

    // ------------------------------------------------------------ registry

    pub fn worker_id(&self, inst: &str, dp: i64) -> Option<u32> {
        self.worker_ids.get(inst)?.iter().find(|(d, _)| *d == dp).map(|(_, w)| *w)
    }

    fn worker(&mut self, inst: &str, dp: i64, tp: u32) -> u32 {
        if let Some(w) = self.worker_id(inst, dp) {
            if self.workers[w as usize].tp_size != tp {
                // Ranks disagree on the TP degree: the latest word wins, and
                // every holder count of the worker is recomputed under it.
                self.workers[w as usize].tp_size = tp;
                self.sync_tp(w);
                self.recount();
            }
            return w;
        }
        let w = self.workers.len() as u32;
        // The name order is kept current here (O(workers) per new worker) because `score`
        // only reads and would otherwise sort on every call.
        let p = self.workers.iter().filter(|x| (x.inst.as_str(), x.dp) < (inst, dp)).count() as u32;
        if self.name_rank.len() == self.workers.len() {
            for r in self.name_rank.iter_mut() {
                if *r >= p {
                    *r += 1;
                }
            }
            self.name_rank.push(p);
        } else {
            self.name_rank.clear();
        }
        self.workers.push(Worker {
            inst: inst.to_owned(),
            dp,
            tp_size: tp,
            ranks: vec![],
            wms: vec![],
            groups: vec![],
            grouped: false,
        });
        self.worker_ids.entry(inst.to_owned()).or_default().push((dp, w));
        w
    }

    pub fn medium_id(&mut self, raw: Option<&str>) -> u32 {
        if let Some(r) = raw {
            if let Some(&m) = self.raw_media.get(r) {
                return m;
            }
        }
        let name = normalize_medium(raw).into_owned();
        let m = match self.media_ids.get(&name) {
            Some(&m) => m,
            None => {
                let m = self.media.len() as u32;
                self.media.push(name.clone());
                self.media_ids.insert(name, m);
                m
            }
        };
        if let Some(r) = raw {
            if self.raw_media.len() < 4096 {
                self.raw_media.insert(r.to_owned(), m);
            }
        }
        m
    }

    fn sync_tp(&mut self, w: u32) {
        let wk = &self.workers[w as usize];
        let tp = if wk.tp_size == 1 && wk.ranks.len() <= 1 { 0 } else { wk.tp_size };
        for &wm in &wk.wms {
            self.hd.wm_tp[wm as usize] = tp;
        }
    }

    fn recount(&mut self) {
        let mut blocks = vec![0i64; self.hd.wm_blocks.len()];
        let tps = &self.hd.wm_tp;
        self.s.for_each_key_wm(&self.hd, |_, wm, n| {
            if n >= tps[wm as usize].max(1) {
                blocks[wm as usize] += 1;
            }
        });
        self.hd.wm_blocks = blocks;
        // Holders changed under the new TP degree: holder sets re-form from the slots.
        self.s.drop_holder_sets();
    }

    fn table(&mut self, rank: &RankId, medium: Option<&str>, group: i64) -> Result<Loc, ApplyError> {
        let tp = rank.tp_size.max(1) as u32;
        let w = self.worker(rank.inst, rank.dp, tp);
        let mid = self.medium_id(medium);
        let wk = &mut self.workers[w as usize];
        let r = match wk.ranks.iter().position(|r| r.tp_rank == rank.tp_rank) {
            Some(r) => r,
            None => {
                wk.ranks.push(Rank { tp_rank: rank.tp_rank, tables: vec![] });
                wk.ranks.len() - 1
            }
        };
        if let Some(t) = wk.ranks[r].tables.iter().position(|t| t.medium == mid && t.group == group) {
            return Ok((w, r, t));
        }
        let wm = match self.wm_ids.get(&(w, mid, group)) {
            Some(&wm) => wm,
            None => {
                let wm = self.wm_worker.len() as u32;
                self.wm_ids.insert((w, mid, group), wm);
                self.wm_worker.push(w);
                self.wm_medium.push(mid);
                self.wm_group.push(group);
                self.hd.wm_tp.push(1);
                self.hd.wm_blocks.push(0);
                self.workers[w as usize].wms.push(wm);
                wm
            }
        };
        let rm = match self.rm_ids.get(&(w, rank.tp_rank, mid, group)) {
            Some(&rm) => rm,
            None => {
                let rm = self.hd.rm_wm.len() as u32;
                if rm > MAX_RM {
                    return Err(ApplyError::Overflow);
                }
                self.rm_ids.insert((w, rank.tp_rank, mid, group), rm);
                self.hd.rm_wm.push(wm);
                self.rm_w.push(w);
                rm
            }
        };
        let tables = &mut self.workers[w as usize].ranks[r].tables;
        tables.push(RTable::new(rm, mid, group));
        let t = tables.len() - 1;
        self.sync_tp(w);
        Ok((w, r, t))
    }

    #[inline]
    fn tab(&mut self, l: Loc) -> &mut RTable {
        &mut self.workers[l.0 as usize].ranks[l.1].tables[l.2]
    }

    // ------------------------------------------------------------ writes

    /// Check that every event of a record can be applied (token counts).
    pub fn validate(events: &[Ev]) -> Result<(), ApplyError> {
        for (e, ev) in events.iter().enumerate() {
            if let Ev::Store(Store { ehs, tokens, bs, .. }) = ev {
                if *bs > 0 && !tokens.is_empty() && store_shape(tokens.len() / 4, *bs, ehs.len()).is_none() {
                    return Err(ApplyError::Malformed(
                        e,
                        format!(
                            "BlockStored with {} hashes of block_size {} carries {} token ids",
                            ehs.len(),
                            bs,
                            tokens.len() / 4
                        ),
                    ));
                }
            }
        }
        Ok(())
    }

    /// Apply one rank's events in order; returns the blocks the store and
    /// remove events named. With `atomic`, a malformed event anywhere applies
    /// nothing; without, the events before it stay applied (the Python
    /// `apply_batch` contract). An overflow always applies nothing.
    pub fn apply(&mut self, rank: &RankId, events: &[Ev], atomic: bool) -> Result<u64, ApplyError> {
        if atomic {
            Self::validate(events)?;
        }
        self.undo.clear();
        let mut blocks = 0u64;
        for (e, ev) in events.iter().enumerate() {
            let r = match ev {
                Ev::Store(st) => {
                    let (ehs, tokens, bs) = (st.ehs, st.tokens, st.bs);
                    let n = ehs.len();
                    if n == 0 {
                        continue;
                    }
                    let engine = bs <= 0 || tokens.is_empty();
                    let shape = if engine { Some(Shape::Dense) } else { store_shape(tokens.len() / 4, bs, n) };
                    let Some(shape) = shape else {
                        self.undo.clear();
                        return Err(ApplyError::Malformed(
                            e,
                            format!("{} token ids for {} blocks of {}", tokens.len() / 4, n, bs),
                        ));
                    };
                    blocks += n as u64;
                    self.store(rank, &Store { bs: if engine { 0 } else { bs }, ..*st }, shape == Shape::Sparse)
                }
                Ev::Remove { medium, group, ehs } => {
                    if ehs.is_empty() {
                        continue;
                    }
                    blocks += ehs.len() as u64;
                    self.remove(rank, *medium, *group, ehs)
                }
                Ev::Clear => {
                    self.clear_rank(rank.inst, rank.dp, rank.tp_rank, true);
                    Ok(())
                }
            };
            if let Err(err) = r {
                self.rollback();
                return Err(err);
            }
        }
        self.undo.clear();
        Ok(blocks)
    }

    fn store(&mut self, rank: &RankId, st: &Store, sparse: bool) -> Result<(), ApplyError> {
        let Store { medium, group, ehs, tokens, bs, parent, lora, blk_ctx, kind, window } = *st;
        let l = self.table(rank, medium, group)?;
        let mut flags = 0u16;
        let mut keys = std::mem::take(&mut self.scratch);
        keys.clear();
        if bs > 0 {
            self.learn_group(l.0, group, bs, kind, window);
            if self.block_sizes.insert(bs) {
                self.undo.push(Undo::BlockSize(bs));
            }
        }
        if bs == 0 {
            flags = ENGINE;
            keys.extend(ehs.iter().map(|&h| engine_key(h)));
        } else if sparse {
            // Which of the covered blocks these hashes are is not in the event: kept for
            // removals and counted as orphans, never matched by a query.
            flags = ORPHAN;
            keys.extend(ehs.iter().map(|&h| orphan_root(h)));
        } else {
            let mut pkey = ROOT;
            if let Some(peh) = parent {
                let (k, orphan) = self.resolve_parent(l, peh);
                pkey = k;
                if orphan {
                    flags = ORPHAN;
                }
            }
            let ctx = match blk_ctx {
                Some(c) if c.len() > 1 => Ctx::PerBlock(c),
                Some(c) => Ctx::One(c[0]),
                None => Ctx::One(self.ctx.get(lora)),
            };
            crate::keys::chain(tokens, bs as usize, ehs.len(), pkey, ctx, &mut keys);
        }
        let rm = self.tab(l).rm;
        let mut over = false;
        for (i, &eh) in ehs.iter().enumerate() {
            let key = keys[i];
            let t = &mut self.workers[l.0 as usize].ranks[l.1].tables[l.2];
            if let Some(m) = t.meta_mut(eh) {
                // vLLM can hold one hash in several physical blocks: count
                // it, keep the first key (a removal needs only the count).
                if *m & REF_MASK == REF_MASK {
                    over = true;
                    break;
                }
                *m += 1;
                t.dups += 1;
                self.undo.push(Undo::Inc(l, eh));
                continue;
            }
            if !self.s.inc(key, rm, &mut self.hd) {
                over = true;
                break;
            }
            self.workers[l.0 as usize].ranks[l.1].tables[l.2].insert(eh, key, flags | 1);
            self.undo.push(Undo::Insert(l, eh));
        }
        self.scratch = keys;
        if over {
            Err(ApplyError::Overflow)
        } else {
            Ok(())
        }
    }

    /// Record what a store says about its group: that it exists and, when the
    /// event carries it, its kind. Logged, so a refused record teaches nothing.
    fn learn_group(&mut self, w: u32, group: i64, bs: i64, kind: Option<&str>, window: Option<i64>) {
        let wk = &mut self.workers[w as usize];
        let reach = kind.map(|k| reach_of(k, window, bs));
        let pos = wk.groups.iter().position(|g| g.group == group);
        if let Some(p) = pos {
            if reach.is_none_or(|r| r == wk.groups[p].reach) {
                return;
            }
        }
        self.undo.push(Undo::Groups(w, wk.groups.clone(), wk.grouped));
        match pos {
            Some(p) => wk.groups[p].reach = reach.expect("changed"),
            None => wk.groups.push(GroupSpec { group, reach: reach.unwrap_or(Reach::Full) }),
        }
        wk.grouped = is_grouped(&wk.groups);
    }

    fn resolve_parent(&self, own: Loc, peh: u64) -> (u64, bool) {
        let wk = &self.workers[own.0 as usize];
        if let Some((k, m)) = wk.ranks[own.1].tables[own.2].get(peh) {
            if m & ENGINE == 0 {
                return (k, m & ORPHAN != 0);
            }
        }
        let order = std::iter::once(own.1).chain((0..wk.ranks.len()).filter(|&r| r != own.1));
        for r in order {
            for (ti, t) in wk.ranks[r].tables.iter().enumerate() {
                if r == own.1 && ti == own.2 {
                    continue;
                }
                if let Some((k, m)) = t.get(peh) {
                    if m & ENGINE == 0 {
                        return (k, m & ORPHAN != 0);
                    }
                }
            }
        }
        (orphan_root(peh), true)
    }

    fn remove(&mut self, rank: &RankId, medium: Option<&str>, group: i64, ehs: &[u64]) -> Result<(), ApplyError> {
        let l = self.table(rank, medium, group)?;
        for &eh in ehs {
            let t = &mut self.workers[l.0 as usize].ranks[l.1].tables[l.2];
            match t.meta_mut(eh) {
                None => {
                    t.unknown += 1;
                    self.undo.push(Undo::Unknown(l));
                }
                Some(m) if *m & REF_MASK > 1 => {
                    *m -= 1;
                    self.undo.push(Undo::Dec(l, eh));
                }
                Some(_) => {
                    let rm = t.rm;
                    let (key, meta) = t.remove(eh).expect("present");
                    self.s.dec(key, rm, &mut self.hd);
                    self.undo.push(Undo::Delete(l, eh, key, meta));
                }
            }
        }
        Ok(())
    }

    fn clear_table(&mut self, l: Loc, log: bool) {
        let t = &mut self.workers[l.0 as usize].ranks[l.1].tables[l.2];
        if t.count == 0 {
            return;
        }
        let mut fresh = RTable::new(t.rm, t.medium, t.group);
        fresh.unknown = t.unknown;
        fresh.dups = t.dups;
        let old = std::mem::replace(t, fresh);
        for (_, key, _) in old.entries() {
            self.s.dec(key, old.rm, &mut self.hd);
        }
        if log {
            self.undo.push(Undo::Clear(l, Box::new(old)));
        }
    }

    fn rank_pos(&self, inst: &str, dp: i64, tp_rank: i64) -> Option<(u32, usize)> {
        let w = self.worker_id(inst, dp)?;
        let r = self.workers[w as usize].ranks.iter().position(|r| r.tp_rank == tp_rank)?;
        Some((w, r))
    }

    /// AllBlocksCleared: O(that rank's entries), counters kept.
    pub fn clear_rank(&mut self, inst: &str, dp: i64, tp_rank: i64, log: bool) {
        if let Some((w, r)) = self.rank_pos(inst, dp, tp_rank) {
            for t in 0..self.workers[w as usize].ranks[r].tables.len() {
                self.clear_table((w, r, t), log);
            }
        }
    }

    /// Forget a rank entirely (expiry): its blocks and its counters.
    pub fn drop_rank(&mut self, inst: &str, dp: i64, tp_rank: i64) {
        if let Some((w, r)) = self.rank_pos(inst, dp, tp_rank) {
            self.clear_rank(inst, dp, tp_rank, false);
            self.workers[w as usize].ranks.remove(r);
            self.sync_tp(w);
        }
    }

    /// Forget every rank of a worker (partition revoked, worker gone).
    pub fn drop_worker(&mut self, inst: &str, dp: i64) {
        if let Some(w) = self.worker_id(inst, dp) {
            for r in 0..self.workers[w as usize].ranks.len() {
                for t in 0..self.workers[w as usize].ranks[r].tables.len() {
                    self.clear_table((w, r, t), false);
                }
            }
            self.workers[w as usize].ranks.clear();
            self.sync_tp(w);
        }
    }

    fn rollback(&mut self) {
        while let Some(u) = self.undo.pop() {
            match u {
                Undo::Insert(l, eh) => {
                    let t = self.tab(l);
                    let rm = t.rm;
                    let (key, _) = t.remove(eh).expect("inserted");
                    self.s.dec(key, rm, &mut self.hd);
                }
                Undo::Inc(l, eh) => {
                    let t = self.tab(l);
                    *t.meta_mut(eh).expect("present") -= 1;
                    t.dups -= 1;
                }
                Undo::Dec(l, eh) => {
                    *self.tab(l).meta_mut(eh).expect("present") += 1;
                }
                Undo::Delete(l, eh, key, meta) => {
                    let rm = self.tab(l).rm;
                    let ok = self.s.inc(key, rm, &mut self.hd);
                    debug_assert!(ok);
                    self.tab(l).insert(eh, key, meta);
                }
                Undo::Unknown(l) => self.tab(l).unknown -= 1,
                Undo::Clear(l, old) => {
                    for (_, key, _) in old.entries() {
                        let ok = self.s.inc(key, old.rm, &mut self.hd);
                        debug_assert!(ok);
                    }
                    *self.tab(l) = *old;
                }
                Undo::BlockSize(bs) => {
                    self.block_sizes.remove(&bs);
                }
                Undo::Groups(w, g, grouped) => {
                    let wk = &mut self.workers[w as usize];
                    wk.groups = g;
                    wk.grouped = grouped;
                }
            }
        }
    }

    // ------------------------------------------------------------ queries

    /// Each worker id's rank in (instance_id, dp_rank) order: the score's last tie-break.
    fn name_order(&self) -> Vec<u32> {
        let mut order: Vec<u32> = (0..self.workers.len() as u32).collect();
        order.sort_by(|&a, &b| {
            let (x, y) = (&self.workers[a as usize], &self.workers[b as usize]);
            (x.inst.as_str(), x.dp).cmp(&(y.inst.as_str(), y.dp))
        });
        let mut nr = vec![0u32; order.len()];
        for (i, &w) in order.iter().enumerate() {
            nr[w as usize] = i as u32;
        }
        nr
    }

    /// Weights per medium id from a (name -> weight) lookup.
    pub fn weight_array(&self, f: impl Fn(&str) -> f64) -> Vec<f64> {
        self.media.iter().map(|m| f(m)).collect()
    }

    /// Longest held prefix per worker over every query (max per field across
    /// queries, i.e. block sizes), ordered best first, at most `top_k`.
    /// `mask[w]` false excludes worker w.
    /// Reads only (`&self`): scores run without the GIL beside each other (py_index.rs `Shared`).
    pub fn score(&self, queries: &[Query], weights: &[f64], mask: Option<&[bool]>, top_k: Option<usize>) -> Scores {
        let nw = self.workers.len();
        let nwm = self.wm_worker.len();
        let mut out = Scores::default();
        out.by_off.push(0);
        if nw == 0 || self.s.count == 0 {
            return out;
        }
        let mut best_run = vec![0i64; nw];
        let mut best_score = vec![0f64; nw];
        let mut best_wm = vec![0i64; nwm];
        let mut run_w = vec![0u32; nw];
        let mut score_w = vec![0f64; nw];
        let mut run_wm = vec![0u32; nwm];
        let mut cnt = vec![0u32; nwm];
        let mut bestw = vec![-1f64; nw];
        let mut touched: Vec<u32> = Vec::with_capacity(64);
        // One flag per worker whatever the mask's length (unchecked reads below rely on it).
        let mut ok = vec![true; nw];
        if let Some(m) = mask {
            for (o, &k) in ok.iter_mut().zip(m) {
                *o = k;
            }
        }
        // Grouped workers (hybrid models) are scored group by group, after the walk.
        let mut grouped: Vec<u32> = vec![];
        for (w, wk) in self.workers.iter().enumerate() {
            if wk.grouped && ok[w] {
                grouped.push(w as u32);
                ok[w] = false;
            }
        }
        // Media a tier view leaves out (weight EXCLUDED): their copies hold nothing here.
        let excluding = weights.iter().any(|&w| w < 0.0);
        let wm_ok: Vec<bool> =
            if excluding { self.wm_medium.iter().map(|&m| weights[m as usize] >= 0.0).collect() } else { vec![] };
        let mut wtouched: Vec<u32> = Vec::with_capacity(64);
        let mut hit_any = false;
        for q in queries {
            let (n, scale) = match q {
                Query::Tokens { tokens, bs, .. } => (tokens.len() / 4 / bs, *bs as i64),
                Query::Keys { keys, scale } => (keys.len(), *scale),
            };
            if n == 0 {
                continue;
            }
            let mut reached = 0usize;
            if self.media.len() == 1 {
                let out = Runs { run_w: &mut run_w, score_w: &mut score_w, run_wm: &mut run_wm, cnt: &mut cnt };
                reached = self.walk_one_medium(q, n, &ok, weights, out);
            }
            let mut ks = KeysAhead::new(q, n);
            for i in 0..if self.media.len() == 1 { 0 } else { n } {
                let key = ks.at(i, &self.s);
                touched.clear();
                wtouched.clear();
                let iu = i as u32;
                let hs = self.s.multi.get(&key);
                if let Some(bits) = hs {
                    // A hot key: its holder set says which wms hold it (TP counted already).
                    for (wi, &word) in bits.iter().enumerate() {
                        let mut b = word;
                        while b != 0 {
                            let wmu = wi * 64 + b.trailing_zeros() as usize;
                            b &= b - 1;
                            let w = self.wm_worker[wmu] as usize;
                            if run_w[w] != iu || !ok[w] || (excluding && !wm_ok[wmu]) {
                                continue;
                            }
                            if run_wm[wmu] == iu {
                                run_wm[wmu] = iu + 1;
                            }
                            if bestw[w] < 0.0 {
                                wtouched.push(w as u32);
                            }
                            let wt = weights[self.wm_medium[wmu] as usize];
                            if wt > bestw[w] {
                                bestw[w] = wt;
                            }
                        }
                    }
                }
                let rm_wm = &self.hd.rm_wm;
                let rm_w = &self.rm_w;
                let hot = hs.is_some();
                // SAFETY: rm ids in S index rm_wm / rm_w; wm ids index cnt; worker ids index run_w / ok.
                if !hot {
                    self.s.holders_fast(key, |rm| unsafe {
                        let w = *rm_w.get_unchecked(rm) as usize;
                        if *run_w.get_unchecked(w) == iu
                            && *ok.get_unchecked(w)
                            && (!excluding || wm_ok[*rm_wm.get_unchecked(rm) as usize])
                        {
                            let wm = *rm_wm.get_unchecked(rm);
                            let c = cnt.get_unchecked_mut(wm as usize);
                            if *c == 0 {
                                touched.push(wm);
                            }
                            *c += 1;
                        }
                    });
                }
                for &wm in &touched {
                    let wmu = wm as usize;
                    if cnt[wmu] >= self.hd.wm_tp[wmu] {
                        if run_wm[wmu] as usize == i {
                            run_wm[wmu] = i as u32 + 1;
                        }
                        let w = self.wm_worker[wmu] as usize;
                        if bestw[w] < 0.0 {
                            wtouched.push(w as u32);
                        }
                        let wt = weights[self.wm_medium[wmu] as usize];
                        if wt > bestw[w] {
                            bestw[w] = wt;
                        }
                    }
                    cnt[wmu] = 0;
                }
                for &w in &wtouched {
                    let w = w as usize;
                    run_w[w] = i as u32 + 1;
                    score_w[w] += bestw[w];
                    bestw[w] = -1.0;
                }
                if wtouched.is_empty() {
                    break;
                }
                reached = i + 1;
            }
            if reached == 0 {
                continue;
            }
            hit_any = true;
            for w in 0..nw {
                if run_w[w] > 0 {
                    best_run[w] = best_run[w].max(run_w[w] as i64 * scale);
                    best_score[w] = best_score[w].max(score_w[w] * scale as f64);
                    run_w[w] = 0;
                    score_w[w] = 0.0;
                }
            }
            for wm in 0..nwm {
                if run_wm[wm] > 0 {
                    best_wm[wm] = best_wm[wm].max(run_wm[wm] as i64 * scale);
                    run_wm[wm] = 0;
                }
            }
        }
        if !grouped.is_empty()
            && self.score_grouped(queries, weights, &grouped, &mut best_run, &mut best_score, &mut best_wm)
        {
            hit_any = true;
        }
        if !hit_any {
            return out;
        }
        let mut hits: Vec<u32> = (0..nw as u32).filter(|&w| best_run[w as usize] > 0).collect();
        let stale;
        let nr: &[u32] = if self.name_rank.len() == self.workers.len() {
            &self.name_rank
        } else {
            stale = self.name_order();
            &stale
        };
        let cmp = |a: &u32, b: &u32| {
            let (a, b) = (*a as usize, *b as usize);
            best_score[b]
                .partial_cmp(&best_score[a])
                .unwrap_or(std::cmp::Ordering::Equal)
                .then(best_run[b].cmp(&best_run[a]))
                .then(nr[a].cmp(&nr[b]))
        };
        if let Some(k) = top_k {
            if k < hits.len() {
                if k == 0 {
                    hits.clear();
                } else {
                    hits.select_nth_unstable_by(k - 1, cmp);
                    hits.truncate(k);
                }
            }
        }
        hits.sort_unstable_by(cmp);
        for &w in &hits {
            let wu = w as usize;
            out.worker.push(w);
            out.matched.push(best_run[wu]);
            out.score.push(best_score[wu]);
            for &wm in &self.workers[wu].wms {
                if best_wm[wm as usize] > 0 {
                    out.by_medium.push(self.wm_medium[wm as usize]);
                    out.by_tokens.push(best_wm[wm as usize]);
                }
            }
            out.by_off.push(out.by_medium.len() as u32);
        }
        out
    }

    /// Scores of grouped workers (several KV-cache groups, or a sparse one). A
    /// worker's usable prefix is the longest L (tokens, a multiple of every
    /// group's block size) that every group can serve: a `Full` group holds
    /// all blocks before L, a `Tail(n)` group the n blocks before L (vLLM's
    /// hybrid coordinator: `find_longest_cache_hit` per group, reconciled to
    /// one length). A block counts for a group when any medium holds it for
    /// that group (all TP ranks). `by_medium` is the same with one medium's
    /// blocks; `score` gives each token of the prefix the best weight w such
    /// that the media weighing >= w alone serve it. Fills the best_* arrays;
    /// returns whether any worker matched.
    fn score_grouped(
        &self,
        queries: &[Query],
        weights: &[f64],
        ws: &[u32],
        best_run: &mut [i64],
        best_score: &mut [f64],
        best_wm: &mut [i64],
    ) -> bool {
        const NONE: u32 = u32::MAX;
        let early = self.block_sizes.len() == 1;
        let kept;
        let ws = if early && queries.len() == 1 {
            kept = self.holding_first_block(&queries[0], ws);
            &kept[..]
        } else {
            ws
        };
        if ws.is_empty() {
            return false;
        }
        let mut slot = vec![NONE; self.wm_worker.len()];
        let mut wms: Vec<u32> = vec![];
        // Full-attention (worker, group) pairs: a slot's pair (NONE: not full attention) and,
        // per worker, its pairs. With one block size, a worker whose full groups stopped
        // holding the prompt cannot use anything past that block: the probe ends once every
        // worker has (those without a full group keep it going).
        let mut pair = vec![NONE; 0];
        let mut pairs_of: Vec<std::ops::Range<usize>> = Vec::with_capacity(ws.len());
        let mut npairs = 0usize;
        for &w in ws {
            let wk = &self.workers[w as usize];
            let first = npairs;
            for g in wk.groups.iter().filter(|g| g.reach == Reach::Full) {
                for &wm in &wk.wms {
                    if self.wm_group[wm as usize] == g.group {
                        slot[wm as usize] = wms.len() as u32;
                        wms.push(wm);
                        pair.push(npairs as u32);
                    }
                }
                npairs += 1;
            }
            pairs_of.push(first..npairs);
            for &wm in &wk.wms {
                if slot[wm as usize] == NONE {
                    slot[wm as usize] = wms.len() as u32;
                    wms.push(wm);
                    pair.push(NONE);
                }
            }
        }
        // Per query: (block size, blocks, words per slot, held bits of every slot).
        let mut per_q: Vec<(i64, usize, usize, Vec<u64>)> = Vec::with_capacity(queries.len());
        let mut cnt = vec![0u32; wms.len()];
        let mut lit = vec![false; wms.len()]; // the slot holds some block of the prompt
        let mut touched: Vec<u32> = Vec::with_capacity(16);
        let rm_wm = &self.hd.rm_wm;
        for q in queries {
            let (n, scale) = match q {
                Query::Tokens { tokens, bs, .. } => (tokens.len() / 4 / bs, *bs as i64),
                Query::Keys { keys, scale } => (keys.len(), *scale),
            };
            let words = n.div_ceil(64);
            let mut bits = vec![0u64; words * wms.len()];
            let mut key = ROOT;
            // Workers still probing (index into ws), their wms as a bitset, and each full
            // pair's leading run.
            let mut alive: Vec<usize> = (0..ws.len()).collect();
            let mut live = vec![0u64; self.wm_worker.len().div_ceil(64)];
            for &wm in &wms {
                if weights[self.wm_medium[wm as usize] as usize] >= 0.0 {
                    live[wm as usize >> 6] |= 1 << (wm & 63);
                }
            }
            let mut run = vec![0u32; npairs];
            for i in 0..n {
                if early && alive.is_empty() {
                    break;
                }
                key = match q {
                    Query::Tokens { tokens, bs, ctx } => {
                        block_key_le(&tokens[i * bs * 4..(i + 1) * bs * 4], key, ctx.at(i))
                    }
                    Query::Keys { keys, .. } => keys[i],
                };
                let mut hold = |s: usize| {
                    bits[s * words + i / 64] |= 1 << (i % 64);
                    lit[s] = true;
                    if pair[s] != NONE && run[pair[s] as usize] == i as u32 {
                        run[pair[s] as usize] = i as u32 + 1;
                    }
                };
                if let Some(hs) = self.s.multi.get(&key) {
                    // A shared prompt's key: its holder set (TP counted) beats scanning 100+ slots.
                    for (wi, &word) in hs.iter().enumerate() {
                        let mut b = word & live.get(wi).copied().unwrap_or(0);
                        while b != 0 {
                            hold(slot[wi * 64 + b.trailing_zeros() as usize] as usize);
                            b &= b - 1;
                        }
                    }
                } else {
                    touched.clear();
                    self.s.holders(key, |rm| {
                        let wm = rm_wm[rm as usize] as usize;
                        if live[wm >> 6] >> (wm & 63) & 1 != 0 {
                            let sl = slot[wm];
                            if cnt[sl as usize] == 0 {
                                touched.push(sl);
                            }
                            cnt[sl as usize] += 1;
                        }
                    });
                    for &sl in &touched {
                        let s = sl as usize;
                        if cnt[s] >= self.hd.wm_tp[wms[s] as usize].max(1) {
                            hold(s);
                        }
                        cnt[s] = 0;
                    }
                }
                if early {
                    let next = i as u32 + 1;
                    alive.retain(|&x| {
                        let on = pairs_of[x].is_empty() || pairs_of[x].clone().all(|p| run[p] == next);
                        if !on {
                            for &wm in &self.workers[ws[x] as usize].wms {
                                live[wm as usize >> 6] &= !(1 << (wm & 63));
                            }
                        }
                        on
                    });
                }
            }
            per_q.push((scale, n, words, bits));
        }
        let held = |q: usize, s: usize, i: usize| -> bool {
            let (_, _, words, ref bits) = per_q[q];
            bits[s * words + i / 64] >> (i % 64) & 1 != 0
        };
        let mut any = false;
        for &w in ws {
            let wk = &self.workers[w as usize];
            // A group that holds none of the prompt leaves nothing usable: most workers stop here.
            let lit_group =
                |g: i64| wk.wms.iter().any(|&wm| self.wm_group[wm as usize] == g && lit[slot[wm as usize] as usize]);
            if !wk.groups.iter().all(|g| lit_group(g.group)) {
                continue;
            }
            // Each group: the query read for it, its block size, reach and slots. A group's
            // keys exist at its own block size only: it is read at the query (block size)
            // where it holds most of the prompt's blocks, the first of equals.
            let mut gs: Vec<(usize, i64, Reach, Vec<usize>)> = vec![];
            let mut scorable = !wk.groups.is_empty();
            for g in &wk.groups {
                let sl: Vec<usize> = wk
                    .wms
                    .iter()
                    .filter(|&&wm| self.wm_group[wm as usize] == g.group)
                    .map(|&wm| slot[wm as usize] as usize)
                    .collect();
                let mut best: Option<(usize, usize)> = None;
                for (q, pq) in per_q.iter().enumerate() {
                    let (words, bits) = (pq.2, &pq.3);
                    let c: usize = (0..words)
                        .map(|k| sl.iter().fold(0u64, |acc, &s| acc | bits[s * words + k]).count_ones() as usize)
                        .sum();
                    if c > 0 && best.is_none_or(|(_, b)| c > b) {
                        best = Some((q, c));
                    }
                }
                match best {
                    Some((q, _)) => gs.push((q, per_q[q].0, g.reach, sl)),
                    None => scorable = false,
                }
            }
            if !scorable {
                continue;
            }
            // Usable prefix in tokens with the blocks of the media `pass` admits.
            let usable = |pass: &dyn Fn(u32) -> bool| -> i64 {
                let mut step = 1i64;
                let mut lmax = i64::MAX;
                let mut cums: Vec<Vec<u32>> = Vec::with_capacity(gs.len());
                for (q, bs, reach, sl) in &gs {
                    let n = per_q[*q].1;
                    let mut cum = vec![0u32; n + 1];
                    let mut run = n;
                    for i in 0..n {
                        let h = sl.iter().any(|&s| pass(self.wm_medium[wms[s] as usize]) && held(*q, s, i));
                        cum[i + 1] = cum[i] + h as u32;
                        if !h && run == n {
                            run = i;
                        }
                    }
                    let top = if *reach == Reach::Full { run } else { n };
                    lmax = lmax.min(top as i64 * bs);
                    step = lcm(step, *bs);
                    cums.push(cum);
                }
                let mut l = lmax / step * step;
                while l > 0 {
                    let fits = gs.iter().zip(&cums).all(|((_, bs, reach, _), cum)| match reach {
                        Reach::Full => true,
                        Reach::Tail(k) => {
                            let nb = (l / bs) as usize;
                            let lo = nb.saturating_sub(*k as usize);
                            (cum[nb] - cum[lo]) as usize == nb - lo
                        }
                    });
                    if fits {
                        return l;
                    }
                    l -= step;
                }
                0
            };
            let mut media: Vec<u32> =
                wk.wms.iter().map(|&wm| self.wm_medium[wm as usize]).filter(|&m| weights[m as usize] >= 0.0).collect();
            media.sort_unstable();
            media.dedup();
            let mut levels: Vec<f64> = media.iter().map(|&m| weights[m as usize]).collect();
            levels.sort_by(|a, b| b.partial_cmp(a).unwrap_or(std::cmp::Ordering::Equal));
            levels.dedup();
            let (mut score, mut prev) = (0f64, 0i64);
            for &t in &levels {
                let l = usable(&|m| weights[m as usize] >= t);
                score += (l - prev).max(0) as f64 * t;
                prev = prev.max(l);
            }
            if prev == 0 {
                continue;
            }
            any = true;
            best_run[w as usize] = prev;
            best_score[w as usize] = score;
            for &m in &media {
                let l = usable(&|x| x == m);
                if let Some(&wm) = wk.wms.iter().find(|&&wm| self.wm_medium[wm as usize] == m) {
                    best_wm[wm as usize] = l;
                }
            }
        }
        any
    }

    /// The workers of `ws` that may use some prefix of the query: every full-attention group
    /// holds its first block (all TP ranks, any medium), or it has no full-attention group. The
    /// others cannot be credited anything, and on a miss that is every worker: the grouped
    /// walk then costs one lookup instead of a pass over the fleet.
    fn holding_first_block(&self, q: &Query, ws: &[u32]) -> Vec<u32> {
        let key = match q {
            Query::Tokens { tokens, bs, ctx } if tokens.len() >= bs * 4 => {
                block_key_le(&tokens[..bs * 4], ROOT, ctx.at(0))
            }
            Query::Keys { keys, .. } if !keys.is_empty() => keys[0],
            _ => return vec![],
        };
        let nwm = self.wm_worker.len();
        let mut held = vec![false; nwm];
        if let Some(hs) = self.s.multi.get(&key) {
            for (wi, &word) in hs.iter().enumerate() {
                let mut b = word;
                while b != 0 {
                    held[wi * 64 + b.trailing_zeros() as usize] = true;
                    b &= b - 1;
                }
            }
        } else {
            let mut cnt = vec![0u32; nwm];
            self.s.holders(key, |rm| cnt[self.hd.rm_wm[rm as usize] as usize] += 1);
            for wm in 0..nwm {
                held[wm] = cnt[wm] > 0 && cnt[wm] >= self.hd.wm_tp[wm].max(1);
            }
        }
        ws.iter()
            .copied()
            .filter(|&w| {
                let wk = &self.workers[w as usize];
                wk.groups
                    .iter()
                    .filter(|g| g.reach == Reach::Full)
                    .all(|g| wk.wms.iter().any(|&wm| self.wm_group[wm as usize] == g.group && held[wm as usize]))
            })
            .collect()
    }

    /// The walk when every holder is on one medium (one wm per worker): the
    /// workers still matching are a bitset, each block intersects it with the
    /// block's holders (a hot key's holder set, word by word, or the wms its
    /// slots show holding), and a worker's run is set once, when it drops out.
    /// Scores are then run x the medium's weight. Fills run_w / score_w /
    /// run_wm like the general walk; returns the blocks anyone matched.
    fn walk_one_medium(&self, q: &Query, n: usize, ok: &[bool], weights: &[f64], out: Runs) -> usize {
        let Runs { run_w, score_w, run_wm, cnt } = out;
        let nwm = self.wm_worker.len();
        let words = nwm.div_ceil(64);
        let mut alive = vec![0u64; words];
        for wm in 0..nwm {
            if ok[self.wm_worker[wm] as usize] && weights[self.wm_medium[wm] as usize] >= 0.0 {
                alive[wm >> 6] |= 1 << (wm & 63);
            }
        }
        let mut held = vec![0u64; words];
        let mut touched: Vec<u32> = Vec::with_capacity(16);
        let rm_wm = &self.hd.rm_wm;
        let mut reached = 0usize;
        let mut ks = KeysAhead::new(q, n);
        for i in 0..n {
            let key = ks.at(i, &self.s);
            held.iter_mut().for_each(|x| *x = 0);
            if let Some(bits) = self.s.multi.get(&key) {
                for (h, &b) in held.iter_mut().zip(bits) {
                    *h = b;
                }
            } else {
                touched.clear();
                self.s.holders_fast(key, |rm| {
                    let wm = rm_wm[rm] as usize;
                    if alive[wm >> 6] & (1 << (wm & 63)) != 0 {
                        if cnt[wm] == 0 {
                            touched.push(wm as u32);
                        }
                        cnt[wm] += 1;
                    }
                });
                for &wm in &touched {
                    let wm = wm as usize;
                    if cnt[wm] >= self.hd.wm_tp[wm] {
                        held[wm >> 6] |= 1 << (wm & 63);
                    }
                    cnt[wm] = 0;
                }
            }
            let mut any = false;
            for k in 0..words {
                let still = alive[k] & held[k];
                let mut dropped = alive[k] & !still;
                while dropped != 0 {
                    run_wm[k * 64 + dropped.trailing_zeros() as usize] = i as u32;
                    dropped &= dropped - 1;
                }
                alive[k] = still;
                any |= still != 0;
            }
            if !any {
                break;
            }
            reached = i + 1;
        }
        for (k, &a) in alive.iter().enumerate() {
            let mut b = a;
            while b != 0 {
                run_wm[k * 64 + b.trailing_zeros() as usize] = reached as u32;
                b &= b - 1;
            }
        }
        for wm in 0..nwm {
            let r = run_wm[wm];
            if r > 0 {
                let w = self.wm_worker[wm] as usize;
                run_w[w] = run_w[w].max(r);
                score_w[w] = score_w[w].max(r as f64 * weights[self.wm_medium[wm] as usize]);
            }
        }
        reached
    }

    pub fn context(&mut self, lora: Option<&str>) -> u64 {
        self.ctx.get(lora)
    }

    // ------------------------------------------------------------ stats

    pub fn stats(&self) -> Vec<Stats> {
        let mut out = vec![];
        for wk in &self.workers {
            if wk.ranks.is_empty() {
                continue;
            }
            let mut st = Stats {
                inst: wk.inst.clone(),
                dp: wk.dp,
                tp_size: wk.tp_size,
                ranks: wk.ranks.len(),
                blocks: vec![],
                entries: 0,
                orphans: 0,
                unknown: 0,
                dups: 0,
            };
            for &wm in &wk.wms {
                let b = self.hd.wm_blocks[wm as usize];
                if b != 0 {
                    // A worker's groups are counted apart, each block once per group holding it.
                    let m = &self.media[self.wm_medium[wm as usize] as usize];
                    match st.blocks.iter_mut().find(|(x, _)| x == m) {
                        Some((_, n)) => *n += b,
                        None => st.blocks.push((m.clone(), b)),
                    }
                }
            }
            for r in &wk.ranks {
                for t in &r.tables {
                    st.entries += t.count;
                    st.orphans += t.orphans;
                    st.unknown += t.unknown;
                    st.dups += t.dups;
                }
            }
            out.push(st);
        }
        out
    }

    pub fn holder_blocks(&self) -> usize {
        self.hd.wm_blocks.iter().sum::<i64>() as usize
    }

    pub fn entries(&self) -> i64 {
        self.workers.iter().flat_map(|w| &w.ranks).flat_map(|r| &r.tables).map(|t| t.count).sum()
    }

    pub fn nbytes(&self) -> usize {
        let mut n = self.s.nbytes() + self.hd.rm_wm.len() * 4 + self.hd.wm_tp.len() * 16 + self.wm_worker.len() * 8;
        for w in &self.workers {
            for r in &w.ranks {
                for t in &r.tables {
                    n += t.nbytes();
                }
            }
        }
        n
    }

    /// (key, wm) of every holder-block.
    pub fn holder_keys(&self, mut f: impl FnMut(u64, u32)) {
        let tps = &self.hd.wm_tp;
        self.s.for_each_key_wm(&self.hd, |key, wm, n| {
            if n >= tps[wm as usize].max(1) {
                f(key, wm)
            }
        });
    }

    /// Of `keys`, every (key's index, medium id, group, held) where some rank of worker
    /// (inst, dp) has the key; `held` when all its TP ranks do (`holder_keys`' rule). Reads
    /// only: the event streams ask it which of the blocks a slice of records named the worker
    /// now holds (`consumer/stream_table.py`), instead of keeping a second copy of the holder
    /// rule, and forget what no rank has any more.
    pub fn worker_holding(&self, inst: &str, dp: i64, keys: &[u64]) -> Vec<(u32, u32, i64, bool)> {
        let mut out = vec![];
        let Some(w) = self.worker_id(inst, dp) else {
            return out;
        };
        // (wm, ranks holding the key): a worker has few wms, and each rm has one slot per key.
        let mut cnt: Vec<(u32, u32)> = Vec::with_capacity(4);
        for (i, &k) in keys.iter().enumerate() {
            cnt.clear();
            self.s.holders(k, |rm| {
                if self.rm_w[rm as usize] == w {
                    let wm = self.hd.rm_wm[rm as usize];
                    match cnt.iter_mut().find(|(x, _)| *x == wm) {
                        Some(c) => c.1 += 1,
                        None => cnt.push((wm, 1)),
                    }
                }
            });
            for &(wm, n) in &cnt {
                let held = n >= self.hd.wm_tp[wm as usize].max(1);
                out.push((i as u32, self.wm_medium[wm as usize], self.wm_group[wm as usize], held));
            }
        }
        out
    }

    /// Every (key, medium id, group) worker (inst, dp) holds, orphans and engine-hash entries
    /// left out (no query can match them). O(the worker's entries): for the moments its whole
    /// state must be read again (a clear, a reset, trust regained, a TP degree changed).
    pub fn worker_held(&self, inst: &str, dp: i64) -> Vec<(u64, u32, i64)> {
        let Some(w) = self.worker_id(inst, dp) else {
            return vec![];
        };
        let mut seen: BTreeSet<u64> = BTreeSet::new();
        for r in &self.workers[w as usize].ranks {
            for t in &r.tables {
                for (_, key, meta) in t.entries() {
                    if meta & (ENGINE | ORPHAN) == 0 {
                        seen.insert(key);
                    }
                }
            }
        }
        let keys: Vec<u64> = seen.into_iter().collect();
        self.worker_holding(inst, dp, &keys)
            .into_iter()
            .filter(|x| x.3)
            .map(|(i, m, g, _)| (keys[i as usize], m, g))
            .collect()
    }

    /// Order-independent digest over the holder-blocks (key, wm) whose
    /// `seeds[wm]` is non-zero: (sum mod 2^64 of xxh3(key LE, seed), count).
    /// A key held by several groups of one (worker, medium) counts once: the
    /// digest is over (worker, medium, key), as it was before groups were kept apart.
    pub fn digest(&self, seeds: &[u64]) -> (u64, u64) {
        let mut total = 0u64;
        let mut n = 0u64;
        // wm -> the first wm of its (worker, medium) when that pair has several (groups).
        let mut first: HashMap<(u32, u32), u32> = HashMap::new();
        let mut canon = vec![u32::MAX; self.wm_worker.len()];
        let mut shared = vec![false; self.wm_worker.len()];
        for wm in 0..self.wm_worker.len() {
            let c = *first.entry((self.wm_worker[wm], self.wm_medium[wm])).or_insert(wm as u32);
            canon[wm] = c;
            if c != wm as u32 {
                shared[wm] = true;
                shared[c as usize] = true;
            }
        }
        let mut seen: std::collections::HashSet<(u64, u32)> = std::collections::HashSet::new();
        self.holder_keys(|key, wm| {
            let c = canon[wm as usize];
            if shared[wm as usize] && !seen.insert((key, c)) {
                return;
            }
            let seed = seeds[c as usize];
            if seed != 0 {
                total = total.wrapping_add(crate::keys::xxh3(&key.to_le_bytes(), seed));
                n += 1;
            }
        });
        (total, n)
    }

    // ------------------------------------------------------------ snapshots

    /// Install exported entries of one table. Err on a duplicate engine hash,
    /// a zero refcount or an S count ceiling: not a blob `export` wrote.
    pub fn import_table(&mut self, rank: &RankId, t: &TableBlob) -> Result<(), String> {
        let TableBlob { medium, group, ehs, keys, metas, unknown, dups } = *t;
        let l = self.table(rank, Some(medium), group).map_err(|_| "too many (rank, medium) pairs".to_string())?;
        if metas.iter().any(|&m| m & ENGINE == 0) {
            // The group's reach follows from the snapshot's group list (`set_group`); until then, full.
            let wk = &mut self.workers[l.0 as usize];
            if !wk.groups.iter().any(|g| g.group == group) {
                wk.groups.push(GroupSpec { group, reach: Reach::Full });
                wk.grouped = is_grouped(&wk.groups);
            }
        }
        let rm = self.tab(l).rm;
        self.tab(l).reserve(ehs.len());
        for i in 0..ehs.len() {
            let m = metas[i];
            if m & REF_MASK == 0 || self.tab(l).get(ehs[i]).is_some() {
                return Err("inconsistent entries".into());
            }
            if !self.s.inc(keys[i], rm, &mut self.hd) {
                return Err("count ceiling".into());
            }
            self.tab(l).insert(ehs[i], keys[i], m);
        }
        let t = self.tab(l);
        t.unknown += unknown;
        t.dups += dups;
        Ok(())
    }

    /// A group's reach as a snapshot recorded it (the worker exists once its tables do).
    pub fn set_group(&mut self, inst: &str, dp: i64, group: i64, reach: Reach) {
        if let Some(w) = self.worker_id(inst, dp) {
            let wk = &mut self.workers[w as usize];
            match wk.groups.iter_mut().find(|g| g.group == group) {
                Some(g) => g.reach = reach,
                None => wk.groups.push(GroupSpec { group, reach }),
            }
            wk.grouped = is_grouped(&wk.groups);
        }
    }

    pub fn add_block_size(&mut self, bs: i64) {
        if bs > 0 {
            self.block_sizes.insert(bs);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn toks(n: u32) -> Vec<u8> {
        (1000..1000 + n).flat_map(|t: u32| t.to_le_bytes()).collect()
    }

    /// A tier view counts only its media's copies: device, then device or host, then all.
    #[test]
    fn excluded_media_hold_nothing() {
        let mut ix = Index::new();
        let t = toks(64);
        let store = |medium, ehs: &'static [u64], tokens, parent| {
            Ev::Store(Store {
                medium: Some(medium),
                group: 0,
                ehs,
                tokens,
                bs: 16,
                parent,
                lora: None,
                blk_ctx: None,
                kind: None,
                window: None,
            })
        };
        // Worker a: blocks 0-1 on GPU, 2 on CPU, 3 on STORAGE. Worker b (TP 2): block 0-3 on CPU,
        // but only one of its ranks holds block 3.
        let a = RankId { inst: "a", dp: 0, tp_rank: 0, tp_size: 1 };
        ix.apply(&a, &[store("GPU", &[1, 2], &t[..128], None)], true).unwrap();
        ix.apply(&a, &[store("CPU", &[3], &t[128..192], Some(2))], true).unwrap();
        ix.apply(&a, &[store("STORAGE", &[4], &t[192..], Some(3))], true).unwrap();
        for tp_rank in 0..2 {
            let b = RankId { inst: "b", dp: 0, tp_rank, tp_size: 2 };
            let ehs: &'static [u64] = if tp_rank == 0 { &[11, 12, 13, 14] } else { &[11, 12, 13] };
            let n = ehs.len() * 64;
            ix.apply(&b, &[store("CPU", ehs, &t[..n], None)], true).unwrap();
        }
        let ctx = Ctx::One(ix.context(None));
        let q = [Query::Tokens { tokens: &t, bs: 16, ctx }];
        let view = |counted: &[&str]| {
            let w: Vec<f64> =
                ix.media.iter().map(|m| if counted.contains(&m.as_str()) { 1.0 } else { EXCLUDED }).collect();
            let s = ix.score(&q, &w, None, None);
            let mut out: Vec<(String, i64)> =
                s.worker.iter().zip(&s.matched).map(|(&w, &m)| (ix.workers[w as usize].inst.clone(), m)).collect();
            out.sort();
            out
        };
        let a_b = |x, y| vec![("a".to_string(), x), ("b".to_string(), y)];
        assert_eq!(view(&["GPU"]), vec![("a".to_string(), 32)]);
        assert_eq!(view(&["GPU", "CPU"]), a_b(48, 48));
        assert_eq!(view(&["GPU", "CPU", "STORAGE"]), a_b(64, 48));
        assert_eq!(view(&["STORAGE"]), vec![]);
    }

    #[test]
    fn store_score_remove_and_overflow_rolls_back() {
        let mut ix = Index::new();
        let r = RankId { inst: "a", dp: 0, tp_rank: 0, tp_size: 1 };
        let t = toks(64);
        let ehs = [1u64, 2, 3, 4];
        let ev = Ev::Store(Store {
            medium: None,
            group: 0,
            ehs: &ehs,
            tokens: &t,
            bs: 16,
            parent: None,
            lora: None,
            blk_ctx: None,
            kind: None,
            window: None,
        });
        assert_eq!(ix.apply(&r, &[ev], true), Ok(4));
        assert_eq!(ix.holder_blocks(), 4);
        let ctx = Ctx::One(ix.context(None));
        let w = vec![1.0; ix.media.len()];
        let s = ix.score(&[Query::Tokens { tokens: &t, bs: 16, ctx }], &w, None, None);
        assert_eq!(s.matched, vec![64]);
        // Fill a refcount to its ceiling, then a record that overflows applies nothing.
        let one = [9u64];
        let t16 = &t[..64];
        for _ in 0..REF_MASK {
            let ev = Ev::Store(Store {
                medium: None,
                group: 0,
                ehs: &one,
                tokens: t16,
                bs: 16,
                parent: None,
                lora: None,
                blk_ctx: None,
                kind: None,
                window: None,
            });
            ix.apply(&r, &[ev], true).unwrap();
        }
        let before = (ix.holder_blocks(), ix.entries(), ix.stats()[0].dups);
        let rmv = [1u64];
        let evs = [
            Ev::Remove { medium: None, group: 0, ehs: &rmv },
            Ev::Clear,
            Ev::Store(Store {
                medium: None,
                group: 0,
                ehs: &one,
                tokens: t16,
                bs: 16,
                parent: None,
                lora: None,
                blk_ctx: None,
                kind: None,
                window: None,
            }),
            Ev::Store(Store {
                medium: None,
                group: 0,
                ehs: &one,
                tokens: t16,
                bs: 16,
                parent: None,
                lora: None,
                blk_ctx: None,
                kind: None,
                window: None,
            }),
        ];
        // After the clear the hash is new, so this record does not overflow...
        assert!(ix.apply(&r, &evs, true).is_ok());
        // ...but stores past the ceiling without a clear do, and leave nothing behind.
        for _ in 0..REF_MASK - 2 {
            let ev = Ev::Store(Store {
                medium: None,
                group: 0,
                ehs: &one,
                tokens: t16,
                bs: 16,
                parent: None,
                lora: None,
                blk_ctx: None,
                kind: None,
                window: None,
            });
            ix.apply(&r, &[ev], true).unwrap();
        }
        let before2 = (ix.holder_blocks(), ix.entries(), ix.stats()[0].dups, ix.stats()[0].unknown);
        let evs = [
            Ev::Remove { medium: None, group: 0, ehs: &[77] },
            Ev::Remove { medium: None, group: 0, ehs: &one },
            Ev::Store(Store {
                medium: None,
                group: 0,
                ehs: &one,
                tokens: t16,
                bs: 16,
                parent: None,
                lora: None,
                blk_ctx: None,
                kind: None,
                window: None,
            }),
            Ev::Store(Store {
                medium: None,
                group: 0,
                ehs: &one,
                tokens: t16,
                bs: 16,
                parent: None,
                lora: None,
                blk_ctx: None,
                kind: None,
                window: None,
            }),
        ];
        assert_eq!(ix.apply(&r, &evs, true), Err(ApplyError::Overflow));
        assert_eq!(before2, (ix.holder_blocks(), ix.entries(), ix.stats()[0].dups, ix.stats()[0].unknown));
        let _ = before;
    }

    #[test]
    fn worker_holding_counts_every_tp_rank() {
        let mut ix = Index::new();
        let t = toks(32);
        let ehs = [11u64, 12];
        let store = |medium| {
            Ev::Store(Store {
                medium,
                group: 0,
                ehs: &ehs,
                tokens: &t,
                bs: 16,
                parent: None,
                lora: None,
                blk_ctx: None,
                kind: None,
                window: None,
            })
        };
        let r0 = RankId { inst: "a", dp: 0, tp_rank: 0, tp_size: 2 };
        let r1 = RankId { inst: "a", dp: 0, tp_rank: 1, tp_size: 2 };
        assert_eq!(ix.apply(&r0, &[store(None), store(Some("CPU"))], true), Ok(4));
        let keys: Vec<u64> = ix.worker_held("a", 0).iter().map(|x| x.0).collect();
        assert!(keys.is_empty(), "one of two ranks holds nothing for the worker");
        let mut ks = vec![];
        crate::keys::chain(&t, 16, 2, ROOT, Ctx::One(ix.context(None)), &mut ks);
        let gpu = ix.media.iter().position(|m| m == "GPU").unwrap() as u32;
        let cpu = ix.media.iter().position(|m| m == "CPU").unwrap() as u32;
        let mut part = ix.worker_holding("a", 0, &ks);
        part.sort();
        assert_eq!(part, vec![(0, gpu, 0, false), (0, cpu, 0, false), (1, gpu, 0, false), (1, cpu, 0, false)]);
        assert_eq!(ix.apply(&r1, &[store(None)], true), Ok(2));
        let held: Vec<_> = ix.worker_holding("a", 0, &ks).into_iter().filter(|x| x.3).collect();
        assert_eq!(held, vec![(0, gpu, 0, true), (1, gpu, 0, true)]);
        let mut held = ix.worker_held("a", 0);
        held.sort();
        let mut want = vec![(ks[0], gpu, 0), (ks[1], gpu, 0)];
        want.sort();
        assert_eq!(held, want);
        // Either rank dropping a block drops it from the worker.
        let rm = [12u64];
        assert_eq!(ix.apply(&r0, &[Ev::Remove { medium: None, group: 0, ehs: &rm }], true), Ok(1));
        let held: Vec<_> = ix.worker_holding("a", 0, &ks).into_iter().filter(|x| x.3).collect();
        assert_eq!(held, vec![(0, gpu, 0, true)]);
        assert!(ix.worker_holding("b", 0, &ks).is_empty());
    }
}
