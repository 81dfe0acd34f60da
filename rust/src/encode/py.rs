//! `encode_record`: the producer's fast path to a record's bytes. It reads the same values
//! fastavro would (the dict `codec.batch_to_record` builds) and declines, returning `None`,
//! anything whose fastavro encoding is not the plain one it writes: then `codec.encode` asks
//! fastavro, which writes it or raises the codec's error.

use pyo3::buffer::PyBuffer;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyBool, PyBytes, PyDict, PyFloat, PyInt, PyList, PyString, PyTuple, PyType};
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

/// `kvwire.schemas.events`' three event types and `array.array`, by identity.
static STORED_T: PyOnceLock<Py<PyType>> = PyOnceLock::new();
static REMOVED_T: PyOnceLock<Py<PyType>> = PyOnceLock::new();
static CLEARED_T: PyOnceLock<Py<PyType>> = PyOnceLock::new();
static ARRAY_T: PyOnceLock<Py<PyType>> = PyOnceLock::new();

/// `encode_record` straight from an `EventBatch`, without the dict `codec.batch_to_record`
/// builds (that dict, the hashes' packing and the worker's fields cost the sender thread more
/// than the encoding itself, on the engine's GIL). It takes only values whose dict and bytes are
/// plain: hashes `u64_packed` takes (the U64 case of `codec.pack_hashes`, which calls it too),
/// token ids in an `array.array` of `I`, no extra keys; anything else is declined (`None`), and
/// `codec.encode` goes the dict's way.
#[pyfunction]
pub fn encode_batch<'py>(py: Python<'py>, header: &[u8], batch: &Bound<'py, PyAny>) -> Option<Bound<'py, PyBytes>> {
    if cfg!(target_endian = "big") {
        return None; // token ids are written little-endian, as `codec.pack_tokens` swaps them
    }
    let branches = BRANCHES.import(py, "kvwire.schemas.codec", "EVENT_BRANCHES").ok()?.cast::<PyTuple>().ok()?;
    let ev = "kvwire.schemas.events";
    let types = [
        STORED_T.import(py, ev, "BlockStored").ok()?,
        REMOVED_T.import(py, ev, "BlockRemoved").ok()?,
        CLEARED_T.import(py, ev, "AllBlocksCleared").ok()?,
        ARRAY_T.import(py, "array", "array").ok()?,
    ];
    let (arena, bufs) = (Arena::new(), Arena::new());
    let o = Objects { v: Values { arena: &arena, branches }, bufs: &bufs, types };
    let r = o.record(batch)?;
    let mut out = Vec::with_capacity(header.len() + 256);
    out.extend_from_slice(header);
    encode_into(&r, &mut out);
    Some(PyBytes::new(py, &out))
}

/// `codec.pack_hashes`' first case, its only home: every hash (an `int`, or anything with
/// `__index__`, as `struct`'s `Q` takes them) in [0, 2^64) and the parent `None` or an `int`
/// there: the hashes and the parent as little-endian U64s. `None` otherwise: the codec's other
/// kinds (I64, digests) and its errors decide.
fn u64_packed(hashes: &Bound<'_, PyAny>, parent: &Bound<'_, PyAny>) -> Option<(Vec<u8>, Option<[u8; 8]>)> {
    let parent = if parent.is_none() {
        None
    } else if parent.is_exact_instance_of::<PyInt>() {
        Some(parent.extract::<u64>().ok()?.to_le_bytes())
    } else {
        return None;
    };
    let mut packed = Vec::with_capacity(hashes.len().unwrap_or(0) * 8);
    for h in hashes.try_iter().ok()? {
        packed.extend_from_slice(&h.ok()?.extract::<u64>().ok()?.to_le_bytes());
    }
    Some((packed, parent))
}

/// `u64_packed` for `codec.pack_hashes`: `(packed, packed_parent)` or `None`.
#[pyfunction]
#[pyo3(signature = (hashes, parent=None))]
pub fn pack_u64<'py>(
    py: Python<'py>,
    hashes: &Bound<'py, PyAny>,
    parent: Option<&Bound<'py, PyAny>>,
) -> Option<(Bound<'py, PyBytes>, Option<Bound<'py, PyBytes>>)> {
    let none = py.None().into_bound(py);
    let (packed, parent) = u64_packed(hashes, parent.unwrap_or(&none))?;
    Some((PyBytes::new(py, &packed), parent.map(|p| PyBytes::new(py, &p))))
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(encode_record, m)?)?;
    m.add_function(wrap_pyfunction!(encode_batch, m)?)?;
    m.add_function(wrap_pyfunction!(pack_u64, m)?)?;
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

/// Reads an `EventBatch`'s attributes as `Values` reads the dict's items; the bytes it packs
/// (hashes, token ids) live in `bufs` until the record is written.
struct Objects<'a, 'py> {
    v: Values<'a, 'py>,
    bufs: &'a Arena<Vec<u8>>,
    /// BlockStored, BlockRemoved, AllBlocksCleared, array.array.
    types: [&'py Bound<'py, PyType>; 4],
}

impl<'a, 'py> Objects<'a, 'py> {
    fn attr(&self, o: &Bound<'py, PyAny>, name: &Bound<'py, PyString>) -> Option<&'a Bound<'py, PyAny>> {
        o.getattr(name).ok().map(|v| self.v.keep(v))
    }

    fn opt_str(&self, o: &Bound<'py, PyAny>, name: &Bound<'py, PyString>) -> Option<Option<&'a str>> {
        self.v.opt(self.attr(o, name)?, |v| self.v.str(v))
    }

    fn opt_int<T: for<'b> FromPyObject<'b, 'py>>(
        &self,
        o: &Bound<'py, PyAny>,
        name: &Bound<'py, PyString>,
    ) -> Option<Option<T>> {
        self.v.opt(self.attr(o, name)?, |v| self.v.int(v))
    }

    fn record(&self, b: &Bound<'py, PyAny>) -> Option<Record<'a>> {
        let py = b.py();
        let w = self.attr(b, intern!(py, "worker"))?;
        let worker = Worker {
            instance_id: self.v.str(self.attr(w, intern!(py, "instance_id"))?)?,
            model: self.v.str(self.attr(w, intern!(py, "model"))?)?,
            dp_rank: self.v.int(self.attr(w, intern!(py, "dp_rank"))?)?,
            tp_rank: self.v.int(self.attr(w, intern!(py, "tp_rank"))?)?,
            tp_size: self.v.int(self.attr(w, intern!(py, "tp_size"))?)?,
        };
        let events = self.attr(b, intern!(py, "events"))?.cast_exact::<PyTuple>().ok()?;
        Some(Record {
            writer_version: VERSION,
            worker,
            epoch: self.v.int(self.attr(b, intern!(py, "epoch"))?)?,
            seq: self.v.int(self.attr(b, intern!(py, "seq"))?)?,
            ts_us: self.v.int(self.attr(b, intern!(py, "ts_us"))?)?,
            engine_ts: self
                .v
                .opt(self.attr(b, intern!(py, "engine_ts"))?, |t| Some(t.cast_exact::<PyFloat>().ok()?.value()))?,
            reset: self.attr(b, intern!(py, "reset"))?.cast_exact::<PyBool>().ok()?.is_true(),
            gap: self.v.int(self.attr(b, intern!(py, "gap"))?)?,
            source: self.v.str(self.attr(b, intern!(py, "source"))?)?,
            events: events.iter().map(|e| self.event(self.v.keep(e))).collect::<Option<_>>()?,
        })
    }

    fn event(&self, e: &'a Bound<'py, PyAny>) -> Option<Event<'a>> {
        let t = e.get_type();
        if t.is(self.types[0]) {
            Some(Event::Stored(self.stored(e)?))
        } else if t.is(self.types[1]) {
            Some(Event::Removed(self.removed(e)?))
        } else if t.is(self.types[2]) {
            Some(Event::Cleared)
        } else {
            None
        }
    }

    /// A store's or removal's hashes (and a store's parent) when `u64_packed` takes them.
    fn u64_hashes(&self, o: &Bound<'py, PyAny>, parent: &Bound<'py, PyAny>) -> Option<(Hashes<'a>, Option<&'a [u8]>)> {
        let (packed, parent) = u64_packed(self.attr(o, intern!(o.py(), "block_hashes"))?, parent)?;
        let parent = parent.map(|p| &self.bufs.alloc(p.to_vec())[..]);
        Some((Hashes { kind: HashKind::U64, width: 8, packed: self.bufs.alloc(packed) }, parent))
    }

    /// `codec.pack_tokens` of an `array.array('I')`: its bytes, little-endian.
    fn tokens(&self, a: &Bound<'py, PyAny>) -> Option<&'a [u8]> {
        if !a.get_type().is(self.types[3]) {
            return None;
        }
        if a.len().ok()? == 0 {
            return Some(&[]); // an empty array's buffer may have no address, which PyBuffer refuses
        }
        let buf = PyBuffer::<u32>::get(a).ok()?;
        let ids = buf.to_vec(a.py()).ok()?;
        Some(self.bufs.alloc(ids.iter().flat_map(|t| t.to_le_bytes()).collect()))
    }

    fn stored(&self, e: &Bound<'py, PyAny>) -> Option<Stored<'a>> {
        let py = e.py();
        if !self.attr(e, intern!(py, "extra_keys"))?.is_none() {
            return None; // the dict's way (`codec._extra_out`)
        }
        let (block_hashes, parent_block_hash) = self.u64_hashes(e, self.attr(e, intern!(py, "parent_block_hash"))?)?;
        Some(Stored {
            block_hashes,
            parent_block_hash,
            token_ids: self.tokens(self.attr(e, intern!(py, "token_ids"))?)?,
            block_size: self.v.int(self.attr(e, intern!(py, "block_size"))?)?,
            lora_id: self.opt_int(e, intern!(py, "lora_id"))?,
            medium: self.opt_str(e, intern!(py, "medium"))?,
            lora_name: self.opt_str(e, intern!(py, "lora_name"))?,
            extra_keys: None,
            group_idx: self.opt_int(e, intern!(py, "group_idx"))?,
            kv_cache_spec_kind: self.opt_str(e, intern!(py, "kv_cache_spec_kind"))?,
            kv_cache_spec_sliding_window: self.opt_int(e, intern!(py, "kv_cache_spec_sliding_window"))?,
            locality: self.opt_str(e, intern!(py, "locality"))?,
            ownership: self.opt_str(e, intern!(py, "ownership"))?,
            session_id: self.opt_str(e, intern!(py, "session_id"))?,
        })
    }

    fn removed(&self, e: &Bound<'py, PyAny>) -> Option<Removed<'a>> {
        let py = e.py();
        Some(Removed {
            block_hashes: self.u64_hashes(e, &py.None().into_bound(py))?.0,
            medium: self.opt_str(e, intern!(py, "medium"))?,
            group_idx: self.opt_int(e, intern!(py, "group_idx"))?,
            locality: self.opt_str(e, intern!(py, "locality"))?,
            ownership: self.opt_str(e, intern!(py, "ownership"))?,
        })
    }
}
