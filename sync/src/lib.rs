#![doc = include_str!("../README.md")]
#![forbid(unsafe_code)]
#![warn(missing_docs)]

use std::fmt;
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

#[cfg(tessera_loom)]
use loom::sync as imp;
#[cfg(not(tessera_loom))]
use std::sync as imp;

pub use std::sync::{Arc, Weak};

/// An `Arc` whose reference count the model checks: loom's under `--cfg tessera_loom`, std's
/// otherwise. Use [`Arc`] unless a model is about this count (it cannot hold `dyn Trait`
/// under loom).
pub use imp::Arc as CheckedArc;

/// std's primitives under loom too, for what no model checks: one-time initialisation of
/// statics, channels, and atomics laid over raw memory (which must be std's type).
pub mod unchecked {
    pub use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, AtomicUsize, Ordering};
    pub use std::sync::{mpsc, OnceLock};
}

/// A guard of [`Mutex`]: std's or loom's.
pub use imp::MutexGuard;

/// Atomics: std's or loom's.
pub mod atomic {
    pub use super::imp::atomic::{fence, AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
}

/// A mutual exclusion lock that ignores poisoning (see the crate's contract).
#[derive(Default)]
pub struct Mutex<T: ?Sized>(imp::Mutex<T>);

impl<T> Mutex<T> {
    /// A new lock holding `value`.
    pub fn new(value: T) -> Self {
        Self(imp::Mutex::new(value))
    }

    /// The value, consuming the lock.
    pub fn into_inner(self) -> T {
        self.0.into_inner().unwrap_or_else(|e| e.into_inner())
    }
}

impl<T: ?Sized> Mutex<T> {
    /// Locks, blocking the thread until the lock is free. Never fails.
    pub fn lock(&self) -> MutexGuard<'_, T> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Locks if the lock is free now.
    pub fn try_lock(&self) -> Option<MutexGuard<'_, T>> {
        match self.0.try_lock() {
            Ok(g) => Some(g),
            Err(std::sync::TryLockError::Poisoned(e)) => Some(e.into_inner()),
            Err(std::sync::TryLockError::WouldBlock) => None,
        }
    }

    /// The value through a unique borrow, without locking.
    pub fn get_mut(&mut self) -> &mut T {
        self.0.get_mut().unwrap_or_else(|e| e.into_inner())
    }
}

impl<T: ?Sized + fmt::Debug> fmt::Debug for Mutex<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.try_lock() {
            Some(g) => f.debug_tuple("Mutex").field(&&*g).finish(),
            None => f.write_str("Mutex(<locked>)"),
        }
    }
}

/// A condition variable paired with [`Mutex`], ignoring poisoning as it does.
#[derive(Default)]
pub struct Condvar(imp::Condvar);

impl Condvar {
    /// A new condition variable.
    pub fn new() -> Self {
        Self(imp::Condvar::new())
    }

    /// Releases `guard`, waits for a notification (or a spurious wake-up), locks again.
    pub fn wait<'a, T>(&self, guard: MutexGuard<'a, T>) -> MutexGuard<'a, T> {
        self.0.wait(guard).unwrap_or_else(|e| e.into_inner())
    }

    /// As [`Condvar::wait`], for at most `timeout`; the flag says whether it timed out.
    pub fn wait_timeout<'a, T>(
        &self,
        guard: MutexGuard<'a, T>,
        timeout: Duration,
    ) -> (MutexGuard<'a, T>, bool) {
        let (g, r) = self
            .0
            .wait_timeout(guard, timeout)
            .unwrap_or_else(|e| e.into_inner());
        (g, r.timed_out())
    }

    /// Wakes one waiter.
    pub fn notify_one(&self) {
        self.0.notify_one();
    }

    /// Wakes every waiter.
    pub fn notify_all(&self) {
        self.0.notify_all();
    }
}

impl fmt::Debug for Condvar {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Condvar")
    }
}

/// A [`Mutex`] for statics (`const` construction): std's always, since loom primitives cannot
/// be statics. Poisoning is ignored as [`Mutex`] does.
#[derive(Default)]
pub struct StaticMutex<T: ?Sized>(std::sync::Mutex<T>);

impl<T> StaticMutex<T> {
    /// A new lock holding `value`.
    pub const fn new(value: T) -> Self {
        Self(std::sync::Mutex::new(value))
    }
}

impl<T: ?Sized> StaticMutex<T> {
    /// Locks, blocking the thread until the lock is free. Never fails.
    // std's guard by its full path: under loom the bare `MutexGuard` is loom's.
    #[allow(unused_qualifications)]
    pub fn lock(&self) -> std::sync::MutexGuard<'_, T> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// A statistics counter or id source (relaxed, so an add costs one uncontended atomic). Counts
/// and ids are not part of any model-checked protocol, so it is std's under loom too, and it
/// can be a static.
#[derive(Debug, Default)]
pub struct Counter(std::sync::atomic::AtomicU64);

impl Counter {
    /// A counter at `start`.
    pub const fn new(start: u64) -> Self {
        Self(std::sync::atomic::AtomicU64::new(start))
    }

    /// Adds `n`.
    pub fn add(&self, n: u64) {
        self.0.fetch_add(n, std::sync::atomic::Ordering::Relaxed);
    }

    /// Adds one and returns the count before: a process-unique id when the counter is a
    /// static.
    pub fn next(&self) -> u64 {
        self.0.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    }

    /// The count now.
    pub fn get(&self) -> u64 {
        self.0.load(std::sync::atomic::Ordering::Relaxed)
    }
}

/// A value set once and read many times: the outcome of an operation that completes on
/// another thread (a transfer, an engine request). Readers block, poll or peek.
pub struct OneShot<T> {
    slot: Mutex<Slot<T>>,
    ready: Condvar,
}

struct Slot<T> {
    value: Option<T>,
    /// The value was taken by its one reader ([`OneShot::wait_take`]): it is not set again.
    taken: bool,
    waker: Option<Waker>,
}

impl<T> Default for OneShot<T> {
    fn default() -> Self {
        Self::new()
    }
}

impl<T> OneShot<T> {
    /// An empty one.
    pub fn new() -> Self {
        Self {
            slot: Mutex::new(Slot {
                value: None,
                taken: false,
                waker: None,
            }),
            ready: Condvar::new(),
        }
    }

    /// Sets the value and wakes every reader. Only the first call sets it: a later one
    /// returns `false` and drops its value.
    pub fn set(&self, value: T) -> bool {
        let waker = {
            let mut slot = self.slot.lock();
            if slot.value.is_some() || slot.taken {
                return false;
            }
            slot.value = Some(value);
            slot.waker.take()
        };
        self.ready.notify_all();
        if let Some(w) = waker {
            w.wake();
        }
        true
    }

    /// Whether the value is set (and not taken).
    pub fn is_set(&self) -> bool {
        self.slot.lock().value.is_some()
    }

    /// Blocks the thread until the value is set, and takes it: for the one reader that owns
    /// the outcome (a value that cannot be cloned). Later reads find it unset, and a later
    /// [`OneShot::set`] is still refused.
    pub fn wait_take(&self) -> T {
        let mut slot = self.slot.lock();
        loop {
            if let Some(v) = slot.value.take() {
                slot.taken = true;
                return v;
            }
            slot = self.ready.wait(slot);
        }
    }

    /// As [`OneShot::wait_take`], for up to `timeout`; `None` (nothing taken) if the value
    /// was not set by then.
    pub fn wait_take_timeout(&self, timeout: Duration) -> Option<T> {
        let deadline = Instant::now() + timeout;
        let mut slot = self.slot.lock();
        loop {
            if let Some(v) = slot.value.take() {
                slot.taken = true;
                return Some(v);
            }
            let left = deadline.checked_duration_since(Instant::now())?;
            slot = self.ready.wait_timeout(slot, left).0;
        }
    }
}

impl<T: Clone> OneShot<T> {
    /// The value, if set, without waiting.
    pub fn get(&self) -> Option<T> {
        self.slot.lock().value.clone()
    }

    /// Blocks the thread until the value is set.
    pub fn wait(&self) -> T {
        let mut slot = self.slot.lock();
        loop {
            if let Some(v) = &slot.value {
                return v.clone();
            }
            slot = self.ready.wait(slot);
        }
    }

    /// Blocks up to `timeout`; `None` if the value was not set by then.
    pub fn wait_timeout(&self, timeout: Duration) -> Option<T> {
        let deadline = Instant::now() + timeout;
        let mut slot = self.slot.lock();
        loop {
            if let Some(v) = &slot.value {
                return Some(v.clone());
            }
            let left = deadline.checked_duration_since(Instant::now())?;
            slot = self.ready.wait_timeout(slot, left).0;
        }
    }

    /// The value if set; otherwise `cx`'s waker is woken when it is (one task polls at a
    /// time: a later poll replaces the waker).
    pub fn poll(&self, cx: &mut Context<'_>) -> Poll<T> {
        let mut slot = self.slot.lock();
        match &slot.value {
            Some(v) => Poll::Ready(v.clone()),
            None => {
                slot.waker = Some(cx.waker().clone());
                Poll::Pending
            }
        }
    }
}

impl<T: fmt::Debug> fmt::Debug for OneShot<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("OneShot")
            .field("value", &self.slot.lock().value)
            .finish()
    }
}

/// Runs `f` under the loom model checker with `--cfg tessera_loom`, and once as a plain call
/// otherwise.
pub fn model<F: Fn() + Sync + Send + 'static>(f: F) {
    #[cfg(tessera_loom)]
    loom::model(f);
    #[cfg(not(tessera_loom))]
    f();
}

/// Threads: std's or loom's.
pub mod thread {
    #[cfg(tessera_loom)]
    pub use loom::thread::{spawn, yield_now, JoinHandle};
    #[cfg(not(tessera_loom))]
    pub use std::thread::{spawn, yield_now, JoinHandle};
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_panic_under_the_lock_does_not_poison_it() {
        let m = Arc::new(Mutex::new(1));
        let m2 = m.clone();
        let r = std::thread::spawn(move || {
            let mut g = m2.lock();
            *g = 2;
            panic!("inside the critical section");
        })
        .join();
        assert!(r.is_err());
        assert_eq!(*m.lock(), 2);
        assert!(m.try_lock().is_some());
    }

    #[test]
    fn one_shot_keeps_the_first_value_and_times_out_unset() {
        let s = OneShot::new();
        assert_eq!(s.wait_timeout(Duration::from_millis(5)), None);
        assert!(!s.is_set());
        assert!(s.set("a"));
        assert!(!s.set("b"));
        assert_eq!((s.get(), s.wait()), (Some("a"), "a"));
    }

    #[test]
    fn one_shot_taken_by_its_reader_stays_taken() {
        let s = Arc::new(OneShot::new());
        assert_eq!(s.wait_take_timeout(Duration::from_millis(5)), None);
        let s2 = s.clone();
        std::thread::spawn(move || assert!(s2.set(String::from("done"))));
        assert_eq!(s.wait_take(), "done");
        assert!(!s.is_set());
        assert!(
            !s.set(String::from("again")),
            "a taken value is not set again"
        );
    }

    #[test]
    fn one_shot_wakes_a_polling_task() {
        use std::sync::atomic::{AtomicBool, Ordering};
        use std::task::Wake;
        struct Flag(AtomicBool);
        impl Wake for Flag {
            fn wake(self: Arc<Self>) {
                self.0.store(true, Ordering::SeqCst);
            }
        }
        let flag = Arc::new(Flag(AtomicBool::new(false)));
        let waker = Waker::from(flag.clone());
        let s = OneShot::new();
        assert!(s.poll(&mut Context::from_waker(&waker)).is_pending());
        s.set(3);
        assert!(flag.0.load(Ordering::SeqCst));
        assert_eq!(s.poll(&mut Context::from_waker(&waker)), Poll::Ready(3));
    }

    #[test]
    fn loom_one_shot_set_races_wait() {
        model(|| {
            let s = Arc::new(OneShot::new());
            let s2 = s.clone();
            let t = thread::spawn(move || s2.set(1u8));
            assert_eq!(s.wait(), 1);
            assert!(t.join().unwrap());
        });
    }
}
