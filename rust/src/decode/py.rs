//! Python entry points of the decoder: the parity test, the benchmark, and
//! any caller that wants `kvwire.schemas.events` objects from the fast path.

use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyBytes, PyDict, PyList, PyTuple};

use super::{decode, Decline, FINGERPRINTS};
use crate::record::{Event, ExtraKey, HashKind, Hashes, Record, Scalar};

static EVENT_BATCH: PyOnceLock<Py<PyAny>> = PyOnceLock::new();
static WORKER_ID: PyOnceLock<Py<PyAny>> = PyOnceLock::new();
static BLOCK_STORED: PyOnceLock<Py<PyAny>> = PyOnceLock::new();
static BLOCK_REMOVED: PyOnceLock<Py<PyAny>> = PyOnceLock::new();
static ALL_CLEARED: PyOnceLock<Py<PyAny>> = PyOnceLock::new();
static ARRAY: PyOnceLock<Py<PyAny>> = PyOnceLock::new();

const EVENTS: &str = "kvwire.schemas.events";

/// The record's bytes, or `None` for anything that is not `bytes` (a tombstone's None included).
fn as_bytes<'a>(value: &'a Bound<'_, PyAny>) -> Option<&'a [u8]> {
    value.cast::<PyBytes>().ok().map(|b| b.as_bytes())
}

/// Decode one record value into `kvwire.schemas.events.EventBatch`, or return
/// `None` when the fast path declines it (then `codec.decode` is the answer).
#[pyfunction]
pub fn decode_record<'py>(py: Python<'py>, value: &Bound<'py, PyAny>) -> PyResult<Option<Bound<'py, PyAny>>> {
    let Some(buf) = as_bytes(value) else { return Ok(None) };
    match decode(buf) {
        Ok(rec) => Ok(Some(event_batch(py, &rec)?)),
        Err(_) => Ok(None),
    }
}

/// Why the fast path declines a value, or `None` when it decodes it.
#[pyfunction]
pub fn decline_reason(value: &Bound<'_, PyAny>) -> Option<String> {
    let Some(buf) = as_bytes(value) else { return Some("not bytes".to_owned()) };
    decode(buf).err().map(|d: Decline| d.to_string())
}

/// Decode a poll batch of values to Rust records and drop them: the decoder's
/// cost alone, for the benchmark. -> (records decoded, blocks in them, indices declined).
#[pyfunction]
pub fn decode_many(values: &Bound<'_, PyList>) -> (usize, usize, Vec<usize>) {
    let (mut ok, mut blocks, mut declined) = (0usize, 0usize, Vec::new());
    for (i, v) in values.iter().enumerate() {
        match as_bytes(&v).map(decode) {
            Some(Ok(rec)) => {
                ok += 1;
                blocks += rec.block_count();
            }
            _ => declined.push(i),
        }
    }
    (ok, blocks, declined)
}

/// Adds the decoder's functions, and `FINGERPRINTS` ({writer version: fingerprint as framed on
/// the wire} for every version the fast path knows), to the module.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(decode_record, m)?)?;
    m.add_function(wrap_pyfunction!(decline_reason, m)?)?;
    m.add_function(wrap_pyfunction!(decode_many, m)?)?;
    let d = PyDict::new(m.py());
    for (v, fp) in FINGERPRINTS {
        d.set_item(v, PyBytes::new(m.py(), &fp))?;
    }
    m.add("FINGERPRINTS", d)
}

/// The `kvwire.schemas.events.EventBatch` of a decoded record, equal to what `codec.decode` gives.
pub fn event_batch<'py>(py: Python<'py>, r: &Record<'_>) -> PyResult<Bound<'py, PyAny>> {
    let w = &r.worker;
    let worker =
        WORKER_ID.import(py, EVENTS, "WorkerId")?.call1((w.instance_id, w.dp_rank, w.tp_rank, w.tp_size, w.model))?;
    let events = r.events.iter().map(|e| event(py, e)).collect::<PyResult<Vec<_>>>()?;
    EVENT_BATCH.import(py, EVENTS, "EventBatch")?.call1((
        worker,
        r.epoch,
        r.seq,
        r.ts_us,
        PyTuple::new(py, events)?,
        r.engine_ts,
        r.reset,
        r.gap,
        r.source,
    ))
}

fn event<'py>(py: Python<'py>, e: &Event<'_>) -> PyResult<Bound<'py, PyAny>> {
    match e {
        Event::Stored(s) => {
            let parent = match s.parent_block_hash {
                None => py.None().into_bound(py),
                Some(p) => hash(py, s.block_hashes.kind, p)?,
            };
            let extra = match &s.extra_keys {
                None => py.None().into_bound(py),
                Some(blocks) => extra_keys(py, blocks)?.into_any(),
            };
            let args = PyTuple::new(
                py,
                [
                    hashes(py, &s.block_hashes)?.into_any(),
                    parent,
                    tokens(py, s.token_ids)?,
                    s.block_size.into_pyobject(py)?.into_any(),
                    s.lora_id.into_pyobject(py)?.into_any(),
                    s.medium.into_pyobject(py)?.into_any(),
                    s.lora_name.into_pyobject(py)?.into_any(),
                    extra,
                    s.group_idx.into_pyobject(py)?.into_any(),
                    s.kv_cache_spec_kind.into_pyobject(py)?.into_any(),
                    s.kv_cache_spec_sliding_window.into_pyobject(py)?.into_any(),
                    s.locality.into_pyobject(py)?.into_any(),
                    s.ownership.into_pyobject(py)?.into_any(),
                    s.session_id.into_pyobject(py)?.into_any(),
                ],
            )?;
            BLOCK_STORED.import(py, EVENTS, "BlockStored")?.call1(args)
        }
        Event::Removed(r) => BLOCK_REMOVED.import(py, EVENTS, "BlockRemoved")?.call1((
            hashes(py, &r.block_hashes)?,
            r.medium,
            r.group_idx,
            r.locality,
            r.ownership,
        )),
        Event::Cleared => ALL_CLEARED.import(py, EVENTS, "AllBlocksCleared")?.call0(),
    }
}

/// One packed hash as `codec.unpack_hashes` gives it: int (unsigned or signed) or bytes.
fn hash<'py>(py: Python<'py>, kind: HashKind, b: &[u8]) -> PyResult<Bound<'py, PyAny>> {
    Ok(match kind {
        HashKind::U64 => u64::from_le_bytes(b.try_into()?).into_pyobject(py)?.into_any(),
        HashKind::I64 => i64::from_le_bytes(b.try_into()?).into_pyobject(py)?.into_any(),
        HashKind::Digest => PyBytes::new(py, b).into_any(),
    })
}

fn hashes<'py>(py: Python<'py>, h: &Hashes<'_>) -> PyResult<Bound<'py, PyTuple>> {
    let items = h.iter().map(|b| hash(py, h.kind, b)).collect::<PyResult<Vec<_>>>()?;
    PyTuple::new(py, items)
}

/// `array('I')` from the packed little-endian ids, as `codec.unpack_tokens` builds it.
fn tokens<'py>(py: Python<'py>, b: &[u8]) -> PyResult<Bound<'py, PyAny>> {
    let a = ARRAY.import(py, "array", "array")?.call1(("I", PyBytes::new(py, b)))?;
    if cfg!(target_endian = "big") {
        a.call_method0("byteswap")?;
    }
    Ok(a)
}

fn scalar<'py>(py: Python<'py>, s: &Scalar<'_>) -> PyResult<Bound<'py, PyAny>> {
    Ok(match *s {
        Scalar::Null => py.None().into_bound(py),
        Scalar::Bool(b) => b.into_pyobject(py)?.to_owned().into_any(),
        Scalar::Long(v) => v.into_pyobject(py)?.into_any(),
        Scalar::Double(v) => v.into_pyobject(py)?.into_any(),
        Scalar::Str(v) => v.into_pyobject(py)?.into_any(),
        Scalar::Bytes(v) => PyBytes::new(py, v).into_any(),
    })
}

/// tuple(None | tuple(scalar | tuple(scalar))), as `codec._extra_in` shapes it.
fn extra_keys<'py>(py: Python<'py>, blocks: &[Option<Vec<ExtraKey<'_>>>]) -> PyResult<Bound<'py, PyTuple>> {
    let mut out = Vec::with_capacity(blocks.len());
    for b in blocks {
        out.push(match b {
            None => py.None().into_bound(py),
            Some(keys) => {
                let mut ks = Vec::with_capacity(keys.len());
                for k in keys {
                    ks.push(match k {
                        ExtraKey::Scalar(s) => scalar(py, s)?,
                        ExtraKey::Tuple(items) => {
                            let t = items.iter().map(|s| scalar(py, s)).collect::<PyResult<Vec<_>>>()?;
                            PyTuple::new(py, t)?.into_any()
                        }
                    });
                }
                PyTuple::new(py, ks)?.into_any()
            }
        });
    }
    PyTuple::new(py, out)
}
