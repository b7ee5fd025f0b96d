//! `tessera._native`: the Rust half of the `tessera` Python package (distribution
//! `tessera-transfer`). The Python half (`python/tessera/`) wraps it; see its README.
//!
//! Every call that waits (a request, a fetch, a unit starting) releases the GIL and runs on
//! the package's tokio runtime (module `runtime`); values cross without a payload copy
//! (`convert`, `tensor`); Rust errors become `tessera.errors` exceptions (`errors`).

mod agent;
mod bench;
mod convert;
mod dtype;
mod errors;
mod release;
mod runtime;
mod storage;
mod tensor;

use pyo3::prelude::*;

/// mimalloc: glibc's allocator gives back the top of its heap as soon as more than 128 KiB
/// of it is free, so a request that allocates and frees more (the descriptors and values of a
/// batch of a thousand tensors) faulted its pages in again each time.
#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Runs the `tessera-storage` command line (`python -m tessera.storage`); returns its exit
/// status. The GIL is released while it runs.
#[pyfunction]
fn storage_cli(py: Python<'_>, args: Vec<String>) -> u8 {
    py.detach(|| tessera_storage_cli::run(args))
}

/// Non-contiguous tensors this process copied on the way in: `(count, bytes)`.
#[pyfunction]
fn copies() -> (u64, u64) {
    convert::copies()
}

/// Engines this build has, by name.
#[pyfunction]
fn backends() -> Vec<&'static str> {
    tessera_engines::EngineKind::ALL
        .into_iter()
        .filter(|k| k.available())
        .map(|k| k.name())
        .collect()
}

/// The dtype names tessera stores (torch's names).
#[pyfunction]
fn dtypes() -> Vec<&'static str> {
    tessera_framecodec::DType::ALL
        .into_iter()
        .map(|d| d.name())
        .collect()
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add_class::<tensor::PyTensor>()?;
    m.add_class::<agent::PyAgent>()?;
    m.add_class::<agent::PyPeer>()?;
    m.add_class::<agent::PySenderPool>()?;
    m.add_class::<agent::PyReceiverPool>()?;
    m.add_class::<agent::PyCancel>()?;
    m.add_class::<storage::PyServer>()?;
    m.add_class::<storage::PyClient>()?;
    m.add_function(wrap_pyfunction!(storage_cli, m)?)?;
    m.add_function(wrap_pyfunction!(copies, m)?)?;
    m.add_function(wrap_pyfunction!(backends, m)?)?;
    m.add_function(wrap_pyfunction!(dtypes, m)?)?;
    m.add_function(wrap_pyfunction!(bench::_bench_put, m)?)?;
    m.add_function(wrap_pyfunction!(bench::_bench_get, m)?)?;
    m.add_function(wrap_pyfunction!(bench::_bench_pool_put, m)?)?;
    Ok(())
}
