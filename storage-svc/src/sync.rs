//! The one place this crate takes its atomics from: std normally, loom under
//! `--cfg tessera_loom`, so the accounting shared between sessions, executors and the chunked
//! registered memory is model-checked with the code that ships.

#[cfg(tessera_loom)]
pub(crate) use loom::sync::atomic::{AtomicU64, Ordering};
#[cfg(not(tessera_loom))]
pub(crate) use std::sync::atomic::{AtomicU64, Ordering};

/// The unit's lock, for the model of its users (session, executor, timer).
#[cfg(all(test, tessera_loom))]
pub(crate) use loom::sync::Mutex;
#[cfg(all(test, not(tessera_loom)))]
pub(crate) use std::sync::Mutex;

/// Shared ownership stays std's under loom too (the transport's handles are std `Arc`s).
pub(crate) use std::sync::Arc;

/// Runs `f` under the loom model checker with `--cfg tessera_loom`, and once as a plain test
/// otherwise.
#[cfg(test)]
pub(crate) fn model<F: Fn() + Sync + Send + 'static>(f: F) {
    #[cfg(tessera_loom)]
    loom::model(f);
    #[cfg(not(tessera_loom))]
    f();
}

#[cfg(test)]
pub(crate) mod thread {
    #[cfg(tessera_loom)]
    pub(crate) use loom::thread::spawn;
    #[cfg(not(tessera_loom))]
    pub(crate) use std::thread::spawn;
}
