//! A snapshot's tables, group list and memos installed into an index.

use super::{is_grouped, GroupSpec, Index, RankId, Reach, TableBlob};
use crate::table::{ENGINE, REF_MASK};

impl Index {
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
                let g = is_grouped(&wk.groups);
                self.set_grouped(l.0, g);
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

    /// Install a worker's exported memo, oldest first (`Memo::entries`), so its line, and
    /// what it pushes out next, is the exporter's. Err when the worker already remembers
    /// something or a hash comes twice: not a blob `export` wrote for an index without the
    /// worker. More than `PARENT_MEMO` entries (a build with a larger bound wrote it) keep
    /// the newest, as the line would have.
    pub fn import_memo(&mut self, inst: &str, dp: i64, tp: u32, entries: &[(u64, u64, bool)]) -> Result<(), String> {
        if entries.is_empty() {
            return Ok(());
        }
        // A worker whose ranks all expired keeps its memo (`drop_rank`), so the blob may name a
        // worker no table names: created here as its tables would have.
        let w = self.worker(inst, dp, tp.max(1));
        let memo = &mut self.workers[w as usize].memo;
        if !memo.is_empty() {
            return Err("a memo for a worker that has one".into());
        }
        for &(eh, key, orphan) in entries {
            if memo.get(eh).is_some() {
                memo.clear();
                return Err("a hash twice in a memo".into());
            }
            memo.remember(eh, key, orphan);
        }
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
            let g = is_grouped(&wk.groups);
            self.set_grouped(w, g);
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
    use super::super::test_util::{rank, stored, toks};
    use super::super::{Ev, Index};

    /// The memo moved with its worker: a child of a parent removed before the move is
    /// chained where it lands, as where it came from.
    #[test]
    fn an_imported_memo_chains_like_the_exported_one() {
        let t = toks(64);
        let a = rank("a", 0, 1);
        let mut src = Index::new();
        src.apply(&a, &[stored(None, &[1, 2], &t[..128], None)], true).unwrap();
        src.apply(&a, &[Ev::Remove { medium: None, group: 0, ehs: &[1, 2] }], true).unwrap();
        let w = src.worker_id("a", 0).unwrap() as usize;
        let memo: Vec<_> = src.workers[w].memo.entries().collect();
        assert_eq!(memo.len(), 2);

        // Every table gone with the removes: the memo alone names the worker.
        let mut dst = Index::new();
        dst.import_memo("a", 0, 1, &memo).unwrap();
        let child = [stored(None, &[3], &t[128..192], Some(2))];
        for ix in [&mut src, &mut dst] {
            ix.apply(&a, &child, true).unwrap();
        }
        let held = |ix: &Index| {
            let w = ix.worker_id("a", 0).unwrap() as usize;
            ix.workers[w].ranks[0].tables[0].entries().collect::<Vec<_>>()
        };
        assert_eq!(held(&dst), held(&src));
        assert_eq!(dst.stats()[0].orphans, 0);

        // Not what an export writes for an index without the worker: refused.
        assert!(dst.import_memo("a", 0, 1, &memo).is_err());
        assert!(Index::new().import_memo("b", 0, 1, &[(5, 6, false), (5, 7, true)]).is_err());
    }

    /// A table exported in store order and imported lays its chain log out in that order,
    /// contiguous: the stores and removes that left it scattered do not carry over.
    #[test]
    fn an_imported_table_keeps_its_store_order() {
        use crate::index::TableBlob;
        let t = toks(256);
        let a = rank("a", 0, 1);
        let mut src = Index::new();
        let ehs: Vec<u64> = (1..=16).collect();
        src.apply(&a, &[stored(None, &ehs[..8], &t[..512], None)], true).unwrap();
        src.apply(&a, &[stored(None, &ehs[8..], &t[512..], Some(8))], true).unwrap();
        src.apply(&a, &[Ev::Remove { medium: None, group: 0, ehs: &[3, 11] }], true).unwrap();
        fn tab(ix: &Index) -> &crate::table::RTable {
            &ix.workers[ix.worker_id("a", 0).unwrap() as usize].ranks[0].tables[0]
        }
        let es = src.entries_in_store_order(tab(&src));
        let order: Vec<u64> = es.iter().map(|e| e.0).collect();
        assert_eq!(order, [1, 2, 4, 5, 6, 7, 8, 9, 10, 12, 13, 14, 15, 16]);
        let (e, k, m): (Vec<u64>, Vec<u64>, Vec<u16>) =
            (es.iter().map(|x| x.0).collect(), es.iter().map(|x| x.1).collect(), es.iter().map(|x| x.2).collect());
        let blob = TableBlob { medium: "GPU", group: 0, ehs: &e, keys: &k, metas: &m, unknown: 0, dups: 0 };
        let mut dst = Index::new();
        dst.import_table(&a, &blob).unwrap();
        let t2 = tab(&dst);
        let ages: Vec<u32> = k.iter().map(|&key| dst.s.log_age(key, t2.rm)).collect();
        assert_eq!(ages, (0..14).collect::<Vec<u32>>());
        assert_eq!(dst.entries_in_store_order(t2), es);
    }
}
