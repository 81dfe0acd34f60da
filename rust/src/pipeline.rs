//! One call per poll batch: decode → fence → apply, and the fence's Python face.
//!
//! `apply_poll` takes a partition's records (their values, or the
//! ConsumerRecords themselves) and walks them in order: the fast decoder
//! (`decode.rs`) decodes each, `Fence::admit` fences it, and the index applies
//! it whole or not at all. It stops early, returning where it stopped:
//!
//! - at a record the fast decoder declines (or one whose extra keys it cannot
//!   encode canonically): Python decodes that one with fastavro
//!   (`codec.decode`, the reference) and either dead-letters it or applies it
//!   through `apply_decoded`, then calls `apply_poll` again for the rest, so
//!   records keep their log order;
//! - when its time budget is spent: the ingest loop yields to the event loop
//!   (heartbeats, HTTP readers) and calls again. This is how readers stay
//!   consistent: the GIL is held for the whole call, each record is applied
//!   whole inside it, and a reader runs only between calls, so it sees a whole
//!   record or none. The budget bounds how long a reader waits.
//!
//! Counters come back once per call, so metrics are updated once per slice of
//! a poll, not once per record.

use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList, PyTuple};

use crate::decode;
use crate::fence::{Fence, RankState, Stamp, Verdict};
use crate::index::{ApplyError, Ev, Index, RankId};
use crate::keys::{self};
use crate::py_index::{borrow_events, owned_event, wait_borrow, PyIndex};
use crate::record::{Event, ExtraKey, HashKind, Hashes, Record, Scalar};

/// Why a record was dead-lettered after its bytes decoded.
const OVERFLOW_REASON: &str =
    "apply failed: IndexOverflow: reference count ceiling reached; the events were not applied";

/// What one record did, for the counters.
#[derive(Default)]
struct Tally {
    records: u64,
    duplicates: u64,
    stale: u64,
    gaps: i64,
    resets: u64,
    blocks: u64,
    events: u64,
    max_lag_us: Option<i64>,
}

/// Outcome of applying one fenced record.
enum Applied {
    Ok,
    Skipped,
    /// Dead-letter with this reason.
    Dead(String),
}

/// Fence and apply one decoded record (both entry points end here).
fn apply_one(ix: &mut Index, fence: &mut Fence, s: &Stamp, evs: &mut Vec<Ev>, t: &mut Tally, now_us: i64) -> Applied {
    // Whole record or nothing: a malformed event found halfway would leave
    // the events before it applied and the sequence advanced, yet dead-lettered.
    if let Err(ApplyError::Malformed(_, m)) = Index::validate(evs) {
        return Applied::Dead(format!("apply failed: MalformedEvent: {m}"));
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
            Applied::Dead(OVERFLOW_REASON.into())
        }
    }
}

fn hash_u64(kind: HashKind, b: &[u8]) -> u64 {
    match kind {
        HashKind::Digest => keys::xxh3(b, 0),
        _ => u64::from_le_bytes(b.try_into().expect("width 8")),
    }
}

fn hashes(h: &Hashes) -> Vec<u64> {
    h.iter().map(|b| hash_u64(h.kind, b)).collect()
}

fn canon_scalar(s: &Scalar, out: &mut Vec<u8>) -> bool {
    match s {
        Scalar::Null => out.push(b'N'),
        Scalar::Bool(true) => out.push(b'T'),
        Scalar::Bool(false) => out.push(b'F'),
        Scalar::Long(v) => {
            let t = v.to_string();
            out.extend_from_slice(format!("i{}:{}", t.len(), t).as_bytes());
        }
        Scalar::Str(v) => {
            out.extend_from_slice(format!("s{}:", v.len()).as_bytes());
            out.extend_from_slice(v.as_bytes());
        }
        Scalar::Bytes(v) => {
            out.extend_from_slice(format!("b{}:", v.len()).as_bytes());
            out.extend_from_slice(v);
        }
        // float.hex() is Python's own format: left to the reference path.
        Scalar::Double(_) => return false,
    }
    true
}

/// `keys.block_contexts` for a decoded record: None when no block has extra
/// keys, Err(()) when a key cannot be encoded here (the record goes to Python).
fn block_contexts(
    extra: &[Option<Vec<ExtraKey>>],
    lora: Option<&str>,
    base: u64,
    n: usize,
) -> Result<Option<Vec<u64>>, ()> {
    let mut out = vec![base; n];
    let mut any = false;
    let mut buf = Vec::new();
    for (i, e) in extra.iter().take(n).enumerate() {
        let Some(keys) = e else { continue };
        let mut ks: &[ExtraKey] = keys;
        // vLLM puts the LoRA name first in every block's extra keys while also sending lora_name.
        if let (Some(l), Some(ExtraKey::Scalar(Scalar::Str(first)))) = (lora, ks.first()) {
            if *first == l {
                ks = &ks[1..];
            }
        }
        if ks.is_empty() {
            continue;
        }
        buf.clear();
        buf.extend_from_slice(format!("t{}:", ks.len()).as_bytes());
        for k in ks {
            match k {
                ExtraKey::Scalar(s) => {
                    if !canon_scalar(s, &mut buf) {
                        return Err(());
                    }
                }
                ExtraKey::Tuple(v) => {
                    buf.extend_from_slice(format!("t{}:", v.len()).as_bytes());
                    for s in v {
                        if !canon_scalar(s, &mut buf) {
                            return Err(());
                        }
                    }
                }
            }
        }
        out[i] = keys::xxh3(&buf, base);
        any = true;
    }
    Ok(if any { Some(out) } else { None })
}

/// A decoded record's events as the index reads them; Err(()) = decline.
struct Owned {
    ehs: Vec<Vec<u64>>,
    parents: Vec<Option<u64>>,
    ctx: Vec<Option<Vec<u64>>>,
}

fn own(rec: &Record, ix: &mut Index) -> Result<Owned, ()> {
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
                        let base = ix.context(s.block_size as i64, s.lora_name);
                        block_contexts(x, s.lora_name, base, n)?
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
    Ok(o)
}

fn events<'a>(rec: &'a Record, o: &'a Owned) -> Vec<Ev<'a>> {
    rec.events
        .iter()
        .enumerate()
        .map(|(i, e)| match e {
            Event::Stored(s) => Ev::Store {
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
            },
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
    }
}

/// A source that cannot observe removals says so with this suffix (producer/connector.py, lmcache_source.py).
pub fn is_approximate(source: &str) -> bool {
    source.ends_with("/approximate")
}

fn tally_tuple<'py>(py: Python<'py>, t: &Tally) -> PyResult<Bound<'py, PyTuple>> {
    (t.records, t.duplicates, t.stale, t.gaps, t.resets, t.blocks, t.events, t.max_lag_us).into_pyobject(py)
}

/// Decode, fence and apply `records[start:]` (bytes values, or objects with a
/// `.value`) until one is declined or `budget_us` is spent. Returns
/// (next index, declined: bool, tally, dead letters [(index, reason)],
/// workers seen [(instance_id, dp_rank)]). With `declined`, `records[next]`
/// is the declined one (not consumed).
#[pyfunction]
#[pyo3(signature = (index, fence, records, start, budget_us, now_us))]
#[allow(clippy::type_complexity)]
pub fn apply_poll<'py>(
    py: Python<'py>,
    index: &Bound<'py, PyIndex>,
    fence: &Bound<'py, PyFence>,
    records: &Bound<'py, PyList>,
    start: usize,
    budget_us: u64,
    now_us: i64,
) -> PyResult<(usize, bool, Bound<'py, PyTuple>, Vec<(usize, String)>, Vec<(String, i64)>)> {
    let mut ixg = index.borrow_mut();
    let mut fg = fence.borrow_mut();
    let ix = &mut ixg.ix;
    let f = &mut fg.fence;
    let t0 = std::time::Instant::now();
    let mut t = Tally::default();
    let mut dead = vec![];
    let mut seen: Vec<(String, i64)> = vec![];
    let n = records.len();
    let mut i = start;
    let value_attr = pyo3::intern!(py, "value");
    while i < n {
        let item = records.get_item(i)?;
        let value = if item.is_instance_of::<PyBytes>() { item } else { item.getattr(value_attr)? };
        let Ok(b) = value.cast::<PyBytes>() else {
            return Ok((i, true, tally_tuple(py, &t)?, dead, seen));
        };
        let Ok(rec) = decode::decode(b.as_bytes()) else {
            return Ok((i, true, tally_tuple(py, &t)?, dead, seen));
        };
        let Ok(o) = own(&rec, ix) else {
            return Ok((i, true, tally_tuple(py, &t)?, dead, seen));
        };
        let mut evs = events(&rec, &o);
        let s = stamp(&rec);
        match apply_one(ix, f, &s, &mut evs, &mut t, now_us) {
            Applied::Dead(why) => {
                // An overflowed record was fenced (its rank is known here); a malformed one was not.
                if why == OVERFLOW_REASON && !seen.iter().any(|(a, d)| a == s.inst && *d == s.dp) {
                    seen.push((s.inst.to_owned(), s.dp));
                }
                dead.push((i, why));
            }
            Applied::Skipped => {}
            Applied::Ok => {
                if !seen.iter().any(|(a, d)| a == s.inst && *d == s.dp) {
                    seen.push((s.inst.to_owned(), s.dp));
                }
            }
        }
        i += 1;
        if t0.elapsed().as_micros() as u64 >= budget_us {
            break;
        }
    }
    Ok((i, false, tally_tuple(py, &t)?, dead, seen))
}

/// The second entry point: fence and apply one record Python decoded (one
/// the fast path declined). `events` are `PrefixIndex`'s event tuples.
/// Returns (verdict, tally, dead-letter reason or None).
#[pyfunction]
#[pyo3(signature = (index, fence, worker, stamp, events, now_us, source=""))]
#[allow(clippy::too_many_arguments)]
pub fn apply_decoded<'py>(
    py: Python<'py>,
    index: &Bound<'py, PyIndex>,
    fence: &Bound<'py, PyFence>,
    worker: (String, i64, i64, i64),
    stamp: (i64, i64, i64, bool, i64),
    events: &Bound<'py, PyList>,
    now_us: i64,
    source: &str,
) -> PyResult<(u8, Bound<'py, PyTuple>, Option<String>)> {
    let mut owned = Vec::with_capacity(events.len());
    for e in events.iter() {
        owned.push(owned_event(e.cast::<PyTuple>()?)?);
    }
    let mut evs = borrow_events(&owned);
    let (inst, dp, tp_rank, tp_size) = &worker;
    let (epoch, seq, ts_us, reset, gap) = stamp;
    let approximate = is_approximate(source);
    let s = Stamp { inst, dp: *dp, tp_rank: *tp_rank, tp_size: *tp_size, epoch, seq, ts_us, reset, gap, approximate };
    let mut ixg = index.borrow_mut();
    let mut fg = fence.borrow_mut();
    let mut t = Tally::default();
    let before = t.records;
    let r = apply_one(&mut ixg.ix, &mut fg.fence, &s, &mut evs, &mut t, now_us);
    let verdict = if t.records == before {
        255
    } else if t.duplicates > 0 {
        Verdict::Duplicate as u8
    } else if t.stale > 0 {
        Verdict::StaleEpoch as u8
    } else if t.resets > 0 {
        Verdict::Reset as u8
    } else {
        Verdict::Apply as u8
    };
    let dead = match r {
        Applied::Dead(w) => Some(w),
        _ => None,
    };
    Ok((verdict, tally_tuple(py, &t)?, dead))
}

type RankRow = (String, i64, i64, i64, i64, bool, String, i64, Vec<i64>, i64, i64, bool);

/// `kvwire.consumer.rank_state.RankTable`'s state, in Rust.
#[pyclass(module = "kvwire._core", name = "Fence")]
#[derive(Default)]
pub struct PyFence {
    pub fence: Fence,
}

#[pymethods]
impl PyFence {
    #[new]
    fn new() -> Self {
        Self::default()
    }

    /// The verdict (0 apply, 1 reset, 2 duplicate, 3 stale epoch) for one record.
    #[pyo3(signature = (inst, dp, tp_rank, tp_size, epoch, seq, ts_us, reset, gap, source=""))]
    #[allow(clippy::too_many_arguments)]
    fn admit(
        &mut self,
        inst: &str,
        dp: i64,
        tp_rank: i64,
        tp_size: i64,
        epoch: i64,
        seq: i64,
        ts_us: i64,
        reset: bool,
        gap: i64,
        source: &str,
    ) -> u8 {
        let approximate = is_approximate(source);
        self.fence.admit(&Stamp { inst, dp, tp_rank, tp_size, epoch, seq, ts_us, reset, gap, approximate }) as u8
    }

    fn approximate_workers(slf: &Bound<'_, Self>) -> Vec<(String, i64)> {
        let this = wait_borrow(slf);
        this.fence.approximate_workers().into_iter().map(|(i, d)| (i.to_owned(), d)).collect()
    }

    fn worker_trusted(slf: &Bound<'_, Self>, inst: &str, dp: i64) -> bool {
        let this = wait_borrow(slf);
        this.fence.worker_trusted(inst, dp)
    }

    fn untrusted_workers(slf: &Bound<'_, Self>) -> Vec<(String, i64)> {
        let this = wait_borrow(slf);
        this.fence.untrusted_workers().into_iter().map(|(i, d)| (i.to_owned(), d)).collect()
    }

    fn workers(slf: &Bound<'_, Self>) -> Vec<(String, i64)> {
        let this = wait_borrow(slf);
        this.fence.workers().into_iter().map(|(i, d)| (i.to_owned(), d)).collect()
    }

    fn expired(slf: &Bound<'_, Self>, now_us: i64, timeout_us: i64) -> Vec<(String, i64, i64)> {
        let this = wait_borrow(slf);
        this.fence.expired(now_us, timeout_us)
    }

    fn forget(&mut self, inst: &str, dp: i64, tp_rank: i64) {
        self.fence.forget(inst, dp, tp_rank);
    }

    fn forget_worker(&mut self, inst: &str, dp: i64) {
        self.fence.forget_worker(inst, dp);
    }

    fn state_known(&mut self, inst: &str, dp: i64, tp_rank: i64) {
        self.fence.state_known(inst, dp, tp_rank);
    }

    /// Every rank: (inst, dp, tp_rank, epoch, last_seq, trusted, reason, last_seen_us, retired, records, gaps).
    fn ranks(slf: &Bound<'_, Self>) -> Vec<RankRow> {
        let this = wait_borrow(slf);
        this.fence
            .all()
            .map(|(i, d, t, s)| {
                (
                    i.to_owned(),
                    d,
                    t,
                    s.epoch,
                    s.last_seq,
                    s.trusted,
                    s.reason.clone(),
                    s.last_seen_us,
                    s.retired.iter().copied().collect(),
                    s.records,
                    s.gaps,
                    s.approximate,
                )
            })
            .collect()
    }

    fn tp_sizes(slf: &Bound<'_, Self>) -> Vec<(String, i64, i64)> {
        let this = wait_borrow(slf);
        this.fence.tp_sizes().map(|(i, d, t)| (i.to_owned(), d, t)).collect()
    }

    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (inst, dp, tp_rank, tp_size, epoch, last_seq, trusted, reason, last_seen_us, retired, records, gaps, approximate=false))]
    fn restore(
        &mut self,
        inst: &str,
        dp: i64,
        tp_rank: i64,
        tp_size: i64,
        epoch: i64,
        last_seq: i64,
        trusted: bool,
        reason: String,
        last_seen_us: i64,
        retired: Vec<i64>,
        records: i64,
        gaps: i64,
        approximate: bool,
    ) {
        let st = RankState {
            epoch,
            last_seq,
            trusted,
            last_seen_us,
            retired: retired.into(),
            reason,
            records,
            gaps,
            approximate,
        };
        self.fence.restore(inst, dp, tp_rank, st, tp_size);
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
    let (untrusted, approx) = {
        let f = wait_borrow(fence);
        (PyList::new(py, f.fence.untrusted_workers())?, PyList::new(py, f.fence.approximate_workers())?)
    };
    PyIndex::score(index, py, queries, None, None, Some(untrusted.as_any()), top_k, as_json, Some(approx.as_any()))
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyFence>()?;
    m.add_function(wrap_pyfunction!(apply_poll, m)?)?;
    m.add_function(wrap_pyfunction!(apply_decoded, m)?)?;
    m.add_function(wrap_pyfunction!(score_trusted, m)?)?;
    Ok(())
}
