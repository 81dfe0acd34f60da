//! Interning: workers (instance_id, dp_rank), media, and the wm / rm ids the
//! tables and the walk count in, with each worker's TP degree and place in
//! name order kept current as they change, so that a score only reads them.

use super::{normalize_medium, ApplyError, Index, Loc, Rank, RankId, Worker};
use crate::table::{RTable, MAX_RM};

impl Index {
    pub fn worker_id(&self, inst: &str, dp: i64) -> Option<u32> {
        self.worker_ids.get(inst)?.iter().find(|(d, _)| *d == dp).map(|(_, w)| *w)
    }

    pub(super) fn worker(&mut self, inst: &str, dp: i64, tp: u32) -> u32 {
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
        // The name order is kept current here because `score` only reads and would otherwise
        // sort on every call: its place found by bisection (a count of the names before it
        // compared every name, seconds for a fleet of 16k workers joining), then O(workers)
        // integer shifts.
        let workers = &self.workers;
        let p = self.name_ids.partition_point(|&id| {
            let x = &workers[id as usize];
            (x.inst.as_str(), x.dp) < (inst, dp)
        }) as u32;
        for r in self.name_rank.iter_mut() {
            if *r >= p {
                *r += 1;
            }
        }
        self.name_rank.push(p);
        self.name_ids.insert(p as usize, w);
        self.workers.push(Worker {
            inst: inst.to_owned(),
            dp,
            tp_size: tp,
            ranks: vec![],
            wms: vec![],
            groups: vec![],
            grouped: false,
            memo: Default::default(),
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

    pub(super) fn sync_tp(&mut self, w: u32) {
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

    pub(super) fn table(&mut self, rank: &RankId, medium: Option<&str>, group: i64) -> Result<Loc, ApplyError> {
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
                self.wm_not_worker |= wm != w;
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
    pub(super) fn tab(&mut self, l: Loc) -> &mut RTable {
        &mut self.workers[l.0 as usize].ranks[l.1].tables[l.2]
    }

    pub fn context(&mut self, lora: Option<&str>) -> u64 {
        self.ctx.get(lora)
    }
}
