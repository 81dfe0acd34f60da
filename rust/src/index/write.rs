//! The write path: events checked, applied to a rank's tables and to S, each
//! change logged so that a call that cannot finish is undone whole.

use super::{is_grouped, reach_of, ApplyError, Ev, GroupSpec, Index, Loc, RankId, Reach, Store};
use crate::keys::{engine_key, orphan_root, Ctx, ROOT};
use crate::table::{RTable, ENGINE, ORPHAN, REF_MASK};

pub(super) enum Undo {
    Insert(Loc, u64),
    Inc(Loc, u64),
    Dec(Loc, u64),
    Delete(Loc, u64, u64, u16),
    Unknown(Loc),
    Clear(Loc, Box<RTable>),
    BlockSize(i64),
    Groups(u32, Vec<GroupSpec>, bool),
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

        evs.push(stored(None, &[9], &t[..64], None));
        let mut ix = two_workers(&t);
        let before = seen(&mut ix, &t);
        assert_eq!(ix.apply(&rank("a", 0, 1), &evs, true), Err(ApplyError::Overflow));
        assert_eq!(seen(&mut ix, &t), before);
        assert_eq!(counts(&ix, "a"), (4, 0, 0, 1));
        // The undone rank still takes writes as before: block 1's two copies need two removes.
        assert_eq!(ix.apply(&rank("a", 0, 1), &[remove(&[1])], true), Ok(1));
        assert_eq!(ranked(&mut ix, &t, |_| 1.0, None, None)[0], ("a".to_string(), 64, 64.0));
    }
}
