//! Python-owned memory that Rust holds: the objects, buffers and DLPack capsules behind PUT
//! sources. Releasing one needs the GIL, and the thread that drops it (a runtime worker
//! finishing a transfer, a thread without the GIL) usually does not hold it: waiting for the GIL
//! there could deadlock against a Python thread waiting for that worker, and the limited API
//! cannot tell whether the current thread holds it. So every release is queued, and the calls
//! into the package run the queue, holding the GIL, before they return: a request's sources are
//! released by the time the call that made it returns.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

use pyo3::Python;

/// Releases queued by threads without the GIL.
static QUEUE: Mutex<Vec<Box<dyn Send>>> = Mutex::new(Vec::new());
/// Whether [`QUEUE`] may hold something (spares every call the lock when it is empty).
static QUEUED: AtomicBool = AtomicBool::new(false);

/// A value released with the GIL by the next [`drain`] after this drops.
pub(crate) struct Deferred(Option<Box<dyn Send>>);

impl Deferred {
    pub(crate) fn new<T: Send + 'static>(value: T) -> Self {
        Self(Some(Box::new(value)))
    }
}

impl Drop for Deferred {
    fn drop(&mut self) {
        let Some(value) = self.0.take() else { return };
        QUEUE.lock().unwrap_or_else(|e| e.into_inner()).push(value);
        QUEUED.store(true, Ordering::Release);
    }
}

/// Runs the queued releases (the caller holds the GIL, as `_py` proves).
pub(crate) fn drain(_py: Python<'_>) {
    if !QUEUED.swap(false, Ordering::AcqRel) {
        return;
    }
    let queued = std::mem::take(&mut *QUEUE.lock().unwrap_or_else(|e| e.into_inner()));
    drop(queued);
}

/// Releases queued now (tests read it to see that nothing is left behind).
pub(crate) fn pending() -> usize {
    QUEUE.lock().unwrap_or_else(|e| e.into_inner()).len()
}
