//! The one place this crate takes its synchronisation primitives from: std normally, loom under
//! `--cfg tessera_loom`, so the shared allocator is model-checked with the code that ships.

#[cfg(tessera_loom)]
pub(crate) use loom::sync::{Arc, Mutex, MutexGuard};
#[cfg(not(tessera_loom))]
pub(crate) use std::sync::{Arc, Mutex, MutexGuard};

/// Allocator ids only need to be unique; they are not part of any model-checked protocol, so a
/// std atomic serves under loom too.
/// After 2^32 allocators the ids wrap; a block would then be misattributed only if it outlived
/// 2^32 allocator creations and was handed to exactly the one that reused its owner's id.
pub(crate) fn next_allocator_id() -> u32 {
    static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(1);
    NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
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
