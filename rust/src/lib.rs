//! `kvwire._core`: the consumer's hot path in Rust.
use pyo3::prelude::*;

pub mod decode;
pub mod record;

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    decode::py::register(m)?;
    Ok(())
}
