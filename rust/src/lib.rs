//! `kvwire._core`: the consumer's hot path in Rust.
use pyo3::prelude::*;

pub mod decode;
pub mod record;
// The index, its keys and its Python bindings (issue 12's index/score half).
pub mod index;
pub mod keys;
pub mod py_index;
pub mod table;

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    py_index::register(m)?;
    decode::py::register(m)?;
    Ok(())
}
