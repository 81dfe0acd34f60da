//! One call per poll batch: decode → fence → apply, and the fence's Python face.
//!
//! `apply_poll` takes a partition's records (their values, or the
//! ConsumerRecords themselves) and walks them in order: the fast decoder
//! (`decode.rs`) decodes each, `Fence::admit` fences it, and the index applies
//! it whole or not at all. It stops early, returning where it stopped:
//!
//! - at a record the fast decoder declines: Python decodes that one with
//!   fastavro (`codec.decode`, the reference, which also resolves a writer
//!   schema kvwire does not ship) and either dead-letters it with the
//!   reference's reason or hands it back re-encoded in the current version,
//!   which this path then applies; then it calls `apply_poll` again for the
//!   rest, so records keep their log order. Every record that reaches the
//!   index comes through here: the malformed-store rule, the context hashing
//!   and the medium names have no other implementation;
//! - when its time budget is spent: the ingest loop yields to the event loop
//!   (heartbeats) and calls again.
//!
//! Readers on other threads (HTTP loops, an embedding router) are not kept
//! waiting for a whole call: the call works in quanta of at most `QUANTUM_US`,
//! each holding the index and the fence and applying whole records without the
//! GIL, and a reader that waits ends the quantum after its record and goes
//! before the next one. So a reader sees every record whole or not at all.
//! Measured with `python -m bench.score_latency` (`under_ingest`): with the
//! GIL held for a whole call, a score from another thread waited for Python's
//! switch interval (5 ms) again and again, and fell seconds behind.
//!
//! Counters come back once per call, so metrics are updated once per slice of
//! a poll, not once per record.

use std::borrow::Cow;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList, PyString};
use std::sync::{Mutex, MutexGuard, PoisonError};

use crate::decode;
use crate::fence::{Fence, RankState, Stamp, Verdict, RETIRED_EPOCHS};
use crate::index::{ApplyError, Ev, Index, RankId, Store};
use crate::keys::{self, Key};
use crate::py_index::{acquire, held, readers_waiting, spin_for, PyIndex, ScoreArgs};
use crate::record::{Event, ExtraKey, HashKind, Hashes, Record, Scalar};

/// What an overflowed record's dead letter says after its kind.
const OVERFLOW_MESSAGE: &str = "reference count ceiling reached; the events were not applied";

/// What the records of one call did, for the counters (`Applier._account`).
#[pyclass(module = "kvwire._core", frozen, get_all)]
#[derive(Clone, Default)]
pub struct Tally {
    pub records: u64,
    pub duplicates: u64,
    pub stale: u64,
    /// Records lost upstream, as the producers' gap fields count them.
    pub gaps: i64,
    pub resets: u64,
    pub blocks: u64,
    pub events: u64,
    /// The oldest applied record's lag; None when none was applied.
    pub max_lag_us: Option<i64>,
}

#[pymethods]
impl Tally {
    /// A tally counted outside the core (`Applier` over an index model, in tests).
    #[new]
    #[pyo3(signature = (*, records=0, duplicates=0, stale=0, gaps=0, resets=0, blocks=0, events=0, max_lag_us=None))]
    #[allow(clippy::too_many_arguments)] // one keyword per field: Python names each one it sets
    fn new(
        records: u64,
        duplicates: u64,
        stale: u64,
        gaps: i64,
        resets: u64,
        blocks: u64,
        events: u64,
        max_lag_us: Option<i64>,
    ) -> Self {
        Tally { records, duplicates, stale, gaps, resets, blocks, events, max_lag_us }
    }
}

/// What `apply_events` did with a record's events.
#[pyclass(module = "kvwire._core", eq, eq_int, frozen)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ApplyStatus {
    #[pyo3(name = "APPLIED")]
    Applied,
    /// A malformed event: nothing applied, or with `atomic=False` the events before it.
    #[pyo3(name = "MALFORMED")]
    Malformed,
    /// A reference count reached its ceiling: nothing applied.
    #[pyo3(name = "OVERFLOW")]
    Overflow,
}

/// Why the core dead-lettered a record whose bytes it decoded.
#[pyclass(module = "kvwire._core", eq, eq_int, frozen)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeadKind {
    /// A store whose token ids do not cover its blocks: nothing applied, not fenced.
    #[pyo3(name = "MALFORMED")]
    Malformed,
    /// A reference count reached its ceiling: nothing applied, the seq consumed, the rank untrusted.
    #[pyo3(name = "OVERFLOW")]
    Overflow,
}

impl DeadKind {
    /// The Python exception the reference path raises for the same record.
    fn error(self) -> &'static str {
        match self {
            DeadKind::Malformed => "MalformedEvent",
            DeadKind::Overflow => "IndexOverflow",
        }
    }
}

/// A record of an `apply_poll` call that goes to the dead-letter topic.
#[pyclass(module = "kvwire._core", frozen, get_all)]
#[derive(Clone, Debug)]
pub struct DeadRecord {
    /// Its index in the call's `records`.
    pub index: usize,
    pub kind: DeadKind,
    pub message: String,
}

#[pymethods]
impl DeadRecord {
    /// A dead record found outside the core (an index model's `apply_poll`, in tests).
    #[new]
    fn new(index: usize, kind: DeadKind, message: String) -> Self {
        DeadRecord { index, kind, message }
    }

    /// The dead letter's reason, worded as the reference path's: "apply failed: <error>: <message>".
    #[getter]
    fn reason(&self) -> String {
        format!("apply failed: {}: {}", self.kind.error(), self.message)
    }

    fn __repr__(&self) -> String {
        format!("DeadRecord(index={}, kind={:?}, message={:?})", self.index, self.kind, self.message)
    }
}

/// What one `apply_poll` call did. With `declined`, `records[next]` is the record the fast
/// decoder declined, not consumed.
#[pyclass(module = "kvwire._core", frozen, get_all)]
#[derive(Clone)]
pub struct Poll {
    /// The index of the first record not consumed.
    pub next: usize,
    pub declined: bool,
    pub tally: Tally,
    pub dead: Vec<DeadRecord>,
    /// Workers (instance_id, dp_rank) whose records were fenced and applied or overflowed.
    pub seen: Vec<(String, i64)>,
}

#[pymethods]
impl Poll {
    /// A poll counted outside the core (an index model's `apply_poll`, in tests).
    #[new]
    #[pyo3(signature = (*, next, declined, tally, dead, seen))]
    fn new(next: usize, declined: bool, tally: Tally, dead: Vec<DeadRecord>, seen: Vec<(String, i64)>) -> Self {
        Poll { next, declined, tally, dead, seen }
    }
}

/// Outcome of applying one fenced record.
enum Applied {
    Ok,
    Skipped,
    /// Dead-letter it.
    Dead(DeadKind, String),
}

/// Fence and apply one decoded record (both entry points end here).
fn apply_one(ix: &mut Index, fence: &mut Fence, s: &Stamp, evs: &mut Vec<Ev>, t: &mut Tally, now_us: i64) -> Applied {
    // Whole record or nothing: a malformed event found halfway would leave
    // the events before it applied and the sequence advanced, yet dead-lettered.
    if let Err(ApplyError::Malformed(_, m)) = Index::validate(evs) {
        return Applied::Dead(DeadKind::Malformed, m);
    }
    let verdict = fence.admit(s);
    t.records += 1;
    match verdict {
        Verdict::Duplicate => {
            t.duplicates += 1;
            return Applied::Skipped;
        }
        Verdict::StaleEpoch => {
            t.stale += 1;
            return Applied::Skipped;
        }
        _ => {}
    }
    if s.gap != 0 {
        t.gaps += s.gap;
    }
    if verdict == Verdict::Reset {
        t.resets += 1;
        // The reset's clear is part of the record: rolled back with it if the record fails.
        evs.insert(0, Ev::Clear);
    }
    let rank = RankId { inst: s.inst, dp: s.dp, tp_rank: s.tp_rank, tp_size: s.tp_size };
    let cleared = evs.iter().skip(usize::from(verdict == Verdict::Reset)).any(|e| matches!(e, Ev::Clear));
    match ix.apply(&rank, evs, true) {
        Ok(n) => {
            t.blocks += n;
            t.events += (evs.len() - usize::from(verdict == Verdict::Reset)) as u64;
            if cleared {
                // The rank said it holds nothing: its state is known again,
                // whatever gap this record carried (that gap happened before it).
                fence.state_known(s.inst, s.dp, s.tp_rank);
            }
            let lag = now_us - s.ts_us;
            t.max_lag_us = Some(t.max_lag_us.map_or(lag, |m| m.max(lag)));
            Applied::Ok
        }
        Err(_) => {
            // Nothing of it was applied but its seq is consumed: the rank's
            // view now lacks a record, so it scores nothing until its state is known again.
            fence.distrust(s.inst, s.dp, s.tp_rank, "a record could not be applied (reference count ceiling)".into());
            Applied::Dead(DeadKind::Overflow, OVERFLOW_MESSAGE.into())
        }
    }
}

fn hash_u64(kind: HashKind, b: &[u8]) -> u64 {
    match kind {
        HashKind::Digest => keys::digest_hash(b),
        _ => u64::from_le_bytes(b.try_into().expect("width 8")),
    }
}

fn hashes(h: &Hashes) -> Vec<u64> {
    h.iter().map(|b| hash_u64(h.kind, b)).collect()
}

fn scalar_key<'a>(s: &Scalar<'a>) -> Key<'a> {
    match *s {
        Scalar::Null => Key::Null,
        Scalar::Bool(b) => Key::Bool(b),
        Scalar::Long(v) => Key::Int(v),
        Scalar::Double(v) => Key::Float(v),
        Scalar::Str(v) => Key::Str(Cow::Borrowed(v.as_bytes())),
        Scalar::Bytes(v) => Key::Bytes(Cow::Borrowed(v)),
    }
}

/// A decoded block's extra keys as the key encoding reads them.
fn block_key<'a>(keys: &[ExtraKey<'a>]) -> Key<'a> {
    Key::Seq(
        keys.iter()
            .map(|k| match k {
                ExtraKey::Scalar(s) => scalar_key(s),
                ExtraKey::Tuple(v) => Key::Seq(v.iter().map(scalar_key).collect()),
            })
            .collect(),
    )
}

/// What a decoded record's events need beyond its bytes: hashes as u64, per-block contexts.
struct Owned {
    ehs: Vec<Vec<u64>>,
    parents: Vec<Option<u64>>,
    ctx: Vec<Option<Vec<u64>>>,
}

fn own(rec: &Record, ix: &mut Index) -> Owned {
    let mut o = Owned { ehs: vec![], parents: vec![], ctx: vec![] };
    for e in &rec.events {
        match e {
            Event::Stored(s) => {
                o.ehs.push(hashes(&s.block_hashes));
                o.parents.push(s.parent_block_hash.map(|p| hash_u64(s.block_hashes.kind, p)));
                let n = s.block_hashes.len();
                let token_mode = s.block_size > 0 && !s.token_ids.is_empty();
                o.ctx.push(match (&s.extra_keys, token_mode) {
                    (Some(x), true) => {
                        let base = ix.context(s.lora_name);
                        let blocks: Vec<Option<Key>> = x.iter().take(n).map(|b| b.as_deref().map(block_key)).collect();
                        keys::block_contexts(&blocks, s.lora_name, base, n)
                    }
                    _ => None,
                });
            }
            Event::Removed(r) => {
                o.ehs.push(hashes(&r.block_hashes));
                o.parents.push(None);
                o.ctx.push(None);
            }
            Event::Cleared => {
                o.ehs.push(vec![]);
                o.parents.push(None);
                o.ctx.push(None);
            }
        }
    }
    o
}

fn events<'a>(rec: &'a Record, o: &'a Owned) -> Vec<Ev<'a>> {
    rec.events
        .iter()
        .enumerate()
        .map(|(i, e)| match e {
            Event::Stored(s) => Ev::Store(Store {
                medium: s.medium,
                group: s.group_idx.unwrap_or(0) as i64,
                ehs: &o.ehs[i],
                tokens: s.token_ids,
                bs: s.block_size as i64,
                parent: o.parents[i],
                lora: s.lora_name,
                blk_ctx: o.ctx[i].as_deref(),
                kind: s.kv_cache_spec_kind,
                window: s.kv_cache_spec_sliding_window.map(i64::from),
            }),
            Event::Removed(r) => {
                Ev::Remove { medium: r.medium, group: r.group_idx.unwrap_or(0) as i64, ehs: &o.ehs[i] }
            }
            Event::Cleared => Ev::Clear,
        })
        .collect()
}

fn stamp<'a>(rec: &'a Record) -> Stamp<'a> {
    Stamp {
        inst: rec.worker.instance_id,
        dp: rec.worker.dp_rank as i64,
        tp_rank: rec.worker.tp_rank as i64,
        tp_size: rec.worker.tp_size as i64,
        epoch: rec.epoch,
        seq: rec.seq,
        ts_us: rec.ts_us,
        reset: rec.reset,
        gap: rec.gap,
        approximate: is_approximate(rec.source),
        model: rec.worker.model,
    }
}

/// A source that cannot observe removals says so with this suffix (producer/connector.py, lmcache_source.py).
pub fn is_approximate(source: &str) -> bool {
    source.ends_with("/approximate")
}

/// A registry id's shipped writer version, from `codec.SchemaIds.shipped()` ({id: version}),
/// read once per call so that decoding needs no Python.
fn versions(schema_ids: Option<&Bound<'_, PyDict>>) -> Vec<(u32, u32)> {
    let mut out = vec![];
    if let Some(d) = schema_ids {
        for (k, v) in d.iter() {
            if let (Ok(k), Ok(v)) = (k.extract::<u32>(), v.extract::<u32>()) {
                out.push((k, v));
            }
        }
    }
    out
}

/// How long one quantum of `apply_poll` holds the index and the fence: what a score arriving
/// meanwhile waits for at most (besides the record in progress).
const QUANTUM_US: u64 = 40;
/// A quantum that a reader waits for ends after its record once it has run this long: a
/// steady stream of readers slows ingest down, never stops it.
const QUANTUM_MIN_US: u64 = 10;
/// The most records whose bytes are taken from Python at once (then read without the GIL).
const CHUNK_RECORDS: usize = 256;

/// How a chunk ended.
enum Stop {
    /// Its records are all applied.
    Done,
    /// The budget is spent: the records before `.0` are applied.
    Budget(usize),
    /// The fast decoder declined record `.0`; those before it are applied.
    Declined(usize),
}

/// Decode, fence and apply `records[start:]` (bytes values, or objects with a
/// `.value`) until one is declined or `budget_us` is spent. `schema_ids`:
/// {registry id: shipped writer version} for Confluent-framed values.
///
/// The records' bytes are taken under the GIL a chunk at a time; then, without the GIL, the
/// chunk is applied in quanta of at most `QUANTUM_US`, each holding the fence's lock and the
/// index's write lock and applying whole records. A score from another thread (an HTTP loop)
/// runs its Python meanwhile and takes the locks between two quanta: a quantum ends early
/// when a reader waits (`py_index::acquire`), and the next one starts once the readers
/// waiting have their locks. A reader sees every record whole or not at all, and the fence
/// as of the same record. A table that a quantum fills past its load limit is not grown in
/// it: the writer builds it between quanta under the read lock (`index/growth.rs`).
#[pyfunction]
#[pyo3(signature = (index, fence, records, start, budget_us, now_us, schema_ids=None))]
pub fn apply_poll<'py>(
    index: &Bound<'py, PyIndex>,
    fence: &Bound<'py, PyFence>,
    records: &Bound<'py, PyList>,
    start: usize,
    budget_us: u64,
    now_us: i64,
    schema_ids: Option<&Bound<'py, PyDict>>,
) -> PyResult<Poll> {
    let py = index.py();
    let vers = versions(schema_ids);
    let version_of = |id: u32| vers.iter().find(|(k, _)| *k == id).map(|(_, v)| *v);
    let (ix_lock, fence_lock) = (index.get().lock(), &fence.get().fence);
    let t0 = std::time::Instant::now();
    let mut t = Tally::default();
    let mut dead = vec![];
    let mut seen: Vec<(String, i64)> = vec![];
    // A hash of each rank in `seen` -> its place there: a record checks one entry, where a scan
    // compared its name with every rank seen so far (a few hundred in an interleaved fleet).
    let mut seen_at = SeenAt::default();
    let n = records.len();
    let mut i = start;
    let value_attr = pyo3::intern!(py, "value");
    let mut values: Vec<Bound<'py, PyBytes>> = Vec::with_capacity(CHUNK_RECORDS.min(n.saturating_sub(start)));
    // Records taken per chunk: twice what the last one applied, so that a call whose budget
    // ends after a few large records does not read hundreds of values for nothing.
    let mut take = 16;
    while i < n {
        values.clear();
        let mut not_bytes = false;
        for j in i..n.min(i + take) {
            let item = records.get_item(j)?;
            let value = if item.is_instance_of::<PyBytes>() { item } else { item.getattr(value_attr)? };
            match value.cast_into::<PyBytes>() {
                Ok(b) => values.push(b),
                Err(_) => {
                    not_bytes = true;
                    break;
                }
            }
        }
        if values.is_empty() {
            return Ok(Poll { next: i, declined: not_bytes, tally: t, dead, seen });
        }
        let bytes: Vec<&[u8]> = values.iter().map(|b| b.as_bytes()).collect();
        let base = i;
        let (tr, dr, sr, ar) = (&mut t, &mut dead, &mut seen, &mut seen_at);
        let stop = py.detach(|| {
            let (t, dead, seen, seen_at) = (tr, dr, sr, ar);
            let mut k = 0;
            // Whether the index may hold growths deferred by a quantum (an earlier call's too).
            let mut deferred = true;
            loop {
                // Deferred growths are built under the read lock, beside the scores, and put in
                // by the quantum (`index/growth.rs`).
                let grown = deferred.then(|| ix_lock.read().unwrap_or_else(PoisonError::into_inner).prepare_growth());
                let mut fg = fence_lock.lock().unwrap_or_else(PoisonError::into_inner);
                // Scores in flight end sooner than this thread would be woken once they did.
                let mut ixw = spin_for(|| held(ix_lock.try_write()))
                    .unwrap_or_else(|| ix_lock.write().unwrap_or_else(PoisonError::into_inner));
                let (ix, f) = (&mut *ixw, &mut *fg);
                if let Some(g) = grown {
                    ix.install_growth(g);
                }
                ix.writes += 1;
                ix.defer_growth(true);
                let q0 = std::time::Instant::now();
                let quantum = budget_us.saturating_sub(t0.elapsed().as_micros() as u64).clamp(1, QUANTUM_US);
                while k < bytes.len() {
                    let Ok(rec) = decode::decode_framed(bytes[k], version_of) else {
                        ix.defer_growth(false);
                        return Stop::Declined(k);
                    };
                    let o = own(&rec, ix);
                    let mut evs = events(&rec, &o);
                    let s = stamp(&rec);
                    let applied = apply_one(ix, f, &s, &mut evs, t, now_us);
                    let fenced = !matches!(applied, Applied::Skipped | Applied::Dead(DeadKind::Malformed, _));
                    if fenced {
                        // An overflowed record was fenced (its rank is known here); a malformed one was not.
                        note_seen(seen, seen_at, s.inst, s.dp);
                    }
                    if let Applied::Dead(kind, message) = applied {
                        dead.push(DeadRecord { index: base + k, kind, message });
                    }
                    k += 1;
                    let ran = q0.elapsed().as_micros() as u64;
                    if ran >= quantum || (ran >= QUANTUM_MIN_US && readers_waiting()) {
                        break;
                    }
                }
                ix.defer_growth(false);
                deferred = ix.growth_deferred();
                drop(ixw);
                drop(fg);
                if k == bytes.len() {
                    return Stop::Done;
                }
                if t0.elapsed().as_micros() as u64 >= budget_us {
                    return Stop::Budget(k);
                }
                // The readers waiting take their locks before the next quantum does.
                let w0 = std::time::Instant::now();
                while readers_waiting() && w0.elapsed().as_micros() < 2_000 {
                    std::thread::yield_now();
                }
            }
        });
        match stop {
            Stop::Done => {
                i += bytes.len();
                take = (take * 2).min(CHUNK_RECORDS);
            }
            Stop::Budget(k) => {
                i += k;
                break;
            }
            Stop::Declined(k) => return Ok(Poll { next: i + k, declined: true, tally: t, dead, seen }),
        }
        if t0.elapsed().as_micros() as u64 >= budget_us {
            break;
        }
    }
    Ok(Poll { next: i, declined: false, tally: t, dead, seen })
}

/// A hash of each rank in a call's `seen` -> its place there (the hash is XXH3's already).
type SeenAt = std::collections::HashMap<u64, usize, std::hash::BuildHasherDefault<crate::table::KeyHasher>>;

/// Adds the rank to `seen` unless it is there; `at` maps a hash of each rank to its place.
fn note_seen(seen: &mut Vec<(String, i64)>, at: &mut SeenAt, inst: &str, dp: i64) {
    let h = keys::xxh3(inst.as_bytes(), dp as u64);
    let is = |j: usize| seen[j].0 == inst && seen[j].1 == dp;
    match at.get(&h) {
        Some(&j) if is(j) => {}
        // Another rank with the same hash: the list itself says.
        Some(_) => {
            if !(0..seen.len()).any(is) {
                seen.push((inst.to_owned(), dp));
            }
        }
        None => {
            at.insert(h, seen.len());
            seen.push((inst.to_owned(), dp));
        }
    }
}

/// What `apply_events` did: its status, the blocks the events named when applied, and what
/// was malformed when not.
#[pyclass(module = "kvwire._core", frozen, get_all)]
pub struct EventsApplied {
    pub status: ApplyStatus,
    pub blocks: u64,
    pub message: String,
}

/// Apply one record's events to its rank without the fence (`PrefixIndex.apply_batch`, which
/// encodes the events it is given). With `atomic`, a malformed event applies nothing.
/// Raises ValueError for bytes the fast decoder declines.
#[pyfunction]
pub fn apply_events(index: &Bound<'_, PyIndex>, value: &[u8], atomic: bool) -> PyResult<EventsApplied> {
    let rec =
        decode::decode(value).map_err(|d| PyValueError::new_err(format!("not a record the core decodes: {d}")))?;
    let mut ixw = index.get().write(index.py());
    let ix = &mut *ixw;
    let o = own(&rec, ix);
    let evs = events(&rec, &o);
    let w = &rec.worker;
    let rank =
        RankId { inst: w.instance_id, dp: w.dp_rank.into(), tp_rank: w.tp_rank.into(), tp_size: w.tp_size.into() };
    let (status, blocks, message) = match ix.apply(&rank, &evs, atomic) {
        Ok(n) => (ApplyStatus::Applied, n, String::new()),
        Err(ApplyError::Malformed(_, m)) => (ApplyStatus::Malformed, 0, m),
        Err(ApplyError::Overflow) => (ApplyStatus::Overflow, 0, OVERFLOW_MESSAGE.into()),
    };
    Ok(EventsApplied { status, blocks, message })
}

/// One rank's fence state (`Fence.ranks()`), the fields of `consumer.rank_state.RankState`
/// under the rank's names.
#[pyclass(module = "kvwire._core", frozen, get_all)]
pub struct RankRow {
    pub instance_id: String,
    pub dp_rank: i64,
    pub tp_rank: i64,
    pub epoch: i64,
    pub last_seq: i64,
    pub trusted: bool,
    pub untrusted_reason: String,
    pub last_seen_us: i64,
    /// Epochs the rank left, oldest first.
    pub retired: Vec<i64>,
    pub records: i64,
    pub gaps: i64,
    pub approximate: bool,
    pub model: String,
}

/// `kvwire.consumer.rank_state.RankTable`'s state, in Rust. Behind a lock of its own, which an
/// apply quantum holds without the GIL (`apply_poll`), together with the index's.
#[pyclass(module = "kvwire._core", name = "Fence", frozen)]
#[derive(Default)]
pub struct PyFence {
    fence: Mutex<Fence>,
}

impl PyFence {
    /// The fence; waits for an apply quantum in progress without the GIL.
    pub fn lock(&self, py: Python<'_>) -> MutexGuard<'_, Fence> {
        let m = &self.fence;
        acquire(py, || held(m.try_lock()), || m.lock().unwrap_or_else(PoisonError::into_inner))
    }
}

#[pymethods]
impl PyFence {
    #[new]
    fn new() -> Self {
        Self::default()
    }

    /// The verdict for one record (an `EventBatch`; its events are not read).
    fn admit(&self, batch: &Bound<'_, PyAny>) -> PyResult<Verdict> {
        let py = batch.py();
        let w = batch.getattr(pyo3::intern!(py, "worker"))?;
        let inst = w.getattr(pyo3::intern!(py, "instance_id"))?.cast_into::<PyString>()?;
        let source = batch.getattr(pyo3::intern!(py, "source"))?.cast_into::<PyString>()?;
        let model = w.getattr(pyo3::intern!(py, "model"))?.cast_into::<PyString>()?;
        let stamp = Stamp {
            inst: inst.to_str()?,
            dp: w.getattr(pyo3::intern!(py, "dp_rank"))?.extract()?,
            tp_rank: w.getattr(pyo3::intern!(py, "tp_rank"))?.extract()?,
            tp_size: w.getattr(pyo3::intern!(py, "tp_size"))?.extract()?,
            epoch: batch.getattr(pyo3::intern!(py, "epoch"))?.extract()?,
            seq: batch.getattr(pyo3::intern!(py, "seq"))?.extract()?,
            ts_us: batch.getattr(pyo3::intern!(py, "ts_us"))?.extract()?,
            reset: batch.getattr(pyo3::intern!(py, "reset"))?.extract()?,
            gap: batch.getattr(pyo3::intern!(py, "gap"))?.extract()?,
            approximate: is_approximate(source.to_str()?),
            model: model.to_str()?,
        };
        Ok(self.lock(py).admit(&stamp))
    }

    fn approximate_workers(slf: &Bound<'_, Self>) -> Vec<(String, i64)> {
        let f = slf.get().lock(slf.py());
        f.approximate_workers().into_iter().map(|(i, d)| (i.to_owned(), d)).collect()
    }

    fn worker_trusted(slf: &Bound<'_, Self>, inst: &str, dp: i64) -> bool {
        let f = slf.get().lock(slf.py());
        f.worker_trusted(inst, dp)
    }

    fn untrusted_workers(slf: &Bound<'_, Self>) -> Vec<(String, i64)> {
        let f = slf.get().lock(slf.py());
        f.untrusted_workers().into_iter().map(|(i, d)| (i.to_owned(), d)).collect()
    }

    fn workers(slf: &Bound<'_, Self>) -> Vec<(String, i64)> {
        let f = slf.get().lock(slf.py());
        f.workers().into_iter().map(|(i, d)| (i.to_owned(), d)).collect()
    }

    fn expired(slf: &Bound<'_, Self>, now_us: i64, timeout_us: i64) -> Vec<(String, i64, i64)> {
        let f = slf.get().lock(slf.py());
        f.expired(now_us, timeout_us)
    }

    fn forget(&self, py: Python<'_>, inst: &str, dp: i64, tp_rank: i64) {
        self.lock(py).forget(inst, dp, tp_rank);
    }

    fn forget_worker(&self, py: Python<'_>, inst: &str, dp: i64) {
        self.lock(py).forget_worker(inst, dp);
    }

    fn state_known(&self, py: Python<'_>, inst: &str, dp: i64, tp_rank: i64) {
        self.lock(py).state_known(inst, dp, tp_rank);
    }

    /// Every rank's state.
    fn ranks(slf: &Bound<'_, Self>) -> Vec<RankRow> {
        let f = slf.get().lock(slf.py());
        f.all()
            .map(|(i, d, t, s)| RankRow {
                instance_id: i.to_owned(),
                dp_rank: d,
                tp_rank: t,
                epoch: s.epoch,
                last_seq: s.last_seq,
                trusted: s.trusted,
                untrusted_reason: s.reason.clone(),
                last_seen_us: s.last_seen_us,
                retired: s.retired.iter().copied().collect(),
                records: s.records,
                gaps: s.gaps,
                approximate: s.approximate,
                model: s.model.clone(),
            })
            .collect()
    }

    fn tp_sizes(slf: &Bound<'_, Self>) -> Vec<(String, i64, i64)> {
        let f = slf.get().lock(slf.py());
        f.tp_sizes().map(|(i, d, t)| (i.to_owned(), d, t)).collect()
    }

    /// Install a rank's state as a snapshot recorded it (`rank_state.RankState`); of its
    /// retired epochs only the newest `RETIRED_EPOCHS` are kept.
    fn restore(&self, rank: (String, i64, i64), tp_size: i64, state: &Bound<'_, PyAny>) -> PyResult<()> {
        let (inst, dp, tp_rank) = rank;
        let py = state.py();
        let mut retired = std::collections::VecDeque::new();
        for e in state.getattr(pyo3::intern!(py, "retired"))?.try_iter()? {
            retired.push_back(e?.extract::<i64>()?);
            if retired.len() > RETIRED_EPOCHS {
                retired.pop_front();
            }
        }
        let st = RankState {
            epoch: state.getattr(pyo3::intern!(py, "epoch"))?.extract()?,
            last_seq: state.getattr(pyo3::intern!(py, "last_seq"))?.extract()?,
            trusted: state.getattr(pyo3::intern!(py, "trusted"))?.extract()?,
            last_seen_us: state.getattr(pyo3::intern!(py, "last_seen_us"))?.extract()?,
            retired,
            reason: state.getattr(pyo3::intern!(py, "untrusted_reason"))?.extract()?,
            records: state.getattr(pyo3::intern!(py, "records"))?.extract()?,
            gaps: state.getattr(pyo3::intern!(py, "gaps"))?.extract()?,
            approximate: state.getattr(pyo3::intern!(py, "approximate"))?.extract()?,
            model: state.getattr(pyo3::intern!(py, "model"))?.extract()?,
        };
        self.lock(py).restore(&inst, dp, tp_rank, st, tp_size);
        Ok(())
    }
}

/// Scores of trusted workers only, as the JSON list `/v1/score` returns.
#[pyfunction]
#[pyo3(signature = (index, fence, queries, top_k=None, as_json=true))]
pub fn score_trusted<'py>(
    py: Python<'py>,
    index: &Bound<'py, PyIndex>,
    fence: &Bound<'py, PyFence>,
    queries: &Bound<'py, PyList>,
    top_k: Option<usize>,
    as_json: bool,
) -> PyResult<Bound<'py, PyAny>> {
    // The fence stays locked until the index is (`score_with`'s hold): both as of one record.
    let mut f = fence.get().lock(py);
    let tv = f.trust_view();
    let (untrusted, approx) = (PyList::new(py, &tv.untrusted)?, PyList::new(py, &tv.approximate)?);
    let how = ScoreArgs {
        weights: None,
        workers: None,
        exclude: Some(untrusted.as_any()),
        approximate: Some(approx.as_any()),
        top_k,
        as_json,
        media: None,
    };
    PyIndex::score_with(index, queries, &how, f)
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyFence>()?;
    m.add("RETIRED_EPOCHS", RETIRED_EPOCHS)?;
    m.add_class::<Verdict>()?;
    m.add_class::<Tally>()?;
    m.add_class::<ApplyStatus>()?;
    m.add_class::<EventsApplied>()?;
    m.add_class::<DeadKind>()?;
    m.add_class::<DeadRecord>()?;
    m.add_class::<Poll>()?;
    m.add_class::<RankRow>()?;
    m.add_function(wrap_pyfunction!(apply_poll, m)?)?;
    m.add_function(wrap_pyfunction!(apply_events, m)?)?;
    m.add_function(wrap_pyfunction!(score_trusted, m)?)?;
    Ok(())
}
