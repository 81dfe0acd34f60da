//! Per-rank stream state: epoch fencing, sequence dedup, gaps, trust, expiry.
//!
//! Every rank publishes `(epoch, seq)`-stamped records. Kafka gives them in
//! order per partition, but a log also holds duplicates (a producer retried
//! before idempotence), late records of a dead incarnation (a zombie flushing
//! after its replacement started), and holes (records lost upstream, or
//! truncated by retention). `admit` decides, per record, what the index must
//! do; it never touches the index itself (`pipeline.rs` does both).
//!
//! Epochs are random, so "newer" cannot be read off their values: an epoch is
//! newer when it arrives after the current one; the epochs a rank has left are
//! remembered (boundedly) so their late records are recognised and ignored.
//!
//! Trust: a rank is untrusted from the moment its view may be incomplete (it
//! joined mid-stream, a new epoch without its reset, a seq hole, a producer
//! gap, a record that could not be applied) until a point where its full state
//! is known again: a reset record, or an AllBlocksCleared from that rank (its
//! state is then known: empty; `pipeline.rs` calls `state_known` after such a
//! record applied). A worker is trusted when all its `tp_size` ranks are.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use pyo3::prelude::*;

/// Enough to outlast any realistic burst of restarts of one rank.
pub const RETIRED_EPOCHS: usize = 32;

/// What the index must do with a record; Python reads it as `kvwire._core.Verdict`
/// (`consumer/rank_state.py` re-exports it), with `label` naming it in metrics.
#[pyclass(module = "kvwire._core", eq, eq_int, frozen, hash)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Verdict {
    #[pyo3(name = "APPLY")]
    Apply,
    /// Drop the rank's blocks, then apply.
    #[pyo3(name = "RESET")]
    Reset,
    #[pyo3(name = "DUPLICATE")]
    Duplicate,
    #[pyo3(name = "STALE_EPOCH")]
    StaleEpoch,
}

#[pymethods]
impl Verdict {
    /// The metrics label of a skipped record's verdict.
    #[getter]
    fn label(&self) -> &'static str {
        match self {
            Verdict::Apply => "apply",
            Verdict::Reset => "reset",
            Verdict::Duplicate => "duplicate",
            Verdict::StaleEpoch => "stale_epoch",
        }
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct RankState {
    pub epoch: i64,
    pub last_seq: i64,
    pub trusted: bool,
    pub last_seen_us: i64,
    pub retired: VecDeque<i64>,
    /// Why the rank is untrusted, for operators (/v1/workers).
    pub reason: String,
    pub records: i64,
    pub gaps: i64,
    /// The rank's latest record came from a source that cannot observe
    /// removals: its blocks may outlive the engine's, so its scores are
    /// marked approximate. Each admitted record sets it afresh.
    pub approximate: bool,
    /// The served model the rank's records name (the latest that named one; "" if none did):
    /// what Dynamo's `model_name` selects workers by.
    pub model: String,
}

/// One record's fencing input.
#[derive(Clone, Copy)]
pub struct Stamp<'a> {
    pub inst: &'a str,
    pub dp: i64,
    pub tp_rank: i64,
    pub tp_size: i64,
    pub epoch: i64,
    pub seq: i64,
    pub ts_us: i64,
    pub reset: bool,
    pub gap: i64,
    pub approximate: bool,
    pub model: &'a str,
}

#[derive(Default)]
pub struct Fence {
    /// instance_id -> (dp_rank, tp_rank) -> state
    ranks: HashMap<String, HashMap<(i64, i64), RankState>>,
    /// instance_id -> dp_rank -> tp_size (the latest a rank said)
    tp_size: HashMap<String, HashMap<i64, i64>>,
    /// Counts changes of what `TrustView` shows (trust, approximate, ranks, tp sizes).
    gen: u64,
    /// The latest `TrustView` and the `gen` it was made at: every score reads it, and it
    /// changes far less often than records arrive.
    view: Option<(u64, Arc<TrustView>)>,
}

/// The workers a score leaves out (untrusted) and marks (approximate).
#[derive(Default, Debug, PartialEq)]
pub struct TrustView {
    pub untrusted: Vec<(String, i64)>,
    pub approximate: Vec<(String, i64)>,
}

fn distrust(st: &mut RankState, why: String) {
    st.trusted = false;
    st.reason = why;
}

fn note(st: &mut RankState, s: &Stamp) {
    st.records += 1;
    st.last_seen_us = st.last_seen_us.max(s.ts_us);
    st.approximate = s.approximate;
    if !s.model.is_empty() && st.model != s.model {
        st.model = s.model.to_owned();
    }
    if s.gap != 0 {
        st.gaps += s.gap;
        distrust(st, format!("producer lost {} batch(es) before seq {}", s.gap, s.seq));
    }
}

impl Fence {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn admit(&mut self, s: &Stamp) -> Verdict {
        let tp_changed = match self.tp_size.get_mut(s.inst) {
            Some(m) => m.insert(s.dp, s.tp_size) != Some(s.tp_size),
            None => {
                self.tp_size.entry(s.inst.to_owned()).or_default().insert(s.dp, s.tp_size);
                true
            }
        };
        if tp_changed {
            self.gen += 1;
        }
        let by_inst = match self.ranks.get_mut(s.inst) {
            Some(m) => m,
            None => self.ranks.entry(s.inst.to_owned()).or_default(),
        };
        let Some(st) = by_inst.get_mut(&(s.dp, s.tp_rank)) else {
            // First sight of a rank. Without a reset we joined its stream in
            // the middle (log truncated by retention, or a rank that predates
            // the snapshot we loaded): what it held before is unknown.
            let mut st = RankState {
                epoch: s.epoch,
                last_seq: s.seq,
                trusted: true,
                last_seen_us: s.ts_us,
                retired: VecDeque::new(),
                reason: String::new(),
                records: 0,
                gaps: 0,
                approximate: s.approximate,
                model: String::new(),
            };
            if !s.reset {
                distrust(&mut st, "joined mid-stream (no reset record seen)".into());
            }
            note(&mut st, s);
            by_inst.insert((s.dp, s.tp_rank), st);
            self.gen += 1;
            return Verdict::Reset;
        };
        let before = (st.trusted, st.approximate);
        let v = Self::admit_rank(st, s);
        if (st.trusted, st.approximate) != before {
            self.gen += 1;
        }
        v
    }

    /// The verdict for a rank seen before, and what it changes of the rank's state.
    fn admit_rank(st: &mut RankState, s: &Stamp) -> Verdict {
        if s.epoch != st.epoch {
            if st.retired.contains(&s.epoch) {
                return Verdict::StaleEpoch;
            }
            if st.retired.len() == RETIRED_EPOCHS {
                st.retired.pop_front();
            }
            st.retired.push_back(st.epoch);
            st.epoch = s.epoch;
            st.last_seq = s.seq;
            st.trusted = true;
            st.reason.clear();
            if !s.reset {
                distrust(st, "new epoch without its reset record".into());
            }
            note(st, s);
            return Verdict::Reset;
        }
        if s.seq <= st.last_seq {
            return Verdict::Duplicate;
        }
        if s.reset {
            // A producer only resets at seq 0; a reset mid-epoch is a fresh
            // start of the same incarnation (e.g. the bridge saw the engine
            // restart without a new process): honour it.
            st.trusted = true;
            st.reason.clear();
            st.last_seq = s.seq;
            note(st, s);
            return Verdict::Reset;
        }
        if s.seq != st.last_seq + 1 {
            distrust(st, format!("records {}..{} missing from the log", st.last_seq + 1, s.seq - 1));
        }
        st.last_seq = s.seq;
        note(st, s);
        Verdict::Apply
    }

    pub fn get(&self, inst: &str, dp: i64, tp_rank: i64) -> Option<&RankState> {
        self.ranks.get(inst)?.get(&(dp, tp_rank))
    }

    fn get_mut(&mut self, inst: &str, dp: i64, tp_rank: i64) -> Option<&mut RankState> {
        self.ranks.get_mut(inst)?.get_mut(&(dp, tp_rank))
    }

    /// The rank's full state is known (it cleared everything): trusted again.
    pub fn state_known(&mut self, inst: &str, dp: i64, tp_rank: i64) {
        self.gen += 1;
        if let Some(st) = self.get_mut(inst, dp, tp_rank) {
            st.trusted = true;
            st.reason.clear();
        }
    }

    pub fn distrust(&mut self, inst: &str, dp: i64, tp_rank: i64, why: String) {
        self.gen += 1;
        if let Some(st) = self.get_mut(inst, dp, tp_rank) {
            distrust(st, why);
        }
    }

    pub fn tp_size_of(&self, inst: &str, dp: i64) -> Option<i64> {
        self.tp_size.get(inst)?.get(&dp).copied()
    }

    /// A worker is trusted when every one of its ranks we know is, and we know all of them.
    pub fn worker_trusted(&self, inst: &str, dp: i64) -> bool {
        let (mut n, mut all) = (0i64, true);
        if let Some(m) = self.ranks.get(inst) {
            for ((d, _), st) in m {
                if *d == dp {
                    n += 1;
                    all &= st.trusted;
                }
            }
        }
        self.trusted_given(inst, dp, n, all)
    }

    /// The rule, given how many of the worker's ranks are known and whether all of those are trusted.
    fn trusted_given(&self, inst: &str, dp: i64, known: i64, all_trusted: bool) -> bool {
        all_trusted && known >= self.tp_size_of(inst, dp).unwrap_or(1)
    }

    /// Per worker (instance, dp rank): how many ranks are known, whether all are trusted and
    /// whether any is approximate, to `f`. One pass over the ranks: a score asks for the
    /// untrusted workers on every query, so this is linear in the fleet, never quadratic.
    fn per_worker<'a>(&'a self, mut f: impl FnMut(&'a str, i64, i64, bool, bool)) {
        let mut by_dp: Vec<(i64, bool, bool)> = vec![];
        for (inst, m) in &self.ranks {
            by_dp.clear();
            by_dp.extend(m.iter().map(|((d, _), st)| (*d, st.trusted, st.approximate)));
            by_dp.sort_unstable_by_key(|x| x.0);
            let mut i = 0;
            while i < by_dp.len() {
                let (d, mut all, mut any) = by_dp[i];
                let mut n = 1;
                while i + n < by_dp.len() && by_dp[i + n].0 == d {
                    all &= by_dp[i + n].1;
                    any |= by_dp[i + n].2;
                    n += 1;
                }
                f(inst, d, n as i64, all, any);
                i += n;
            }
        }
    }

    pub fn workers(&self) -> Vec<(&str, i64)> {
        let mut out = vec![];
        self.per_worker(|i, d, _, _, _| out.push((i, d)));
        out
    }

    pub fn untrusted_workers(&self) -> Vec<(&str, i64)> {
        let mut out = vec![];
        self.per_worker(|i, d, n, all, _| {
            if !self.trusted_given(i, d, n, all) {
                out.push((i, d));
            }
        });
        out
    }

    /// The untrusted and approximate workers, made again only after something they depend on
    /// changed.
    pub fn trust_view(&mut self) -> Arc<TrustView> {
        if let Some((g, tv)) = &self.view {
            if *g == self.gen {
                return Arc::clone(tv);
            }
        }
        let own = |w: Vec<(&str, i64)>| w.into_iter().map(|(i, d)| (i.to_owned(), d)).collect();
        let tv = Arc::new(TrustView {
            untrusted: own(self.untrusted_workers()),
            approximate: own(self.approximate_workers()),
        });
        self.view = Some((self.gen, Arc::clone(&tv)));
        tv
    }

    /// Workers any of whose ranks' latest record came from an approximate source.
    pub fn approximate_workers(&self) -> Vec<(&str, i64)> {
        let mut out = vec![];
        self.per_worker(|i, d, _, _, any| {
            if any {
                out.push((i, d));
            }
        });
        out
    }

    pub fn expired(&self, now_us: i64, timeout_us: i64) -> Vec<(String, i64, i64)> {
        let mut out = vec![];
        for (inst, m) in &self.ranks {
            for ((d, t), st) in m {
                if now_us - st.last_seen_us > timeout_us {
                    out.push((inst.clone(), *d, *t));
                }
            }
        }
        out
    }

    pub fn forget(&mut self, inst: &str, dp: i64, tp_rank: i64) {
        self.gen += 1;
        if let Some(m) = self.ranks.get_mut(inst) {
            m.remove(&(dp, tp_rank));
            if m.is_empty() {
                self.ranks.remove(inst);
            }
        }
    }

    pub fn forget_worker(&mut self, inst: &str, dp: i64) {
        self.gen += 1;
        if let Some(m) = self.ranks.get_mut(inst) {
            m.retain(|(d, _), _| *d != dp);
            if m.is_empty() {
                self.ranks.remove(inst);
            }
        }
        if let Some(m) = self.tp_size.get_mut(inst) {
            m.remove(&dp);
            if m.is_empty() {
                self.tp_size.remove(inst);
            }
        }
    }

    /// Install a rank's state as a snapshot recorded it.
    pub fn restore(&mut self, inst: &str, dp: i64, tp_rank: i64, st: RankState, tp_size: i64) {
        self.gen += 1;
        self.ranks.entry(inst.to_owned()).or_default().insert((dp, tp_rank), st);
        self.tp_size.entry(inst.to_owned()).or_default().insert(dp, tp_size);
    }

    pub fn all(&self) -> impl Iterator<Item = (&str, i64, i64, &RankState)> {
        self.ranks.iter().flat_map(|(i, m)| m.iter().map(move |((d, t), st)| (i.as_str(), *d, *t, st)))
    }

    pub fn tp_sizes(&self) -> impl Iterator<Item = (&str, i64, i64)> {
        self.tp_size.iter().flat_map(|(i, m)| m.iter().map(move |(d, t)| (i.as_str(), *d, *t)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn st(epoch: i64, seq: i64, reset: bool, gap: i64) -> Stamp<'static> {
        Stamp {
            inst: "a",
            dp: 0,
            tp_rank: 0,
            tp_size: 1,
            epoch,
            seq,
            ts_us: 0,
            reset,
            gap,
            approximate: false,
            model: "",
        }
    }

    #[test]
    fn model_is_the_latest_one_named() {
        let mut f = Fence::new();
        let at = |seq, model| Stamp { model, ..st(1, seq, seq == 0, 0) };
        f.admit(&at(0, ""));
        assert_eq!(f.all().next().unwrap().3.model, "");
        f.admit(&at(1, "m1"));
        // A record that names no model (an older writer) keeps the one known.
        f.admit(&at(2, ""));
        assert_eq!(f.all().next().unwrap().3.model, "m1");
        f.admit(&at(3, "m2"));
        assert_eq!(f.all().next().unwrap().3.model, "m2");
    }

    #[test]
    fn approximate_follows_the_latest_record() {
        let mut f = Fence::new();
        let a = |tp_rank, epoch, seq, reset, approximate| Stamp {
            inst: "a",
            dp: 0,
            tp_rank,
            tp_size: 2,
            epoch,
            seq,
            ts_us: 0,
            reset,
            gap: 0,
            approximate,
            model: "",
        };
        f.admit(&a(0, 1, 0, true, false));
        f.admit(&a(1, 1, 0, true, true));
        assert_eq!(f.approximate_workers(), vec![("a", 0)]);
        // A duplicate says nothing new about the rank.
        f.admit(&a(1, 1, 0, true, false));
        assert_eq!(f.approximate_workers(), vec![("a", 0)]);
        // A new epoch from a source that observes removals clears it.
        f.admit(&a(1, 2, 0, true, false));
        assert!(f.approximate_workers().is_empty());
    }

    #[test]
    fn epochs_dups_gaps_and_known_state() {
        let mut f = Fence::new();
        assert_eq!(f.admit(&st(1, 0, true, 0)), Verdict::Reset);
        assert!(f.worker_trusted("a", 0));
        assert_eq!(f.admit(&st(1, 1, false, 0)), Verdict::Apply);
        assert_eq!(f.admit(&st(1, 1, false, 0)), Verdict::Duplicate);
        assert_eq!(f.admit(&st(1, 3, false, 0)), Verdict::Apply);
        assert!(!f.worker_trusted("a", 0));
        f.state_known("a", 0, 0);
        assert!(f.worker_trusted("a", 0));
        assert_eq!(f.admit(&st(2, 0, true, 0)), Verdict::Reset);
        assert_eq!(f.admit(&st(1, 9, false, 0)), Verdict::StaleEpoch);
    }

    /// The view a score reads is cached; after any sequence of records and calls it equals
    /// the workers `worker_trusted` (the rule) and the ranks' approximate flags give.
    #[test]
    fn trust_view_follows_every_change() {
        let insts = ["a", "b", "c"];
        let mut f = Fence::new();
        let mut next = crate::test_rng::xorshift(0x9E37_79B9_7F4A_7C15);
        let mut rnd = |n: u64| next() % n;
        let mut seqs: HashMap<(usize, i64, i64), i64> = HashMap::new();
        for step in 0..4000 {
            let (i, dp, tp_rank) = (rnd(3) as usize, rnd(2) as i64, rnd(2) as i64);
            match rnd(10) {
                0 => f.distrust(insts[i], dp, tp_rank, "test".into()),
                1 => f.state_known(insts[i], dp, tp_rank),
                2 => f.forget(insts[i], dp, tp_rank),
                3 if step % 7 == 0 => f.forget_worker(insts[i], dp),
                _ => {
                    let seq = seqs.entry((i, dp, tp_rank)).or_insert(-1);
                    *seq += 1 + i64::from(rnd(20) == 0);
                    let s = Stamp {
                        inst: insts[i],
                        dp,
                        tp_rank,
                        tp_size: 1 + rnd(2) as i64,
                        epoch: 1,
                        seq: *seq,
                        ts_us: 0,
                        reset: rnd(15) == 0,
                        gap: 0,
                        approximate: rnd(4) == 0,
                        model: "",
                    };
                    f.admit(&s);
                }
            }
            let tv = f.trust_view();
            let mut want_u: Vec<(String, i64)> = vec![];
            let mut want_a: Vec<(String, i64)> = vec![];
            for inst in insts {
                for dp in 0..2 {
                    let ranks: Vec<&RankState> = (0..2).filter_map(|t| f.get(inst, dp, t)).collect();
                    if ranks.is_empty() {
                        continue;
                    }
                    if !f.worker_trusted(inst, dp) {
                        want_u.push((inst.into(), dp));
                    }
                    if ranks.iter().any(|r| r.approximate) {
                        want_a.push((inst.into(), dp));
                    }
                }
            }
            let (mut got_u, mut got_a) = (tv.untrusted.clone(), tv.approximate.clone());
            got_u.sort();
            got_a.sort();
            assert_eq!((got_u, got_a), (want_u, want_a), "after step {step}");
        }
    }
}
