//! The score: every query's blocks walked in order, each worker credited
//! until the first block it lacks. Workers with several KV-cache groups, or a
//! sparse one, need more than a leading run and are handed to `grouped`.

use super::{Index, Query, Scores};
use crate::keys::{chain_batch, CHAIN_BATCH, ROOT};
use crate::table::{mix, prefetch_line, Probe, STable};

/// A score as an integer in the same order (f64 total order, -0.0 counted as 0.0, as the
/// comparison of the numbers has it).
#[inline]
fn score_order(x: f64) -> u64 {
    let b = (x + 0.0).to_bits();
    if b >> 63 == 1 {
        !b
    } else {
        b | 1 << 63
    }
}

/// What `walk_one_medium` fills (`run_wm`) and works in.
struct Runs<'r> {
    run_wm: &'r mut [u32],
    cnt: &'r mut [u32],
    alive: &'r mut Vec<u64>,
    held: &'r mut Vec<u64>,
    touched: &'r mut Vec<u32>,
}

/// A score's per-worker and per-wm arrays, kept by each thread between its scores: a score
/// of a miss is otherwise mostly allocating and freeing them (a fifth of its time at 256
/// workers). Each score sizes and zeroes what it uses.
#[derive(Default)]
struct Scratch {
    best_run: Vec<i64>,
    best_score: Vec<f64>,
    best_wm: Vec<i64>,
    run_w: Vec<u32>,
    score_w: Vec<f64>,
    run_wm: Vec<u32>,
    cnt: Vec<u32>,
    bestw: Vec<f64>,
    bestm: Vec<u32>,
    wcnt: Vec<u32>,
    ok: Vec<bool>,
    alive: Vec<u64>,
    held: Vec<u64>,
    touched: Vec<u32>,
    wtouched: Vec<u32>,
    at: Vec<u32>,
    fill: Vec<u32>,
    matched_wms: Vec<u32>,
}

/// Below one hit per this many wms, a score's per-medium results are read from its hits'
/// Workers rather than from passes over every wm.
const FEW_HITS_PER_WM: usize = 8;

thread_local! {
    /// Taken for a score and put back after it (a score never runs inside another, and if one
    /// did it would take an empty one).
    static SCRATCH: std::cell::Cell<Scratch> = std::cell::Cell::new(Scratch::default());
}

/// A worker's score from the tokens each weight serves, `(weight, tokens)`: the sum of
/// tokens x weight, equal weights merged, the highest weight first. Every path (one medium,
/// several, hybrid groups) and the oracle sum the same way, so that one prefix gets one float
/// whichever path scored it (a sum block by block drifted: 6 blocks of 16 at 0.8 gave 76.8
/// where 96 x 0.8 gives 76.80000000000001). Sorts `levels` in place: no allocation on the walk.
pub(super) fn weighted(levels: &mut [(f64, i64)]) -> f64 {
    if let [(t, tokens)] = levels {
        return *tokens as f64 * *t;
    }
    let v = levels;
    v.sort_by(|a, b| b.0.partial_cmp(&a.0).unwrap_or(std::cmp::Ordering::Equal));
    let (mut score, mut i) = (0f64, 0);
    while i < v.len() {
        let t = v[i].0;
        let mut tokens = 0i64;
        while i < v.len() && v[i].0 == t {
            tokens += v[i].1;
            i += 1;
        }
        score += tokens as f64 * t;
    }
    score
}

/// `v` as `n` copies of `x`, reusing its allocation.
fn filled<T: Copy>(v: &mut Vec<T>, n: usize, x: T) -> &mut [T] {
    v.clear();
    v.resize(n, x);
    v
}

/// How many blocks ahead of the walk a query's keys are computed and their
/// table slots prefetched: enough to cover a memory miss at the walk's
/// per-block pace, few enough that a miss query hashes only a handful extra.
const AHEAD: usize = 8;
/// Holds the block read and the `AHEAD + CHAIN_BATCH` after it.
const RING: usize = 32;

/// How many blocks ahead of the one being hashed a query's token bytes are prefetched. A
/// query's tokens are usually cold (a router's request, written once, 32 KB for 8k tokens)
/// and the hardware prefetcher does not cross a 4 KB page, so without this a stored
/// conversation's score waited on its own tokens: cold-query p99 28.7 µs, against 21.4 with
/// the tokens touched before the score (bench workload at 10M; docs/DESIGN.md).
const TOKENS_AHEAD: usize = 2 * CHAIN_BATCH;

/// Prefetch the token bytes of blocks `from..to` (those that exist).
#[inline]
fn prefetch_tokens(tokens: &[u8], bs: usize, from: usize, to: usize) {
    let w = bs * 4;
    let (a, b) = ((from * w).min(tokens.len()), (to * w).min(tokens.len()));
    for off in (a..b).step_by(64) {
        prefetch_line(tokens[off..].as_ptr());
    }
}

/// A query's block keys in walk order, each computed `AHEAD` blocks before the
/// walk reads it, with its probe kept (the walk does not compute it twice) and, once the
/// holder sets are looked up (`sets`), the key's set when it has one. A key's S slots are
/// prefetched then, unless it has a holder set, which the walk reads instead of its slots
/// (a shared prompt's blocks: prefetching their slots only queued misses ahead of the
/// misses that matter).
struct KeysAhead<'a, 'q, 's> {
    q: &'a Query<'q>,
    s: &'s STable,
    n: usize,
    ring: [(u64, Probe, Option<&'s [u64]>); RING],
    done: usize,
    last: u64,
    /// Look up holder sets ahead; off, every key's slots are prefetched and no set is given.
    sets: bool,
    /// Prefetch the slots of keys without a set; off while a chain log answers instead, and
    /// then a key's probe is left `lazy` (only the last survivor reads keys computed then).
    prefetch: bool,
}

impl<'a, 'q, 's> KeysAhead<'a, 'q, 's> {
    fn new(q: &'a Query<'q>, n: usize, s: &'s STable) -> Self {
        if let Query::Tokens { tokens, bs, .. } = q {
            // The blocks after the first batch, up to where `fill` starts prefetching.
            prefetch_tokens(tokens, *bs, CHAIN_BATCH, CHAIN_BATCH + TOKENS_AHEAD);
        }
        KeysAhead {
            q,
            s,
            n,
            ring: [(0, Probe::default(), None); RING],
            done: 0,
            last: ROOT,
            sets: true,
            prefetch: true,
        }
    }

    /// Key of block `i`, its probe and its holder set; blocks are asked for in order, 0, 1, 2, ...
    #[inline]
    fn at(&mut self, i: usize) -> (u64, Probe, Option<&'s [u64]>) {
        self.fill(self.n.min(i + AHEAD + 1));
        self.ring[i % RING]
    }

    /// How many blocks from `i` on have the mixed keys `run` lists, in its order (at most
    /// `run.len()`): a chain log's entries, read as a slice instead of one lookup per block.
    /// Keys are computed a batch at a time, not `AHEAD`: while a log answers, nothing is
    /// prefetched. A blank entry (0) matches no block. Past the keys already in the ring, a
    /// batch is compared where it was computed and goes into the ring only when the run ends
    /// inside it (the walk reads those keys next): a conversation's followed blocks were each
    /// written to the ring and read back, ~2 ns a block over the hashing itself.
    #[inline]
    fn follow(&mut self, i: usize, run: &[u64]) -> usize {
        let lim = run.len().min(self.n - i);
        let mut m = 0;
        while m < lim && i + m < self.done {
            let h = self.ring[(i + m) % RING].1.h;
            if h == 0 || h != run[m] {
                return m;
            }
            m += 1;
        }
        while m < lim {
            let (from, to) = (self.done, self.n.min(self.done + CHAIN_BATCH));
            let batch = self.batch(from, to);
            let upto = (to - from).min(lim - m);
            let mut j = 0;
            while j < upto {
                let h = mix(batch[j]);
                if h == 0 || h != run[m + j] {
                    break;
                }
                j += 1;
            }
            if j < to - from {
                self.put(from, to, &batch);
                return m + j;
            }
            self.last = batch[j - 1];
            self.done = to;
            m += j;
        }
        m
    }

    /// Compute keys (a batch at a time) until block `until` is in the ring.
    #[inline]
    fn fill(&mut self, until: usize) {
        while self.done < until {
            let (from, to) = (self.done, self.n.min(self.done + CHAIN_BATCH));
            let batch = self.batch(from, to);
            self.put(from, to, &batch);
        }
    }

    /// Keys of blocks `from..to` (at most a batch; `from` is `done`), not yet in the ring: a
    /// query's tokens hashed at once (keys.rs: their content hashes overlap in the CPU), or
    /// its given keys.
    #[inline]
    fn batch(&self, from: usize, to: usize) -> [u64; CHAIN_BATCH] {
        let mut batch = [0u64; CHAIN_BATCH];
        match self.q {
            Query::Tokens { tokens, bs, ctx } => {
                prefetch_tokens(tokens, *bs, to + TOKENS_AHEAD, to + TOKENS_AHEAD + CHAIN_BATCH);
                chain_batch(tokens, *bs, from, to, self.last, *ctx, &mut batch);
            }
            Query::Keys { keys, .. } => batch[..to - from].copy_from_slice(&keys[from..to]),
        }
        batch
    }

    /// Put blocks `from..to` (their keys `batch`) in the ring with their probes and sets.
    #[inline]
    fn put(&mut self, from: usize, to: usize, batch: &[u64; CHAIN_BATCH]) {
        let s = self.s;
        for (b, &key) in (from..to).zip(batch.iter()) {
            let set = if self.sets && !s.multi.is_empty() { s.multi.get(&key).map(|v| &v[..]) } else { None };
            let p = if set.is_none() && self.prefetch {
                let p = s.probe(key);
                s.prefetch(p);
                p
            } else if self.prefetch {
                s.probe(key)
            } else {
                STable::lazy(key)
            };
            self.ring[b % RING] = (key, p, set);
        }
        self.last = batch[to - from - 1];
        self.done = to;
    }
}

/// Distinct (score, matched) values `by_score_stably` groups by; past this, it sorts.
const FEW_VALUES: usize = 8;

/// `hits` ordered by (score, matched) and otherwise as they came: what a stable sort by
/// those two gives. A score's hits take a handful of distinct values (a shared prompt matches
/// hundreds of workers alike, a conversation's own worker beyond them), so they are emitted
/// value by value, in passes over the hits: ~0.49 µs for 170 hits of two values against the
/// stable sort's ~0.92 (4% of a stored conversation's score with every matched worker returned).
fn by_score_stably(hits: Vec<(u64, u64, u32, u32)>) -> Vec<(u64, u64, u32, u32)> {
    let mut values: Vec<(u64, u64)> = Vec::with_capacity(FEW_VALUES);
    for h in &hits {
        let v = (h.0, h.1);
        if !values.contains(&v) {
            if values.len() == FEW_VALUES {
                let mut hits = hits;
                hits.sort_by_key(|h| (h.0, h.1));
                return hits;
            }
            values.push(v);
        }
    }
    if values.len() <= 1 {
        return hits;
    }
    values.sort_unstable();
    let mut out = Vec::with_capacity(hits.len());
    for v in values {
        out.extend(hits.iter().filter(|h| (h.0, h.1) == v));
    }
    out
}

impl Index {
    /// Weights per medium id from a (name -> weight) lookup.
    pub fn weight_array(&self, f: impl Fn(&str) -> f64) -> Vec<f64> {
        self.media.iter().map(|m| f(m)).collect()
    }

    /// Longest held prefix per worker over every query (max per field across
    /// queries, i.e. block sizes), ordered best first, at most `top_k`.
    /// `mask[w]` false excludes worker w.
    /// Reads only (`&self`): scores run without the GIL beside each other (py_index.rs `Shared`).
    pub fn score(&self, queries: &[Query], weights: &[f64], mask: Option<&[bool]>, top_k: Option<usize>) -> Scores {
        let mut sc = SCRATCH.with(std::cell::Cell::take);
        let out = self.score_in(&mut sc, queries, weights, mask, top_k);
        SCRATCH.with(|c| c.set(sc));
        out
    }

    fn score_in(
        &self,
        sc: &mut Scratch,
        queries: &[Query],
        weights: &[f64],
        mask: Option<&[bool]>,
        top_k: Option<usize>,
    ) -> Scores {
        let nw = self.workers.len();
        let nwm = self.wm_worker.len();
        let mut out = Scores::default();
        out.by_off.push(0);
        if nw == 0 || self.s.count == 0 {
            return out;
        }
        if let ([q], [weight]) = (queries, weights) {
            if mask.is_none() && self.n_grouped == 0 && !self.wm_not_worker && *weight >= 0.0 {
                return self.score_one(sc, q, *weight, top_k);
            }
        }
        let Scratch {
            best_run,
            best_score,
            best_wm,
            run_w,
            score_w,
            run_wm,
            cnt,
            bestw,
            bestm,
            wcnt,
            ok,
            alive,
            held,
            touched,
            wtouched,
            at: at_s,
            fill,
            matched_wms: matched_s,
        } = sc;
        let best_run = filled(best_run, nw, 0);
        let best_score = filled(best_score, nw, 0.0);
        let best_wm = filled(best_wm, nwm, 0);
        let run_w = filled(run_w, nw, 0);
        let score_w = filled(score_w, nw, 0.0);
        let run_wm = filled(run_wm, nwm, 0);
        let cnt = filled(cnt, nwm, 0);
        let bestw = filled(bestw, nw, -1.0);
        let nmed = weights.len();
        let bestm = filled(bestm, nw, 0);
        // Per worker, its blocks of this walk by the medium that weighs most among their holders.
        let wcnt = filled(wcnt, if self.media.len() == 1 { 0 } else { nw * nmed }, 0);
        // A worker's (weight, tokens) for `weighted`, one buffer for the whole score.
        let mut levels: Vec<(f64, i64)> = Vec::with_capacity(nmed);
        touched.clear();
        // One flag per worker whatever the mask's length (unchecked reads below rely on it).
        let ok = filled(ok, nw, true);
        if let Some(m) = mask {
            for (o, &k) in ok.iter_mut().zip(m) {
                *o = k;
            }
        }
        // Grouped workers (hybrid models) are scored group by group, after the walk.
        let mut grouped: Vec<u32> = vec![];
        for (w, wk) in self.workers.iter().enumerate().take(if self.n_grouped > 0 { nw } else { 0 }) {
            if wk.grouped && ok[w] {
                grouped.push(w as u32);
                ok[w] = false;
            }
        }
        // Media a tier view leaves out (weight EXCLUDED): their copies hold nothing here.
        let excluding = weights.iter().any(|&w| w < 0.0);
        let wm_ok: Vec<bool> =
            if excluding { self.wm_medium.iter().map(|&m| weights[m as usize] >= 0.0).collect() } else { vec![] };
        let every = mask.is_none() && grouped.is_empty() && !excluding;
        wtouched.clear();
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
                reached = self.walk_one_medium(q, n, ok, every, weights, Runs { run_wm, cnt, alive, held, touched });
                for wm in 0..nwm {
                    let r = run_wm[wm];
                    if r > 0 {
                        let w = self.wm_worker[wm] as usize;
                        run_w[w] = run_w[w].max(r);
                        let wt = weights[self.wm_medium[wm] as usize];
                        score_w[w] = score_w[w].max(weighted(&mut [(wt, r as i64 * scale)]));
                    }
                }
            }
            let mut ks = KeysAhead::new(q, n, &self.s);
            for i in 0..if self.media.len() == 1 { 0 } else { n } {
                let (_, probe, hs) = ks.at(i);
                touched.clear();
                wtouched.clear();
                let iu = i as u32;
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
                                bestm[w] = self.wm_medium[wmu];
                            }
                        }
                    }
                }
                let rm_wm = &self.hd.rm_wm;
                let rm_w = &self.rm_w;
                let hot = hs.is_some();
                // SAFETY: rm ids in S index rm_wm / rm_w; wm ids index cnt; worker ids index run_w / ok.
                if !hot {
                    self.s.holders_fast(probe, |rm| unsafe {
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
                for &wm in touched.iter() {
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
                            bestm[w] = self.wm_medium[wmu];
                        }
                    }
                    cnt[wmu] = 0;
                }
                for &w in wtouched.iter() {
                    let w = w as usize;
                    run_w[w] = i as u32 + 1;
                    wcnt[w * nmed + bestm[w] as usize] += 1;
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
                    if self.media.len() != 1 {
                        let row = &mut wcnt[w * nmed..(w + 1) * nmed];
                        levels.clear();
                        levels.extend((0..nmed).filter(|&m| row[m] > 0).map(|m| (weights[m], row[m] as i64 * scale)));
                        row.fill(0);
                        score_w[w] = weighted(&mut levels);
                    }
                    best_run[w] = best_run[w].max(run_w[w] as i64 * scale);
                    best_score[w] = best_score[w].max(score_w[w]);
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
        if !grouped.is_empty() && self.score_grouped(queries, weights, &grouped, best_run, best_score, best_wm) {
            hit_any = true;
        }
        if !hit_any {
            return out;
        }
        let hits = self.ordered_hits(|w| (best_run[w], best_score[w]), top_k);
        out.worker.reserve(hits.len());
        out.matched.reserve(hits.len());
        out.score.reserve(hits.len());
        out.by_off.reserve(hits.len());
        out.by_medium.reserve(hits.len());
        out.by_tokens.reserve(hits.len());
        // Each hit's wms that matched, in the order of its `wms`, which is wm id order (wm ids
        // are handed out in creation order, and a worker's list grows with them). Few hits (a
        // top k) read their Workers' lists; many are grouped by worker in passes over the wm
        // arrays instead of a visit to every hit's Worker.
        let ident = !self.wm_not_worker;
        let few = !ident && hits.len() * FEW_HITS_PER_WM < nwm;
        let (mut at, mut matched_wms): (&[u32], &[u32]) = (&[], &[]);
        if !ident && !few {
            let matched_wm = || best_wm.iter().zip(&self.wm_worker).enumerate().filter(|(_, (&b, _))| b > 0);
            let at_ = filled(at_s, nw + 1, 0);
            for (_, (_, &w)) in matched_wm() {
                at_[w as usize + 1] += 1;
            }
            // The running sum in a register: `at_[w + 1] += at_[w]` waited on its own store
            // each step (a seventh of an every-worker answer's cost at 256 workers).
            let mut sum = 0;
            for a in at_[1..].iter_mut() {
                sum += *a;
                *a = sum;
            }
            let fill = filled(fill, nw, 0);
            fill.copy_from_slice(&at_[..nw]);
            let m = filled(matched_s, at_[nw] as usize, 0);
            for (wm, (_, &w)) in matched_wm() {
                m[fill[w as usize] as usize] = wm as u32;
                fill[w as usize] += 1;
            }
            (at, matched_wms) = (at_, m);
        }
        for &(_, _, _, w) in &hits {
            let wu = w as usize;
            out.worker.push(w);
            out.matched.push(best_run[wu]);
            out.score.push(best_score[wu]);
            // Its wms: itself (`wm_not_worker`), its Worker's list, or its run of the passes.
            let wms: &[u32] = if ident {
                std::slice::from_ref(&w)
            } else if few {
                &self.workers[wu].wms
            } else {
                &matched_wms[at[wu] as usize..at[wu + 1] as usize]
            };
            for &wm in wms {
                if best_wm.get(wm as usize).is_some_and(|&b| b > 0) {
                    out.by_medium.push(self.wm_medium[wm as usize]);
                    out.by_tokens.push(best_wm[wm as usize]);
                }
            }
            out.by_off.push(out.by_medium.len() as u32);
        }
        out
    }

    /// A score's hits, best first: the weighted score, then the matched tokens, then the name;
    /// at most `top_k`. `at(w)`: worker w's (matched tokens, score), matched 0 for no hit.
    fn ordered_hits(&self, at: impl Fn(usize) -> (i64, f64), top_k: Option<usize>) -> Vec<(u64, u64, u32, u32)> {
        let nw = self.workers.len();
        let (nr, ids) = (&self.name_rank, &self.name_ids);
        // Each hit gets its order as plain integers once, so the sort compares words instead
        // of chasing three arrays per comparison (a shared prompt matches hundreds of workers).
        let key = |w: usize| {
            let (m, sc) = at(w);
            (!score_order(sc), !(m as u64), nr[w], w as u32)
        };
        match top_k {
            Some(k) if k < nw => {
                let mut hits = Vec::with_capacity(nw);
                hits.extend((0..nw).filter(|&w| at(w).0 > 0).map(key));
                if k < hits.len() {
                    if k == 0 {
                        hits.clear();
                    } else {
                        hits.select_nth_unstable(k - 1);
                        hits.truncate(k);
                    }
                }
                hits.sort_unstable();
                hits
            }
            _ => {
                // Every hit: taken in name order, one pass over the workers in that order, then
                // sorted stably by score and matched tokens. Hits mostly tie (a shared prompt
                // matches hundreds of workers equally), and a stable sort passes over a tied run
                // once, where a comparison sort of the whole tuple costs n log n.
                let mut hits = Vec::with_capacity(nw);
                hits.extend(ids.iter().map(|&w| w as usize).filter(|&w| at(w).0 > 0).map(key));
                by_score_stably(hits)
            }
        }
    }

    /// The common score, apart: one query (one block size), one medium, every worker asked, and
    /// each worker one wm. Its walk's per-wm runs are the answer, read once, where the general
    /// path sizes and passes over nine per-worker arrays (the same answers: the oracle tests
    /// run both, and `the_one_query_path_answers_as_the_general_one` pins them equal).
    fn score_one(&self, sc: &mut Scratch, q: &Query, weight: f64, top_k: Option<usize>) -> Scores {
        let mut out = Scores::default();
        out.by_off.push(0);
        let (n, scale) = match q {
            Query::Tokens { tokens, bs, .. } => (tokens.len() / 4 / bs, *bs as i64),
            Query::Keys { keys, scale } => (keys.len(), *scale),
        };
        if n == 0 {
            return out;
        }
        let nw = self.workers.len();
        let Scratch { run_wm, cnt, alive, held, touched, .. } = sc;
        let run_wm = filled(run_wm, nw, 0);
        let cnt = filled(cnt, nw, 0);
        if self.walk_one_medium(q, n, &[], true, &[weight], Runs { run_wm, cnt, alive, held, touched }) == 0 {
            return out;
        }
        // As the general path computes them (`weighted`).
        let at = |w: usize| {
            let tokens = run_wm[w] as i64 * scale;
            (tokens, weighted(&mut [(weight, tokens)]))
        };
        let hits: Vec<u32> = match top_k {
            Some(k) if k < nw => self.ordered_hits(at, top_k).iter().map(|h| h.3).collect(),
            _ => self.by_run_then_name(run_wm),
        };
        // One array at a time, each from an exact-size iterator: pushing a hit into six
        // vectors at once kept their lengths in memory, a store and a reload per push (a
        // seventh of a stored conversation's score with its 171 hits).
        let wm_medium = &self.wm_medium;
        Scores {
            matched: hits.iter().map(|&w| at(w as usize).0).collect(),
            score: hits.iter().map(|&w| at(w as usize).1).collect(),
            // Each hit holds on its one medium.
            by_off: (0..=hits.len() as u32).collect(),
            by_medium: hits.iter().map(|&w| wm_medium[w as usize]).collect(),
            by_tokens: hits.iter().map(|&w| at(w as usize).0).collect(),
            worker: hits,
        }
    }

    /// Every worker with a run, longest run first, then by name: the order `ordered_hits`
    /// gives in `score_one`, where a worker's score and matched tokens both grow with its run
    /// (weight > 0; at weight 0 every score ties and matched tokens order them). A run takes
    /// a handful of values, so hits are taken in name order and emitted run by run, ids alone
    /// (4 bytes a hit where an ordering key is 24).
    fn by_run_then_name(&self, run: &[u32]) -> Vec<u32> {
        let mut hits = Vec::with_capacity(self.workers.len());
        let mut runs: Vec<u32> = Vec::with_capacity(FEW_VALUES);
        let mut few = true;
        for &w in &self.name_ids {
            let r = run[w as usize];
            if r > 0 {
                hits.push(w);
                if few && !runs.contains(&r) {
                    few = runs.len() < FEW_VALUES;
                    runs.push(r);
                }
            }
        }
        if !few {
            hits.sort_by_key(|&w| std::cmp::Reverse(run[w as usize]));
            return hits;
        }
        if runs.len() <= 1 {
            return hits;
        }
        runs.sort_unstable_by(|a, b| b.cmp(a));
        let mut out = Vec::with_capacity(hits.len());
        for r in runs {
            out.extend(hits.iter().filter(|&&w| run[w as usize] == r));
        }
        out
    }

    /// The walk when every holder is on one medium (one wm per worker): the
    /// workers still matching are a bitset, each block intersects it with the
    /// block's holders (a hot key's holder set, word by word, or the wms its
    /// slots show holding), and a wm's run is set once, when it drops out.
    /// Fills `run_wm` (zeroed by the caller); returns the blocks anyone matched. `every`:
    /// `ok` is all true and no weight excludes a medium.
    fn walk_one_medium(&self, q: &Query, n: usize, ok: &[bool], every: bool, weights: &[f64], out: Runs) -> usize {
        let Runs { run_wm, cnt, alive, held, touched } = out;
        let nwm = self.wm_worker.len();
        let words = nwm.div_ceil(64);
        let alive = filled(alive, words, 0);
        if every {
            // Nothing masked or excluded: every wm, a word at a time (a pass over the wm arrays
            // was a tenth of a miss query's cost at 256 workers).
            alive.iter_mut().for_each(|a| *a = !0);
            if nwm % 64 != 0 {
                alive[words - 1] = (1 << (nwm % 64)) - 1;
            }
        } else {
            for wm in 0..nwm {
                if ok[self.wm_worker[wm] as usize] && weights[self.wm_medium[wm] as usize] >= 0.0 {
                    alive[wm >> 6] |= 1 << (wm & 63);
                }
            }
        }
        let held = filled(held, words, 0);
        let rm_wm = &self.hd.rm_wm;
        let mut reached = 0usize;
        let mut ks = KeysAhead::new(q, n, &self.s);
        for i in 0..n {
            let (_, probe, set) = ks.at(i);
            held.iter_mut().for_each(|x| *x = 0);
            if let Some(bits) = set {
                for (h, &b) in held.iter_mut().zip(bits) {
                    *h = b;
                }
            } else {
                touched.clear();
                self.s.holders_fast(probe, |rm| {
                    let wm = rm_wm[rm] as usize;
                    if alive[wm >> 6] & (1 << (wm & 63)) != 0 {
                        if cnt[wm] == 0 {
                            touched.push(wm as u32);
                        }
                        cnt[wm] += 1;
                    }
                });
                for &wm in touched.iter() {
                    let wm = wm as usize;
                    if cnt[wm] >= self.hd.wm_tp[wm] {
                        held[wm >> 6] |= 1 << (wm & 63);
                    }
                    cnt[wm] = 0;
                }
            }
            // Words still alive, and the last of them (popcount is not in the baseline ISA).
            let (mut nz, mut last) = (0usize, 0usize);
            for k in 0..words {
                let still = alive[k] & held[k];
                let mut dropped = alive[k] & !still;
                while dropped != 0 {
                    run_wm[k * 64 + dropped.trailing_zeros() as usize] = i as u32;
                    dropped &= dropped - 1;
                }
                alive[k] = still;
                if still != 0 {
                    nz += 1;
                    last = k;
                }
            }
            if nz == 0 {
                break;
            }
            reached = i + 1;
            if nz == 1 && alive[last] & (alive[last] - 1) == 0 {
                // One wm left, as in a conversation's own tail: its blocks are tested against
                // its slots alone. A single rank (TP 1) holds a block iff one of its live slots
                // does, hot key or not, so neither the holder sets nor the bitset passes are
                // needed per block.
                let k = last;
                let x = k * 64 + alive[k].trailing_zeros() as usize;
                if self.hd.wm_tp[x] <= 1 {
                    reached = self.last_survivor(&mut ks, i + 1, n, x);
                    if reached < n {
                        run_wm[x] = reached as u32;
                        alive[k] = 0;
                    }
                    break;
                }
            }
        }
        for (k, &a) in alive.iter().enumerate() {
            let mut b = a;
            while b != 0 {
                run_wm[k * 64 + b.trailing_zeros() as usize] = reached as u32;
                b &= b - 1;
            }
        }
        reached
    }
}

impl Index {
    /// The blocks from `from` on that wm `x` (a single rank) holds, until the first it lacks:
    /// returns that block's position, or `n`. Out of line: the walk's loop stays as small as
    /// it was for queries that never narrow to one worker.
    ///
    /// A block found in a slot of x's gives that slot's place in its rm's chain log, and while
    /// the next block's key is the log's next entry it is held (a live entry is a live slot),
    /// with no probe: a stored conversation's blocks are a sequential read of its own log,
    /// probed only where its chain breaks (a record boundary, a block stored earlier).
    #[inline(never)]
    fn last_survivor(&self, ks: &mut KeysAhead, from: usize, n: usize, x: usize) -> usize {
        let rm_wm = &self.hd.rm_wm;
        // Its own slots and log answer for hot keys too: no more sets looked up.
        ks.sets = false;
        let mut at: Option<(usize, u32)> = None;
        let mut j = from;
        while j < n {
            if let Some((rm, pos)) = at {
                // The log is answering: the slots of the keys ahead are not needed.
                ks.prefetch = false;
                let m = ks.follow(j, self.s.logged_run(rm, pos.wrapping_add(1)));
                if m > 0 {
                    // Blocks j..j+m held; a run ends at its chunk's end, where the next one starts.
                    at = Some((rm, pos.wrapping_add(m as u32)));
                    j += m;
                    continue;
                }
            }
            let (_, probe, set) = ks.at(j);
            j += 1;
            ks.prefetch = true;
            if let Some(bits) = set {
                // Looked up before the walk narrowed (its slots not prefetched): the set answers.
                if bits.get(x >> 6).is_some_and(|b| b & (1 << (x & 63)) != 0) {
                    at = None;
                    continue;
                }
                return j - 1;
            }
            at = self.s.holder_slot(self.s.complete(probe), |rm| rm_wm[rm] as usize == x);
            if at.is_none() {
                return j - 1;
            }
        }
        n
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::index::test_util::{rank, ranked, stored, toks};
    use crate::index::{Ev, RankId, Store, EXCLUDED};
    use crate::keys::Ctx;

    /// The one-query path (`score_one`) answers as the general one, which a mask of every
    /// worker forces: hits in both 64-wm words, a hot key's holder set, a conversation's own
    /// tail, ties, a weight, top_k below and above the hits, and a query shorter than a block.
    #[test]
    fn weighted_sums_tokens_per_weight_merged_highest_first() {
        assert_eq!(weighted(&mut [(0.8, 96)]), 96.0 * 0.8);
        // Equal weights are merged before the product, whatever order they come in.
        assert_eq!(weighted(&mut [(0.8, 32), (1.0, 32), (0.8, 64)]), 32.0 * 1.0 + 96.0 * 0.8);
        assert_ne!(96.0 * 0.8, [0.8f64; 6].iter().sum::<f64>() * 16.0, "the drift the rule removes");
        assert_eq!(weighted(&mut []), 0.0);
    }

    #[test]
    fn the_one_query_path_answers_as_the_general_one() {
        let mut ix = Index::new();
        let n = 40usize;
        let t = toks(n as u32 * 16);
        let ehs: Vec<u64> = (1..=n as u64).collect();
        let mut next = crate::test_rng::xorshift(0x9E37_79B9_7F4A_7C15);
        for i in 0..100 {
            // Every worker holds block 1 (a hot key); then a prefix of its own length.
            let len = 1 + (next() % n as u64) as usize;
            let inst = format!("w{i:03}");
            ix.apply(&rank(&inst, 0, 1), &[stored(None, &ehs[..len], &t[..len * 64], None)], true).unwrap();
        }
        for weight in [1.0, 0.25, 0.0] {
            let wf = move |_: &str| weight;
            let all = vec![true; ix.workers.len()];
            for top_k in [None, Some(0), Some(1), Some(7), Some(1000)] {
                for blocks in [0usize, 1, 2, 17, n] {
                    let q = &t[..blocks * 64 + if blocks == 0 { 8 } else { 0 }];
                    let ctx = Ctx::One(ix.context(None));
                    let w = ix.weight_array(wf);
                    let qs = [Query::Tokens { tokens: q, bs: 16, ctx }];
                    let fast = ix.score(&qs, &w, None, top_k);
                    let general = ix.score(&qs, &w, Some(&all), top_k);
                    assert_eq!(fast, general, "weight {weight} top_k {top_k:?} blocks {blocks}");
                    assert_eq!(fast.worker.len(), if blocks == 0 { 0 } else { top_k.unwrap_or(100).min(100) });
                }
            }
        }
    }

    /// Grouping by value gives exactly the stable sort's order, with few values or many.
    #[test]
    fn by_score_stably_is_the_stable_sort() {
        let mut next = crate::test_rng::xorshift(0x9E37_79B9_7F4A_7C15);
        for distinct in [1u64, 2, 3, 8, 9, 40] {
            for n in [0usize, 1, 5, 170, 600] {
                let hits: Vec<(u64, u64, u32, u32)> = (0..n as u32)
                    .map(|i| {
                        let v = next() % distinct;
                        (v / 3, v % 3, i, next() as u32)
                    })
                    .collect();
                let mut want = hits.clone();
                want.sort_by_key(|h| (h.0, h.1));
                assert_eq!(by_score_stably(hits), want, "{distinct} values, {n} hits");
            }
        }
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

    fn one(_: &str) -> f64 {
        1.0
    }

    fn hit(inst: &str, tokens: i64) -> (String, i64, f64) {
        (inst.to_string(), tokens, tokens as f64)
    }

    /// The one-medium walk scores until a second medium appears; a block of another prompt
    /// held on CPU by worker z then sends every score through the general walk.
    fn add_a_second_medium(ix: &mut Index) {
        assert_eq!(ix.media.len(), 1);
        let other = toks(80);
        ix.apply(&rank("z", 0, 1), &[stored(Some("CPU"), &[901], &other[256..], None)], true).unwrap();
    }

    #[test]
    fn a_tp_worker_is_credited_only_for_blocks_every_rank_holds() {
        let mut ix = Index::new();
        let t = toks(64);
        ix.apply(&rank("a", 0, 2), &[stored(None, &[1, 2, 3, 4], &t, None)], true).unwrap();
        ix.apply(&rank("a", 1, 2), &[stored(None, &[1, 2], &t[..128], None)], true).unwrap();
        ix.apply(&rank("b", 0, 1), &[stored(None, &[11, 12, 13], &t[..192], None)], true).unwrap();
        assert_eq!(ranked(&mut ix, &t, one, None, None), vec![hit("b", 48), hit("a", 32)]);
        add_a_second_medium(&mut ix);
        assert_eq!(ranked(&mut ix, &t, one, None, None), vec![hit("b", 48), hit("a", 32)]);
        ix.apply(&rank("a", 1, 2), &[stored(None, &[3], &t[128..192], Some(2))], true).unwrap();
        assert_eq!(ranked(&mut ix, &t, one, None, None), vec![hit("a", 48), hit("b", 48)]);
    }

    #[test]
    fn a_masked_worker_is_not_scored() {
        let mut ix = Index::new();
        let t = toks(64);
        for inst in ["a", "b", "c"] {
            ix.apply(&rank(inst, 0, 1), &[stored(None, &[1, 2, 3, 4], &t, None)], true).unwrap();
        }
        let b = ix.worker_id("b", 0).unwrap() as usize;
        let mut mask = vec![true; 3];
        mask[b] = false;
        assert_eq!(ranked(&mut ix, &t, one, Some(&mask), None), vec![hit("a", 64), hit("c", 64)]);
        // A mask shorter than the fleet leaves the workers past its end in.
        assert_eq!(ix.worker_id("a", 0), Some(0));
        assert_eq!(ranked(&mut ix, &t, one, Some(&[false]), None), vec![hit("b", 64), hit("c", 64)]);
        add_a_second_medium(&mut ix);
        assert_eq!(ranked(&mut ix, &t, one, Some(&mask), None), vec![hit("a", 64), hit("c", 64)]);
    }

    /// Best first: the weighted score, then the matched tokens, then the name; `top_k` keeps
    /// the first k of that order, whatever order the workers came in.
    #[test]
    fn top_k_keeps_the_best_by_score_then_matched_then_name() {
        let mut ix = Index::new();
        let t = toks(64);
        // (name, medium, blocks held), stored in an order that is none of the ones checked.
        let held =
            [("f", "GPU", 2), ("e", "CPU", 2), ("d", "CPU", 4), ("c", "GPU", 3), ("b", "GPU", 2), ("a", "GPU", 4)];
        let ehs = [1u64, 2, 3, 4];
        for (inst, medium, n) in held {
            ix.apply(&rank(inst, 0, 1), &[stored(Some(medium), &ehs[..n], &t[..n * 64], None)], true).unwrap();
        }
        let weight = |m: &str| if m == "GPU" { 1.0 } else { 0.5 };
        let all = vec![
            hit("a", 64),
            hit("c", 48),
            ("d".to_string(), 64, 32.0),
            hit("b", 32),
            hit("f", 32),
            ("e".to_string(), 32, 16.0),
        ];
        assert_eq!(ranked(&mut ix, &t, weight, None, None), all);
        for k in 0..=all.len() + 1 {
            let want = &all[..k.min(all.len())];
            assert_eq!(ranked(&mut ix, &t, weight, None, Some(k)), want, "top_k {k}");
        }
    }

    /// The walk's last survivor is tested against its own slots: hot keys (holder sets) and a
    /// cleared rank's unswept slots on its blocks change nothing of what it is credited.
    #[test]
    fn the_last_survivor_is_credited_by_its_own_live_slots() {
        let mut ix = Index::new();
        ix.s.promote = 1;
        let t = toks(128);
        let ehs: Vec<u64> = (1..=8).collect();
        ix.apply(&rank("a", 0, 1), &[stored(None, &ehs, &t, None)], true).unwrap();
        ix.apply(&rank("b", 0, 1), &[stored(None, &[11, 12], &t[..128], None)], true).unwrap();
        // c held every block, then cleared them: its slots stay until swept, dead.
        let c_ehs: Vec<u64> = (21..=28).collect();
        ix.apply(&rank("c", 0, 1), &[stored(None, &c_ehs, &t, None)], true).unwrap();
        ix.clear_rank("c", 0, 0, false);
        assert_eq!(ranked(&mut ix, &t, one, None, None), vec![hit("a", 128), hit("b", 32)]);
        // a loses block 6 (eh 6): a's run ends at block 5, whichever walk reads it.
        ix.apply(&rank("a", 0, 1), &[Ev::Remove { medium: None, group: 0, ehs: &[6] }], true).unwrap();
        assert_eq!(ranked(&mut ix, &t, one, None, None), vec![hit("a", 80), hit("b", 32)]);
        // TP 2 worker d: both ranks hold blocks 0-7 but rank 1 lacks block 4.
        for tp_rank in 0..2 {
            let e: &[u64] = if tp_rank == 0 { &[31, 32, 33, 34, 35, 36, 37, 38] } else { &[31, 32, 33, 34] };
            ix.apply(&rank("d", tp_rank, 2), &[stored(None, e, &t[..e.len() * 64], None)], true).unwrap();
        }
        ix.apply(&rank("a", 0, 1), &[Ev::Remove { medium: None, group: 0, ehs: &[3, 4, 5] }], true).unwrap();
        assert_eq!(ranked(&mut ix, &t, one, None, None), vec![hit("d", 64), hit("a", 32), hit("b", 32)]);
    }

    /// A conversation longer than a chain log's chunk (512 entries) is followed across chunk
    /// edges; a block removed at an edge ends the credit there, and blocks stored again (at
    /// the log's end, so the log's chain breaks where the index's does not) count again.
    #[test]
    fn a_chain_across_log_chunks_is_followed_exactly() {
        let mut ix = Index::new();
        let n = 1300usize;
        let t = toks(n as u32 * 16);
        let ehs: Vec<u64> = (1..=n as u64).collect();
        for a in (0..n).step_by(100) {
            let b = (a + 100).min(n);
            let parent = (a > 0).then(|| ehs[a - 1]);
            ix.apply(&rank("a", 0, 1), &[stored(None, &ehs[a..b], &t[a * 64..b * 64], parent)], true).unwrap();
        }
        // b shares the first two blocks: the walk narrows to a, its last survivor, after them.
        ix.apply(&rank("b", 0, 1), &[stored(None, &[9001, 9002], &t[..128], None)], true).unwrap();
        let full = n as i64 * 16;
        assert_eq!(ranked(&mut ix, &t, one, None, None), vec![hit("a", full), hit("b", 32)]);
        for q in [3usize, 511, 512, 513, 1024, 1025] {
            assert_eq!(ranked(&mut ix, &t[..q * 64], one, None, None)[0], hit("a", q as i64 * 16), "{q} blocks");
        }
        for gone in [1025usize, 512, 511] {
            let ev = Ev::Remove { medium: None, group: 0, ehs: &ehs[gone..gone + 1] };
            ix.apply(&rank("a", 0, 1), &[ev], true).unwrap();
            assert_eq!(ranked(&mut ix, &t, one, None, None)[0], hit("a", gone as i64 * 16), "{gone} removed");
        }
        for back in [511usize, 512, 1025] {
            let ev = stored(None, &ehs[back..back + 1], &t[back * 64..(back + 1) * 64], Some(ehs[back - 1]));
            ix.apply(&rank("a", 0, 1), &[ev], true).unwrap();
        }
        assert_eq!(ranked(&mut ix, &t, one, None, None)[0], hit("a", full));
    }

    #[test]
    fn a_removed_middle_block_ends_the_credited_prefix() {
        let mut ix = Index::new();
        let t = toks(64);
        ix.apply(&rank("a", 0, 1), &[stored(None, &[1, 2, 3, 4], &t, None)], true).unwrap();
        ix.apply(&rank("b", 0, 1), &[stored(None, &[11, 12, 13, 14], &t, None)], true).unwrap();
        let gone = Ev::Remove { medium: None, group: 0, ehs: &[2] };
        ix.apply(&rank("a", 0, 1), &[gone], true).unwrap();
        assert_eq!(ix.holder_blocks(), 7);
        assert_eq!(ranked(&mut ix, &t, one, None, None), vec![hit("b", 64), hit("a", 16)]);
        add_a_second_medium(&mut ix);
        assert_eq!(ranked(&mut ix, &t, one, None, None), vec![hit("b", 64), hit("a", 16)]);
        // Stored again under its parent, the block has its old key: the blocks after it count again.
        ix.apply(&rank("a", 0, 1), &[stored(None, &[2], &t[64..128], Some(1))], true).unwrap();
        assert_eq!(ranked(&mut ix, &t, one, None, None), vec![hit("a", 64), hit("b", 64)]);
    }
}
