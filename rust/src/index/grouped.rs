//! The score of grouped workers (hybrid models' KV-cache groups, sliding
//! window, Mamba): every group's held blocks found first, one usable prefix
//! reconciled from them after, as vLLM's hybrid coordinator does.

use super::{Index, Query, Reach};
use crate::keys::{block_key_le, ROOT};

fn lcm(a: i64, b: i64) -> i64 {
    let (mut x, mut y) = (a, b);
    while y != 0 {
        (x, y) = (y, x % y);
    }
    a / x * b
}

impl Index {
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
    pub(super) fn score_grouped(
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
            // The tokens each weight serves: those the media weighing at least it reach beyond
            // what heavier media reach.
            let mut served: Vec<(f64, i64)> = Vec::with_capacity(levels.len());
            let mut prev = 0i64;
            for &t in &levels {
                let l = usable(&|m| weights[m as usize] >= t);
                served.push((t, (l - prev).max(0)));
                prev = prev.max(l);
            }
            let score = super::walk::weighted(&mut served);
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
}
