//! Exposures: which ranges of a scoped registration one peer may touch, for which
//! operations, and which bytes of them completed WRITEs covered.
//!
//! A registration made scoped ([`Agent::register_scoped`](crate::Agent::register_scoped),
//! [`RegisteredPool::new_scoped`](crate::RegisteredPool::new_scoped)) grants a peer's request
//! only inside an [`Exposure`] to that peer's name for that operation; anything else is
//! refused with [`RejectReason::NotExposed`](crate::RejectReason::NotExposed). Dropping the
//! exposure revokes it. An unscoped registration grants every in-range request, as before;
//! an exposure on it only counts written bytes.
//!
//! Enforced where the target sees every request: `tcp` (each descriptor), `shm` (at its
//! grant; `shm` hands the whole memfd to an authenticated peer, which can bypass it), and
//! `inproc`. The one-sided `ucx` and `nixl` engines never see the peer's request, so they
//! cannot enforce it.

use std::collections::{BTreeMap, HashMap};
use std::fmt;

use crate::engine::Standing;
use crate::registry::ListedEngine;
use crate::transfer::Op;
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};
use tessera_sync::atomic::{AtomicUsize, Ordering};
use tessera_sync::{Arc, Condvar, Mutex};

/// The operations an exposure allows.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Ops(u8);

impl Ops {
    /// The peer may READ the range.
    pub const READ: Ops = Ops(1);
    /// The peer may WRITE the range.
    pub const WRITE: Ops = Ops(2);
    /// Both.
    pub const READ_WRITE: Ops = Ops(3);

    /// Whether `op` is allowed.
    pub fn allows(self, op: Op) -> bool {
        let bit = match op {
            Op::Read => 1,
            Op::Write => 2,
        };
        self.0 & bit != 0
    }
}

impl fmt::Debug for Ops {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self.0 {
            1 => "READ",
            2 => "WRITE",
            3 => "READ_WRITE",
            _ => "NONE",
        })
    }
}

/// Bytes covered by completed WRITEs: a union of half-open intervals, relative to the
/// exposure's start.
#[derive(Default)]
struct Coverage {
    /// Disjoint, non-adjacent intervals by start.
    runs: BTreeMap<u64, u64>,
    bytes: u64,
    /// Tasks waiting for it to grow ([`Exposure::poll_written`]), woken when it does.
    wakers: Vec<Waker>,
    /// Threads blocked in [`Exposure::wait_written`]: only then does a record signal the
    /// condition variable (a signal is a system call even when nobody waits).
    sleepers: usize,
}

impl Coverage {
    /// Whether `lo..hi` lies in one run (an empty range always does).
    fn covers(&self, lo: u64, hi: u64) -> bool {
        lo >= hi
            || self
                .runs
                .range(..=lo)
                .next_back()
                .is_some_and(|(_, &e)| e >= hi)
    }

    fn add(&mut self, mut lo: u64, mut hi: u64) {
        if lo >= hi {
            return;
        }
        // Merge with the run that starts at or before `lo` if it reaches it.
        if let Some((&s, &e)) = self.runs.range(..=lo).next_back() {
            if e >= lo {
                if e >= hi {
                    return;
                }
                lo = s;
                self.runs.remove(&s);
                self.bytes -= e - s;
            }
        }
        // Absorb every run starting inside `lo..=hi`.
        while let Some((&s, &e)) = self.runs.range(lo..=hi).next() {
            self.runs.remove(&s);
            self.bytes -= e - s;
            hi = hi.max(e);
        }
        self.runs.insert(lo, hi);
        self.bytes += hi - lo;
    }
}

/// One exposure's state, shared by the table and the grants that matched it.
pub(crate) struct ExpState {
    /// First byte, relative to the registration.
    start: u64,
    len: u64,
    ops: Ops,
    written: Mutex<Coverage>,
    /// Signalled whenever `written` grows.
    grew: Condvar,
}

impl ExpState {
    /// Whether this exposure allows `op` on `offset..offset + len` of the registration.
    pub(crate) fn covers(&self, op: Op, offset: u64, len: u64) -> bool {
        self.ops.allows(op)
            && offset >= self.start
            && offset
                .checked_add(len)
                .is_some_and(|end| end <= self.start + self.len)
    }

    /// Records that `offset..offset + len` of the registration was written.
    pub(crate) fn record(&self, offset: u64, len: u64) {
        let lo = offset.saturating_sub(self.start).min(self.len);
        let hi = offset
            .saturating_add(len)
            .saturating_sub(self.start)
            .min(self.len);
        let (wakers, sleepers) = {
            let mut c = self.written.lock();
            c.add(lo, hi);
            (std::mem::take(&mut c.wakers), c.sleepers)
        };
        if sleepers > 0 {
            self.grew.notify_all();
        }
        for w in wakers {
            w.wake();
        }
    }
}

/// Exposures by peer, each peer's ordered by start: a lookup is one hash and a short walk
/// back from the nearest start, bounded by the longest exposure that peer holds.
#[derive(Default)]
struct PeerExposures {
    by_start: BTreeMap<(u64, u64), Arc<ExpState>>,
    max_len: u64,
}

/// A registration's exposure table.
#[derive(Default)]
pub(crate) struct Scope {
    /// Whether requests outside every exposure are refused.
    pub(crate) enforced: bool,
    /// Live exposures, so unscoped registrations without any skip the lock.
    count: AtomicUsize,
    table: Mutex<HashMap<String, PeerExposures>>,
}

impl Scope {
    pub(crate) fn new(enforced: bool) -> Self {
        Self {
            enforced,
            ..Self::default()
        }
    }

    /// The exposure to `peer` allowing `op` that holds `offset..offset + len`, if any. `Err`
    /// when the registration is enforced and none does.
    pub(crate) fn check(
        &self,
        peer: &str,
        op: Op,
        offset: u64,
        len: u64,
    ) -> Result<Option<Arc<ExpState>>, ()> {
        if self.count.load(Ordering::Acquire) == 0 {
            return if self.enforced { Err(()) } else { Ok(None) };
        }
        let end = offset.checked_add(len).ok_or(())?;
        let found = {
            let t = self.table.lock();
            t.get(peer).and_then(|p| {
                let floor = end.saturating_sub(p.max_len);
                p.by_start
                    .range(..=(offset, u64::MAX))
                    .rev()
                    .take_while(|((s, _), _)| *s >= floor)
                    .map(|(_, e)| e)
                    .find(|e| e.ops.allows(op) && e.start + e.len >= end)
                    .cloned()
            })
        };
        match found {
            Some(e) => Ok(Some(e)),
            None if self.enforced => Err(()),
            None => Ok(None),
        }
    }

    pub(crate) fn expose(
        self: &Arc<Self>,
        peer: &str,
        start: u64,
        len: u64,
        ops: Ops,
        keep: Option<crate::transfer::KeepAlive>,
    ) -> Exposure {
        // Orders exposures of one start in the table; nothing outside this agent sees it.
        static NEXT: tessera_sync::unchecked::AtomicU64 =
            tessera_sync::unchecked::AtomicU64::new(1);
        let id = NEXT.fetch_add(1, Ordering::Relaxed);
        let state = Arc::new(ExpState {
            start,
            len,
            ops,
            written: Mutex::new(Coverage::default()),
            grew: Condvar::new(),
        });
        {
            let mut t = self.table.lock();
            let p = t.entry(peer.to_owned()).or_default();
            p.max_len = p.max_len.max(len);
            p.by_start.insert((start, id), state.clone());
        }
        self.count.fetch_add(1, Ordering::AcqRel);
        Exposure {
            _keep: keep,
            scope: self.clone(),
            peer: peer.to_owned(),
            key: (start, id),
            state,
            standing: None,
        }
    }
}

/// A range of a registration that one peer may touch with some operations, until this is
/// dropped. It also reports how many of its bytes completed WRITEs covered.
///
/// On a scoped registration a peer's request is granted only inside an exposure to its
/// (authenticated) name for that operation. `tcp` checks each descriptor and `inproc` its
/// grant; `shm` checks its grant, but maps the whole memfd for the initiator, so a malicious
/// authenticated peer can bypass it; the one-sided `ucx` and `nixl` engines cannot enforce it
/// (the target never sees the request). See the crate README's trust model.
#[must_use = "dropping an exposure revokes it"]
pub struct Exposure {
    /// What the exposure keeps alive (a pool block stays leased while it is exposed).
    _keep: Option<crate::transfer::KeepAlive>,
    scope: Arc<Scope>,
    peer: String,
    key: (u64, u64),
    state: Arc<ExpState>,
    /// A standing exposure's engine and grant, withdrawn when it drops.
    standing: Option<(Arc<dyn ListedEngine>, Standing)>,
}

impl Exposure {
    /// Makes it standing: `engine` hears of it now and of its end when it drops
    /// ([`Registration::expose_standing`](crate::Registration::expose_standing)).
    pub(crate) fn announce(mut self, engine: Arc<dyn ListedEngine>, reg: u64) -> Self {
        let grant = Standing {
            key: self.key.1,
            reg,
            offset: self.state.start,
            len: self.state.len,
        };
        engine.standing(&self.peer, grant, true);
        self.standing = Some((engine, grant));
        self
    }

    /// The peer it is for.
    pub fn peer(&self) -> &str {
        &self.peer
    }

    /// Where it starts in the registration peers name.
    pub fn offset(&self) -> u64 {
        self.state.start
    }

    /// Its length.
    pub fn len(&self) -> u64 {
        self.state.len
    }

    /// Whether it is empty.
    pub fn is_empty(&self) -> bool {
        self.state.len == 0
    }

    /// The operations it allows.
    pub fn ops(&self) -> Ops {
        self.state.ops
    }

    /// Bytes of its range that completed WRITEs from its peer covered (each byte once,
    /// however often written).
    pub fn written(&self) -> u64 {
        self.state.written.lock().bytes
    }

    /// Whether completed WRITEs covered every `(offset, len)` of `ranges`, offsets relative to
    /// the exposure's start (a range beyond its end never is): the frames of a block exposed
    /// whole, the padding between them left out.
    pub fn ranges_written(&self, ranges: &[(u64, u64)]) -> bool {
        let c = self.state.written.lock();
        ranges.iter().all(|&(offset, len)| {
            offset
                .checked_add(len)
                .is_some_and(|end| end <= self.state.len && c.covers(offset, end))
        })
    }

    /// Whether completed WRITEs covered every byte of it.
    pub fn is_fully_written(&self) -> bool {
        self.written() == self.state.len
    }

    /// Waits up to `timeout` until completed WRITEs covered at least `bytes` of it; returns
    /// the bytes covered then. Where the target learns of a WRITE only after the initiator
    /// saw it complete (`shm`: the initiator's `DONE` is read by the target's own thread), a
    /// peer may report a WRITE done a moment before it counts here; a check that follows a
    /// peer's word over another channel waits briefly with this (or, from async code, with
    /// [`Exposure::poll_written`], as the storage unit's COMMIT does).
    pub fn wait_written(&self, bytes: u64, timeout: Duration) -> u64 {
        let deadline = Instant::now() + timeout;
        let mut c = self.state.written.lock();
        c.sleepers += 1;
        while c.bytes < bytes.min(self.state.len) {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            c = self.state.grew.wait_timeout(c, left).0;
        }
        c.sleepers -= 1;
        c.bytes
    }

    /// Spins for up to `window` until completed WRITEs covered at least `bytes` of it; returns
    /// whether they did. A standing exposure's engine records meanwhile, on this thread, the
    /// WRITEs it can see without its own thread (`shm`: its peer's copies into standing
    /// ranges), so a WRITE that completes within the window counts here within about a
    /// cache-line transfer instead of after the engine's thread was woken. For a caller that
    /// knows the WRITE is under way and has its core to spare (a busy-polling server); others
    /// wait with [`Exposure::poll_written`].
    pub fn spin_written(&self, bytes: u64, window: Duration) -> bool {
        let enough = bytes.min(self.state.len);
        let mut done = || self.state.written.lock().bytes >= enough;
        match &self.standing {
            Some((engine, _)) => engine.spin_for_writes(&self.peer, window, &mut done),
            None => done(),
        }
    }

    /// Keeps the peer's WRITEs into this agent's standing ranges from waking its engine's
    /// thread until the returned watch drops; they are recorded then
    /// ([`Transport::watch_writes`](crate::engine::Transport::watch_writes)). For a standing
    /// exposure whose caller learns from the peer itself that its WRITE landed (a client's
    /// GET block, which the server's answer follows) and never waits on the record. Other
    /// exposures watch nothing.
    pub fn watch_written(&self) -> crate::engine::WriteWatch {
        match &self.standing {
            Some((engine, _)) => engine.watch_writes(&self.peer),
            None => crate::engine::WriteWatch::default(),
        }
    }

    /// [`Exposure::wait_written`] for async callers: ready once completed WRITEs covered at
    /// least `bytes` of it; otherwise the task is woken when the coverage grows.
    pub fn poll_written(&self, bytes: u64, cx: &mut Context<'_>) -> Poll<()> {
        let mut c = self.state.written.lock();
        if c.bytes >= bytes.min(self.state.len) {
            return Poll::Ready(());
        }
        if !c.wakers.iter().any(|w| w.will_wake(cx.waker())) {
            c.wakers.push(cx.waker().clone());
        }
        Poll::Pending
    }

    /// [`Exposure::wait_written`] of the whole exposure: whether it was fully written within
    /// `timeout`.
    pub fn wait_fully_written(&self, timeout: Duration) -> bool {
        self.wait_written(self.state.len, timeout) == self.state.len
    }
}

impl Drop for Exposure {
    fn drop(&mut self) {
        let removed = {
            let mut t = self.scope.table.lock();
            let (removed, empty) = match t.get_mut(&self.peer) {
                Some(p) => (p.by_start.remove(&self.key), p.by_start.is_empty()),
                None => (None, false),
            };
            if empty {
                t.remove(&self.peer);
            }
            removed
        };
        if removed.is_some() {
            self.scope.count.fetch_sub(1, Ordering::AcqRel);
        }
        // Withdrawn from the peer's side only once the target grants nothing more in it.
        if let Some((engine, grant)) = self.standing.take() {
            engine.standing(&self.peer, grant, false);
        }
    }
}

impl fmt::Debug for Exposure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Exposure")
            .field("peer", &self.peer)
            .field("offset", &self.state.start)
            .field("len", &self.state.len)
            .field("ops", &self.state.ops)
            .field("written", &self.written())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn coverage_is_a_union() {
        let mut c = Coverage::default();
        c.add(10, 20);
        c.add(30, 40);
        assert_eq!(c.bytes, 20);
        c.add(15, 35);
        assert_eq!(c.bytes, 30);
        assert_eq!(c.runs.len(), 1);
        c.add(0, 5);
        c.add(5, 10);
        assert_eq!(c.bytes, 40);
        assert_eq!(c.runs.len(), 1);
        c.add(0, 40);
        assert_eq!(c.bytes, 40);
        c.add(50, 50);
        assert_eq!(c.bytes, 40);
    }

    #[test]
    fn ranges_count_as_written_only_once_covered_whole() {
        let s = Arc::new(Scope::new(true));
        let e = s.expose("p", 1000, 300, Ops::WRITE, None);
        assert!(e.ranges_written(&[]));
        assert!(e.ranges_written(&[(10, 0)]), "an empty range is covered");
        e.state.record(1000, 64);
        e.state.record(1128, 64);
        assert!(e.ranges_written(&[(0, 64), (128, 64)]));
        assert!(e.ranges_written(&[(10, 20), (150, 42)]));
        assert!(!e.ranges_written(&[(0, 65)]), "one byte past the run");
        assert!(!e.ranges_written(&[(0, 192)]), "the gap between the runs");
        assert!(!e.ranges_written(&[(64, 1)]));
        e.state.record(1064, 64);
        assert!(e.ranges_written(&[(0, 192)]));
        assert!(
            !e.ranges_written(&[(192, 109)]),
            "beyond the exposure's end"
        );
        assert!(!e.ranges_written(&[(u64::MAX, 2)]));
    }

    #[test]
    fn a_task_waiting_for_writes_is_woken_when_they_are_recorded() {
        use std::sync::atomic::{AtomicUsize, Ordering as O};
        struct Flag(AtomicUsize);
        impl std::task::Wake for Flag {
            fn wake(self: Arc<Self>) {
                self.0.fetch_add(1, O::SeqCst);
            }
        }
        let flag = Arc::new(Flag(AtomicUsize::new(0)));
        let waker = Waker::from(flag.clone());
        let mut cx = Context::from_waker(&waker);
        let s = Arc::new(Scope::new(true));
        let e = s.expose("p", 100, 100, Ops::WRITE, None);
        assert!(e.poll_written(100, &mut cx).is_pending());
        assert!(e.poll_written(100, &mut cx).is_pending(), "registered once");
        e.state.record(100, 60);
        assert_eq!(flag.0.load(O::SeqCst), 1);
        assert!(e.poll_written(60, &mut cx).is_ready());
        assert!(e.poll_written(100, &mut cx).is_pending());
        e.state.record(160, 40);
        assert_eq!(flag.0.load(O::SeqCst), 2);
        assert!(e.poll_written(100, &mut cx).is_ready());
    }

    #[test]
    fn lookups_find_the_covering_exposure_only() {
        let s = Arc::new(Scope::new(true));
        assert!(s.check("p", Op::Write, 0, 1).is_err());
        let a = s.expose("p", 100, 100, Ops::WRITE, None);
        let b = s.expose("p", 300, 50, Ops::READ, None);
        assert!(s.check("p", Op::Write, 100, 100).unwrap().is_some());
        assert!(s.check("p", Op::Write, 150, 10).unwrap().is_some());
        assert!(s.check("p", Op::Write, 150, 100).is_err());
        assert!(s.check("p", Op::Read, 100, 10).is_err());
        assert!(s.check("q", Op::Write, 100, 10).is_err());
        assert!(s.check("p", Op::Read, 300, 50).unwrap().is_some());
        drop(a);
        assert!(s.check("p", Op::Write, 100, 10).is_err());
        drop(b);
        assert!(s.table.lock().is_empty());
        let open = Arc::new(Scope::new(false));
        assert!(open.check("p", Op::Write, 0, 1).unwrap().is_none());
    }
}
