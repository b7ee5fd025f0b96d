//! The receiving side of a control connection. Answers are read off the socket and handed to
//! their waiters by the connection's reader task, or by a caller itself: one on a thread of
//! its own (`block_on`, as Python's threads call) whose request is the only one its client
//! has in flight waits on the socket instead of for the reader ([`Inbox::answer_here`]).
//!
//! Why: a worker of the runtime, woken by the answer, read it, then woke the caller on the same
//! core and gave the core up to it. That hand-over cost about 12 us of a 4-byte PUT's
//! unpolled round trip of 75 us, where the machine's own cross-core round trip takes 53. The
//! caller waiting on the socket is woken by the answer itself, as a thread blocked in `recv`
//! is.
//!
//! Whoever reads hands out every whole answer read so far, under one lock, so answers of one
//! request (a `Writing` ahead of its answer) reach their waiter in order. The worker is still
//! woken by an answer the caller takes (the socket stays in the runtime's epoll set): it
//! yields its core first when a caller waits there, then finds nothing to read. An answer it
//! reads first reaches the caller through an eventfd that the caller polls beside the socket.

use std::io;
use std::ops::Range;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::time::{Duration, Instant};

use tessera_sync::atomic::{AtomicUsize, Ordering};
use tessera_sync::Mutex;
use tokio::sync::oneshot;

use super::Waiters;
use crate::error::{ClientError, WireError};
use crate::outbox::Direct;
use crate::proto::{self, Response};

/// The longest a caller waits on the socket before it lets the other futures of its
/// `block_on` run (a `select!` beside the request, a timer): it then goes back to waiting.
pub(super) const SLICE: Duration = Duration::from_millis(2);

/// A read end of the connection's socket that the runtime watches (the reader task's).
pub(super) enum ReadHalf {
    Tcp(tokio::net::tcp::OwnedReadHalf),
    Unix(tokio::net::unix::OwnedReadHalf),
}

impl ReadHalf {
    /// Until the runtime saw the socket readable.
    pub(super) async fn readable(&self) -> io::Result<()> {
        match self {
            ReadHalf::Tcp(r) => r.readable().await,
            ReadHalf::Unix(r) => r.readable().await,
        }
    }

    /// A read that does not wait; `WouldBlock` clears the runtime's readiness.
    pub(super) fn try_read(&self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            ReadHalf::Tcp(r) => r.try_read(buf),
            ReadHalf::Unix(r) => r.try_read(buf),
        }
    }
}

/// What the connection has read and not yet handed out: `buf[start..end]`, whole answers
/// first, then the start of the next.
struct Received {
    buf: Vec<u8>,
    start: usize,
    end: usize,
    /// The connection closed or failed, and every waiter was told.
    closed: bool,
}

impl Received {
    /// The body of the next whole answer, if one was read, taken off the buffer.
    fn next(&mut self, max: u64) -> Result<Option<Range<usize>>, WireError> {
        let Some(len) = self.announced(max)? else {
            return Ok(None);
        };
        let body = self.start + proto::LEN_PREFIX;
        if self.end - body < len {
            return Ok(None);
        }
        self.start = body + len;
        Ok(Some(body..body + len))
    }

    /// The body length the next answer's prefix announces, once its prefix was read.
    fn announced(&self, max: u64) -> Result<Option<usize>, WireError> {
        let Some(prefix) = self.buf.get(self.start..self.start + proto::LEN_PREFIX) else {
            return Ok(None);
        };
        if self.end - self.start < proto::LEN_PREFIX {
            return Ok(None);
        }
        let prefix: [u8; proto::LEN_PREFIX] = prefix.try_into().expect("a prefix's length");
        proto::frame_len(prefix, max).map(Some)
    }

    /// Room after `end` for the next read, and for the whole of the answer begun: what was
    /// handed out is dropped from the front; the buffer grows to an answer larger than it,
    /// and goes back to its usual size once such an answer was handed out.
    fn make_room(&mut self, max: u64) -> Result<(), WireError> {
        if self.start == self.end {
            (self.start, self.end) = (0, 0);
            if self.buf.len() > proto::READ_BUFFER {
                self.buf = vec![0; proto::READ_BUFFER];
            }
        }
        let need = match self.announced(max)? {
            Some(len) => proto::LEN_PREFIX + len,
            None => proto::LEN_PREFIX,
        };
        if self.start + need > self.buf.len() || self.end == self.buf.len() {
            self.buf.copy_within(self.start..self.end, 0);
            (self.start, self.end) = (0, self.end - self.start);
            if need > self.buf.len() {
                self.buf.resize(need, 0);
            }
        }
        Ok(())
    }
}

/// What a [`Inbox::pump`] handed out besides reading.
#[derive(Default)]
pub(super) struct Handed {
    /// To a caller on a thread of its own, which may sleep on this thread's core.
    pub(super) to_thread: bool,
    /// To another caller waiting on the socket: it was woken through the eventfd.
    pub(super) to_socket: bool,
    /// What the caller pumping waits for: its answer, or its meta ahead of it.
    mine: bool,
}

pub(super) struct Inbox {
    unit: usize,
    /// The largest answer accepted (`ClientConfig::max_message_bytes`).
    max: u64,
    /// A handle on the socket of its own, valid as long as the inbox, whatever became of the
    /// reader.
    sock: Direct,
    /// Written when an answer was handed to a caller waiting on the socket by someone else.
    wake: OwnedFd,
    /// Callers waiting on the socket now.
    here: AtomicUsize,
    received: Mutex<Received>,
}

impl Inbox {
    /// An inbox over `sock`, one end of a socket pair, for tests.
    #[cfg(test)]
    pub(super) fn over(unit: usize, sock: std::os::unix::net::UnixStream) -> io::Result<Inbox> {
        sock.set_nonblocking(true)?;
        Inbox::new(unit, 64 << 20, Direct::Unix(sock))
    }

    /// The inbox of the socket `sock` is a handle on, whose answers may be up to `max` bytes.
    pub(super) fn new(unit: usize, max: u64, sock: Direct) -> io::Result<Inbox> {
        // SAFETY: eventfd takes no pointers; a non-negative result is a new descriptor that
        // nothing else owns.
        let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `fd` was just opened above and is owned by nothing else.
        let wake = unsafe { OwnedFd::from_raw_fd(fd) };
        Ok(Inbox {
            unit,
            max,
            sock,
            wake,
            here: AtomicUsize::new(0),
            received: Mutex::new(Received {
                buf: vec![0; proto::READ_BUFFER],
                start: 0,
                end: 0,
                closed: false,
            }),
        })
    }

    /// The reader task: hands out answers as the runtime finds the socket readable, until the
    /// connection closes or fails (every waiter is then told).
    pub(super) async fn read_loop(&self, r: &ReadHalf, waiters: Waiters) {
        loop {
            if let Err(e) = r.readable().await {
                self.fail(&waiters, &e.to_string());
                return;
            }
            // The answer woke a caller that waits on the socket as well as this worker, on
            // the same core most likely: it goes first, and reads the answer itself.
            if self.here.load(Ordering::Relaxed) > 0 {
                std::thread::yield_now();
            }
            // Not `WouldBlock` where it stopped at a hand-over: the socket is still readable
            // to the runtime, and the next round reads on.
            let Ok(handed) = self.pump(&waiters, None, |buf| r.try_read(buf)) else {
                return;
            };
            if handed.to_socket {
                self.wake_callers();
            }
            // A caller on a thread of its own may sleep on this thread's core. Woken there,
            // it runs only once this worker stops: after its busy poll's whole window when
            // the caller has used its share of the core (a large PUT's copy: it does not
            // preempt the spin), and after the worker's way to its park otherwise. The core
            // goes to it now instead. (A caller that is a task runs on a worker; yielding for
            // it would hand the core to whatever else waits for it, a large copy under load.)
            if handed.to_thread {
                std::thread::yield_now();
            }
        }
    }

    /// Reads what the socket holds with `read` (until it would block) and hands out every
    /// whole answer: `Err` once the connection closed or failed, every waiter told. `me` is
    /// the request of the caller pumping, if one does: it needs no wake-up, and reads no
    /// further than its answer (the reader reads the rest, if any: the runtime still finds
    /// the socket readable). The reader stops reading too once it handed an answer to a
    /// caller on a thread of its own, which it then yields its core to before it reads on.
    fn pump(
        &self,
        waiters: &Waiters,
        me: Option<u64>,
        mut read: impl FnMut(&mut [u8]) -> io::Result<usize>,
    ) -> Result<Handed, ()> {
        let mut r = self.received.lock();
        if r.closed {
            return Err(());
        }
        let mut handed = Handed::default();
        let why = 'reading: loop {
            loop {
                match r.next(self.max) {
                    Ok(Some(body)) => hand_out(self.unit, waiters, &r.buf[body], me, &mut handed),
                    Ok(None) => break,
                    Err(e) => break 'reading e.to_string(),
                }
            }
            if handed.mine || (me.is_none() && handed.to_thread) {
                return Ok(handed);
            }
            if let Err(e) = r.make_room(self.max) {
                break e.to_string();
            }
            let end = r.end;
            match read(&mut r.buf[end..]) {
                Ok(0) => break "connection closed".to_owned(),
                Ok(n) => r.end += n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(handed),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => break e.to_string(),
            }
        };
        self.fail_locked(&mut r, waiters, &why);
        Err(())
    }

    fn fail(&self, waiters: &Waiters, why: &str) {
        let mut r = self.received.lock();
        self.fail_locked(&mut r, waiters, why);
    }

    /// Closes the inbox and tells every waiter, now and later, that the connection is gone.
    fn fail_locked(&self, r: &mut Received, waiters: &Waiters, why: &str) {
        r.closed = true;
        let mut pending = waiters.lock();
        pending.closed = true;
        let mut to_socket = false;
        for (_, w) in pending.map.drain() {
            to_socket |= w.here;
            let _ = w.tx.send(Err(ClientError::Io {
                unit: self.unit,
                source: io::Error::new(io::ErrorKind::ConnectionAborted, why.to_owned()),
            }));
        }
        drop(pending);
        if to_socket {
            self.wake_callers();
        }
    }

    fn wake_callers(&self) {
        let one = 1u64.to_ne_bytes();
        // SAFETY: writes 8 bytes from a live array to the eventfd this inbox owns. A full
        // counter (it would take 2^64 wake-ups unread) fails harmlessly.
        unsafe { libc::write(self.wake.as_raw_fd(), one.as_ptr().cast(), one.len()) };
    }

    /// Empties the eventfd's counter.
    fn woken(&self) {
        let mut count = [0u8; 8];
        // SAFETY: reads at most 8 bytes into a live array from the eventfd this inbox owns;
        // non-blocking, so an empty counter returns at once.
        unsafe {
            libc::read(
                self.wake.as_raw_fd(),
                count.as_mut_ptr().cast(),
                count.len(),
            )
        };
    }

    /// What request `id` waits for on `rx` (its answer, or the meta sent ahead of it), read
    /// off the socket by this caller: `Some(None)` when its sender went away. Waits until
    /// `until` at most (a [`SLICE`] from now), and not past `deadline`; `Err` gives `rx` back,
    /// for the caller to wait again or as a future.
    pub(super) fn answer_here<T>(
        &self,
        waiters: &Waiters,
        id: u64,
        mut rx: oneshot::Receiver<T>,
        until: Instant,
        deadline: Instant,
    ) -> Result<Option<Option<T>>, Here<T>> {
        match waiters.lock().map.get_mut(&id) {
            Some(w) => w.here = true,
            // Taken out by the reader, which is handing the answer over now.
            None => return Err(Here::Handed(rx)),
        }
        self.here.fetch_add(1, Ordering::Relaxed);
        let answer = loop {
            match rx.try_recv() {
                Ok(a) => break Ok(Some(Some(a))),
                Err(oneshot::error::TryRecvError::Closed) => break Ok(Some(None)),
                Err(oneshot::error::TryRecvError::Empty) => {}
            }
            let now = Instant::now();
            if now >= deadline {
                break Err(Here::Past(rx));
            }
            let until = until.min(deadline);
            if now >= until {
                break Err(Here::Slice(rx));
            }
            // At once when the socket holds something; otherwise until it does, someone else
            // handed this answer over, or the slice is over.
            if self.wait(until - now) {
                // On `Err` every waiter, this one too, was told: the answer is on `rx`. An
                // answer read for another caller waiting here wakes it.
                let pumped = self.pump(waiters, Some(id), |buf| self.sock.read(buf));
                if pumped.is_ok_and(|h| h.to_socket) {
                    self.wake_callers();
                }
            }
        };
        self.here.fetch_sub(1, Ordering::Relaxed);
        if let Some(w) = waiters.lock().map.get_mut(&id) {
            w.here = false;
        }
        answer
    }

    /// Sleeps until the socket is readable (then true), a wake-up came, or `most` passed.
    fn wait(&self, most: Duration) -> bool {
        let mut fds = [
            libc::pollfd {
                fd: self.sock.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
            libc::pollfd {
                fd: self.wake.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
        ];
        let ts = libc::timespec {
            tv_sec: most.as_secs() as libc::time_t,
            tv_nsec: most.subsec_nanos() as libc::c_long,
        };
        // SAFETY: `fds` and `ts` are live for the call and sized as passed; both descriptors
        // are owned by this inbox. An interrupted or failed wait returns to the caller's
        // loop, which reads, checks the time and waits again.
        let n = unsafe { libc::ppoll(fds.as_mut_ptr(), 2, &ts, std::ptr::null()) };
        if n > 0 && fds[1].revents != 0 {
            self.woken();
        }
        n > 0 && fds[0].revents != 0
    }
}

/// Where a request's answer comes.
pub(super) type Answered = oneshot::Receiver<Result<Response, ClientError>>;

/// Why a caller's wait on the socket ended without what it waits for (on a receiver of `T`).
pub(super) enum Here<T> {
    /// Its [`SLICE`] is over: the other futures of its `block_on` run, then it may wait again.
    Slice(oneshot::Receiver<T>),
    /// Its deadline passed.
    Past(oneshot::Receiver<T>),
    /// The reader is handing its answer over: it waits for it as a future.
    Handed(oneshot::Receiver<T>),
}

impl<T> Here<T> {
    /// The receiver given back.
    pub(super) fn rx(self) -> oneshot::Receiver<T> {
        match self {
            Here::Slice(rx) | Here::Past(rx) | Here::Handed(rx) => rx,
        }
    }
}

/// Hands answer `body` to its waiter.
fn hand_out(unit: usize, waiters: &Waiters, body: &[u8], me: Option<u64>, handed: &mut Handed) {
    let (id, answer) = match proto::decode_body::<Response>(body) {
        Ok((id, resp)) => (id, Ok(resp)),
        Err((id, e)) => (id, Err(ClientError::Wire { unit, source: e })),
    };
    let mut note = |from_thread: bool, here: bool| {
        handed.to_thread |= from_thread;
        handed.to_socket |= here && me != Some(id);
    };
    let answer = match answer {
        // Ahead of the answer: the waiter stays for it. A waiter that expects nothing ahead
        // gets nothing (a unit's mistake), and its answer says what happened.
        Ok(Response::Writing { meta }) => {
            let ahead = waiters
                .lock()
                .map
                .get_mut(&id)
                .and_then(|w| Some((w.ahead.take()?, w.from_thread, w.here)));
            if let Some((tx, from_thread, here)) = ahead {
                let _ = tx.send(meta);
                note(from_thread, here);
                // A caller reading the socket for its meta has it: it reads no further.
                handed.mine |= me == Some(id);
            }
            return;
        }
        other => other,
    };
    // The waiter is taken out before it is woken: the caller, woken on this thread's core,
    // must not find the map still locked when it sends its next request.
    let waiter = {
        let mut p = waiters.lock();
        let w = p.map.remove(&id);
        if let Some((key, sent)) = w.as_ref().and_then(|w| w.timed) {
            p.timings.answered(key, sent.elapsed());
        }
        w
    };
    if let Some(w) = waiter {
        let _ = w.tx.send(answer);
        // A caller waiting for a meta ahead (none came) is woken now and finds the answer.
        drop(w.ahead);
        note(w.from_thread, w.here);
        handed.mine |= me == Some(id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::client::conn::{Pending, Waiter};
    use serde_bytes::ByteBuf;
    use std::io::Write;
    use std::os::unix::net::UnixStream;
    use tessera_sync::Arc;

    /// An inbox over one end of a socket pair (the unit's end is returned beside it), and
    /// waiters for requests `ids`.
    fn inbox(ids: &[u64]) -> (Inbox, UnixStream, Waiters, Vec<Answered>) {
        let (ours, theirs) = UnixStream::pair().unwrap();
        let inbox = Inbox::over(0, ours).unwrap();
        let waiters: Waiters = Arc::new(Mutex::new(Pending::default()));
        let rxs = ids
            .iter()
            .map(|&id| {
                let (tx, rx) = oneshot::channel();
                waiters.lock().map.insert(
                    id,
                    Waiter {
                        tx,
                        from_thread: true,
                        ahead: None,
                        timed: None,
                        here: false,
                    },
                );
                rx
            })
            .collect();
        (inbox, theirs, waiters, rxs)
    }

    fn frame(id: u64, resp: &Response) -> Vec<u8> {
        proto::encode_frame(id, resp).unwrap()
    }

    /// A challenge of `n` bytes: an answer of about that size.
    fn big(n: usize) -> Response {
        Response::Challenge {
            nonce: ByteBuf::from(vec![7; n]),
            proof: ByteBuf::new(),
        }
    }

    /// As the reader pumps: again after each hand-over to a caller's thread, until the socket
    /// would block.
    fn pump(inbox: &Inbox, waiters: &Waiters) -> Result<(), ()> {
        while inbox
            .pump(waiters, None, |buf| inbox.sock.read(buf))?
            .to_thread
        {}
        Ok(())
    }

    /// Answers cut anywhere by the socket (one byte at a time, several in one read, one
    /// larger than the buffer between small ones) reach their waiters whole; the buffer
    /// goes back to its usual size after the large one.
    #[test]
    fn answers_however_cut_reach_their_waiters() {
        let (inbox, mut unit, waiters, mut rxs) = inbox(&[1, 2, 3, 4]);
        let large = big(3 * proto::READ_BUFFER);
        let mut bytes = frame(1, &Response::Done);
        bytes.extend(frame(2, &large));
        bytes.extend(frame(3, &Response::GetDone));
        bytes.extend(frame(4, &Response::Done));
        let (first, rest) = bytes.split_at(7);
        for b in first {
            unit.write_all(&[*b]).unwrap();
            pump(&inbox, &waiters).unwrap();
        }
        assert!(rxs[0].try_recv().is_err(), "not whole yet");
        for chunk in rest.chunks(5000) {
            unit.write_all(chunk).unwrap();
            pump(&inbox, &waiters).unwrap();
        }
        let got: Vec<Response> = rxs
            .iter_mut()
            .map(|rx| rx.try_recv().unwrap().unwrap())
            .collect();
        assert_eq!(
            got,
            [Response::Done, large, Response::GetDone, Response::Done]
        );
        assert!(waiters.lock().map.is_empty());
        assert_eq!(inbox.received.lock().buf.len(), proto::READ_BUFFER);
    }

    /// An answer announcing more than the limit, or a connection closed, fails every waiter
    /// and closes the inbox for later ones.
    #[test]
    fn a_prefix_past_the_limit_or_a_close_fails_every_waiter() {
        for close in [false, true] {
            let (inbox, mut unit, waiters, mut rxs) = inbox(&[1, 2]);
            let mut bytes = frame(1, &Response::Done);
            if close {
                bytes.extend(&frame(2, &Response::Done)[..6]);
            } else {
                bytes.extend((65u32 << 20).to_le_bytes());
            }
            unit.write_all(&bytes).unwrap();
            if close {
                drop(unit);
            }
            assert!(pump(&inbox, &waiters).is_err());
            assert_eq!(rxs[0].try_recv().unwrap().unwrap(), Response::Done);
            let e = rxs[1].try_recv().unwrap().unwrap_err();
            assert!(matches!(e, ClientError::Io { .. }), "{e:?}");
            assert!(waiters.lock().closed);
            assert!(pump(&inbox, &waiters).is_err());
        }
    }

    /// A caller waiting for the meta sent ahead of its answer reads it off the socket too; the
    /// answer that follows is read when the caller waits for that.
    #[test]
    fn a_caller_reads_the_meta_ahead_of_its_answer_off_the_socket() {
        let (inbox, mut unit, waiters, mut rxs) = inbox(&[4]);
        let (tx, ahead) = oneshot::channel();
        waiters.lock().map.get_mut(&4).unwrap().ahead = Some(tx);
        let meta = ByteBuf::from(vec![3u8; 40]);
        let writer = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(20));
            let writing = Response::Writing { meta: meta.clone() };
            unit.write_all(&frame(4, &writing)).unwrap();
            std::thread::sleep(Duration::from_millis(20));
            unit.write_all(&frame(4, &Response::GetDone)).unwrap();
            (unit, meta)
        });
        let far = Instant::now() + Duration::from_secs(60);
        let got = inbox.answer_here(&waiters, 4, ahead, far, far);
        let Ok(Some(Some(got))) = got else {
            panic!("no meta read");
        };
        assert!(rxs[0].try_recv().is_err(), "the answer came later");
        let got_answer = inbox.answer_here(&waiters, 4, rxs.remove(0), far, far);
        assert!(matches!(got_answer, Ok(Some(Some(Ok(Response::GetDone))))));
        let (_unit, meta) = writer.join().unwrap();
        assert_eq!(got, meta);
        assert!(waiters.lock().map.is_empty());
    }

    /// A caller reads its own answer off the socket: no reader runs here. Answers to others
    /// read with it are handed to them.
    #[test]
    fn a_caller_reads_its_answer_off_the_socket() {
        let (inbox, mut unit, waiters, mut rxs) = inbox(&[1, 2, 3]);
        let mine = rxs.remove(1);
        let writer = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(20));
            let mut bytes = frame(1, &Response::GetDone);
            bytes.extend(frame(2, &Response::Done));
            bytes.extend(frame(3, &Response::Done));
            unit.write_all(&bytes).unwrap();
            unit
        });
        let far = Instant::now() + Duration::from_secs(60);
        let got = inbox.answer_here(&waiters, 2, mine, far, far);
        let Ok(Some(Some(Ok(resp)))) = got else {
            panic!("no answer read");
        };
        assert_eq!(resp, Response::Done);
        assert_eq!(rxs[0].try_recv().unwrap().unwrap(), Response::GetDone);
        assert_eq!(rxs[1].try_recv().unwrap().unwrap(), Response::Done);
        assert_eq!(inbox.here.load(Ordering::Relaxed), 0);
        drop(writer.join().unwrap());
    }

    /// A caller waiting on the socket whose answer someone else read and handed over (the
    /// reader, first to run) is woken through the eventfd: nothing comes on the socket.
    #[test]
    fn a_caller_is_woken_when_its_answer_is_handed_over() {
        let (inbox, unit, waiters, mut rxs) = inbox(&[5]);
        let inbox = Arc::new(inbox);
        let mine = rxs.remove(0);
        let far = Instant::now() + Duration::from_secs(60);
        let caller = {
            let (inbox, waiters) = (inbox.clone(), waiters.clone());
            std::thread::spawn(move || inbox.answer_here(&waiters, 5, mine, far, far).is_ok())
        };
        // The reader hands it over once the caller waits on the socket.
        while !waiters.lock().map[&5].here {
            std::thread::yield_now();
        }
        let body = frame(5, &Response::Done);
        let mut handed = Handed::default();
        hand_out(0, &waiters, &body[proto::LEN_PREFIX..], None, &mut handed);
        assert!(handed.to_socket && handed.to_thread);
        inbox.wake_callers();
        assert!(caller.join().unwrap(), "the caller did not find its answer");
        drop(unit);
    }

    /// A caller whose slice ends without an answer gets its receiver back, and is no longer
    /// counted as waiting on the socket.
    #[test]
    fn a_slice_without_an_answer_gives_the_receiver_back() {
        let (inbox, _unit, waiters, mut rxs) = inbox(&[9]);
        let now = Instant::now();
        let far = now + Duration::from_secs(60);
        let got = inbox.answer_here(&waiters, 9, rxs.remove(0), now + SLICE, far);
        assert!(matches!(got, Err(Here::Slice(_))));
        let got = inbox.answer_here(&waiters, 9, got.err().map(Here::rx).unwrap(), far, now);
        assert!(matches!(got, Err(Here::Past(_))));
        assert!(!waiters.lock().map[&9].here);
        assert_eq!(inbox.here.load(Ordering::Relaxed), 0);
    }
}
