//! The package's tokio runtime, started on first use, and how Python threads wait for it:
//! with the GIL released, waking every 100 ms for signals. Its workers busy-poll the control
//! sockets of the clients that ask for it (`busy_poll=True`) before they park.
//!
//! A caller interrupted by Ctrl-C gets its `KeyboardInterrupt` at once while its request runs
//! to its end on the runtime (bounded by the client's timeout) and then frees what it held:
//! dropping a request half-way could free a receive block a unit is still writing.

use std::future::Future;
use std::sync::OnceLock;
use std::time::Duration;

use pyo3::prelude::*;
use tessera_storage::BusyPoll;
use tokio::runtime::Runtime;

use crate::errors;
use crate::release;

struct Rt {
    rt: Runtime,
    /// The process that started it; its worker threads do not survive a fork.
    pid: u32,
    /// Polls the control sockets of the clients made with `busy_poll=True` while one of
    /// their requests awaits its answer; idle otherwise.
    poll: BusyPoll,
}

static RT: OnceLock<Rt> = OnceLock::new();

/// How often a waiting thread looks for signals.
const SIGNAL_POLL: Duration = Duration::from_millis(100);

/// The busy-polling window of the runtime's workers for clients that ask for it
/// (`busy_poll=True`), as the Rust storage bench's client polls.
const POLL_WINDOW: Duration = Duration::from_micros(50);

/// How far past a request they poll for an answer expected later than the window.
const POLL_EXPECT: Duration = Duration::from_micros(500);

/// The runtime, started if need be; an error in a forked child of the process that started it.
pub(crate) fn runtime() -> PyResult<&'static Runtime> {
    started().map(|rt| &rt.rt)
}

/// The runtime's poller (see [`Rt::poll`]), for a client that busy-polls.
pub(crate) fn busy_poll() -> PyResult<BusyPoll> {
    started().map(|rt| rt.poll.clone())
}

fn started() -> PyResult<&'static Rt> {
    let rt = match RT.get() {
        Some(rt) => rt,
        None => {
            let workers = std::thread::available_parallelism().map_or(2, |n| n.get().clamp(2, 4));
            let starting =
                |e: std::io::Error| errors::tessera(format!("starting tessera's runtime: {e}"));
            let poll = BusyPoll::expecting(POLL_WINDOW, POLL_EXPECT).map_err(starting)?;
            let built = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(workers)
                .thread_name("tessera")
                .enable_all()
                .on_thread_park(poll.on_park())
                .build()
                .map_err(starting)?;
            // Another thread may have won the race: its runtime is the one kept.
            let _ = RT.set(Rt {
                rt: built,
                pid: std::process::id(),
                poll,
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
    Ok(rt)
}

/// Runs `fut` on this thread, without the GIL, waking every [`SIGNAL_POLL`] for signals: a
/// `KeyboardInterrupt` (or any other signal handler's exception) is raised at once, and `fut`
/// is handed to the runtime to finish by itself. Driving it here rather than as a task spares
/// a wake-up of a worker thread and a hand-over back, each a cross-core round trip.
pub(crate) fn wait<T: Send + 'static>(
    py: Python<'_>,
    fut: impl Future<Output = T> + Send + 'static,
) -> PyResult<T> {
    let rt = runtime()?;
    let mut fut = Box::pin(fut);
    loop {
        let step = py.detach(|| {
            // Inside `block_on`, so that the timer is made in the runtime's context.
            rt.block_on(async {
                tokio::select! {
                    biased;
                    v = &mut fut => Some(v),
                    _ = tokio::time::sleep(SIGNAL_POLL) => None,
                }
            })
        });
        if let Some(v) = step {
            release::drain(py);
            return Ok(v);
        }
        if let Err(e) = py.check_signals() {
            rt.spawn(fut);
            release::drain(py);
            return Err(e);
        }
    }
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
