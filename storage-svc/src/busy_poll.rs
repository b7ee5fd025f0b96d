//! Bounded busy polling of control sockets before a tokio worker parks.
//!
//! A worker that runs out of work parks in `epoll_wait`, and its core may halt. Waking a
//! halted core costs tens of microseconds on virtual machines (about 35 us one way on the
//! 2-vCPU machine the benchmarks run on), which dominates a small request's round trip
//! when client and unit sit on different cores: one byte echoed across cores takes about
//! 70 us there, about 23 us when one end polls and 3-4 us when both do. [`BusyPoll`] keeps
//! a parking worker polling the sockets it watches for a bounded window instead, so a
//! request or an answer that arrives within the window is picked up without a wake-up. This is the trade every
//! low-latency transport offers (UCX and RDMA completion queues poll; Linux has
//! `SO_BUSY_POLL` for NIC queues, which loopback and Unix sockets do not have): CPU time
//! for latency, here at most `window` per idle transition of a worker.
//!
//! A worker polls only while something is awaited, and stops as soon as nothing is: a
//! client's poller while one of its requests waits for its answer, a server's while it has
//! a session open (the next request). It spins without `sched_yield`: a thread woken on the
//! same core that has slept more than it ran (the caller of a small request) preempts the
//! spin as it would an idle core, where a yielding spin kept it waiting for the whole window
//! about half the time (EEVDF, Linux 6.x). One that has used its share (the caller of a
//! large PUT, after its copy) does not preempt it, so a client's reader yields its core once
//! after it handed an answer to a caller on a thread of its own (`block_on`), before its
//! worker goes on to poll.
//!
//! What is awaited can be expected later than the window. A batch of a thousand tensors
//! keeps the unit busy for a few hundred microseconds before its answer; the client that
//! sent it encodes its next batch for tens of microseconds before the unit hears from it
//! again. Polling for the window and then parking spends the window and still pays the
//! wake-up. A poller built with [`BusyPoll::expecting`] keeps polling past its window, up to
//! a bound, while something awaited is expected: a client learns how long the answers to
//! requests of each shape took lately and, sending one, says when its answer should come; a
//! server learns how long each session's client paused between requests and, having
//! answered, says when the next request should come. Only what is expected within a bound
//! of the request (or the answer) is polled for: a spin to the bound would end before
//! anything expected later came (a 16 MiB PUT's answer, a session that pauses for
//! milliseconds). Past its window a spin yields at every round and stops once another
//! thread took the core for a while: where client and unit share one core, a spin that is
//! not preempted keeps the other end from sending what it waits for, so the longer it
//! spins the later that comes.
//!
//! It is off unless asked for: build the runtime with [`BusyPoll::on_park`] and hand the
//! same `BusyPoll` to the server (`ServerConfig::busy_poll`) or the client
//! (`ClientConfig::busy_poll`), which register their control sockets with it. Measured by
//! `cargo xtask bench storage` (`small_put_us` against `small_put_unpolled_us`).
//!
//! ```no_run
//! # fn main() -> std::io::Result<()> {
//! use std::time::Duration;
//! let poll = tessera_storage::BusyPoll::new(Duration::from_micros(50))?;
//! let rt = tokio::runtime::Builder::new_multi_thread()
//!     .enable_all()
//!     .on_thread_park(poll.on_park())
//!     .build()?;
//! # drop(rt);
//! # Ok(())
//! # }
//! ```

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};
use tessera_sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use tessera_sync::Arc;

use tokio::io::{AsyncRead, ReadBuf};

use crate::ring::Ring;

/// A set of sockets that parking workers poll for up to `window` (see the module docs).
/// Cheap to clone; clones share the set.
#[derive(Clone)]
pub struct BusyPoll {
    inner: Arc<Inner>,
}

struct Inner {
    /// Level-triggered epoll set of the watched sockets (readable).
    epoll: OwnedFd,
    window: Duration,
    /// Awaited things ([`Waiting`] guards alive): no polling while zero.
    waiting: AtomicUsize,
    /// Of those, sessions whose peer sent its last message from the core of the thread that
    /// read it ([`Near`] guards alive): no polling while these are all that is awaited.
    near: AtomicUsize,
    /// Waits on this process's own threads ([`Quiet`] guards alive): no polling while any.
    quiet: AtomicUsize,
    /// How far past a request its answer (or past an answer the next request) may be
    /// expected ([`BusyPoll::expecting`]); zero: nothing is ever expected, the window is all.
    longest: Duration,
    /// When the latest expected answer or request should come, in nanoseconds since
    /// `epoch`: parking workers poll until then while something is awaited, past their
    /// window.
    expected: AtomicU64,
    epoch: Instant,
}

impl std::fmt::Debug for BusyPoll {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BusyPoll")
            .field("window", &self.inner.window)
            .finish_non_exhaustive()
    }
}

impl BusyPoll {
    /// The `tessera-storage serve` binary's default window, in microseconds (0: off). Without
    /// pinning, where users run, it halves a 4-byte PUT on the benchmark machine against a
    /// unit that does not poll (`cargo xtask bench storage`, `small_put_default_unpinned_us`).
    pub const SERVE_DEFAULT_US: u64 = 50;

    /// The `tessera-storage serve` binary's default bound on an expected request, in
    /// microseconds past the answer before it ([`BusyPoll::expecting`]; 0: none). A session
    /// that sends a batch of a thousand tensors after each answer pauses about 50 us (its
    /// encoding) on the benchmark machine, at the edge of the window.
    pub const SERVE_EXPECT_DEFAULT_US: u64 = 250;

    /// A poller that spins for at most `window` each time a worker is about to park.
    pub fn new(window: Duration) -> io::Result<Self> {
        Self::expecting(window, Duration::ZERO)
    }

    /// A poller that spins for `window` each time a worker is about to park, and longer while
    /// something awaited is expected later (see the module docs): until then, when that is
    /// within `longest` of the request (or the answer) it follows. A client given this
    /// poller says when it expects each answer, from how long the latest requests of the
    /// same shape took; a server, when it expects each session's next request, from how long
    /// the session's latest pauses took.
    pub fn expecting(window: Duration, longest: Duration) -> io::Result<Self> {
        // SAFETY: epoll_create1 takes no pointers; a non-negative result is a new descriptor
        // that nothing else owns.
        let fd = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `fd` was just created and is owned by nothing else.
        let epoll = unsafe { OwnedFd::from_raw_fd(fd) };
        Ok(Self {
            inner: Arc::new(Inner {
                epoll,
                window,
                waiting: AtomicUsize::new(0),
                near: AtomicUsize::new(0),
                quiet: AtomicUsize::new(0),
                longest,
                expected: AtomicU64::new(0),
                epoch: Instant::now(),
            }),
        })
    }

    /// The longest a parking worker polls.
    pub fn window(&self) -> Duration {
        self.inner.window
    }

    /// How far past a request a parking worker polls for its expected answer, or past an
    /// answer for the next request (zero: not at all; [`BusyPoll::expecting`]).
    pub fn longest(&self) -> Duration {
        self.inner.longest
    }

    /// When the latest answer or request expected so far should come (see
    /// [`BusyPoll::expecting`]), or `None` when none was.
    pub fn expected(&self) -> Option<Instant> {
        match self.inner.expected.load(Ordering::Relaxed) {
            0 => None,
            ns => Some(self.inner.epoch + Duration::from_nanos(ns)),
        }
    }

    /// Something awaited since `sent` (an answer, or a session's next request) is expected
    /// `after` it: parking workers poll until then, past their window, while anything is
    /// awaited. Expected later than [`BusyPoll::longest`] after `sent`, it is not polled for
    /// at all: a spin to the bound would end before it came.
    pub(crate) fn expect(&self, sent: Instant, after: Duration) {
        let inner = &*self.inner;
        if inner.longest.is_zero() || after > inner.longest {
            return;
        }
        let by = sent.saturating_duration_since(inner.epoch) + after;
        let by = u64::try_from(by.as_nanos()).unwrap_or(u64::MAX);
        inner.expected.fetch_max(by, Ordering::Relaxed);
    }

    /// Spins on this thread for something that is coming (a credited PUT's WRITE record: the
    /// client copies while its request travels) until `poll` says it came: for the window,
    /// then, where this poller expects ([`BusyPoll::expecting`]), on until `longest` plus
    /// `work` (how long what is coming may take to make, such as that copy; at most
    /// [`SPIN_MOST`]) past `since` while nothing else waits for this worker (a watched socket
    /// readable, a task woken from outside the runtime), giving way at every round past the
    /// window and stopping once another thread took the core (where both ends share one, the
    /// other is the one copying). `poll(d)` looks for up to `d` and says whether it came; one
    /// that returns before `d` has nothing to spin on, and ends the spin. Whether it came; if
    /// not, the caller waits for it parked.
    ///
    /// A spin that ended with the window parked and was woken by the engine's thread instead:
    /// a batch PUT's copy of 4 MB outlasts its request's decoding plus the window, and half
    /// of such PUTs paid that wake-up; with `longest` alone as the bound, all of them did
    /// where that copy took longer than it (about 55 us each).
    pub(crate) fn spin_for(
        &self,
        since: Instant,
        work: Duration,
        poll: impl FnMut(Duration) -> bool,
    ) -> bool {
        self.spin_giving_way(since, work, poll, gave_way)
    }

    /// [`BusyPoll::spin_for`], offering the core with `give_way` (true: another thread took
    /// it).
    fn spin_giving_way(
        &self,
        since: Instant,
        work: Duration,
        mut poll: impl FnMut(Duration) -> bool,
        mut give_way: impl FnMut() -> bool,
    ) -> bool {
        let start = Instant::now();
        if poll(self.inner.window) {
            return true;
        }
        // A look that ended before its window had nothing to spin on (an engine whose records
        // come from its own thread, which a spin here would only hold up).
        if start.elapsed() < self.inner.window {
            return false;
        }
        if self.inner.longest.is_zero() {
            return false;
        }
        let deadline = since + self.inner.longest + work.min(SPIN_MOST);
        let runtime = tokio::runtime::Handle::try_current().ok();
        while Instant::now() < deadline {
            if self.other_work(runtime.as_ref()) || give_way() {
                return poll(Duration::ZERO);
            }
            if poll(SPIN_ROUND) {
                return true;
            }
        }
        false
    }

    /// Whether a worker of `runtime` has something else to do: a watched socket is readable,
    /// or a task woken from outside the runtime (a transfer completing on an engine's
    /// thread) waits in its shared queue, where its worker's own poller, which no spin
    /// watches, would have seen it.
    fn other_work(&self, runtime: Option<&tokio::runtime::Handle>) -> bool {
        let mut ev = [libc::epoll_event { events: 0, u64: 0 }; 1];
        // SAFETY: `ev` has room for the one event asked for; timeout 0 never blocks.
        let n = unsafe { libc::epoll_wait(self.inner.epoll.as_raw_fd(), ev.as_mut_ptr(), 1, 0) };
        n != 0 || runtime.is_some_and(|h| h.metrics().global_queue_depth() > 0)
    }

    /// How many things are awaited now: open server sessions plus client requests waiting
    /// for their answers, of the servers and clients given this poller.
    pub fn awaited(&self) -> usize {
        self.inner.waiting.load(Ordering::Relaxed)
    }

    /// The hook for `tokio::runtime::Builder::on_thread_park`: while something is awaited,
    /// polls the watched sockets until one is readable, nothing is awaited any more or the
    /// window passed, then lets the worker park (and find the event at once in its own
    /// `epoll_wait`).
    pub fn on_park(&self) -> impl Fn() + Send + Sync + 'static {
        let this = self.clone();
        move || this.spin()
    }

    /// Counts one awaited thing until the guard is dropped: parking workers poll while any
    /// is.
    pub(crate) fn waiting(&self) -> Waiting {
        self.inner.waiting.fetch_add(1, Ordering::Relaxed);
        Waiting { poll: self.clone() }
    }

    /// How many of the awaited things a spin waits for: those not awaited from a peer on the
    /// spinning thread's core ([`Watched`]).
    fn spun_for(&self) -> usize {
        let near = self.inner.near.load(Ordering::Relaxed);
        self.inner
            .waiting
            .load(Ordering::Relaxed)
            .saturating_sub(near)
    }

    /// Stops the polling while the guard lives: for a wait on another thread of this process
    /// (an engine's thread recording a WRITE), which a spin on the same core would keep off
    /// it until the window ends. The worker parks, and that thread's wake-up finds it as it
    /// would any parked worker.
    pub(crate) fn quiet(&self) -> Quiet {
        self.inner.quiet.fetch_add(1, Ordering::Relaxed);
        Quiet { poll: self.clone() }
    }

    /// `reader` (the read half of the socket `fd`), watched by `poll` if there is one until
    /// it is dropped; with `awaited`, the socket's next message counts as awaited all along
    /// (a server's session). A socket the set cannot take is read unpolled, with a warning.
    pub(crate) fn watched<R>(
        poll: Option<&BusyPoll>,
        fd: RawFd,
        reader: R,
        awaited: bool,
    ) -> Watched<R> {
        let watch = poll.and_then(|p| match p.watch(fd) {
            Ok(w) => Some(w),
            Err(e) => {
                tracing::warn!(error = %e, "busy polling: socket not added, read without it");
                None
            }
        });
        let waiting = match (&watch, awaited) {
            (Some(w), true) => Some(w.poll.waiting()),
            _ => None,
        };
        Watched {
            awaited,
            near: None,
            _waiting: waiting,
            watch,
            reader,
        }
    }

    /// Watches `fd` until the returned guard is dropped. The socket must outlive the guard.
    fn watch(&self, fd: RawFd) -> io::Result<Watch> {
        let mut ev = libc::epoll_event {
            events: libc::EPOLLIN as u32,
            u64: fd as u64,
        };
        // SAFETY: `ev` is a valid epoll_event for the duration of the call; the epoll
        // descriptor is owned by `self`.
        let rc = unsafe {
            libc::epoll_ctl(
                self.inner.epoll.as_raw_fd(),
                libc::EPOLL_CTL_ADD,
                fd,
                &mut ev,
            )
        };
        if rc < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(Watch {
            poll: self.clone(),
            fd,
        })
    }

    fn spin(&self) {
        let awaited = || self.spun_for() > 0 && self.inner.quiet.load(Ordering::Relaxed) == 0;
        if !awaited() {
            return;
        }
        // A task woken from outside the runtime (a transfer completing on an engine's thread,
        // a WRITE recorded by the target's) lands in the runtime's shared queue and wakes the
        // worker through the runtime's own poller, which this spin does not watch: seen here
        // (`other_work`), it ends the spin at once instead of at the window's end.
        let runtime = tokio::runtime::Handle::try_current().ok();
        let window_end = Instant::now() + self.inner.window;
        // The window, or an answer expected later (zero when none ever was).
        let expected =
            self.inner.epoch + Duration::from_nanos(self.inner.expected.load(Ordering::Relaxed));
        let deadline = window_end.max(expected);
        loop {
            // Readable (or an error, which the worker's own poll will see): stop.
            if self.other_work(runtime.as_ref()) || !awaited() {
                return;
            }
            let now = Instant::now();
            if now >= deadline {
                return;
            }
            // Within the window, no sched_yield: under EEVDF it can keep a thread woken on
            // this core (the caller the answer is for) off the core for the whole window,
            // where a plain spin is preempted by the wake-up. Past it, polling for what is
            // expected, the spin gives way to any thread that wants the core and stops once
            // one took it: where client and unit share a core, a spin that is not preempted
            // keeps the other end from sending what it waits for, and the longer the spin,
            // the later that comes (a 4-byte PUT took 280 us there, against 80 us when the
            // spin ended with the window).
            if now >= window_end && gave_way() {
                return;
            }
            std::hint::spin_loop();
        }
    }
}

/// Offers this thread's core to any other thread that wants it; true when one took it (the
/// yield returned later than [`GAVE_WAY`]).
fn gave_way() -> bool {
    let t = Instant::now();
    // SAFETY: sched_yield takes no arguments and only asks the scheduler to run another
    // thread first.
    unsafe { libc::sched_yield() };
    t.elapsed() > GAVE_WAY
}

/// The most [`BusyPoll::spin_for`] adds to `longest` for the work it waits for.
const SPIN_MOST: Duration = Duration::from_millis(50);

/// How long [`BusyPoll::spin_for`] looks between two offers of its core, past the window.
const SPIN_ROUND: Duration = Duration::from_micros(10);

/// A yield that returns later than this ran another thread first. One with nothing else to
/// run returns within a few microseconds, but a timer tick on a virtual machine can hold it
/// past 50 us: with a 10 us bound a spin of 60 ms ended at a tick, every 4 ms. Another end
/// on the same core that sends its request in less than this is not counted, and needs not
/// be: the spin sees the request when the yield returns.
const GAVE_WAY: Duration = Duration::from_micros(200);

/// When the next of a kind of wait is expected to end, from how long the recent ones took:
/// after their median, plus a quarter. The median, so that one long wait (a request queued
/// behind another session's, a client's pause) does not make the next ones poll longer.
/// `None` without any. Sorted on the stack: it runs for every request that learns.
pub(crate) fn expected_after<const N: usize>(recent: &Ring<Duration, N>) -> Option<Duration> {
    let mut times = [Duration::ZERO; N];
    let mut n = 0;
    for (slot, t) in times.iter_mut().zip(recent.iter()) {
        *slot = t;
        n += 1;
    }
    let times = &mut times[..n];
    times.sort_unstable();
    let median = *times.get(n / 2)?;
    Some(median + median / 4)
}

/// A socket's read half, watched by a [`BusyPoll`] while it lives. The watch is dropped
/// before the reader (field order), so the socket is still open when it leaves the set.
pub(crate) struct Watched<R> {
    /// Its next message is awaited all along (a server's session)...
    awaited: bool,
    /// ...but not spun for while its peer sent its last message from this reader's core.
    near: Option<Near>,
    _waiting: Option<Waiting>,
    watch: Option<Watch>,
    reader: R,
}

impl<R: AsyncRead + Unpin> AsyncRead for Watched<R> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let read = Pin::new(&mut self.reader).poll_read(cx, buf);
        if read.is_pending() && self.awaited {
            self.follow_peer();
        }
        read
    }
}

impl<R> Watched<R> {
    /// About to wait for the peer's next message: not spun for where the peer sent its last
    /// one from this thread's core. A spin there keeps the peer off the core it needs to send
    /// the next one: with client and unit on one core, a polling unit's 4-byte PUT took 29 us
    /// against 25 us for one that does not poll. Where threads are not pinned, the kernel
    /// puts two threads that wake each other on one core when it can.
    fn follow_peer(&mut self) {
        let Some(w) = &self.watch else {
            return;
        };
        let near = w.peer_shares_core();
        match (near, self.near.is_some()) {
            (true, false) => {
                w.poll.inner.near.fetch_add(1, Ordering::Relaxed);
                self.near = Some(Near {
                    poll: w.poll.clone(),
                });
            }
            (false, true) => self.near = None,
            _ => {}
        }
    }
}

/// One awaited thing of a [`BusyPoll`] (see [`BusyPoll::waiting`]).
pub(crate) struct Waiting {
    poll: BusyPoll,
}

impl Drop for Waiting {
    fn drop(&mut self) {
        self.poll.inner.waiting.fetch_sub(1, Ordering::Relaxed);
    }
}

/// An awaited session whose peer is on its reader's core (see [`Watched`]).
struct Near {
    poll: BusyPoll,
}

impl Drop for Near {
    fn drop(&mut self) {
        self.poll.inner.near.fetch_sub(1, Ordering::Relaxed);
    }
}

/// A wait on this process's own threads: no polling while it lives (see [`BusyPoll::quiet`]).
pub(crate) struct Quiet {
    poll: BusyPoll,
}

impl Drop for Quiet {
    fn drop(&mut self) {
        self.poll.inner.quiet.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Keeps a socket in a [`BusyPoll`] set; removes it when dropped.
struct Watch {
    poll: BusyPoll,
    fd: RawFd,
}

impl Watch {
    /// Whether the socket's last message came from this thread's core: the core that
    /// received it (`SO_INCOMING_CPU`: over loopback, the sender's) is this one. False where
    /// that is not known (a Unix socket).
    fn peer_shares_core(&self) -> bool {
        let mut cpu: libc::c_int = -1;
        let mut len = size_of::<libc::c_int>() as libc::socklen_t;
        // SAFETY: `cpu` and `len` are live and sized as passed; `fd` is the watched socket,
        // open while the guard lives.
        let rc = unsafe {
            libc::getsockopt(
                self.fd,
                libc::SOL_SOCKET,
                libc::SO_INCOMING_CPU,
                (&mut cpu as *mut libc::c_int).cast(),
                &mut len,
            )
        };
        // SAFETY: no arguments; the calling thread's current CPU.
        rc == 0 && cpu >= 0 && cpu == unsafe { libc::sched_getcpu() }
    }
}

impl Drop for Watch {
    fn drop(&mut self) {
        // SAFETY: no pointers are passed (DEL ignores the event); the socket is still open
        // (the guard is dropped before it), so `fd` names the registered socket.
        unsafe {
            libc::epoll_ctl(
                self.poll.inner.epoll.as_raw_fd(),
                libc::EPOLL_CTL_DEL,
                self.fd,
                std::ptr::null_mut(),
            );
        }
    }
}

#[cfg(test)]
mod tests {
    //! Bounds here are generous lower or upper limits on behaviour (polls for the whole
    //! window, or stops long before it), never speed goals.
    use super::*;
    use crate::testing::{current_cpu, pin, Spinner};
    use std::io::Write;
    use std::os::unix::net::UnixStream;
    use std::sync::atomic::AtomicBool;

    fn timed(f: impl FnOnce()) -> Duration {
        let t = Instant::now();
        f();
        t.elapsed()
    }

    #[test]
    fn nothing_awaited_means_no_polling() {
        let poll = BusyPoll::new(Duration::from_secs(30)).unwrap();
        let (a, _b) = UnixStream::pair().unwrap();
        let _w = BusyPoll::watched(Some(&poll), a.as_raw_fd(), (), false);
        let hook = poll.on_park();
        assert!(timed(&hook) < Duration::from_secs(5));
    }

    #[test]
    fn polls_for_the_window_while_awaited_and_nothing_arrives() {
        let poll = BusyPoll::new(Duration::from_millis(30)).unwrap();
        let (a, _b) = UnixStream::pair().unwrap();
        let _w = BusyPoll::watched(Some(&poll), a.as_raw_fd(), (), false);
        let _waiting = poll.waiting();
        let took = timed(poll.on_park());
        assert!(took >= Duration::from_millis(30), "{took:?}");
    }

    #[test]
    fn a_readable_socket_ends_the_poll() {
        let poll = BusyPoll::new(Duration::from_secs(30)).unwrap();
        let (a, mut b) = UnixStream::pair().unwrap();
        // A session's socket: its next message is awaited as long as it is watched.
        let _w = BusyPoll::watched(Some(&poll), a.as_raw_fd(), (), true);
        let writer = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(20));
            b.write_all(b"x").unwrap();
            b
        });
        assert!(timed(poll.on_park()) < Duration::from_secs(5));
        drop(writer.join().unwrap());
    }

    #[test]
    fn the_last_awaited_answer_ends_the_poll() {
        let poll = BusyPoll::new(Duration::from_secs(30)).unwrap();
        let (a, _b) = UnixStream::pair().unwrap();
        let _w = BusyPoll::watched(Some(&poll), a.as_raw_fd(), (), false);
        let waiting = poll.waiting();
        let dropper = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(20));
            drop(waiting);
        });
        assert!(timed(poll.on_park()) < Duration::from_secs(5));
        dropper.join().unwrap();
    }

    #[test]
    fn a_dropped_watch_leaves_the_set_and_its_awaited_count() {
        let poll = BusyPoll::new(Duration::from_millis(30)).unwrap();
        let (a, mut b) = UnixStream::pair().unwrap();
        b.write_all(b"x").unwrap();
        let w = BusyPoll::watched(Some(&poll), a.as_raw_fd(), (), true);
        // Readable and watched: the poll ends at once.
        assert!(timed(poll.on_park()) < Duration::from_millis(30));
        drop(w);
        assert_eq!(poll.awaited(), 0);
        // Still readable, no longer watched: polls the whole window for another awaited.
        let _waiting = poll.waiting();
        let took = timed(poll.on_park());
        assert!(took >= Duration::from_millis(30), "{took:?}");
    }

    /// A task woken from a thread outside the runtime (an engine's, completing a transfer)
    /// runs at once: the spinning worker sees it queued and parks, which finds it.
    #[test]
    fn a_task_woken_from_outside_the_runtime_ends_the_poll() {
        let poll = BusyPoll::new(Duration::from_secs(30)).unwrap();
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .on_thread_park(poll.on_park())
            .build()
            .unwrap();
        let _waiting = poll.waiting();
        let (tx, rx) = tokio::sync::oneshot::channel::<Instant>();
        let task = rt.spawn(async move { rx.await.unwrap().elapsed() });
        std::thread::sleep(Duration::from_millis(50));
        tx.send(Instant::now()).unwrap();
        let waited = rt.block_on(task).unwrap();
        assert!(waited < Duration::from_secs(5), "{waited:?}");
    }

    #[test]
    fn a_quiet_wait_stops_the_poll() {
        let poll = BusyPoll::new(Duration::from_secs(30)).unwrap();
        let _waiting = poll.waiting();
        let quiet = poll.quiet();
        assert!(timed(poll.on_park()) < Duration::from_secs(5));
        drop(quiet);
        let poll = BusyPoll::new(Duration::from_millis(30)).unwrap();
        let _waiting = poll.waiting();
        assert!(timed(poll.on_park()) >= Duration::from_millis(30));
    }

    /// Past the window the spin gives way to other threads that want its core and stops when
    /// one took it (the other tests' threads, a build beside): on a quiet machine it polls
    /// until the answer is expected, on a busy one at least past the window, in one of a few
    /// tries.
    #[test]
    fn an_expected_answer_is_polled_for_past_the_window() {
        let window = Duration::from_millis(1);
        let poll = BusyPoll::expecting(window, Duration::from_millis(200)).unwrap();
        let (a, _b) = UnixStream::pair().unwrap();
        let _w = BusyPoll::watched(Some(&poll), a.as_raw_fd(), (), false);
        let _waiting = poll.waiting();
        let past = |t: &Duration| *t >= window + window / 2;
        let mut tries = Vec::new();
        while tries.len() < 20 && !tries.iter().any(past) {
            poll.expect(Instant::now(), Duration::from_millis(60));
            tries.push(timed(poll.on_park()));
        }
        assert!(tries.iter().any(past), "{tries:?}");
    }

    /// A thread that wants the spinning thread's core (the other end of a session, on a
    /// shared core) gets it, and the spin past the window ends there instead of keeping it
    /// waiting until what it was to send is expected.
    #[test]
    fn a_spin_past_the_window_ends_when_another_thread_wants_the_core() {
        let cpu = current_cpu();
        assert!(pin(cpu));
        let other = Spinner::on(cpu);
        let poll = BusyPoll::expecting(Duration::from_millis(1), Duration::from_secs(2)).unwrap();
        let _waiting = poll.waiting();
        poll.expect(Instant::now(), Duration::from_secs(2));
        let took = timed(poll.on_park());
        drop(other);
        assert!(took < Duration::from_secs(1), "{took:?}");
    }

    /// What is expected later than the bound is not polled for; what is expected within it
    /// is, until then.
    #[test]
    fn an_expectation_is_bounded_and_needs_an_expecting_poller() {
        let poll =
            BusyPoll::expecting(Duration::from_millis(1), Duration::from_millis(40)).unwrap();
        let sent = Instant::now();
        poll.expect(sent, Duration::from_secs(3600));
        assert_eq!(poll.expected(), None);
        poll.expect(sent, Duration::from_millis(30));
        assert_eq!(poll.expected(), Some(sent + Duration::from_millis(30)));
        let _waiting = poll.waiting();
        let took = timed(poll.on_park());
        assert!(took < Duration::from_secs(5), "{took:?}");
        // A poller without `expecting` ignores what is expected.
        let plain = BusyPoll::new(Duration::from_millis(1)).unwrap();
        let _waiting = plain.waiting();
        plain.expect(Instant::now(), Duration::from_secs(3600));
        assert!(timed(plain.on_park()) < Duration::from_secs(5));
        assert!(plain.longest().is_zero());
    }

    /// What `spin_for` waits for: a flag another thread sets `after` from now; `poll(d)`
    /// spins up to `d` for it.
    fn coming(after: Duration) -> (Arc<AtomicBool>, std::thread::JoinHandle<()>) {
        let flag = Arc::new(AtomicBool::new(false));
        let setter = std::thread::spawn({
            let flag = flag.clone();
            move || {
                std::thread::sleep(after);
                flag.store(true, Ordering::Release);
            }
        });
        (flag, setter)
    }

    fn spin_poll(flag: &AtomicBool) -> impl FnMut(Duration) -> bool + '_ {
        move |d| {
            let until = Instant::now() + d;
            loop {
                if flag.load(Ordering::Acquire) {
                    return true;
                }
                if Instant::now() >= until {
                    return false;
                }
                std::hint::spin_loop();
            }
        }
    }

    /// A record that comes after the window is spun for by an expecting poller, up to its
    /// bound and the work it waits for; a plain poller spins for the window only, whatever
    /// the work. The spin's core is never taken here (`kept`): whether it is depends on what
    /// else the machine runs, and a taken core ends the spin (the test below). The tries
    /// allow for the thread that sets the flag being late on a busy machine.
    #[test]
    fn what_is_coming_is_spun_for_past_the_window_up_to_the_bound() {
        let window = Duration::from_millis(1);
        let expecting = BusyPoll::expecting(window, Duration::from_secs(2)).unwrap();
        let came = (0..20).any(|_| {
            let (flag, setter) = coming(Duration::from_millis(20));
            let got =
                expecting.spin_giving_way(Instant::now(), Duration::ZERO, spin_poll(&flag), kept);
            setter.join().unwrap();
            got
        });
        assert!(came, "never spun until it came");

        let plain = BusyPoll::new(window).unwrap();
        let (flag, setter) = coming(Duration::from_millis(500));
        let took = timed(|| {
            assert!(!plain.spin_giving_way(
                Instant::now(),
                Duration::from_secs(2),
                spin_poll(&flag),
                kept
            ))
        });
        setter.join().unwrap();
        assert!(took < Duration::from_millis(400), "{took:?}");

        // Nothing to spin on (`poll` returns at once): no spin past the window either.
        let took =
            timed(|| assert!(!expecting.spin_for(Instant::now(), Duration::ZERO, |_| false)));
        assert!(took < Duration::from_secs(1), "{took:?}");

        // Nothing comes: the spin ends at the bound, not later.
        let bounded = BusyPoll::expecting(window, Duration::from_millis(50)).unwrap();
        let never = AtomicBool::new(false);
        let took = timed(|| {
            assert!(!bounded.spin_giving_way(
                Instant::now(),
                Duration::ZERO,
                spin_poll(&never),
                kept
            ))
        });
        assert!(took < Duration::from_secs(1), "{took:?}");

        // What takes long to make is spun for past `longest`, up to `longest` plus that work,
        // and never `SPIN_MOST` past it, however long the work.
        let short = BusyPoll::expecting(window, Duration::from_millis(5)).unwrap();
        let came = (0..20).any(|_| {
            let (flag, setter) = coming(Duration::from_millis(20));
            let got = short.spin_giving_way(
                Instant::now(),
                Duration::from_millis(40),
                spin_poll(&flag),
                kept,
            );
            setter.join().unwrap();
            got
        });
        assert!(came, "never spun past the bound for the work");
        let took = timed(|| {
            let forever = Duration::from_secs(u64::MAX / 2);
            assert!(!short.spin_giving_way(Instant::now(), forever, spin_poll(&never), kept));
        });
        assert!(took < SPIN_MOST * 20, "{took:?}");
    }

    /// The core is never taken.
    fn kept() -> bool {
        false
    }

    /// Past the window, a spin whose core another thread took ends there, with one last
    /// look; within the window the core is not offered.
    #[test]
    fn a_taken_core_ends_a_spin_past_the_window() {
        let window = Duration::from_millis(20);
        let poll = BusyPoll::expecting(window, Duration::from_secs(30)).unwrap();
        let never = AtomicBool::new(false);
        let mut looks = Vec::new();
        let took = timed(|| {
            let look = |d: Duration| {
                looks.push(d);
                spin_poll(&never)(d)
            };
            assert!(!poll.spin_giving_way(Instant::now(), Duration::ZERO, look, || true));
        });
        assert!(took < Duration::from_secs(5), "{took:?}");
        assert_eq!(looks, [window, Duration::ZERO]);
        // What came meanwhile is found by the last look.
        let came = AtomicBool::new(true);
        let mut first = true;
        let look = |d: Duration| {
            if std::mem::take(&mut first) {
                return spin_poll(&never)(d);
            }
            spin_poll(&came)(d)
        };
        assert!(poll.spin_giving_way(Instant::now(), Duration::ZERO, look, || true));
    }

    /// Past the window, a request on another watched socket (another session's, which this
    /// worker should serve) ends the spin.
    #[test]
    fn other_work_ends_a_spin_past_the_window() {
        let poll = BusyPoll::expecting(Duration::from_millis(1), Duration::from_secs(30)).unwrap();
        let (a, mut b) = UnixStream::pair().unwrap();
        let _w = BusyPoll::watched(Some(&poll), a.as_raw_fd(), (), true);
        b.write_all(b"x").unwrap();
        let never = AtomicBool::new(false);
        let took =
            timed(|| assert!(!poll.spin_for(Instant::now(), Duration::ZERO, spin_poll(&never))));
        assert!(took < Duration::from_secs(5), "{took:?}");
    }

    /// A session whose client sent its last request from the unit's core is not spun for
    /// (the spin would hold the core the client needs), though still awaited; sent from
    /// another core, it is spun for again.
    #[test]
    fn a_session_whose_peer_shares_its_core_is_not_awaited() {
        let cpu = current_cpu();
        assert!(pin(cpu));
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let mut client = std::net::TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (unit, _) = l.accept().unwrap();
        let poll = BusyPoll::new(Duration::from_millis(1)).unwrap();
        let mut w = BusyPoll::watched(Some(&poll), unit.as_raw_fd(), (), true);
        assert_eq!((poll.awaited(), poll.spun_for()), (1, 1));
        client.write_all(b"x").unwrap();
        w.follow_peer();
        assert_eq!(
            (poll.awaited(), poll.spun_for()),
            (1, 0),
            "sent from this core"
        );
        let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
        let Some(other) = (0..cpus).find(|c| *c != cpu) else {
            return;
        };
        let sent = std::thread::spawn(move || {
            pin(other)
                .then(|| client.write_all(b"y").unwrap())
                .is_some()
        });
        if sent.join().unwrap() {
            w.follow_peer();
            assert_eq!(poll.spun_for(), 1, "sent from another core");
        }
    }

    #[test]
    fn without_a_poller_nothing_is_watched() {
        let (a, _b) = UnixStream::pair().unwrap();
        let w = BusyPoll::watched(None, a.as_raw_fd(), (), true);
        assert!(w.watch.is_none() && w._waiting.is_none());
    }

    #[test]
    fn a_socket_the_set_refuses_is_read_unpolled() {
        let poll = BusyPoll::new(Duration::from_millis(1)).unwrap();
        let (a, _b) = UnixStream::pair().unwrap();
        let _first = BusyPoll::watched(Some(&poll), a.as_raw_fd(), (), true);
        // The same descriptor twice: epoll refuses it (EEXIST); no awaited count is left.
        let second = BusyPoll::watched(Some(&poll), a.as_raw_fd(), (), true);
        assert!(second.watch.is_none() && second._waiting.is_none());
        assert_eq!(poll.awaited(), 1);
    }
}
