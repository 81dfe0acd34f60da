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

/// `mi_option_purge_delay` in mimalloc.h's `mi_option_e` (v2 and v3 alike; the sys crate does
/// not name it).
const MI_OPTION_PURGE_DELAY: libmimalloc_sys::mi_option_t = 15;

/// Freed memory stays with the allocator for reuse instead of going back to the OS 10 ms
/// later. Those returns (madvise, a page-table walk and a TLB shootdown across CPUs, slow on a
/// virtual machine) ran inside whichever call freed memory next: an apply quantum, holding the
/// index's write lock for 2-4 ms while scores waited. The index's memory is mostly reused as
/// it churns (bench/results/soak.json measures RSS under churn).
fn keep_freed_memory() {
    // SAFETY: an option write; mimalloc reads it when it would purge.
    unsafe { libmimalloc_sys::mi_option_set(MI_OPTION_PURGE_DELAY, -1) };
}

pub mod decode;
// The write half of the wire layout: the producer's sender encodes with it.
pub mod encode;
pub mod record;
// The index, its keys and its Python bindings (issue 12's index/score half).
pub mod fence;
pub mod index;
pub mod keys;
pub mod pipeline;
pub mod py_index;
pub mod py_keys;
// The score lane's request head (consumer/score_lane.py): read here, its one home.
pub mod score_head;
// The lane's plain request answered whole, and the binary body's rule.
pub mod score_lane;
pub mod table;
#[cfg(test)]
mod test_rng;

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    keep_freed_memory();
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    py_index::register(m)?;
    py_keys::register(m)?;
    pipeline::register(m)?;
    decode::py::register(m)?;
    encode::py::register(m)?;
    score_head::register(m)?;
    score_lane::register(m)?;
    Ok(())
}
