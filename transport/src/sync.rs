//! The one place this crate takes its synchronisation primitives from: std normally, loom under
//! `--cfg tessera_loom`, so the refcounting of registrations and in-flight transfers is
//! model-checked with the code that ships.

#[cfg(tessera_loom)]
pub(crate) use loom::sync::{
    atomic::{AtomicBool, AtomicUsize, Ordering},
    Condvar, Mutex, MutexGuard,
};
#[cfg(not(tessera_loom))]
pub(crate) use std::sync::{
    atomic::{AtomicBool, AtomicUsize, Ordering},
    Condvar, Mutex, MutexGuard,
};

/// Shared ownership stays std's under loom too: loom has no `Weak` and no unsized coercion
/// (`Arc<dyn Transport>`). The protocols built on top of it (the registration table, in-flight
/// counts, completion) use the primitives above and are what loom checks.
pub(crate) use std::sync::{Arc, Weak};

use std::sync::atomic::Ordering::Relaxed as StdRelaxed;

/// A statistics counter (relaxed, so an add costs one uncontended atomic): counts are not part
/// of any model-checked protocol, so std's atomic serves under loom too.
#[derive(Default)]
pub(crate) struct Counter(std::sync::atomic::AtomicU64);

impl Counter {
    pub(crate) fn add(&self, n: u64) {
        self.0.fetch_add(n, StdRelaxed);
    }

    pub(crate) fn get(&self) -> u64 {
        self.0.load(StdRelaxed)
    }
}

/// For process-wide tables built in statics, which loom primitives cannot be.
pub(crate) use std::sync::Mutex as StaticMutex;

/// Locks `m`, ignoring poisoning: every critical section in this crate leaves its data
/// consistent before anything that could panic, so a poisoned lock still holds valid state.
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Ids only need to be unique within the process; they are not part of any model-checked
/// protocol, so a std atomic serves under loom too.
pub(crate) fn next_id() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
    static NEXT: AtomicU64 = AtomicU64::new(1);
    NEXT.fetch_add(1, Relaxed)
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
