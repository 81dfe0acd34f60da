//! Python bindings of the index (`kvwire._core.Index`) and of the key functions.
//!
//! `kvwire/consumer/index.py` wraps these in the typed API (`PrefixIndex`);
//! nothing else should call them directly. Arrays cross as `bytes` of
//! little-endian machine words (numpy reads them without a copy) and buffers
//! (array('I'), numpy, bytes) are read in place.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, PoisonError, RwLock, RwLockReadGuard, RwLockWriteGuard, TryLockError, TryLockResult};

use numpy::IntoPyArray;
use pyo3::exceptions::{PyBufferError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList, PyTuple};

use crate::index::{Index, Query, RankId, Scores, TableBlob};
use crate::keys::{self, Ctx};

/// A contiguous buffer's bytes, held for as long as this lives.
pub struct RawBuf {
    view: Box<pyo3::ffi::Py_buffer>,
}

impl RawBuf {
    pub fn get(obj: &Bound<'_, PyAny>) -> PyResult<Self> {
        let mut view: Box<pyo3::ffi::Py_buffer> = Box::new(unsafe { std::mem::zeroed() });
        // SAFETY: a zeroed Py_buffer is what PyObject_GetBuffer fills; released in Drop.
        let rc = unsafe { pyo3::ffi::PyObject_GetBuffer(obj.as_ptr(), &mut *view, pyo3::ffi::PyBUF_SIMPLE) };
        if rc != 0 {
            return Err(PyErr::take(obj.py()).unwrap_or_else(|| PyBufferError::new_err("not a contiguous buffer")));
        }
        Ok(RawBuf { view })
    }

    pub fn bytes(&self) -> &[u8] {
        if self.view.len == 0 {
            return &[];
        }
        // SAFETY: PyBUF_SIMPLE gives a contiguous block of `len` bytes, alive until release.
        unsafe { std::slice::from_raw_parts(self.view.buf as *const u8, self.view.len as usize) }
    }
}

impl Drop for RawBuf {
    fn drop(&mut self) {
        // SAFETY: obtained by PyObject_GetBuffer. A RawBuf is made and dropped with the GIL
        // held; in between its bytes may be read without it (a score's walk): the exporter
        // keeps them in place until the release, and kvwire's callers do not write to a
        // query's buffer while it is scored.
        unsafe { pyo3::ffi::PyBuffer_Release(&mut *self.view) }
    }
}

pub fn words_u64(b: &[u8]) -> Vec<u64> {
    b.chunks_exact(8).map(|c| u64::from_le_bytes(c.try_into().unwrap())).collect()
}

pub(crate) fn u64_bytes<'py>(py: Python<'py>, v: impl IntoIterator<Item = u64>) -> Bound<'py, PyBytes> {
    let b: Vec<u8> = v.into_iter().flat_map(|x| x.to_le_bytes()).collect();
    PyBytes::new(py, &b)
}

/// The index, shared between its writers and scores that run without the GIL.
///
/// How a reader sees a whole record or none: writers take the write lock and apply records
/// whole before they let it go; `apply_poll` does so in quanta without the GIL. Two rules keep
/// the lock from meeting the GIL in a deadlock: a writer that has to wait for readers waits
/// without the GIL (`PyIndex::write`), and so does a reader (`acquire`), and whoever holds the
/// lock without the GIL never needs the GIL to let it go. A score then releases the GIL and
/// walks the index under its read lock: it sees the index as it was between two quanta, and
/// several scores run at once, beside ingest's Python work and its quanta. The index lives
/// behind the `Arc` (not inline in the Python object) so a reader holds it without holding a
/// borrow of the Python object.
type Shared = Arc<RwLock<Index>>;

/// Readers (other threads) waiting for the index's read lock or the fence's lock: an apply
/// call ends its quantum early and lets them in before its next one (`pipeline::apply_poll`).
static READERS_WAITING: AtomicUsize = AtomicUsize::new(0);

pub(crate) fn readers_waiting() -> bool {
    READERS_WAITING.load(Ordering::Relaxed) != 0
}

/// `take()`'s first `Some`, polled (yielding the CPU between polls) for up to ~200 us: a
/// quantum or a score ends sooner than a sleeping thread is woken on a virtual machine; None after.
pub(crate) fn spin_for<G>(mut take: impl FnMut() -> Option<G>) -> Option<G> {
    let t0 = std::time::Instant::now();
    while t0.elapsed().as_micros() < 200 {
        if let Some(g) = take() {
            return Some(g);
        }
        std::thread::yield_now();
    }
    None
}

/// A lock's guard if `try_*` took it (a poisoned one's too, as everywhere in the core: a
/// panic is a bug, and refusing every later call would not undo it), None if it would block.
pub(crate) fn held<G>(r: TryLockResult<G>) -> Option<G> {
    match r {
        Ok(g) => Some(g),
        Err(TryLockError::Poisoned(e)) => Some(e.into_inner()),
        Err(TryLockError::WouldBlock) => None,
    }
}

/// A lock guard taken without the GIL, handed back to the thread that took it.
struct Taken<G>(G);
// SAFETY: `py.detach` runs its closure on the calling thread, so a guard taken in it is used
// and dropped on the thread that took it, as a guard must be; only the type crosses `detach`.
unsafe impl<G> Send for Taken<G> {}

/// `try_lock` under the GIL, and while it would block, the lock taken without the GIL
/// (announced in `READERS_WAITING`): polled, then `lock` waits for it. The holder is an apply
/// quantum or a score, which never needs the GIL to let go, and whatever else wants the GIL
/// meanwhile gets it. The guard comes back held: a wait that only saw the lock free and then
/// tried again under the GIL lost it, under a saturated ingest, to the next quantum again and
/// again (scores of 25-80 ms at 10M, `bench.score_latency`'s `under_ingest_restart`).
pub(crate) fn acquire<G>(
    py: Python<'_>,
    try_lock: impl Fn() -> Option<G> + Sync,
    lock: impl FnOnce() -> G + Send,
) -> G {
    if let Some(g) = try_lock() {
        return g;
    }
    READERS_WAITING.fetch_add(1, Ordering::Relaxed);
    let Taken(g) = py.detach(|| Taken(spin_for(&try_lock).unwrap_or_else(lock)));
    READERS_WAITING.fetch_sub(1, Ordering::Relaxed);
    g
}

/// One score query, as Python builds it (`consumer.index.PrefixIndex`): token ids, hashed
/// here in blocks of `block_size` under their per-block extra keys and LoRA, or keys
/// computed before, each worth `tokens_per_key` tokens. A size of 0 stands for every block
/// size the index holds, read under the score's own read lock (a second lock to ask for the
/// sizes first waited out an apply quantum of its own under ingest, and could miss a size
/// the score then saw).
#[pyclass(module = "kvwire._core", frozen)]
pub enum ScoreQuery {
    Tokens { tokens: Py<PyAny>, block_size: i64, extra_keys: Option<Py<PyAny>>, lora_name: Option<String> },
    Keys { keys: Py<PyAny>, tokens_per_key: i64 },
}

/// How a score call filters, weighs and returns its scores.
#[derive(Clone, Copy)]
pub struct ScoreArgs<'a, 'py> {
    pub weights: Option<&'a Bound<'py, PyDict>>,
    pub workers: Option<&'a Bound<'py, PyAny>>,
    pub exclude: Option<&'a Bound<'py, PyAny>>,
    /// Workers whose JSON entries are marked approximate.
    pub approximate: Option<&'a Bound<'py, PyAny>>,
    pub top_k: Option<usize>,
    pub as_json: bool,
    /// Only these media count (a tier's view, e.g. Dynamo's cumulative tiers); None: all.
    pub media: Option<&'a Bound<'py, PyAny>>,
}

#[pyclass(module = "kvwire._core", name = "Index", frozen)]
pub struct PyIndex {
    ix: Shared,
    weights: std::collections::HashMap<String, f64>,
    default_weight: f64,
}

impl PyIndex {
    /// The index to change; waits for the running scores without the GIL, which they may
    /// need to finish, and comes back holding the lock (as `acquire` does, for the same reason).
    /// Every such write moves `Index::writes` on, so that growth an apply call prepared
    /// before it is not put in after it.
    pub fn write(&self, py: Python<'_>) -> RwLockWriteGuard<'_, Index> {
        let lock: &RwLock<Index> = &self.ix;
        let mut g = match held(lock.try_write()) {
            Some(g) => g,
            None => py.detach(|| Taken(lock.write().unwrap_or_else(PoisonError::into_inner))).0,
        };
        g.writes += 1;
        g
    }

    /// The index to read; waits for an apply quantum in progress without the GIL.
    pub fn read(&self, py: Python<'_>) -> RwLockReadGuard<'_, Index> {
        let lock: &RwLock<Index> = &self.ix;
        acquire(py, || held(lock.try_read()), || lock.read().unwrap_or_else(PoisonError::into_inner))
    }

    /// The lock itself, for a writer that holds it without the GIL (`pipeline::apply_poll`).
    pub(crate) fn lock(&self) -> &RwLock<Index> {
        &self.ix
    }

    /// Per medium id: its weight, or `index::EXCLUDED` for a medium outside `media`.
    pub fn weights_for(
        &self,
        ix: &Index,
        over: Option<&Bound<'_, PyDict>>,
        media: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Vec<f64>> {
        let counted: Option<Vec<String>> = match media {
            Some(m) => Some(m.try_iter()?.map(|x| x?.extract::<String>()).collect::<PyResult<_>>()?),
            None => None,
        };
        let mut out = Vec::with_capacity(ix.media.len());
        for m in &ix.media {
            let mut w = *self.weights.get(m).unwrap_or(&self.default_weight);
            if let Some(d) = over {
                if let Some(v) = d.get_item(m)? {
                    w = v.extract()?;
                }
            }
            if w < 0.0 || w.is_nan() {
                return Err(PyValueError::new_err("medium weights must be >= 0"));
            }
            if let Some(c) = &counted {
                if !c.iter().any(|n| n == m) {
                    w = crate::index::EXCLUDED;
                }
            }
            out.push(w);
        }
        Ok(out)
    }

    pub fn mask(ix: &Index, workers: &Bound<'_, PyAny>, keep: bool) -> PyResult<Vec<bool>> {
        let mut m = vec![!keep; ix.workers.len()];
        for w in workers.try_iter()? {
            let (inst, dp): (String, i64) = w?.extract()?;
            if let Some(id) = ix.worker_id(&inst, dp) {
                m[id as usize] = keep;
            }
        }
        Ok(m)
    }
}

/// A score call's results as the six NumPy arrays of `consumer.index.ScoreArrays`, in its
/// field order, best first: result i is worker `worker[i]` (u32 id) with `matched_tokens[i]`
/// (i64) and `score[i]` (f64); its per-medium runs are `by_medium[by_off[i]..by_off[i+1]]`
/// (u32 medium ids) with `by_tokens` (i64) of the same slice. Each array owns the vector the
/// walk filled (no copy); made from bytes in Python, the six cost ~1 µs a score, a third of a
/// miss's whole score.
pub fn score_arrays<'py>(py: Python<'py>, s: Scores) -> PyResult<Bound<'py, PyTuple>> {
    let Scores { worker, matched, score, by_off, by_medium, by_tokens } = s;
    PyTuple::new(
        py,
        [
            worker.into_pyarray(py).into_any(),
            matched.into_pyarray(py).into_any(),
            score.into_pyarray(py).into_any(),
            by_off.into_pyarray(py).into_any(),
            by_medium.into_pyarray(py).into_any(),
            by_tokens.into_pyarray(py).into_any(),
        ],
    )
}

/// A worker's index statistics (`Index.stats()`), the fields of `consumer.index.WorkerStats`.
#[pyclass(module = "kvwire._core", frozen, get_all)]
pub struct StatsRow {
    pub instance_id: String,
    pub dp_rank: i64,
    pub tp_size: u32,
    pub ranks: usize,
    /// Holder-blocks per medium.
    pub blocks: Vec<(String, i64)>,
    pub entries: i64,
    pub orphans: i64,
    pub unknown_removes: i64,
    pub duplicate_stores: i64,
}

/// One exported table: what names it and its counters, a row of the snapshot blob's header.
#[pyclass(module = "kvwire._core", frozen, get_all)]
pub struct TableRow {
    pub instance_id: String,
    pub dp_rank: i64,
    pub tp_size: u32,
    pub tp_rank: i64,
    pub medium: String,
    pub group: i64,
    pub entries: i64,
    pub unknown_removes: i64,
    pub duplicate_stores: i64,
}

/// `export_workers`: the tables in the index's order, then their entries' engine hashes (u64),
/// keys (u64) and metas (u16, refcount|flags), table after table; and the workers' memos of
/// removed parents, (instance_id, dp_rank, tp_size, entries) per worker with one, then their
/// engine hashes (u64), keys (u64) and orphan flags (u8), oldest first, worker after worker.
#[pyclass(module = "kvwire._core", frozen, get_all)]
pub struct Exported {
    pub tables: Vec<Py<TableRow>>,
    pub ehs: Py<PyBytes>,
    pub keys: Py<PyBytes>,
    pub metas: Py<PyBytes>,
    pub memos: Vec<(String, i64, u32, usize)>,
    pub memo_ehs: Py<PyBytes>,
    pub memo_keys: Py<PyBytes>,
    pub memo_orphans: Py<PyBytes>,
}

/// A worker's KV-cache group and what a prefix needs of it (`export_groups`): its last
/// `tail` blocks, or every block when `tail` is 0.
#[pyclass(module = "kvwire._core", frozen, get_all)]
pub struct GroupReach {
    pub instance_id: String,
    pub dp_rank: i64,
    pub group: i64,
    pub tail: u32,
}

/// Append a float as JSON (msgspec's form: a whole number keeps ".0").
fn json_f64(out: &mut String, x: f64) {
    use std::fmt::Write;
    if x.is_finite() && x.fract() == 0.0 && x.abs() < 1e16 {
        // The integer's digits and ".0": what `{x:.1}` prints, without its exact-precision
        // formatter, whose bignum fallback was ~10% of a /v1/score request's CPU (py-spy on
        // bench.http_score; scores are mostly whole token counts).
        if x == 0.0 && x.is_sign_negative() {
            out.push('-');
        }
        out.push_str(itoa::Buffer::new().format(x as i64));
        out.push_str(".0");
    } else if x.is_finite() {
        let _ = write!(out, "{x}");
    } else {
        out.push_str("null");
    }
}

fn json_str(out: &mut String, s: &str) {
    use std::fmt::Write;
    out.push('"');
    // Worker ids and media names almost never need escaping: copied whole, not char by char.
    if !s.bytes().any(|b| b < 0x20 || b == b'"' || b == b'\\') {
        out.push_str(s);
        out.push('"');
        return;
    }
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// The `/v1/score` "scores" list as JSON, straight from the arrays. An entry
/// whose worker id is set in `approx` carries `"approximate":true`.
pub fn scores_json(ix: &Index, s: &Scores, approx: Option<&[bool]>) -> String {
    let mut out = String::with_capacity(64 + s.worker.len() * 96);
    out.push('[');
    for i in 0..s.worker.len() {
        if i > 0 {
            out.push(',');
        }
        let wk = &ix.workers[s.worker[i] as usize];
        out.push_str("{\"instance_id\":");
        json_str(&mut out, &wk.inst);
        // itoa, not fmt's machinery: formatting was a tenth of an HTTP score's CPU (perf on
        // bench.http_score; an answer lists every matched worker, ~170 there).
        let mut num = itoa::Buffer::new();
        out.push_str(",\"dp_rank\":");
        out.push_str(num.format(wk.dp));
        out.push_str(",\"matched_tokens\":");
        out.push_str(num.format(s.matched[i]));
        out.push_str(",\"by_medium\":{");
        for j in s.by_off[i] as usize..s.by_off[i + 1] as usize {
            if j > s.by_off[i] as usize {
                out.push(',');
            }
            json_str(&mut out, &ix.media[s.by_medium[j] as usize]);
            out.push(':');
            out.push_str(num.format(s.by_tokens[j]));
        }
        out.push_str("},\"score\":");
        json_f64(&mut out, s.score[i]);
        if approx.is_some_and(|a| a.get(s.worker[i] as usize).copied().unwrap_or(false)) {
            out.push_str(",\"approximate\":true");
        }
        out.push('}');
    }
    out.push(']');
    out
}

/// A token query's per-block contexts for `blocks` blocks (`py_keys::contexts`).
fn contexts(
    py: Python<'_>,
    extra_keys: &Option<Py<PyAny>>,
    lora_name: &Option<String>,
    base: u64,
    blocks: usize,
) -> PyResult<Option<Vec<u64>>> {
    let extra = match extra_keys {
        Some(x) => x.bind(py).clone(),
        None => py.None().into_bound(py),
    };
    crate::py_keys::contexts(&extra, lora_name.as_deref(), base, blocks)
}

impl PyIndex {
    /// `score`'s work, also for `score_trusted`, which marks approximate workers.
    pub fn score_with<'py, H>(
        slf: &Bound<'py, Self>,
        queries: &Bound<'py, PyList>,
        how: &ScoreArgs<'_, 'py>,
        hold: H,
    ) -> PyResult<Bound<'py, PyAny>> {
        let py = slf.py();
        let ScoreArgs { weights, workers, exclude, approximate, top_k, as_json, media } = *how;
        let mut qs_in = Vec::with_capacity(queries.len());
        for q in queries.iter() {
            qs_in.push(q.cast_into::<ScoreQuery>()?);
        }
        let mut bufs = vec![];
        // Per query, before the lock: its buffer, what it is (a token query's extra keys and
        // LoRA, None for keys), its block size (tokens per key), its context seed, and, unless
        // the size is 0 (every size, known only under the lock), its per-block contexts or keys.
        let mut asked = vec![];
        for q in &qs_in {
            let b = bufs.len();
            match q.get() {
                ScoreQuery::Tokens { tokens, block_size, extra_keys, lora_name } => {
                    let buf = RawBuf::get(tokens.bind(py))?;
                    let (n, base) = (*block_size, keys::context_seed(lora_name.as_deref()));
                    let words = if n > 0 {
                        Some(contexts(py, extra_keys, lora_name, base, buf.bytes().len() / 4 / n as usize)?)
                    } else {
                        None
                    };
                    bufs.push(buf);
                    if n >= 0 {
                        asked.push((b, Some((extra_keys, lora_name)), n, base, words));
                    }
                }
                ScoreQuery::Keys { keys, tokens_per_key } => {
                    let buf = RawBuf::get(keys.bind(py))?;
                    let n = *tokens_per_key;
                    asked.push((b, None, n, 0, (n != 0).then(|| Some(words_u64(buf.bytes())))));
                    bufs.push(buf);
                }
            }
        }
        // Weights and mask under the read lock the walk then keeps: they see the same index.
        let this = slf.get();
        let reader = this.read(py);
        // The caller's hold (the fence, for scores of trusted workers) ends once the index is
        // read-locked: the fence and the index are then of the same record.
        drop(hold);
        let ix: &Index = &reader;
        let mut sizes: Vec<i64> = vec![];
        if asked.iter().any(|a| a.4.is_none()) {
            sizes.extend(ix.block_sizes.iter().copied());
            sizes.sort_unstable();
        }
        // One query per (query, size): (buffer, tokens?, size, seed) and its contexts or keys.
        let (mut meta, mut words) = (vec![], vec![]);
        for (b, named, n, base, pre) in asked {
            if let Some(w) = pre {
                meta.push((b, named.is_some(), n, base));
                words.push(w);
                continue;
            }
            for &bs in &sizes {
                let w = match named {
                    Some((extra_keys, lora_name)) => {
                        contexts(py, extra_keys, lora_name, base, bufs[b].bytes().len() / 4 / bs as usize)?
                    }
                    None => Some(words_u64(bufs[b].bytes())),
                };
                meta.push((b, named.is_some(), bs, base));
                words.push(w);
            }
        }
        let mut qs = vec![];
        for (i, &(b, tok, n, base)) in meta.iter().enumerate() {
            if tok {
                let ctx = match &words[i] {
                    Some(c) => Ctx::PerBlock(c),
                    None => Ctx::One(base),
                };
                qs.push(Query::Tokens { tokens: bufs[b].bytes(), bs: n as usize, ctx });
            } else {
                qs.push(Query::Keys { keys: words[i].as_deref().unwrap_or(&[]), scale: n });
            }
        }
        let wts = this.weights_for(ix, weights, media)?;
        let mut mask = match workers {
            Some(w) => Some(Self::mask(ix, w, true)?),
            None => None,
        };
        if let Some(x) = exclude {
            let ex = Self::mask(ix, x, false)?;
            mask = Some(match mask {
                Some(m) => m.iter().zip(ex).map(|(a, b)| *a && b).collect(),
                None => ex,
            });
        }
        let approx = match approximate {
            Some(a) => Some(Self::mask(ix, a, true)?),
            None => None,
        };
        let (s, json) = py.detach(|| {
            let s = ix.score(&qs, &wts, mask.as_deref(), top_k);
            let json = if as_json { Some(scores_json(ix, &s, approx.as_deref())) } else { None };
            (s, json)
        });
        drop(reader);
        if let Some(j) = json {
            return Ok(PyBytes::new(py, j.as_bytes()).into_any());
        }
        Ok(score_arrays(py, s)?.into_any())
    }
}

#[pymethods]
impl PyIndex {
    #[new]
    #[pyo3(signature = (weights=None, default_weight=0.5, capacity=0, holder_sets_at=None))]
    fn new(
        weights: Option<std::collections::HashMap<String, f64>>,
        default_weight: f64,
        capacity: usize,
        holder_sets_at: Option<u32>,
    ) -> Self {
        let weights = weights.unwrap_or_else(|| {
            [("GPU".to_string(), 1.0), ("CPU".to_string(), 0.8), ("STORAGE".to_string(), 0.5)].into_iter().collect()
        });
        let mut ix = Index::new();
        if capacity > 0 {
            ix.s.reserve(capacity);
        }
        if let Some(n) = holder_sets_at {
            ix.s.promote = n.max(1);
        }
        PyIndex { ix: Arc::new(RwLock::new(ix)), weights, default_weight }
    }

    fn clear(&self, py: Python<'_>, inst: &str, dp: i64, tp_rank: i64) {
        self.write(py).clear_rank(inst, dp, tp_rank, false);
    }

    fn drop_rank(&self, py: Python<'_>, inst: &str, dp: i64, tp_rank: i64) {
        self.write(py).drop_rank(inst, dp, tp_rank);
    }

    fn drop_worker(&self, py: Python<'_>, inst: &str, dp: i64) {
        self.write(py).drop_worker(inst, dp);
    }

    /// Score queries (`ScoreQuery`); returns `score_arrays`' tuple, or the JSON list when
    /// `as_json`. The walk runs without the GIL (see `Shared`).
    #[pyo3(signature = (queries, weights=None, workers=None, exclude=None, top_k=None, as_json=false))]
    pub fn score<'py>(
        slf: &Bound<'py, Self>,
        queries: &Bound<'py, PyList>,
        weights: Option<&Bound<'py, PyDict>>,
        workers: Option<&Bound<'py, PyAny>>,
        exclude: Option<&Bound<'py, PyAny>>,
        top_k: Option<usize>,
        as_json: bool,
    ) -> PyResult<Bound<'py, PyAny>> {
        let how = ScoreArgs { weights, workers, exclude, approximate: None, top_k, as_json, media: None };
        Self::score_with(slf, queries, &how, ())
    }

    /// `score` counting only the blocks that `media` hold (a tier's view: Dynamo's cumulative
    /// tiers are the prefix held on device, on device or host, ...); returns `score_arrays`' tuple.
    #[pyo3(signature = (queries, media, workers=None, top_k=None))]
    pub fn score_media<'py>(
        slf: &Bound<'py, Self>,
        queries: &Bound<'py, PyList>,
        media: &Bound<'py, PyAny>,
        workers: Option<&Bound<'py, PyAny>>,
        top_k: Option<usize>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let how = ScoreArgs {
            weights: None,
            workers,
            exclude: None,
            approximate: None,
            top_k,
            as_json: false,
            media: Some(media),
        };
        Self::score_with(slf, queries, &how, ())
    }

    /// (instance_id, dp_rank) of every worker id ever seen, by id.
    fn worker_names(slf: &Bound<'_, Self>) -> Vec<(String, i64)> {
        let this = slf.get();
        let ix = this.read(slf.py());
        ix.workers.iter().map(|w| (w.inst.clone(), w.dp)).collect()
    }

    fn media(slf: &Bound<'_, Self>) -> Vec<String> {
        let this = slf.get();
        let ix = this.read(slf.py());
        ix.media.clone()
    }

    /// (instance_id, dp_rank, medium) of every wm, by id.
    fn wm_names(slf: &Bound<'_, Self>) -> Vec<(String, i64, String)> {
        let this = slf.get();
        let ix = this.read(slf.py());
        (0..ix.wm_worker.len())
            .map(|wm| {
                let w = &ix.workers[ix.wm_worker[wm] as usize];
                (w.inst.clone(), w.dp, ix.media[ix.wm_medium[wm] as usize].clone())
            })
            .collect()
    }

    fn stats(slf: &Bound<'_, Self>) -> Vec<StatsRow> {
        let this = slf.get();
        let ix = this.read(slf.py());
        ix.stats()
            .into_iter()
            .map(|s| StatsRow {
                instance_id: s.inst,
                dp_rank: s.dp,
                tp_size: s.tp_size,
                ranks: s.ranks,
                blocks: s.blocks,
                entries: s.entries,
                orphans: s.orphans,
                unknown_removes: s.unknown,
                duplicate_stores: s.dups,
            })
            .collect()
    }

    /// (wm ids, keys) of every holder-block, as u32 and u64 bytes.
    fn holder_keys<'py>(slf: &Bound<'py, Self>, py: Python<'py>) -> (Bound<'py, PyBytes>, Bound<'py, PyBytes>) {
        let this = slf.get();
        let ix = this.read(slf.py());
        let mut wms: Vec<u8> = vec![];
        let mut ks = vec![];
        ix.holder_keys(|k, wm| {
            wms.extend_from_slice(&wm.to_le_bytes());
            ks.push(k);
        });
        (PyBytes::new(py, &wms), u64_bytes(py, ks))
    }

    /// `Index::worker_holding`: (indexes into `keys` as u32, medium ids as u32, groups as i64,
    /// held as u8) bytes.
    #[allow(clippy::type_complexity)]
    fn worker_holding<'py>(
        slf: &Bound<'py, Self>,
        py: Python<'py>,
        inst: &str,
        dp: i64,
        keys: &Bound<'py, PyAny>,
    ) -> PyResult<(Bound<'py, PyBytes>, Bound<'py, PyBytes>, Bound<'py, PyBytes>, Bound<'py, PyBytes>)> {
        let ks = words_u64(RawBuf::get(keys)?.bytes());
        let this = slf.get();
        let ix = this.read(slf.py());
        let rows = ix.worker_holding(inst, dp, &ks);
        let idx: Vec<u8> = rows.iter().flat_map(|x| x.0.to_le_bytes()).collect();
        let med: Vec<u8> = rows.iter().flat_map(|x| x.1.to_le_bytes()).collect();
        let held: Vec<u8> = rows.iter().map(|x| x.3 as u8).collect();
        Ok((
            PyBytes::new(py, &idx),
            PyBytes::new(py, &med),
            u64_bytes(py, rows.iter().map(|x| x.2 as u64)),
            PyBytes::new(py, &held),
        ))
    }

    /// `Index::worker_held`: (keys as u64, medium ids as u32, groups as i64) bytes.
    fn worker_held<'py>(
        slf: &Bound<'py, Self>,
        py: Python<'py>,
        inst: &str,
        dp: i64,
    ) -> (Bound<'py, PyBytes>, Bound<'py, PyBytes>, Bound<'py, PyBytes>) {
        let this = slf.get();
        let ix = this.read(slf.py());
        let held = ix.worker_held(inst, dp);
        let med: Vec<u8> = held.iter().flat_map(|x| x.1.to_le_bytes()).collect();
        (
            u64_bytes(py, held.iter().map(|x| x.0)),
            PyBytes::new(py, &med),
            u64_bytes(py, held.iter().map(|x| x.2 as u64)),
        )
    }

    fn __len__(slf: &Bound<'_, Self>) -> usize {
        let this = slf.get();
        let ix = this.read(slf.py());
        ix.holder_blocks()
    }

    fn entries(slf: &Bound<'_, Self>) -> i64 {
        let this = slf.get();
        let ix = this.read(slf.py());
        ix.entries()
    }

    /// Cleared tables whose slots are not yet swept, and their entries.
    fn unswept(slf: &Bound<'_, Self>) -> (usize, i64) {
        let this = slf.get();
        let ix = this.read(slf.py());
        ix.unswept()
    }

    fn nbytes(slf: &Bound<'_, Self>) -> usize {
        let this = slf.get();
        let ix = this.read(slf.py());
        ix.nbytes()
    }

    fn block_sizes(slf: &Bound<'_, Self>) -> Vec<i64> {
        let this = slf.get();
        let ix = this.read(slf.py());
        ix.block_sizes.iter().copied().collect()
    }

    fn add_block_sizes(&self, py: Python<'_>, sizes: Vec<i64>) {
        let mut ix = self.write(py);
        for b in sizes {
            ix.add_block_size(b);
        }
    }

    /// The KV-cache groups of these workers and what each needs.
    fn export_groups(slf: &Bound<'_, Self>, workers: Vec<(String, i64)>) -> Vec<GroupReach> {
        let this = slf.get();
        let ix = this.read(slf.py());
        let mut out = vec![];
        for (inst, dp) in workers {
            if let Some(w) = ix.worker_id(&inst, dp) {
                for g in &ix.workers[w as usize].groups {
                    let tail = match g.reach {
                        crate::index::Reach::Full => 0,
                        crate::index::Reach::Tail(n) => n,
                    };
                    out.push(GroupReach { instance_id: inst.clone(), dp_rank: dp, group: g.group, tail });
                }
            }
        }
        out
    }

    /// Install a group's reach from a snapshot (tail 0: every block).
    fn import_group(&self, py: Python<'_>, inst: &str, dp: i64, group: i64, tail: u32) {
        let reach = if tail == 0 { crate::index::Reach::Full } else { crate::index::Reach::Tail(tail) };
        self.write(py).set_group(inst, dp, group, reach);
    }

    fn has_blocks(slf: &Bound<'_, Self>) -> bool {
        let this = slf.get();
        let ix = this.read(slf.py());
        ix.s.count > 0
    }

    /// (sum, count) over holder-blocks of xxh3(key, seeds[wm]) where seeds[wm] != 0.
    fn digest(slf: &Bound<'_, Self>, seeds: &Bound<'_, PyAny>) -> PyResult<(u64, u64)> {
        let this = slf.get();
        let ix = this.read(slf.py());
        let s = words_u64(RawBuf::get(seeds)?.bytes());
        if s.len() < ix.wm_worker.len() {
            return Err(PyValueError::new_err("one seed per wm"));
        }
        Ok(ix.digest(&s))
    }

    /// The tables of these workers, in their order (ranks, then tables).
    fn export_workers(&self, py: Python<'_>, workers: Vec<(String, i64)>) -> PyResult<Exported> {
        let ix = self.read(py);
        let mut tables = vec![];
        let (mut ehs, mut ks, mut ms): (Vec<u8>, Vec<u8>, Vec<u8>) = (vec![], vec![], vec![]);
        let mut memos = vec![];
        let (mut mes, mut mks, mut mos): (Vec<u8>, Vec<u8>, Vec<u8>) = (vec![], vec![], vec![]);
        for (inst, dp) in workers {
            let Some(w) = ix.worker_id(&inst, dp) else {
                continue;
            };
            let wk = &ix.workers[w as usize];
            let memo = ix.memo_entries(w);
            if !memo.is_empty() {
                memos.push((inst.clone(), dp, wk.tp_size, memo.len()));
                for (e, k, o) in memo {
                    mes.extend_from_slice(&e.to_le_bytes());
                    mks.extend_from_slice(&k.to_le_bytes());
                    mos.push(o as u8);
                }
            }
            for r in &wk.ranks {
                for t in &r.tables {
                    let row = TableRow {
                        instance_id: inst.clone(),
                        dp_rank: dp,
                        tp_size: wk.tp_size,
                        tp_rank: r.tp_rank,
                        medium: ix.media[t.medium as usize].clone(),
                        group: t.group,
                        entries: t.count,
                        unknown_removes: t.unknown,
                        duplicate_stores: t.dups,
                    };
                    tables.push(Py::new(py, row)?);
                    for (e, k, m) in ix.entries_in_store_order(t) {
                        ehs.extend_from_slice(&e.to_le_bytes());
                        ks.extend_from_slice(&k.to_le_bytes());
                        ms.extend_from_slice(&m.to_le_bytes());
                    }
                }
            }
        }
        Ok(Exported {
            tables,
            ehs: PyBytes::new(py, &ehs).unbind(),
            keys: PyBytes::new(py, &ks).unbind(),
            metas: PyBytes::new(py, &ms).unbind(),
            memos,
            memo_ehs: PyBytes::new(py, &mes).unbind(),
            memo_keys: PyBytes::new(py, &mks).unbind(),
            memo_orphans: PyBytes::new(py, &mos).unbind(),
        })
    }

    /// Install one worker's memo of removed parents as `export_workers` wrote it (oldest first;
    /// orphan flags 0 or 1).
    // One argument per field of a blob header's memo row and per array, as `import_table`.
    #[allow(clippy::too_many_arguments)]
    fn import_memo(
        &self,
        py: Python<'_>,
        inst: &str,
        dp: i64,
        tp_size: u32,
        ehs: &Bound<'_, PyAny>,
        keys: &Bound<'_, PyAny>,
        orphans: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let e = words_u64(RawBuf::get(ehs)?.bytes());
        let k = words_u64(RawBuf::get(keys)?.bytes());
        let o = RawBuf::get(orphans)?;
        let o = o.bytes();
        if e.len() != k.len() || e.len() != o.len() || o.iter().any(|&b| b > 1) {
            return Err(PyValueError::new_err(format!("index blob: a malformed memo for {inst}/{dp}")));
        }
        let entries: Vec<(u64, u64, bool)> = (0..e.len()).map(|i| (e[i], k[i], o[i] == 1)).collect();
        self.write(py)
            .import_memo(inst, dp, tp_size, &entries)
            .map_err(|why| PyValueError::new_err(format!("index blob: {why} for {inst}/{dp}")))
    }

    // One argument per field of a blob header's table row, which Python reads and checks.
    #[allow(clippy::too_many_arguments)]
    fn import_table(
        &self,
        py: Python<'_>,
        inst: &str,
        dp: i64,
        tp_size: i64,
        tp_rank: i64,
        medium: &str,
        group: i64,
        ehs: &Bound<'_, PyAny>,
        keys: &Bound<'_, PyAny>,
        metas: &Bound<'_, PyAny>,
        unknown: i64,
        dups: i64,
    ) -> PyResult<()> {
        let e = words_u64(RawBuf::get(ehs)?.bytes());
        let k = words_u64(RawBuf::get(keys)?.bytes());
        let m: Vec<u16> =
            RawBuf::get(metas)?.bytes().chunks_exact(2).map(|c| u16::from_le_bytes([c[0], c[1]])).collect();
        if e.len() != k.len() || e.len() != m.len() {
            return Err(PyValueError::new_err("array lengths differ"));
        }
        let rank = RankId { inst, dp, tp_rank, tp_size };
        let blob = TableBlob { medium, group, ehs: &e, keys: &k, metas: &m, unknown, dups };
        self.write(py)
            .import_table(&rank, &blob)
            .map_err(|why| PyValueError::new_err(format!("index blob: {why} for {inst}/{dp} rank {tp_rank}")))
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyIndex>()?;
    m.add_class::<ScoreQuery>()?;
    m.add_class::<StatsRow>()?;
    m.add_class::<TableRow>()?;
    m.add_class::<Exported>()?;
    m.add_class::<GroupReach>()?;
    // The memo's bound, read by the oracle (tests/oracle.py) so that one number rules both.
    m.add("PARENT_MEMO", crate::index::PARENT_MEMO)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::json_f64;

    fn f(x: f64) -> String {
        let mut s = String::new();
        json_f64(&mut s, x);
        s
    }

    #[test]
    fn whole_floats_print_as_the_precision_formatter_does() {
        let mut xs = vec![0.0, -0.0, 1.0, -1.0, 9_999_999_999_999_998.0, -9_999_999_999_999_998.0, 8192.0];
        let mut x = 1.0f64;
        while x < 1e16 {
            xs.extend([x, x - 1.0, x + 1.0, -x, (x * 1.7).floor()]);
            x *= 3.0;
        }
        for x in xs {
            assert_eq!(f(x), format!("{x:.1}"), "{x:e}");
        }
    }

    #[test]
    fn other_floats_print_shortest_or_null() {
        assert_eq!(f(0.5), "0.5");
        assert_eq!(f(1e16), "10000000000000000");
        assert_eq!(f(2.5e-7), "0.00000025");
        assert_eq!(f(f64::NAN), "null");
        assert_eq!(f(f64::INFINITY), "null");
    }
}
