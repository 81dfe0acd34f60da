//! `encode_record`: the producer's fast path to a record's bytes. It reads the same values
//! fastavro would (the dict `codec.batch_to_record` builds) and declines, returning `None`,
//! anything whose fastavro encoding is not the plain one it writes: then `codec.encode` asks
//! fastavro, which writes it or raises the codec's error.

use pyo3::intern;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyBool, PyBytes, PyDict, PyFloat, PyInt, PyList, PyString, PyTuple};
use typed_arena::Arena;

use super::{encode_into, VERSION};
use crate::record::{Event, ExtraKey, HashKind, Hashes, Record, Removed, Scalar, Stored, Worker};

/// `codec.EVENT_BRANCHES`: the names `codec.batch_to_record` tags events with, in the union's
/// order (stored, removed, cleared).
static BRANCHES: PyOnceLock<Py<PyAny>> = PyOnceLock::new();

/// `header` followed by the record's body in schema version `ENCODE_VERSION`, or `None` when
/// the fast path declines the values.
#[pyfunction]
pub fn encode_record<'py>(py: Python<'py>, header: &[u8], record: &Bound<'py, PyDict>) -> Option<Bound<'py, PyBytes>> {
    let branches = BRANCHES.import(py, "kvwire.schemas.codec", "EVENT_BRANCHES").ok()?.cast::<PyTuple>().ok()?;
    // Every value a record borrows from lives here until its bytes are written.
    let arena = Arena::new();
    let r = Values { arena: &arena, branches }.record(record)?;
    let mut out = Vec::with_capacity(header.len() + 256);
    out.extend_from_slice(header);
    encode_into(&r, &mut out);
    Some(PyBytes::new(py, &out))
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(encode_record, m)?)?;
    m.add("ENCODE_VERSION", VERSION)
}

/// Reads values of exactly the Python types fastavro writes plainly; `None` otherwise.
struct Values<'a, 'py> {
    arena: &'a Arena<Bound<'py, PyAny>>,
    branches: &'a Bound<'py, PyTuple>,
}

impl<'a, 'py> Values<'a, 'py> {
    fn keep(&self, v: Bound<'py, PyAny>) -> &'a Bound<'py, PyAny> {
        self.arena.alloc(v)
    }

    fn field(&self, d: &Bound<'py, PyDict>, name: &Bound<'py, PyString>) -> Option<&'a Bound<'py, PyAny>> {
        d.get_item(name).ok().flatten().map(|v| self.keep(v))
    }

    fn dict(&self, v: &'a Bound<'py, PyAny>) -> Option<&'a Bound<'py, PyDict>> {
        v.cast_exact::<PyDict>().ok()
    }

    fn str(&self, v: &'a Bound<'py, PyAny>) -> Option<&'a str> {
        v.cast_exact::<PyString>().ok()?.to_str().ok()
    }

    fn bytes(&self, v: &'a Bound<'py, PyAny>) -> Option<&'a [u8]> {
        Some(v.cast_exact::<PyBytes>().ok()?.as_bytes())
    }

    /// An `int` (never a `bool`) that fits `T`.
    fn int<T: for<'b> FromPyObject<'b, 'py>>(&self, v: &Bound<'py, PyAny>) -> Option<T> {
        if !v.is_exact_instance_of::<PyInt>() {
            return None;
        }
        v.extract::<T>().ok()
    }

    fn opt<T>(
        &self,
        v: &'a Bound<'py, PyAny>,
        some: impl FnOnce(&'a Bound<'py, PyAny>) -> Option<T>,
    ) -> Option<Option<T>> {
        if v.is_none() {
            Some(None)
        } else {
            some(v).map(Some)
        }
    }

    fn list(&self, v: &'a Bound<'py, PyAny>) -> Option<Vec<&'a Bound<'py, PyAny>>> {
        Some(v.cast_exact::<PyList>().ok()?.iter().map(|x| self.keep(x)).collect())
    }

    fn record(&self, d: &Bound<'py, PyDict>) -> Option<Record<'a>> {
        let w = self.dict(self.field(d, intern!(d.py(), "worker"))?)?;
        let worker = Worker {
            instance_id: self.str(self.field(w, intern!(w.py(), "instance_id"))?)?,
            model: self.str(self.field(w, intern!(w.py(), "model"))?)?,
            dp_rank: self.int(self.field(w, intern!(w.py(), "dp_rank"))?)?,
            tp_rank: self.int(self.field(w, intern!(w.py(), "tp_rank"))?)?,
            tp_size: self.int(self.field(w, intern!(w.py(), "tp_size"))?)?,
        };
        let reset = self.field(d, intern!(d.py(), "reset"))?;
        let events = self.list(self.field(d, intern!(d.py(), "events"))?)?;
        Some(Record {
            writer_version: VERSION,
            worker,
            epoch: self.int(self.field(d, intern!(d.py(), "epoch"))?)?,
            seq: self.int(self.field(d, intern!(d.py(), "seq"))?)?,
            ts_us: self.int(self.field(d, intern!(d.py(), "ts_us"))?)?,
            engine_ts: self
                .opt(self.field(d, intern!(d.py(), "engine_ts"))?, |t| Some(t.cast_exact::<PyFloat>().ok()?.value()))?,
            reset: reset.cast_exact::<PyBool>().ok()?.is_true(),
            gap: self.int(self.field(d, intern!(d.py(), "gap"))?)?,
            source: self.str(self.field(d, intern!(d.py(), "source"))?)?,
            events: events.into_iter().map(|e| self.event(e)).collect::<Option<_>>()?,
        })
    }

    fn event(&self, e: &'a Bound<'py, PyAny>) -> Option<Event<'a>> {
        let t = e.cast_exact::<PyTuple>().ok()?;
        if t.len() != 2 {
            return None;
        }
        let name = t.get_item(0).ok()?;
        let body = self.dict(self.keep(t.get_item(1).ok()?))?;
        // batch_to_record tags with the very strings of EVENT_BRANCHES, which str equality
        // answers by identity first.
        let branch = (0..3).find(|&i| self.branches.get_item(i).is_ok_and(|b| b.eq(&name).unwrap_or(false)))?;
        match branch {
            0 => Some(Event::Stored(self.stored(body)?)),
            1 => Some(Event::Removed(self.removed(body)?)),
            _ => Some(Event::Cleared),
        }
    }

    fn hashes(&self, d: &Bound<'py, PyDict>) -> Option<Hashes<'a>> {
        let kind = match self.str(self.field(d, intern!(d.py(), "hash_kind"))?)? {
            "U64" => HashKind::U64,
            "I64" => HashKind::I64,
            "DIGEST" => HashKind::Digest,
            _ => return None,
        };
        // An Avro int, and a width: not negative.
        let width = usize::try_from(self.int::<i32>(self.field(d, intern!(d.py(), "hash_width"))?)?).ok()?;
        Some(Hashes { kind, width, packed: self.bytes(self.field(d, intern!(d.py(), "block_hashes"))?)? })
    }

    fn opt_str(&self, d: &Bound<'py, PyDict>, name: &Bound<'py, PyString>) -> Option<Option<&'a str>> {
        self.opt(self.field(d, name)?, |v| self.str(v))
    }

    fn opt_int<T: for<'b> FromPyObject<'b, 'py>>(
        &self,
        d: &Bound<'py, PyDict>,
        name: &Bound<'py, PyString>,
    ) -> Option<Option<T>> {
        self.opt(self.field(d, name)?, |v| self.int(v))
    }

    fn stored(&self, d: &Bound<'py, PyDict>) -> Option<Stored<'a>> {
        Some(Stored {
            block_hashes: self.hashes(d)?,
            parent_block_hash: self.opt(self.field(d, intern!(d.py(), "parent_block_hash"))?, |v| self.bytes(v))?,
            token_ids: self.bytes(self.field(d, intern!(d.py(), "token_ids"))?)?,
            block_size: self.int(self.field(d, intern!(d.py(), "block_size"))?)?,
            lora_id: self.opt_int(d, intern!(d.py(), "lora_id"))?,
            medium: self.opt_str(d, intern!(d.py(), "medium"))?,
            lora_name: self.opt_str(d, intern!(d.py(), "lora_name"))?,
            extra_keys: self.opt(self.field(d, intern!(d.py(), "extra_keys"))?, |v| self.extra_keys(v))?,
            group_idx: self.opt_int(d, intern!(d.py(), "group_idx"))?,
            kv_cache_spec_kind: self.opt_str(d, intern!(d.py(), "kv_cache_spec_kind"))?,
            kv_cache_spec_sliding_window: self.opt_int(d, intern!(d.py(), "kv_cache_spec_sliding_window"))?,
            locality: self.opt_str(d, intern!(d.py(), "locality"))?,
            ownership: self.opt_str(d, intern!(d.py(), "ownership"))?,
            session_id: self.opt_str(d, intern!(d.py(), "session_id"))?,
        })
    }

    fn removed(&self, d: &Bound<'py, PyDict>) -> Option<Removed<'a>> {
        Some(Removed {
            block_hashes: self.hashes(d)?,
            medium: self.opt_str(d, intern!(d.py(), "medium"))?,
            group_idx: self.opt_int(d, intern!(d.py(), "group_idx"))?,
            locality: self.opt_str(d, intern!(d.py(), "locality"))?,
            ownership: self.opt_str(d, intern!(d.py(), "ownership"))?,
        })
    }

    fn extra_keys(&self, v: &'a Bound<'py, PyAny>) -> Option<Vec<Option<Vec<ExtraKey<'a>>>>> {
        self.list(v)?
            .into_iter()
            .map(|block| self.opt(block, |keys| self.list(keys)?.into_iter().map(|k| self.extra_key(k)).collect()))
            .collect()
    }

    /// A list is a tuple key (union branch 6); anything else one scalar.
    fn extra_key(&self, k: &'a Bound<'py, PyAny>) -> Option<ExtraKey<'a>> {
        if k.is_exact_instance_of::<PyList>() {
            return Some(ExtraKey::Tuple(self.list(k)?.into_iter().map(|s| self.scalar(s)).collect::<Option<_>>()?));
        }
        Some(ExtraKey::Scalar(self.scalar(k)?))
    }

    /// The first union branch fastavro would pick, for the types whose pick is plain: an
    /// `int` beyond 64 bits (fastavro would write it as a double) is declined.
    fn scalar(&self, s: &'a Bound<'py, PyAny>) -> Option<Scalar<'a>> {
        if s.is_none() {
            Some(Scalar::Null)
        } else if let Ok(b) = s.cast_exact::<PyBool>() {
            Some(Scalar::Bool(b.is_true()))
        } else if s.is_exact_instance_of::<PyInt>() {
            Some(Scalar::Long(self.int(s)?))
        } else if let Ok(f) = s.cast_exact::<PyFloat>() {
            Some(Scalar::Double(f.value()))
        } else if let Ok(t) = s.cast_exact::<PyString>() {
            Some(Scalar::Str(t.to_str().ok()?))
        } else {
            Some(Scalar::Bytes(self.bytes(s)?))
        }
    }
}
