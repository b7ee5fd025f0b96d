//! The one place this crate takes its synchronisation primitives from: std normally, loom under
//! `--cfg tessera_loom`, so the pools' bookkeeping is model-checked with the code that ships.

#[cfg(tessera_loom)]
pub(crate) use loom::sync::{
    atomic::{AtomicU64, Ordering},
    Mutex, MutexGuard,
};
#[cfg(not(tessera_loom))]
pub(crate) use std::sync::{
    atomic::{AtomicU64, Ordering},
    Mutex, MutexGuard,
};

/// Shared ownership stays std's under loom, as in `tessera-transport`: the counters and locks
/// above are what the model checks.
pub(crate) use std::sync::Arc;

/// Locks `m`, ignoring poisoning: no critical section of this crate leaves its data
/// inconsistent before something that could panic.
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

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
