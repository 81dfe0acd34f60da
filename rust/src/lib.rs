//! `kvwire._core`: the consumer's hot path in Rust.
use pyo3::prelude::*;

/// The core's own heap. The apply path allocates per record and a score per call: mimalloc's
/// thread-local free lists make those cheap (`bench.ab_core`, docs/DESIGN.md "Allocator").
/// Without transparent huge pages (`no_thp`): with them the walk gained ~10% at 10M
/// holder-blocks, but a fault on a fresh 2 MB page inside an apply quantum (zeroing it, or
/// compacting memory for it) held the index's write lock for milliseconds, and scores beside
/// ingest waited: p99 963 us -> 6.8 ms.
#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;

pub mod decode;
pub mod record;
// The index, its keys and its Python bindings (issue 12's index/score half).
pub mod fence;
pub mod index;
pub mod keys;
pub mod pipeline;
pub mod py_index;
pub mod py_keys;
pub mod table;

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    py_index::register(m)?;
    py_keys::register(m)?;
    pipeline::register(m)?;
    decode::py::register(m)?;
    Ok(())
}
