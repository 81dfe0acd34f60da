//! `kvwire._core`: the consumer's hot path in Rust.
use pyo3::prelude::*;

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
