//! `kvwire._core`: the consumer's hot path in Rust.
use pyo3::prelude::*;

/// The core's own heap. The index is millions of small table shards walked at random, and the
/// apply path allocates per record: mimalloc backs its segments with huge pages where the kernel
/// allows (fewer TLB misses per probe) and keeps small allocations thread-local. Measured with
/// `bench.ab_core` (docs/DESIGN.md, "Allocator").
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
