//! The write path: events checked, applied to a rank's tables and to S, each
//! change logged so that a call that cannot finish is undone whole.

use super::memo::MemoUndo;
use super::{is_grouped, reach_of, ApplyError, Ev, GroupSpec, Index, Loc, RankId, Reach, Store};
use crate::keys::{engine_key, orphan_root, Ctx, ROOT};
use crate::table::{RTable, ENGINE, MAX_RM, ORPHAN, REF_MASK};

/// Entries of cleared tables each apply purges from S before its own work:
/// ~12 µs at ~0.2 µs a purge (prefetched), well inside an apply quantum, so a
/// score waiting for the quantum does not wait out a sweep too (256 a record
/// put the score call's p99 ~15% higher while a restarted fleet was swept). A
/// cleared rank of 1M blocks is gone after ~16,000 applies; a rank re-storing
/// its blocks takes one apply per record of ~32, so the sweep still outruns it.
const SWEEP_PER_APPLY: usize = 64;
/// Keys a sweep reads and prefetches before it purges them.
const SWEEP_BATCH: usize = 16;

pub(super) enum Undo {
    Insert(Loc, u64),
    Inc(Loc, u64),
    Dec(Loc, u64),
    Delete(Loc, u64, u64, u16),
    Unknown(Loc),
    /// A deferred clear: the table's rm was retired (its table is the
    /// graveyard's last); the wm's block count and the holder sets it left.
    Clear(Loc, i64, Vec<u64>),
    /// A clear done in place (no rm id was free): the old table.
    ClearNow(Loc, Box<RTable>),
    BlockSize(i64),
    Groups(u32, Vec<GroupSpec>, bool),
    /// A removed hash remembered by worker `.0`'s memo. What it says is true
    /// whatever happens to the record, but a refused record must change
    /// nothing a later record can see: its entry may have pushed an older one
    /// out of the memo, and the oracle (and a replica that never saw the
    /// record applied) would still have that one. So it is undone too.
    Memo(u32, MemoUndo),
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

impl Index {
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
        // Before the undo log starts: a rollback only ever revives this call's clears.
        self.sweep(SWEEP_PER_APPLY);
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
        {
            let t = &self.workers[l.0 as usize].ranks[l.1].tables[l.2];
            for (&eh, &key) in ehs.iter().zip(keys.iter()) {
                t.prefetch(eh);
                self.s.prefetch(self.s.probe(key));
            }
        }
        let mut over = false;
        for (i, &eh) in ehs.iter().enumerate() {
            let key = keys[i];
            let t = &mut self.workers[l.0 as usize].ranks[l.1].tables[l.2];
            let vacant = match t.find_for_store(eh) {
                Ok(m) => {
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
                Err(v) => v,
            };
            if !self.s.inc(key, rm, &mut self.hd) {
                over = true;
                break;
            }
            let t = &mut self.workers[l.0 as usize].ranks[l.1].tables[l.2];
            if t.insert_vacant(vacant, eh, key, flags | 1, self.s.defer) {
                self.r_deferred.push(l);
            }
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
        let g = is_grouped(&wk.groups);
        self.set_grouped(w, g);
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
        // Gone from every table: the key it was last stored under is still its key.
        if let Some(hit) = wk.memo.get(peh) {
            return hit;
        }
        (orphan_root(peh), true)
    }

    fn remove(&mut self, rank: &RankId, medium: Option<&str>, group: i64, ehs: &[u64]) -> Result<(), ApplyError> {
        let l = self.table(rank, medium, group)?;
        {
            // As a store does: every block's R slots, then (their keys read back) its S slots.
            let t = &self.workers[l.0 as usize].ranks[l.1].tables[l.2];
            for &eh in ehs {
                t.prefetch(eh);
            }
            for &eh in ehs {
                if let Some((key, _)) = t.get(eh) {
                    self.s.prefetch(self.s.probe(key));
                }
            }
        }
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
                    if meta & ENGINE == 0 {
                        let u = self.workers[l.0 as usize].memo.remember(eh, key, meta & ORPHAN != 0);
                        self.undo.push(Undo::Memo(l.0, u));
                    }
                }
            }
        }
        Ok(())
    }

    fn clear_table(&mut self, l: Loc, log: bool) {
        let (w, r, _) = l;
        let tp_rank = self.workers[w as usize].ranks[r].tp_rank;
        let t = &mut self.workers[w as usize].ranks[r].tables[l.2];
        if t.count == 0 {
            return;
        }
        let (old_rm, medium, group) = (t.rm, t.medium, t.group);
        let Some(rm) = self.spare_rm(old_rm) else {
            return self.clear_now(l, log);
        };
        let t = &mut self.workers[w as usize].ranks[r].tables[l.2];
        let mut fresh = RTable::new(rm, medium, group);
        fresh.unknown = t.unknown;
        fresh.dups = t.dups;
        let old = std::mem::replace(t, fresh);
        self.rm_ids.insert((w, tp_rank, medium, group), rm);
        // The rank holds nothing now, so neither does its wm: one pass over
        // the holder sets, and the old slots wait for `sweep`.
        let wm = self.hd.rm_wm[old_rm as usize];
        self.s.kill(old_rm);
        let blocks = std::mem::take(&mut self.hd.wm_blocks[wm as usize]);
        let had = self.s.forget_wm(wm);
        self.graveyard.push_back((old, (0, 0)));
        if log {
            self.undo.push(Undo::Clear(l, blocks, had));
        }
    }

    /// An rm id for a cleared table of `like`'s (worker, wm): a swept one, or a new one.
    fn spare_rm(&mut self, like: u32) -> Option<u32> {
        let rm = match self.free_rm.pop() {
            Some(rm) => rm,
            None => {
                let rm = self.hd.rm_wm.len() as u32;
                if rm > MAX_RM {
                    return None;
                }
                self.hd.rm_wm.push(0);
                self.rm_w.push(0);
                rm
            }
        };
        self.hd.rm_wm[rm as usize] = self.hd.rm_wm[like as usize];
        self.rm_w[rm as usize] = self.rm_w[like as usize];
        Some(rm)
    }

    /// The clear without a spare rm id: every entry's slot deleted now.
    fn clear_now(&mut self, l: Loc, log: bool) {
        let t = &mut self.workers[l.0 as usize].ranks[l.1].tables[l.2];
        let mut fresh = RTable::new(t.rm, t.medium, t.group);
        fresh.unknown = t.unknown;
        fresh.dups = t.dups;
        let old = std::mem::replace(t, fresh);
        for (_, key, _) in old.entries() {
            self.s.dec(key, old.rm, &mut self.hd);
        }
        if log {
            self.undo.push(Undo::ClearNow(l, Box::new(old)));
        }
    }

    /// Purge up to `budget` entries of cleared tables from S; a table done
    /// gives its rm id back. Bounded so that no apply pays for a whole clear.
    /// The keys are read a batch at a time and their S lines prefetched before
    /// any is purged: each purge is a probe of a table far larger than the cache.
    pub fn sweep(&mut self, mut budget: usize) {
        let mut keys = [0u64; SWEEP_BATCH];
        while budget > 0 {
            let Some((t, (si, j))) = self.graveyard.front_mut() else { return };
            let rm = t.rm;
            let mut n = 0;
            while n < SWEEP_BATCH.min(budget) && *si < t.shards.len() {
                let sh = &t.shards[*si];
                if *j == sh.slot.len() {
                    *si += 1;
                    *j = 0;
                    continue;
                }
                if sh.slot[*j].meta != 0 {
                    keys[n] = sh.slot[*j].key();
                    n += 1;
                }
                *j += 1;
            }
            let done = *si == t.shards.len();
            for &k in &keys[..n] {
                self.s.prefetch(self.s.probe(k));
            }
            for &k in &keys[..n] {
                self.s.purge(k, rm);
            }
            budget -= n;
            if done {
                self.graveyard.pop_front();
                self.s.revive(rm);
                self.s.reset_log(rm);
                self.free_rm.push(rm);
            }
        }
    }

    /// Cleared tables not yet swept, and their entries left (an upper bound).
    pub fn unswept(&self) -> (usize, i64) {
        (self.graveyard.len(), self.graveyard.iter().map(|(t, _)| t.count).sum())
    }

    fn rank_pos(&self, inst: &str, dp: i64, tp_rank: i64) -> Option<(u32, usize)> {
        let w = self.worker_id(inst, dp)?;
        let r = self.workers[w as usize].ranks.iter().position(|r| r.tp_rank == tp_rank)?;
        Some((w, r))
    }

    /// AllBlocksCleared, counters kept: each table retired at once, its S slots left to `sweep`.
    /// The memo is kept (its keys are still right) and not filled: a clear stays O(1).
    pub fn clear_rank(&mut self, inst: &str, dp: i64, tp_rank: i64, log: bool) {
        if let Some((w, r)) = self.rank_pos(inst, dp, tp_rank) {
            for t in 0..self.workers[w as usize].ranks[r].tables.len() {
                self.clear_table((w, r, t), log);
            }
        }
    }

    /// Forget a rank entirely (expiry): its blocks and its counters. The
    /// worker's memo stays: its keys are still right, and the worker's other
    /// ranks (or this one, back) store children of those parents.
    pub fn drop_rank(&mut self, inst: &str, dp: i64, tp_rank: i64) {
        if let Some((w, r)) = self.rank_pos(inst, dp, tp_rank) {
            self.clear_rank(inst, dp, tp_rank, false);
            self.workers[w as usize].ranks.remove(r);
            self.sync_tp(w);
        }
    }

    /// Forget every rank of a worker (partition revoked, worker gone), and
    /// its memo: still right, but a worker gone would keep its memory for
    /// good, and a member that takes the partition over gets it from the
    /// partition's snapshot (`export_workers` carries it), as it gets the tables.
    pub fn drop_worker(&mut self, inst: &str, dp: i64) {
        if let Some(w) = self.worker_id(inst, dp) {
            self.workers[w as usize].memo.clear();
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
                Undo::Clear(l, blocks, had) => {
                    let (old, _) = self.graveyard.pop_back().expect("this call's clear");
                    let (w, r, _) = l;
                    let tp_rank = self.workers[w as usize].ranks[r].tp_rank;
                    // Everything stored after the clear is undone already: the fresh table is empty.
                    let fresh = self.tab(l).rm;
                    self.free_rm.push(fresh);
                    let wm = self.hd.rm_wm[old.rm as usize];
                    self.s.revive(old.rm);
                    self.hd.wm_blocks[wm as usize] = blocks;
                    self.s.restore_wm(wm, &had);
                    self.rm_ids.insert((w, tp_rank, old.medium, old.group), old.rm);
                    *self.tab(l) = old;
                }
                Undo::ClearNow(l, old) => {
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
                    self.workers[w as usize].groups = g;
                    self.set_grouped(w, grouped);
                }
                Undo::Memo(w, u) => self.workers[w as usize].memo.undo(u),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::index::test_util::{rank, ranked, stored, toks};
    use crate::index::Query;

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

    fn remove<'a>(ehs: &'a [u64]) -> Ev<'a> {
        Ev::Remove { medium: None, group: 0, ehs }
    }

    /// (entries, orphans, unknown, dups) of worker `inst`.
    fn counts(ix: &Index, inst: &str) -> (i64, i64, i64, i64) {
        let st = ix.stats().into_iter().find(|s| s.inst == inst).expect("worker");
        (st.entries, st.orphans, st.unknown, st.dups)
    }

    #[test]
    fn removing_what_was_stored_leaves_nothing_held() {
        let mut ix = Index::new();
        let t = toks(64);
        let a = rank("a", 0, 1);
        let engine = Ev::Store(Store {
            medium: Some("CPU"),
            group: 0,
            ehs: &[7, 8],
            tokens: &[],
            bs: 0,
            parent: None,
            lora: None,
            blk_ctx: None,
            kind: None,
            window: None,
        });
        assert_eq!(ix.apply(&a, &[stored(None, &[1, 2, 3, 4], &t, None), engine], true), Ok(6));
        assert_eq!((ix.entries(), ix.holder_blocks(), ix.s.count), (6, 6, 6));
        assert_eq!(ranked(&mut ix, &t, |_| 1.0, None, None), vec![("a".to_string(), 64, 64.0)]);
        let gone = [remove(&[3, 1, 4, 2]), Ev::Remove { medium: Some("CPU"), group: 0, ehs: &[8, 7] }];
        assert_eq!(ix.apply(&a, &gone, true), Ok(6));
        assert_eq!((ix.entries(), ix.holder_blocks(), ix.s.count, ix.s.multi.len()), (0, 0, 0, 0));
        assert_eq!(counts(&ix, "a"), (0, 0, 0, 0));
        assert!(ix.stats()[0].blocks.is_empty());
        assert_eq!(ix.digest(&vec![1; ix.wm_worker.len()]), (0, 0));
        assert!(ix.worker_held("a", 0).is_empty());
        assert!(ranked(&mut ix, &t, |_| 1.0, None, None).is_empty());
    }

    /// vLLM may hold one hash in two physical blocks: the entry stays until both are freed.
    #[test]
    fn a_hash_stored_twice_is_a_dup_and_needs_two_removes() {
        let mut ix = Index::new();
        let t = toks(32);
        let a = rank("a", 0, 1);
        assert_eq!(ix.apply(&a, &[stored(None, &[1, 2], &t, None)], true), Ok(2));
        assert_eq!(ix.apply(&a, &[stored(None, &[1, 2], &t, None)], true), Ok(2));
        assert_eq!((ix.entries(), ix.holder_blocks()), (2, 2));
        assert_eq!(counts(&ix, "a"), (2, 0, 0, 2));
        assert_eq!(ix.apply(&a, &[remove(&[1, 2])], true), Ok(2));
        assert_eq!((ix.entries(), ix.holder_blocks()), (2, 2));
        assert_eq!(ranked(&mut ix, &t, |_| 1.0, None, None), vec![("a".to_string(), 32, 32.0)]);
        assert_eq!(ix.apply(&a, &[remove(&[1, 2])], true), Ok(2));
        assert_eq!((ix.entries(), ix.holder_blocks()), (0, 0));
        // Dups count stores, not copies still held: a removal leaves the count as it was.
        assert_eq!(counts(&ix, "a"), (0, 0, 0, 2));
        assert!(ranked(&mut ix, &t, |_| 1.0, None, None).is_empty());
    }

    #[test]
    fn removes_of_hashes_not_held_are_counted_as_unknown() {
        let mut ix = Index::new();
        let t = toks(16);
        let a = rank("a", 0, 1);
        assert_eq!(ix.apply(&a, &[remove(&[77, 78])], true), Ok(2));
        assert_eq!(counts(&ix, "a"), (0, 0, 2, 0));
        assert_eq!(ix.apply(&a, &[stored(None, &[1], &t, None), remove(&[1, 1])], true), Ok(3));
        assert_eq!(counts(&ix, "a"), (0, 0, 3, 0));
        assert_eq!((ix.entries(), ix.holder_blocks()), (0, 0));
    }

    /// Worker a: blocks 1-4 on GPU, block 1 stored twice; worker b: its own two blocks on CPU.
    fn two_workers(t: &[u8]) -> Index {
        let mut ix = Index::new();
        ix.apply(&rank("a", 0, 1), &[stored(None, &[1, 2, 3, 4], t, None)], true).unwrap();
        ix.apply(&rank("a", 0, 1), &[stored(None, &[1], &t[..64], None)], true).unwrap();
        ix.apply(&rank("b", 0, 1), &[stored(Some("CPU"), &[21, 22], &t[..128], None)], true).unwrap();
        ix
    }

    /// Everything a refused record could have changed and a reader can see.
    fn seen(ix: &mut Index, t: &[u8]) -> impl PartialEq + std::fmt::Debug {
        let seeds: Vec<u64> = (1..=ix.wm_worker.len() as u64).collect();
        let stats: Vec<_> = ix
            .stats()
            .into_iter()
            .map(|s| (s.inst, s.dp, s.tp_size, s.ranks, s.blocks, s.entries, s.orphans, s.unknown, s.dups))
            .collect();
        let groups: Vec<(Vec<(i64, Reach)>, bool)> =
            ix.workers.iter().map(|w| (w.groups.iter().map(|g| (g.group, g.reach)).collect(), w.grouped)).collect();
        let score = ranked(ix, t, |m| if m == "GPU" { 1.0 } else { 0.5 }, None, None);
        (ix.digest(&seeds), stats, ix.holder_blocks(), ix.entries(), ix.block_sizes.clone(), groups, score)
    }

    /// An atomic record whose last store overflows a refcount undoes every kind of change
    /// the events before it made: inserts, dups, decrements, deletes, unknowns, a clear, a
    /// new block size and a group's new reach.
    #[test]
    fn a_record_refused_at_its_last_event_leaves_the_index_as_it_was() {
        let t = toks(64);
        let wide = Ev::Store(Store {
            medium: None,
            group: 0,
            ehs: &[31, 32],
            tokens: &t,
            bs: 32,
            parent: None,
            lora: None,
            blk_ctx: None,
            kind: Some("sliding_window"),
            window: Some(64),
        });
        let mut evs =
            vec![wide, remove(&[4]), remove(&[1]), remove(&[99]), stored(None, &[2], &t[64..128], Some(1)), Ev::Clear];
        // The clear emptied the table: hash 9 reaches its ceiling within the record.
        evs.extend((0..REF_MASK).map(|_| stored(None, &[9], &t[..64], None)));

        // The record short of its last event applies, and changes what is seen.
        let mut applied = two_workers(&t);
        let untouched = seen(&mut applied, &t);
        assert!(applied.apply(&rank("a", 0, 1), &evs, true).is_ok());
        assert_ne!(seen(&mut applied, &t), untouched);
        // The sliding-window group made worker a grouped, and the score's count of them says so.
        assert_eq!((applied.n_grouped, grouped(&applied)), (1, 1));

        evs.push(stored(None, &[9], &t[..64], None));
        let mut ix = two_workers(&t);
        let before = seen(&mut ix, &t);
        assert_eq!(ix.apply(&rank("a", 0, 1), &evs, true), Err(ApplyError::Overflow));
        assert_eq!(seen(&mut ix, &t), before);
        assert_eq!((ix.n_grouped, grouped(&ix)), (0, 0));
        assert_eq!(counts(&ix, "a"), (4, 0, 0, 1));
        // The undone rank still takes writes as before: block 1's two copies need two removes.
        assert_eq!(ix.apply(&rank("a", 0, 1), &[remove(&[1])], true), Ok(1));
        assert_eq!(ranked(&mut ix, &t, |_| 1.0, None, None)[0], ("a".to_string(), 64, 64.0));
    }

    fn grouped(ix: &Index) -> usize {
        ix.workers.iter().filter(|w| w.grouped).count()
    }

    /// The key under which `inst` holds engine hash `eh`, and whether it is an orphan.
    fn entry(ix: &Index, inst: &str, eh: u64) -> Option<(u64, bool)> {
        let w = ix.workers.iter().find(|w| w.inst == inst)?;
        w.ranks.iter().flat_map(|r| &r.tables).find_map(|t| t.get(eh)).map(|(k, m)| (k, m & ORPHAN != 0))
    }

    /// LMCache evicts a chunk's parent just before storing the chunk, in one record: the
    /// child still gets the chained key, and once the parent is back the chain scores whole.
    #[test]
    fn a_child_of_a_parent_just_removed_is_chained_not_orphaned() {
        let t = toks(64);
        let a = rank("a", 0, 1);
        // The keys a record that kept its parent gives blocks 3 and 4.
        let mut kept = Index::new();
        kept.apply(&a, &[stored(None, &[1, 2], &t[..128], None), stored(None, &[3, 4], &t[128..], Some(2))], true)
            .unwrap();
        let want = (entry(&kept, "a", 3), entry(&kept, "a", 4));
        assert!(matches!(want, (Some((_, false)), Some((_, false)))));

        let mut ix = Index::new();
        ix.apply(&a, &[stored(None, &[1, 2], &t[..128], None)], true).unwrap();
        ix.apply(&a, &[remove(&[2]), stored(None, &[3, 4], &t[128..], Some(2))], true).unwrap();
        assert_eq!((entry(&ix, "a", 3), entry(&ix, "a", 4)), want);
        assert_eq!(counts(&ix, "a").1, 0);
        // Block 2 missing: only block 1 scores; back again: the whole chain.
        assert_eq!(ranked(&mut ix, &t, |_| 1.0, None, None), vec![("a".to_string(), 16, 16.0)]);
        ix.apply(&a, &[stored(None, &[2], &t[64..128], Some(1))], true).unwrap();
        assert_eq!(ranked(&mut ix, &t, |_| 1.0, None, None), vec![("a".to_string(), 64, 64.0)]);

        // Removed in an earlier record, on another rank of the worker: the same.
        let (r0, r1) = (rank("b", 0, 2), rank("b", 1, 2));
        for r in [&r0, &r1] {
            ix.apply(r, &[stored(None, &[1, 2], &t[..128], None)], true).unwrap();
        }
        ix.apply(&r0, &[remove(&[2])], true).unwrap();
        ix.apply(&r1, &[remove(&[2])], true).unwrap();
        ix.apply(&r1, &[stored(None, &[3, 4], &t[128..], Some(2))], true).unwrap();
        assert_eq!((entry(&ix, "b", 3), entry(&ix, "b", 4)), want);

        // A parent never stored, or stored in engine-hash mode, still leaves an orphan.
        let engine = Ev::Store(Store { bs: 0, tokens: &[], ..store_of(&[8]) });
        ix.apply(&a, &[engine, Ev::Remove { medium: None, group: 0, ehs: &[8] }], true).unwrap();
        ix.apply(&a, &[stored(None, &[9], &t[..64], Some(8)), stored(None, &[10], &t[..64], Some(77))], true).unwrap();
        assert!(matches!((entry(&ix, "a", 9), entry(&ix, "a", 10)), (Some((_, true)), Some((_, true)))));

        // A dropped worker's memo goes with it.
        ix.drop_worker("b", 0);
        ix.apply(&r0, &[stored(None, &[3], &t[128..192], Some(2))], true).unwrap();
        assert!(matches!(entry(&ix, "b", 3), Some((_, true))));
    }

    fn store_of(ehs: &[u64]) -> Store<'_> {
        match stored(None, ehs, &[], None) {
            Ev::Store(st) => st,
            _ => unreachable!(),
        }
    }

    /// A refused record's removes leave no trace in the memo: the child of a parent it
    /// removed is an orphan, as it would be had the record never come.
    #[test]
    fn a_refused_record_leaves_the_memo_as_it_was() {
        let t = toks(64);
        let a = rank("a", 0, 1);
        let mut ix = Index::new();
        ix.apply(&a, &[stored(None, &[1, 2], &t[..128], None), stored(None, &[9], &t[..64], None)], true).unwrap();
        let mut evs = vec![remove(&[2]), remove(&[9])];
        evs.extend((0..=REF_MASK).map(|_| stored(None, &[9], &t[..64], None)));
        assert_eq!(ix.apply(&a, &evs, true), Err(ApplyError::Overflow));
        ix.apply(&a, &[Ev::Clear, stored(None, &[3], &t[128..192], Some(2))], true).unwrap();
        assert!(matches!(entry(&ix, "a", 3), Some((_, true))));
        // The same removes applied: the clear keeps the memo, and the child is chained.
        ix.apply(&a, &[remove(&[3]), stored(None, &[1, 2], &t[..128], None), remove(&[2]), Ev::Clear], true).unwrap();
        ix.apply(&a, &[stored(None, &[3], &t[128..192], Some(2))], true).unwrap();
        assert!(matches!(entry(&ix, "a", 3), Some((_, false))));
    }
}

/// AllBlocksCleared retires the table's rm and leaves its slots to `sweep`:
/// checked against indexes rebuilt from only what is still held, before and
/// after the sweep, with and without holder sets, through TP and rm reuse.
#[cfg(test)]
mod clear_tests {
    use super::super::test_util::{rank, stored, toks};
    use super::super::{ApplyError, Ev, Index, Query};
    use crate::keys::Ctx;
    use crate::table::{CNT_MASK, PROMOTE};

    /// (instance, matched tokens) of every credited worker, for `t` and for its first half
    /// followed by other tokens.
    fn answers(ix: &mut Index, t: &[u8]) -> Vec<(String, i64)> {
        let ctx = Ctx::One(ix.context(None));
        let w = vec![1.0; ix.media.len().max(1)];
        let mut out = vec![];
        for q in [t.to_vec(), [&t[..t.len() / 2], &toks(64)[..]].concat()] {
            let s = ix.score(&[Query::Tokens { tokens: &q, bs: 16, ctx }], &w, None, None);
            out.extend(s.worker.iter().zip(&s.matched).map(|(&w, &m)| (ix.workers[w as usize].inst.clone(), m)));
        }
        out.sort();
        out
    }

    const SHARED: [u64; 4] = [1, 2, 3, 4];
    const OWN: [u64; 4] = [5, 6, 7, 8];

    /// Who stores what: a (TP 1) the shared chain and its own tail, b (TP 1) the shared
    /// chain, c (TP 2) the shared chain on both ranks.
    fn fill(ix: &mut Index, t: &[u8], who: &[(&str, i64, i64)]) {
        for &(inst, tp_rank, tp_size) in who {
            let r = rank(inst, tp_rank, tp_size);
            ix.apply(&r, &[stored(None, &SHARED, &t[..256], None)], true).unwrap();
            if inst == "a" {
                ix.apply(&r, &[stored(None, &OWN, &t[256..], Some(4))], true).unwrap();
            }
        }
    }

    fn rebuilt(t: &[u8], who: &[(&str, i64, i64)], promote: u32) -> Index {
        let mut ix = Index::new();
        ix.s.promote = promote;
        fill(&mut ix, t, who);
        ix
    }

    #[test]
    fn cleared_ranks_hold_nothing_before_and_after_the_sweep() {
        let t = toks(128);
        let all = [("a", 0, 1), ("b", 0, 1), ("c", 0, 2), ("c", 1, 2)];
        for promote in [1, PROMOTE] {
            let mut ix = rebuilt(&t, &all, promote);
            ix.clear_rank("a", 0, 0, false);
            ix.clear_rank("c", 0, 0, false);
            assert_eq!(ix.unswept(), (2, 12));
            let rest = [("b", 0, 1), ("c", 1, 2)];
            let mut want = rebuilt(&t, &rest, promote);
            assert_eq!(answers(&mut ix, &t), answers(&mut want, &t));
            assert_eq!(ix.holder_blocks(), want.holder_blocks());
            assert_eq!(ix.entries(), want.entries());
            // Stored again before any sweep: the new slots count, the old ones still don't.
            fill(&mut ix, &t, &[("a", 0, 1), ("c", 0, 2)]);
            let mut want = rebuilt(&t, &all, promote);
            assert_eq!(answers(&mut ix, &t), answers(&mut want, &t));
            assert_eq!(ix.holder_blocks(), want.holder_blocks());
            // A partial sweep changes nothing a reader sees; a full one leaves S as rebuilt.
            ix.sweep(3);
            assert_eq!(answers(&mut ix, &t), answers(&mut want, &t));
            ix.sweep(usize::MAX);
            assert_eq!(ix.unswept(), (0, 0));
            assert_eq!(ix.s.count, want.s.count);
            assert_eq!(answers(&mut ix, &t), answers(&mut want, &t));
            // Many clears reuse the swept rm ids instead of growing the id space.
            let ids = ix.hd.rm_wm.len();
            for _ in 0..5 {
                ix.clear_rank("a", 0, 0, false);
                ix.sweep(usize::MAX);
                fill(&mut ix, &t, &[("a", 0, 1)]);
            }
            assert_eq!(ix.hd.rm_wm.len(), ids);
            assert_eq!(answers(&mut ix, &t), answers(&mut want, &t));
            assert_eq!(ix.s.count, want.s.count);
        }
    }

    #[test]
    fn a_rolled_back_clear_restores_every_holder() {
        let t = toks(128);
        let all = [("a", 0, 1), ("b", 0, 1), ("c", 0, 2), ("c", 1, 2)];
        for promote in [1, PROMOTE] {
            let mut ix = rebuilt(&t, &all, promote);
            let before = (answers(&mut ix, &t), ix.holder_blocks(), ix.entries(), ix.s.count, ix.s.multi.len());
            let a = rank("a", 0, 1);
            // Cleared, re-stored, then one key stored under more engine hashes than an S count
            // holds: the record fails at its last event and is undone whole.
            let many: Vec<u64> = (100..100 + CNT_MASK as u64 + 1).collect();
            let mut evs = vec![Ev::Clear, stored(None, &SHARED, &t[..256], None)];
            evs.extend(many.iter().map(|eh| stored(None, std::slice::from_ref(eh), &t[..64], None)));
            assert_eq!(ix.apply(&a, &evs, true), Err(ApplyError::Overflow));
            let after = (answers(&mut ix, &t), ix.holder_blocks(), ix.entries(), ix.s.count, ix.s.multi.len());
            assert_eq!(after, before);
            assert_eq!(ix.unswept(), (0, 0));
            ix.sweep(usize::MAX);
            assert_eq!(answers(&mut ix, &t), before.0);
        }
    }
}
