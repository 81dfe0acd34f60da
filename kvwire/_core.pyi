# Typed surface of the Rust extension (rust/src/lib.rs). Keep in step with the #[pyfunction]s there.

__version__: str
