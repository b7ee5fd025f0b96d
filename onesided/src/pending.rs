//! The one-shot an engine's raw API hands back for a posted transfer: the engine's callback
//! settles it once, and the caller waits on it. A [`tessera_sync::OneShot`] with one owner.

use std::time::Duration;

use tessera_sync::{Arc, OneShot};

/// An outcome not known yet, to wait on. [`Pending::new`] makes it with the callback that
/// settles it.
#[must_use = "a transfer's outcome should be checked"]
pub struct Pending<T> {
    slot: Arc<OneShot<T>>,
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
        let slot = Arc::new(OneShot::new());
        let s = slot.clone();
        let settle = move |outcome: T| {
            s.set(outcome);
        };
        (Self { slot }, settle)
    }
}

impl<T> Pending<T> {
    /// Whether the outcome is known.
    pub fn is_done(&self) -> bool {
        self.slot.is_set()
    }

    /// Blocks until the outcome is known.
    pub fn wait(self) -> T {
        self.slot.wait_take()
    }

    /// Blocks up to `timeout`; `None` if the outcome is not known by then.
    pub fn wait_timeout(&mut self, timeout: Duration) -> Option<T> {
        self.slot.wait_take_timeout(timeout)
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
