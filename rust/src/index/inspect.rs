//! Reads that are not a score: per-worker counts, sizes, what a worker holds,
//! and the digest that compares this index with another's.

use std::collections::{BTreeSet, HashMap};

use super::{Index, Stats};
use crate::table::{RTable, ENGINE, ORPHAN};

impl Index {
    /// A table's entries (engine hash, key, meta) oldest first, as its rm's chain log has
    /// them (an R table's own order is its hash order): what a snapshot writes, so that an
    /// index built from it scores stored conversations by their logs, as this one does.
    pub fn entries_in_store_order(&self, t: &RTable) -> Vec<(u64, u64, u16)> {
        let mut es: Vec<_> = t.entries().collect();
        es.sort_by_cached_key(|&(_, key, _)| self.s.log_age(key, t.rm));
        es
    }

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
        n += self.graveyard.iter().map(|(t, _)| t.nbytes()).sum::<usize>();
        for w in &self.workers {
            n += w.memo.nbytes();
            for r in &w.ranks {
                for t in &r.tables {
                    n += t.nbytes();
                }
            }
        }
        n
    }

    /// Worker `w`'s memo of removed parents as (engine hash, key, orphan), oldest first: what a
    /// snapshot carries of it (`import_memo` rebuilds the same line).
    pub fn memo_entries(&self, w: u32) -> Vec<(u64, u64, bool)> {
        self.workers[w as usize].memo.entries().collect()
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
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::index::test_util::toks;
    use crate::index::{Ev, RankId, Store};
    use crate::keys::{Ctx, ROOT};

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
