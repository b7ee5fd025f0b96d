//! The package's tokio runtime, started on first use, and how Python threads wait for it:
//! with the GIL released, waking every 100 ms for signals.
//!
//! A request runs as a task of its own. A caller interrupted by Ctrl-C gets its
//! `KeyboardInterrupt` at once while the task runs to its end (bounded by the client's
//! timeout) and then frees what it held: dropping a request half-way could free a receive
//! block a unit is still writing.

use std::future::Future;
use std::sync::OnceLock;
use std::time::Duration;

use pyo3::prelude::*;
use tokio::runtime::Runtime;

use crate::errors;
use crate::release;

struct Rt {
    rt: Runtime,
    /// The process that started it; its worker threads do not survive a fork.
    pid: u32,
}

static RT: OnceLock<Rt> = OnceLock::new();

/// How often a waiting thread looks for signals.
const SIGNAL_POLL: Duration = Duration::from_millis(100);

/// The runtime, started if need be; an error in a forked child of the process that started it.
pub(crate) fn runtime() -> PyResult<&'static Runtime> {
    let rt = match RT.get() {
        Some(rt) => rt,
        None => {
            let workers = std::thread::available_parallelism().map_or(2, |n| n.get().clamp(2, 4));
            let built = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(workers)
                .thread_name("tessera")
                .enable_all()
                .build()
                .map_err(|e| errors::tessera(format!("starting tessera's runtime: {e}")))?;
            // Another thread may have won the race: its runtime is the one kept.
            let _ = RT.set(Rt {
                rt: built,
                pid: std::process::id(),
            });
            let rt = RT
                .get()
                .ok_or_else(|| errors::tessera("tessera's runtime did not start".into()))?;
            let _ = pyo3_async_runtimes::tokio::init_with_runtime(&rt.rt);
            rt
        }
    };
    if rt.pid != std::process::id() {
        return Err(errors::forked(rt.pid));
    }
    Ok(&rt.rt)
}

/// Runs `fut` as a task and waits for it without the GIL, raising `KeyboardInterrupt` (and any
/// other signal handler's exception) while it runs; the task then carries on by itself.
pub(crate) fn wait<T: Send + 'static>(
    py: Python<'_>,
    fut: impl Future<Output = T> + Send + 'static,
) -> PyResult<T> {
    let rt = runtime()?;
    let mut task = rt.spawn(fut);
    let out = loop {
        // The timer is made inside the runtime's context (`block_on` enters it).
        let step =
            py.detach(|| rt.block_on(async { tokio::time::timeout(SIGNAL_POLL, &mut task).await }));
        match step {
            Ok(Ok(v)) => break Ok(v),
            Ok(Err(e)) => break Err(errors::tessera(format!("tessera task failed: {e}"))),
            Err(_) => {
                if let Err(e) = py.check_signals() {
                    release::drain(py);
                    return Err(e);
                }
            }
        }
    };
    release::drain(py);
    out
}

/// Runs `fut` as a task and returns an asyncio awaitable of its result. Cancelling the
/// awaitable leaves the task running to its end, as [`wait`] does.
pub(crate) fn awaitable<'py>(
    py: Python<'py>,
    fut: impl Future<Output = PyResult<Py<PyAny>>> + Send + 'static,
) -> PyResult<Bound<'py, PyAny>> {
    let task = runtime()?.spawn(fut);
    pyo3_async_runtimes::tokio::future_into_py(py, async move {
        let out = task
            .await
            .map_err(|e| errors::tessera(format!("tessera task failed: {e}")))?;
        Python::attach(release::drain);
        out
    })
}
