//! A snapshot's tables and group list installed into an index.

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
