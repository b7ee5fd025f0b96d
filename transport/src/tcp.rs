//! `tcp`: agents on different hosts, one-sided WRITE and READ carried over TCP.
//!
//! Each agent owns a small tokio runtime (one worker thread) that accepts peers and drives its
//! connections; nothing needs the caller's runtime, and the public calls never block on it.
//! One persistent connection carries every transfer an initiator sends to a target, pipelined.
//!
//! Request (initiator → target): a 24-byte header (kind, op, notification flag, descriptor
//! count, notification length, transfer id), the descriptors (24 bytes each: registration,
//! offset, length), the notification, and for a WRITE the payload. The payload is sent with
//! vectored writes straight from the registered ranges. The target validates and pins every
//! descriptor against its live registrations *before* reading the payload, then reads it
//! straight into the pinned ranges; a refused WRITE's payload is drained into a scratch buffer
//! and never lands. Response (target → initiator): a 16-byte header (status, reason, transfer
//! id), followed for a READ by the payload, read straight into the local ranges.
//!
//! Header, descriptor and grant buffers are reused, so a steady stream of transfers allocates
//! nothing in the engine; the only per-transfer allocation is the transfer handle's state.

use std::collections::VecDeque;
use std::io::{self, IoSlice, IoSliceMut};
use std::net::{SocketAddr, ToSocketAddrs};
use std::os::fd::AsRawFd;
use std::sync::OnceLock;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch};

use crate::agent::MAX_NOTIFICATION;
use crate::backend::{Connection, Grant, Host, Op, PeerInfo, RegInfo, Transport, Xfer};
use crate::error::{BackendError, RegisterError, RejectReason, TransferError};
use crate::sync::{lock, Arc, AtomicBool, Mutex, Ordering, Weak};

const KIND: &str = "tcp";
const REQ_HEADER: usize = 24;
const RESP_HEADER: usize = 16;
const KIND_XFER: u8 = 1;
const KIND_NOTIFY: u8 = 2;
const KIND_HELLO: u8 = 3;
/// Most descriptors in one request.
const MAX_DESCS: usize = 1 << 22;
/// Slices per vectored system call.
const IOV_BATCH: usize = 64;
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// A peer that stops acknowledging data (a dead host, a partition) fails the connection after
/// this long, rather than leaving transfers pending forever.
const USER_TIMEOUT: Duration = Duration::from_secs(30);
/// Keepalive probes: first after this much idleness, then every `KEEPALIVE_INTERVAL`, giving
/// up after `KEEPALIVE_PROBES` unanswered ones.
const KEEPALIVE_IDLE: Duration = Duration::from_secs(10);
const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(2);
const KEEPALIVE_PROBES: i32 = 5;

/// Bounds how long a silent peer can hold a connection: keepalive while idle, and
/// `TCP_USER_TIMEOUT` while data is unacknowledged.
fn harden(fd: std::os::fd::RawFd) {
    let set = |level: libc::c_int, name: libc::c_int, value: libc::c_int| {
        // SAFETY: `fd` is an open socket owned by the caller; the option value is a c_int
        // that lives across the call, with its size passed alongside.
        unsafe {
            libc::setsockopt(
                fd,
                level,
                name,
                (&value as *const libc::c_int).cast(),
                size_of::<libc::c_int>() as libc::socklen_t,
            )
        }
    };
    set(libc::SOL_SOCKET, libc::SO_KEEPALIVE, 1);
    set(
        libc::IPPROTO_TCP,
        libc::TCP_KEEPIDLE,
        KEEPALIVE_IDLE.as_secs() as libc::c_int,
    );
    set(
        libc::IPPROTO_TCP,
        libc::TCP_KEEPINTVL,
        KEEPALIVE_INTERVAL.as_secs() as libc::c_int,
    );
    set(libc::IPPROTO_TCP, libc::TCP_KEEPCNT, KEEPALIVE_PROBES);
    set(
        libc::IPPROTO_TCP,
        libc::TCP_USER_TIMEOUT,
        USER_TIMEOUT.as_millis() as libc::c_int,
    );
}

/// The TCP backend.
pub struct Tcp {
    inner: Arc<Inner>,
}

struct Inner {
    bind: SocketAddr,
    advertise: OnceLock<SocketAddr>,
    local: OnceLock<SocketAddr>,
    name: OnceLock<String>,
    runtime: Mutex<Option<tokio::runtime::Runtime>>,
    handle: OnceLock<tokio::runtime::Handle>,
    stop: watch::Sender<bool>,
    closed: AtomicBool,
    conns: Mutex<Vec<Weak<Shared>>>,
}

impl Tcp {
    /// An engine listening on 127.0.0.1 at a port the OS picks.
    pub fn new() -> Self {
        Self::bind(SocketAddr::from(([127, 0, 0, 1], 0)))
    }

    /// An engine listening on `addr`; peers reach it at its bound address (see
    /// [`Tcp::advertise`] when binding a wildcard address).
    pub fn bind(addr: SocketAddr) -> Self {
        Self {
            inner: Arc::new(Inner {
                bind: addr,
                advertise: OnceLock::new(),
                local: OnceLock::new(),
                name: OnceLock::new(),
                runtime: Mutex::new(None),
                handle: OnceLock::new(),
                stop: watch::channel(false).0,
                closed: AtomicBool::new(false),
                conns: Mutex::new(Vec::new()),
            }),
        }
    }

    /// Announces `addr` to peers instead of the bound address (its port 0 means "the bound
    /// port").
    pub fn advertise(self, addr: SocketAddr) -> Self {
        let _ = self.inner.advertise.set(addr);
        self
    }

    /// The address the engine listens on, once started.
    pub fn local_addr(&self) -> Option<SocketAddr> {
        self.inner.local.get().copied()
    }
}

impl Default for Tcp {
    fn default() -> Self {
        Self::new()
    }
}

impl std::fmt::Debug for Tcp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tcp")
            .field("local", &self.local_addr())
            .finish()
    }
}

fn backend(e: impl std::fmt::Display) -> BackendError {
    BackendError::new(KIND, e)
}

impl Transport for Tcp {
    fn kind(&self) -> &'static str {
        KIND
    }

    fn start(&self, host: Host) -> Result<(), BackendError> {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("tessera-tcp")
            .enable_io()
            .enable_time()
            .build()
            .map_err(backend)?;
        let std_listener = std::net::TcpListener::bind(self.inner.bind).map_err(backend)?;
        std_listener.set_nonblocking(true).map_err(backend)?;
        let local = std_listener.local_addr().map_err(backend)?;
        let _ = self.inner.local.set(local);
        let listener = {
            let _guard = rt.enter();
            TcpListener::from_std(std_listener).map_err(backend)?
        };
        let _ = self.inner.handle.set(rt.handle().clone());
        let _ = self.inner.name.set(host.name().to_owned());
        rt.spawn(accept_loop(listener, host, self.inner.stop.subscribe()));
        *lock(&self.inner.runtime) = Some(rt);
        Ok(())
    }

    fn register(&self, _: &RegInfo<'_>) -> Result<Vec<u8>, RegisterError> {
        Ok(Vec::new())
    }

    fn deregister(&self, _: u64) {}

    fn address(&self) -> Vec<u8> {
        let local = self.local_addr();
        let addr = match (self.inner.advertise.get().copied(), local) {
            (Some(mut a), Some(l)) => {
                if a.port() == 0 {
                    a.set_port(l.port());
                }
                a
            }
            (Some(a), None) => a,
            (None, Some(l)) => l,
            (None, None) => return Vec::new(),
        };
        addr.to_string().into_bytes()
    }

    fn connect(&self, peer: &PeerInfo) -> Result<Arc<dyn Connection>, BackendError> {
        let text = std::str::from_utf8(&peer.address).map_err(|_| backend("malformed address"))?;
        let addr = text
            .to_socket_addrs()
            .map_err(backend)?
            .next()
            .ok_or_else(|| backend("no address"))?;
        let handle = self
            .inner
            .handle
            .get()
            .cloned()
            .ok_or_else(|| backend("not started"))?;
        if self.inner.closed.load(Ordering::Acquire) {
            return Err(backend("shut down"));
        }
        let std_stream = std::net::TcpStream::connect_timeout(&addr, CONNECT_TIMEOUT)
            .map_err(|e| backend(format!("connecting to {} at {addr}: {e}", peer.name)))?;
        std_stream.set_nodelay(true).map_err(backend)?;
        harden(std_stream.as_raw_fd());
        let me = self
            .inner
            .name
            .get()
            .ok_or_else(|| backend("not started"))?;
        let mut hello = [0u8; REQ_HEADER].to_vec();
        hello[0] = KIND_HELLO;
        hello[1] = Op::Write.code();
        hello[8..12].copy_from_slice(&(me.len() as u32).to_le_bytes());
        hello.extend_from_slice(me.as_bytes());
        io::Write::write_all(&mut &std_stream, &hello).map_err(backend)?;
        std_stream.set_nonblocking(true).map_err(backend)?;
        let stream = {
            let _guard = handle.enter();
            TcpStream::from_std(std_stream).map_err(backend)?
        };
        let (rd, wr) = stream.into_split();
        let (tx, rx) = mpsc::unbounded_channel();
        let shared = Arc::new(Shared {
            peer: peer.name.clone(),
            pending: Mutex::new(VecDeque::new()),
            dead: Mutex::new(None),
        });
        {
            let mut conns = lock(&self.inner.conns);
            conns.retain(|w| w.strong_count() > 0);
            conns.push(Arc::downgrade(&shared));
        }
        handle.spawn(send_loop(
            wr,
            rx,
            shared.clone(),
            self.inner.stop.subscribe(),
        ));
        handle.spawn(recv_loop(rd, shared.clone(), self.inner.stop.subscribe()));
        Ok(Arc::new(TcpConnection {
            tx: Mutex::new(Some(tx)),
            shared,
        }))
    }

    fn shutdown(&self) {
        if self.inner.closed.swap(true, Ordering::AcqRel) {
            return;
        }
        let _ = self.inner.stop.send(true);
        if let Some(rt) = lock(&self.inner.runtime).take() {
            rt.shutdown_background();
        }
        let conns = std::mem::take(&mut *lock(&self.inner.conns));
        for c in conns.iter().filter_map(Weak::upgrade) {
            c.die("the agent shut down");
        }
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        if let Some(rt) = lock(&self.runtime).take() {
            rt.shutdown_background();
        }
    }
}

/// State an initiator connection shares between its tasks and its handle.
struct Shared {
    peer: String,
    /// Requests written (or being written), oldest first; responses come back in this order.
    pending: Mutex<VecDeque<Xfer>>,
    dead: Mutex<Option<String>>,
}

impl Shared {
    fn gone(&self, detail: &str) -> TransferError {
        TransferError::PeerGone {
            peer: self.peer.clone(),
            detail: detail.to_owned(),
        }
    }

    fn die(&self, why: &str) {
        lock(&self.dead).get_or_insert_with(|| why.to_owned());
        let pending: Vec<Xfer> = lock(&self.pending).drain(..).collect();
        for x in pending {
            x.done.complete(Err(self.gone(why)));
        }
    }

    fn dead(&self) -> Option<String> {
        lock(&self.dead).clone()
    }
}

struct TcpConnection {
    tx: Mutex<Option<mpsc::UnboundedSender<Xfer>>>,
    shared: Arc<Shared>,
}

impl Connection for TcpConnection {
    fn post(&self, xfer: Xfer) {
        if let Some(why) = self.shared.dead() {
            xfer.done.complete(Err(self.shared.gone(&why)));
            return;
        }
        let tx = lock(&self.tx).clone();
        let refused = match tx {
            Some(tx) => tx.send(xfer).err().map(|e| e.0),
            None => Some(xfer),
        };
        if let Some(xfer) = refused {
            let why = self
                .shared
                .dead()
                .unwrap_or_else(|| "connection closed".into());
            xfer.done.complete(Err(self.shared.gone(&why)));
        }
    }

    fn close(&self) {
        // Dropping the sender ends the send loop, which closes the write half; the target
        // then closes its side and the receive loop ends.
        lock(&self.tx).take();
    }
}

// ----- vectored I/O straight from and into registered ranges -------------------------------

/// Position in a list of (address, length) spans.
#[derive(Default)]
struct Cursor {
    span: usize,
    offset: u64,
}

impl Cursor {
    fn advance(&mut self, spans: &[(usize, u64)], mut n: usize) {
        while n > 0 && self.span < spans.len() {
            let rest = spans[self.span].1 - self.offset;
            if (n as u64) < rest {
                self.offset += n as u64;
                return;
            }
            n -= rest as usize;
            self.span += 1;
            self.offset = 0;
        }
    }

    fn done(&self, spans: &[(usize, u64)]) -> bool {
        self.span >= spans.len()
    }
}

/// Largest slice handed to one system call entry (the kernel caps a call near 2 GiB anyway).
const MAX_IOV: u64 = 1 << 30;

/// Writes every span, in order, with vectored writes.
///
/// # Safety
/// Each span must be readable for its length until this returns (it lies in a pinned
/// registration).
async unsafe fn write_spans(w: &OwnedWriteHalf, spans: &[(usize, u64)]) -> io::Result<()> {
    let mut cur = Cursor::default();
    while !cur.done(spans) {
        w.writable().await?;
        let result = {
            let mut bufs: [IoSlice<'_>; IOV_BATCH] = std::array::from_fn(|_| IoSlice::new(&[]));
            let mut k = 0;
            let (mut j, mut off) = (cur.span, cur.offset);
            while k < IOV_BATCH && j < spans.len() {
                let (addr, len) = spans[j];
                let chunk = (len - off).min(MAX_IOV);
                // SAFETY: the caller promises the span is readable; `off + chunk <= len`.
                bufs[k] = IoSlice::new(unsafe {
                    std::slice::from_raw_parts((addr + off as usize) as *const u8, chunk as usize)
                });
                k += 1;
                if off + chunk < len {
                    break;
                }
                j += 1;
                off = 0;
            }
            w.try_write_vectored(&bufs[..k])
        };
        match result {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => cur.advance(spans, n),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Reads into every span, in order, with vectored reads.
///
/// # Safety
/// Each span must be writable for its length until this returns and not be accessed through
/// references meanwhile (it lies in a pinned registration).
async unsafe fn read_spans(r: &OwnedReadHalf, spans: &[(usize, u64)]) -> io::Result<()> {
    let mut cur = Cursor::default();
    while !cur.done(spans) {
        r.readable().await?;
        let result = {
            let mut bufs: [IoSliceMut<'_>; IOV_BATCH] =
                std::array::from_fn(|_| IoSliceMut::new(&mut []));
            let mut k = 0;
            let (mut j, mut off) = (cur.span, cur.offset);
            while k < IOV_BATCH && j < spans.len() {
                let (addr, len) = spans[j];
                let chunk = (len - off).min(MAX_IOV);
                // SAFETY: the caller promises the span is writable and unaliased;
                // `off + chunk <= len`, and the spans of one transfer do not overlap the ones
                // built in this batch more than the caller's descriptors do.
                bufs[k] = IoSliceMut::new(unsafe {
                    std::slice::from_raw_parts_mut((addr + off as usize) as *mut u8, chunk as usize)
                });
                k += 1;
                if off + chunk < len {
                    break;
                }
                j += 1;
                off = 0;
            }
            r.try_read_vectored(&mut bufs[..k])
        };
        match result {
            Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => cur.advance(spans, n),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

// ----- initiator ---------------------------------------------------------------------------

async fn send_loop(
    mut w: OwnedWriteHalf,
    mut rx: mpsc::UnboundedReceiver<Xfer>,
    shared: Arc<Shared>,
    mut stop: watch::Receiver<bool>,
) {
    let mut head = Vec::with_capacity(4096);
    let mut spans: Vec<(usize, u64)> = Vec::new();
    loop {
        let xfer = tokio::select! {
            x = rx.recv() => match x {
                Some(x) => x,
                None => break,
            },
            _ = stop.changed() => break,
        };
        let plan = xfer.plan();
        let segs = plan.segments();
        let notify = xfer.notify.as_deref();
        head.clear();
        head.push(if segs.is_empty() {
            KIND_NOTIFY
        } else {
            KIND_XFER
        });
        head.push(plan.op().code());
        head.push(u8::from(notify.is_some()));
        head.push(0);
        head.extend_from_slice(&(segs.len() as u32).to_le_bytes());
        head.extend_from_slice(&(notify.map_or(0, <[u8]>::len) as u32).to_le_bytes());
        head.extend_from_slice(&0u32.to_le_bytes());
        head.extend_from_slice(&0u64.to_le_bytes());
        for s in segs {
            head.extend_from_slice(&s.remote_reg.to_le_bytes());
            head.extend_from_slice(&s.remote_offset.to_le_bytes());
            head.extend_from_slice(&s.len.to_le_bytes());
        }
        head.extend_from_slice(notify.unwrap_or_default());
        spans.clear();
        let is_write = plan.op() == Op::Write;
        if is_write {
            spans.extend(segs.iter().map(|s| (s.local_ptr() as usize, s.len)));
        }
        // Hold the plan while its payload is written: if the connection fails meanwhile, the
        // receive loop completes the transfer, and the memory must stay pinned until the
        // write call has returned.
        let keep = is_write.then(|| xfer.done.plan_handle());
        // Queue before writing: the response may come back before the write call returns.
        lock(&shared.pending).push_back(xfer);
        // If the receive loop already failed, nobody will answer: fail what is queued. (`die`
        // marks the connection dead before draining, so either it drained this transfer or
        // this check sees the mark.)
        if let Some(why) = shared.dead() {
            shared.die(&why);
            break;
        }
        let mut sent = w.write_all(&head).await;
        if sent.is_ok() && is_write {
            // SAFETY: the spans lie in local registrations pinned by the plan that `keep`
            // holds until the write has returned.
            sent = unsafe { write_spans(&w, &spans) }.await;
        }
        drop(keep);
        if let Err(e) = sent {
            shared.die(&format!("sending a request: {e}"));
            break;
        }
    }
    rx.close();
    let why = shared.dead().unwrap_or_else(|| "connection closed".into());
    while let Ok(x) = rx.try_recv() {
        x.done.complete(Err(shared.gone(&why)));
    }
    let _ = w.shutdown().await;
}

async fn recv_loop(mut r: OwnedReadHalf, shared: Arc<Shared>, mut stop: watch::Receiver<bool>) {
    let mut head = [0u8; RESP_HEADER];
    let mut spans: Vec<(usize, u64)> = Vec::new();
    let why = loop {
        let got = tokio::select! {
            g = r.read_exact(&mut head) => g,
            _ = stop.changed() => break "the agent shut down".to_owned(),
        };
        if let Err(e) = got {
            break if e.kind() == io::ErrorKind::UnexpectedEof {
                "connection closed".to_owned()
            } else {
                format!("connection failed: {e}")
            };
        }
        let Some(xfer) = lock(&shared.pending).pop_front() else {
            break "a response without a request".to_owned();
        };
        let (status, reason) = (head[0], head[1]);
        if status != 0 {
            xfer.done.complete(Err(TransferError::Rejected {
                peer: shared.peer.clone(),
                reason: RejectReason::from_code(reason),
            }));
            continue;
        }
        if xfer.plan().op() == Op::Read {
            spans.clear();
            spans.extend(
                xfer.plan()
                    .segments()
                    .iter()
                    .map(|s| (s.local_ptr() as usize, s.len)),
            );
            // SAFETY: the spans lie in local registrations pinned by this transfer's plan,
            // which `xfer` owns until it is completed below.
            let read = unsafe { read_spans(&r, &spans) }.await;
            if let Err(e) = read {
                let why = format!("receiving a payload: {e}");
                xfer.done.complete(Err(shared.gone(&why)));
                break why;
            }
        }
        xfer.done.complete(Ok(()));
    };
    shared.die(&why);
}

// ----- target ------------------------------------------------------------------------------

async fn accept_loop(listener: TcpListener, host: Host, mut stop: watch::Receiver<bool>) {
    loop {
        let accepted = tokio::select! {
            a = listener.accept() => a,
            _ = stop.changed() => return,
        };
        let Ok((stream, _)) = accepted else {
            continue;
        };
        let _ = stream.set_nodelay(true);
        harden(stream.as_raw_fd());
        tokio::spawn(serve(stream, host.clone(), stop.clone()));
    }
}

async fn serve(stream: TcpStream, host: Host, mut stop: watch::Receiver<bool>) {
    let (mut r, mut w) = stream.into_split();
    let mut head = [0u8; REQ_HEADER];
    let mut descs: Vec<u8> = Vec::new();
    let mut note: Vec<u8> = Vec::new();
    let mut grant = Grant::new();
    let mut spans: Vec<(usize, u64)> = Vec::new();
    let mut scratch: Vec<u8> = Vec::new();
    let mut peer = String::new();
    loop {
        let got = tokio::select! {
            g = r.read_exact(&mut head) => g,
            _ = stop.changed() => break,
        };
        if got.is_err() {
            break;
        }
        let (kind, op, has_note) = (head[0], head[1], head[2] != 0);
        let n = u32::from_le_bytes([head[4], head[5], head[6], head[7]]) as usize;
        let note_len = u32::from_le_bytes([head[8], head[9], head[10], head[11]]) as usize;
        let Some(op) = Op::from_code(op) else { break };
        if n > MAX_DESCS || note_len > MAX_NOTIFICATION || !(KIND_XFER..=KIND_HELLO).contains(&kind)
        {
            break;
        }
        descs.resize(n * 24, 0);
        note.resize(note_len, 0);
        if r.read_exact(&mut descs).await.is_err() || r.read_exact(&mut note).await.is_err() {
            break;
        }
        if kind == KIND_HELLO {
            peer = String::from_utf8_lossy(&note).into_owned();
            continue;
        }
        let desc = |i: usize| {
            let at = i * 24;
            let u = |o: usize| {
                let mut a = [0u8; 8];
                a.copy_from_slice(&descs[at + o..at + o + 8]);
                u64::from_le_bytes(a)
            };
            (u(0), u(8), u(16))
        };
        let mut total = 0u64;
        let mut overflow = false;
        for i in 0..n {
            match total.checked_add(desc(i).2) {
                Some(t) => total = t,
                None => overflow = true,
            }
        }
        if overflow {
            break;
        }
        let verdict = host.grant_into(&mut grant, (0..n).map(desc));
        let mut resp = [0u8; RESP_HEADER];
        match verdict {
            Ok(()) => {
                spans.clear();
                spans.extend((0..grant.len()).map(|i| {
                    let (p, l) = grant.span(i);
                    (p as usize, l)
                }));
                if op == Op::Write && total > 0 {
                    // SAFETY: every span was validated against, and is pinned in, a live
                    // registration of this agent by `grant`, which outlives the read. By the
                    // registration contract, registered memory may be written by transfers at
                    // any time and its owner reaches it only through raw-pointer copies.
                    if unsafe { read_spans(&r, &spans) }.await.is_err() {
                        break;
                    }
                }
                if w.write_all(&resp).await.is_err() {
                    break;
                }
                if op == Op::Read && total > 0 {
                    // SAFETY: as above: the spans are pinned by `grant` until it is cleared.
                    if unsafe { write_spans(&w, &spans) }.await.is_err() {
                        break;
                    }
                }
                grant.clear();
                if has_note {
                    host.notify(&peer, note.clone());
                }
            }
            Err(reason) => {
                if op == Op::Write && total > 0 {
                    let mut left = total;
                    scratch.resize(64 * 1024, 0);
                    while left > 0 {
                        let chunk = left.min(scratch.len() as u64) as usize;
                        if r.read_exact(&mut scratch[..chunk]).await.is_err() {
                            return;
                        }
                        left -= chunk as u64;
                    }
                }
                resp[0] = 1;
                resp[1] = reason.code();
                if w.write_all(&resp).await.is_err() {
                    break;
                }
            }
        }
    }
    let _ = w.shutdown().await;
}
