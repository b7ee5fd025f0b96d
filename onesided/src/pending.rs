//! The one-shot an engine's raw API hands back for a posted transfer: the engine's callback
//! settles it once, and the caller waits on it.

use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use crate::lock;

struct Slot<T> {
    outcome: Mutex<Option<T>>,
    cv: Condvar,
}

/// An outcome not known yet, to wait on. [`Pending::new`] makes it with the callback that
/// settles it.
#[must_use = "a transfer's outcome should be checked"]
pub struct Pending<T> {
    slot: Arc<Slot<T>>,
}

impl<T> std::fmt::Debug for Pending<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pending")
            .field("done", &self.is_done())
            .finish()
    }
}

impl<T: Send + 'static> Pending<T> {
    /// A pending outcome and the one-shot callback that settles it (from any thread).
    pub fn new() -> (Self, impl FnOnce(T) + Send + 'static) {
        let slot = Arc::new(Slot {
            outcome: Mutex::new(None),
            cv: Condvar::new(),
        });
        let s = slot.clone();
        let settle = move |outcome: T| {
            *lock(&s.outcome) = Some(outcome);
            s.cv.notify_all();
        };
        (Self { slot }, settle)
    }
}

impl<T> Pending<T> {
    /// Whether the outcome is known.
    pub fn is_done(&self) -> bool {
        lock(&self.slot.outcome).is_some()
    }

    /// Blocks until the outcome is known.
    pub fn wait(self) -> T {
        let mut r = lock(&self.slot.outcome);
        loop {
            if let Some(r) = r.take() {
                return r;
            }
            r = self.slot.cv.wait(r).unwrap_or_else(|e| e.into_inner());
        }
    }

    /// Blocks up to `timeout`; `None` if the outcome is not known by then.
    pub fn wait_timeout(&mut self, timeout: Duration) -> Option<T> {
        let deadline = Instant::now() + timeout;
        let mut r = lock(&self.slot.outcome);
        loop {
            if let Some(r) = r.take() {
                return Some(r);
            }
            let now = Instant::now();
            if now >= deadline {
                return None;
            }
            r = self
                .slot
                .cv
                .wait_timeout(r, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn settled_once_from_another_thread() {
        let (mut p, settle) = Pending::<u32>::new();
        assert!(!p.is_done());
        assert_eq!(p.wait_timeout(Duration::from_millis(1)), None);
        std::thread::spawn(move || settle(7)).join().unwrap();
        assert!(p.is_done());
        assert_eq!(p.wait(), 7);
    }
}
