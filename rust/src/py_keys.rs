//! Python face of `keys.rs`: block keys, context seeds, the canonical encoding
//! and the hash roots, for `kvwire/consumer/keys.py` and the index's queries.
//!
//! Python values become `keys::Key`s here and are hashed by the same code as a
//! decoded record's extra keys, so a query and a stored block can only agree
//! on a key by carrying equal values. Inputs are checked before any index
//! arithmetic: a bad one raises ValueError, never a panic.

use std::borrow::Cow;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyByteArray, PyBytes, PyFloat, PyInt, PyList, PyMemoryView, PyString, PyTuple};

use crate::index::normalize_medium as medium_name;
use crate::keys::{self, Ctx, Key};
use crate::py_index::{u64_bytes, words_u64, RawBuf};

/// Nesting past this is refused: vLLM's keys are two deep, and the walk must not recurse without bound.
const MAX_DEPTH: usize = 32;

/// A Python value as the key encoding sees it (`None`, bool, int, float, str,
/// bytes-like, tuple or list of these; anything else by its `repr`).
pub fn key_of(v: &Bound<'_, PyAny>, depth: usize) -> PyResult<Key<'static>> {
    if v.is_none() {
        return Ok(Key::Null);
    }
    if let Ok(b) = v.cast::<PyBool>() {
        return Ok(Key::Bool(b.is_true()));
    }
    if v.is_instance_of::<PyInt>() {
        // An int subclass is written the way its str() writes it, as Python's encoding did.
        if v.is_exact_instance_of::<PyInt>() {
            if let Ok(i) = v.extract::<i64>() {
                return Ok(Key::Int(i));
            }
        }
        return Ok(Key::BigInt(v.str()?.to_str()?.to_owned()));
    }
    if v.is_instance_of::<PyFloat>() {
        return Ok(Key::Float(v.extract()?));
    }
    if let Ok(s) = v.cast::<PyString>() {
        let b = match s.to_str() {
            Ok(t) => t.as_bytes().to_vec(),
            // Lone surrogates (str from surrogateescape'd bytes) pass through as their UTF-8 form.
            Err(_) => s.call_method1("encode", ("utf-8", "surrogatepass"))?.cast::<PyBytes>()?.as_bytes().to_vec(),
        };
        return Ok(Key::Str(Cow::Owned(b)));
    }
    if let Ok(b) = v.cast::<PyBytes>() {
        return Ok(Key::Bytes(Cow::Owned(b.as_bytes().to_vec())));
    }
    if v.is_instance_of::<PyByteArray>() || v.is_instance_of::<PyMemoryView>() {
        let b = v.py().get_type::<PyBytes>().call1((v,))?;
        return Ok(Key::Bytes(Cow::Owned(b.cast::<PyBytes>()?.as_bytes().to_vec())));
    }
    if v.is_instance_of::<PyTuple>() || v.is_instance_of::<PyList>() {
        if depth >= MAX_DEPTH {
            return Err(PyValueError::new_err(format!("extra keys nested deeper than {MAX_DEPTH}")));
        }
        let mut items = Vec::with_capacity(v.len()?);
        for x in v.try_iter()? {
            items.push(key_of(&x?, depth + 1)?);
        }
        return Ok(Key::Seq(items));
    }
    Ok(Key::Repr(v.repr()?.to_str()?.to_owned()))
}

/// Per-block contexts of `n` blocks for Python extra keys (one entry per block, None for a
/// block without), or None when no block has any (every context is `base`).
pub fn contexts(extra: &Bound<'_, PyAny>, lora: Option<&str>, base: u64, n: usize) -> PyResult<Option<Vec<u64>>> {
    if extra.is_none() || n == 0 {
        return Ok(None);
    }
    let mut blocks = Vec::new();
    for b in extra.try_iter()?.take(n) {
        let b = b?;
        blocks.push(if b.is_none() { None } else { Some(key_of(&b, 0)?) });
    }
    Ok(keys::block_contexts(&blocks, lora, base, n))
}

/// XXH3-64 of a buffer's bytes.
#[pyfunction]
#[pyo3(signature = (data, seed=0))]
fn xxh3_64(data: &Bound<'_, PyAny>, seed: u64) -> PyResult<u64> {
    Ok(keys::xxh3(RawBuf::get(data)?.bytes(), seed))
}

/// Bytes of `n` blocks of `bs` u32 tokens, or ValueError when they overflow or exceed `have`.
fn need_tokens(bs: usize, n: usize, have: usize) -> PyResult<()> {
    if bs == 0 {
        return Err(PyValueError::new_err("block_size must be > 0"));
    }
    match n.checked_mul(bs).and_then(|t| t.checked_mul(4)) {
        Some(b) if b <= have => Ok(()),
        _ => Err(PyValueError::new_err(format!(
            "{n} blocks of {bs} tokens need more tokens than the {} given",
            have / 4
        ))),
    }
}

/// Keys of `n` blocks of `bs` tokens (a u32 buffer) chained from `parent`;
/// `ctx` is u64 bytes: one context for every block, or one per block.
#[pyfunction]
fn chain_keys<'py>(
    py: Python<'py>,
    tokens: &Bound<'py, PyAny>,
    bs: usize,
    n: usize,
    parent: u64,
    ctx: &Bound<'py, PyAny>,
) -> PyResult<Bound<'py, PyBytes>> {
    let t = RawBuf::get(tokens)?;
    need_tokens(bs, n, t.bytes().len())?;
    let c = words_u64(RawBuf::get(ctx)?.bytes());
    let ctx = match c.len() {
        0 => return Err(PyValueError::new_err("chain_keys: no context (ctx holds no 8-byte word)")),
        1 => Ctx::One(c[0]),
        k if k < n => return Err(PyValueError::new_err(format!("chain_keys: {k} contexts for {n} blocks"))),
        _ => Ctx::PerBlock(&c),
    };
    let mut out = Vec::with_capacity(n);
    keys::chain(t.bytes(), bs, n, parent, ctx, &mut out);
    Ok(u64_bytes(py, out))
}

/// Keys of the first `nblocks` (default: every) full blocks of `tokens` (a u32 buffer, little
/// endian) chained from `parent` under (lora_name, per-block extra keys).
#[pyfunction]
#[pyo3(signature = (tokens, block_size, parent=keys::ROOT, lora_name=None, extra_keys=None, nblocks=None))]
fn block_keys<'py>(
    py: Python<'py>,
    tokens: &Bound<'py, PyAny>,
    block_size: i64,
    parent: u64,
    lora_name: Option<&str>,
    extra_keys: Option<&Bound<'py, PyAny>>,
    nblocks: Option<usize>,
) -> PyResult<Bound<'py, PyBytes>> {
    if block_size <= 0 {
        return Err(PyValueError::new_err("block_size must be > 0"));
    }
    let t = RawBuf::get(tokens)?;
    let bs = usize::try_from(block_size).map_err(|_| PyValueError::new_err("block_size too large"))?;
    let full = t.bytes().len() / 4 / bs;
    let n = nblocks.map_or(full, |k| k.min(full));
    let base = keys::context_seed(lora_name);
    let per = match extra_keys {
        Some(e) => contexts(e, lora_name, base, n)?,
        None => None,
    };
    let ctx = per.as_deref().map_or(Ctx::One(base), Ctx::PerBlock);
    let mut out = Vec::with_capacity(n);
    keys::chain(t.bytes(), bs, n, parent, ctx, &mut out);
    Ok(u64_bytes(py, out))
}

/// Per-block context seeds of `nblocks` blocks as u64 bytes: one word when no block has extra keys.
#[pyfunction]
#[pyo3(signature = (lora_name, extra_keys, nblocks))]
fn block_contexts<'py>(
    py: Python<'py>,
    lora_name: Option<&str>,
    extra_keys: &Bound<'py, PyAny>,
    nblocks: usize,
) -> PyResult<Bound<'py, PyBytes>> {
    let base = keys::context_seed(lora_name);
    Ok(match contexts(extra_keys, lora_name, base, nblocks)? {
        Some(c) => u64_bytes(py, c),
        None => u64_bytes(py, [base]),
    })
}

#[pyfunction]
#[pyo3(signature = (lora_name=None))]
fn context_seed(lora_name: Option<&str>) -> u64 {
    keys::context_seed(lora_name)
}

/// The canonical encoding of a value (what a block's extra keys are hashed as).
#[pyfunction]
fn canonical<'py>(py: Python<'py>, value: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyBytes>> {
    let mut out = Vec::new();
    keys::canon(&key_of(value, 0)?, &mut out);
    Ok(PyBytes::new(py, &out))
}

/// An engine hash as the u64 the index stores: ints modulo 2^64 (negative
/// LMCache ones too), digests through xxh3.
#[pyfunction]
pub fn engine_hash(obj: &Bound<'_, PyAny>) -> PyResult<u64> {
    if let Ok(v) = obj.extract::<u64>() {
        return Ok(v);
    }
    if let Ok(v) = obj.extract::<i64>() {
        return Ok(v as u64);
    }
    if obj.is_instance_of::<PyInt>() {
        let masked = obj.call_method1("__and__", (u64::MAX,))?;
        return masked.extract::<u64>();
    }
    Ok(keys::digest_hash(RawBuf::get(obj)?.bytes()))
}

/// Engine-hash mode keys of these engine hashes, as u64 bytes.
#[pyfunction]
fn engine_keys<'py>(py: Python<'py>, hashes: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyBytes>> {
    let mut out = Vec::new();
    for h in hashes.try_iter()? {
        out.push(keys::engine_key(engine_hash(&h?)?));
    }
    Ok(u64_bytes(py, out))
}

#[pyfunction]
fn orphan_root(parent_hash: &Bound<'_, PyAny>) -> PyResult<u64> {
    Ok(keys::orphan_root(engine_hash(parent_hash)?))
}

/// The medium name the index files a store under ("GPU" for none, the three known ones in capitals).
#[pyfunction]
#[pyo3(signature = (medium=None))]
fn normalize_medium(medium: Option<&str>) -> String {
    medium_name(medium).into_owned()
}

/// The routers' sequence hashes (kvwire's keys) of a prompt given as its blocks' content
/// hashes (u64 bytes, as Dynamo's `/query_by_hash` and `compute_block_hash_for_seq` give them).
#[pyfunction]
fn sequence_keys<'py>(py: Python<'py>, content: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyBytes>> {
    let mut parent = keys::ROOT;
    let out: Vec<u64> = words_u64(RawBuf::get(content)?.bytes())
        .into_iter()
        .map(|c| {
            parent = keys::chain_step(parent, c);
            parent
        })
        .collect();
    Ok(u64_bytes(py, out))
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("ROOT", keys::ROOT)?;
    m.add("ORPHAN_ROOT", keys::ORPHAN_ROOT)?;
    m.add("ENGINE_NS", keys::ENGINE_NS)?;
    m.add_function(wrap_pyfunction!(xxh3_64, m)?)?;
    m.add_function(wrap_pyfunction!(chain_keys, m)?)?;
    m.add_function(wrap_pyfunction!(sequence_keys, m)?)?;
    m.add_function(wrap_pyfunction!(block_keys, m)?)?;
    m.add_function(wrap_pyfunction!(block_contexts, m)?)?;
    m.add_function(wrap_pyfunction!(context_seed, m)?)?;
    m.add_function(wrap_pyfunction!(canonical, m)?)?;
    m.add_function(wrap_pyfunction!(engine_hash, m)?)?;
    m.add_function(wrap_pyfunction!(engine_keys, m)?)?;
    m.add_function(wrap_pyfunction!(orphan_root, m)?)?;
    m.add_function(wrap_pyfunction!(normalize_medium, m)?)?;
    Ok(())
}
