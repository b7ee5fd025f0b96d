//! `tcp`: agents on different hosts, one-sided WRITE and READ carried over TCP.
//!
//! Each agent owns a small tokio runtime (one worker thread) that accepts peers and drives its
//! links; nothing needs the caller's runtime, and the public calls never block on it.
//!
//! **One link per pair of agents.** The first agent to add the other dials it and introduces
//! itself (`HELLO`, answered by `HELLO_ACK` once the target has filed the link under the
//! dialer's name); from then on both agents use that one persistent connection, in both
//! directions, pipelined. Only two agents adding each other at the very same moment can end
//! up with a second link (each then uses its own; both work).
//!
//! Each link has a reader task and a writer task. The reader never writes: it queues answers
//! for the writer, so two agents writing large payloads to each other cannot deadlock.
//!
//! Messages all start with a 24-byte header. A request (kind, op, notification flag, descriptor
//! count, notification length) is followed by its descriptors (24 bytes each: registration,
//! offset, length), the notification, and for a WRITE the payload, written with vectored
//! writes straight from the registered ranges, at most 1 MiB per call. The target validates and pins every descriptor
//! against its live registrations *before* reading the payload, then reads it straight into
//! the pinned ranges; a refused WRITE's payload is drained into a scratch buffer and never
//! lands. A response (status, reason) is followed, for a granted READ, by the payload, read
//! straight into the local ranges. Responses come back in request order.
//!
//! Header, descriptor and grant buffers are reused, so a steady stream of transfers allocates
//! nothing in the engine; the only per-transfer allocation is the transfer handle's state.

use std::collections::{HashMap, VecDeque};
use std::io;
use std::net::{SocketAddr, ToSocketAddrs};
use std::os::fd::AsRawFd;
use std::sync::OnceLock;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt, Interest};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch};

use crate::agent::MAX_NOTIFICATION;
use crate::engine::{Connection, Grant, Host, Op, PeerInfo, RegInfo, Transport, Xfer};
use crate::error::{BackendError, RegisterError, RejectReason, TransferError};
use crate::sync::{lock, Arc, AtomicBool, Mutex, Ordering};

const KIND: &str = "tcp";
const HEADER: usize = 24;
const KIND_XFER: u8 = 1;
const KIND_NOTIFY: u8 = 2;
const KIND_HELLO: u8 = 3;
const KIND_RESP: u8 = 4;
const KIND_HELLO_ACK: u8 = 5;
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
    host: Mutex<Option<Host>>,
    runtime: Mutex<Option<tokio::runtime::Runtime>>,
    handle: OnceLock<tokio::runtime::Handle>,
    stop: watch::Sender<bool>,
    closed: AtomicBool,
    links: Arc<Links>,
}

/// Live links by peer name.
#[derive(Default)]
struct Links {
    by_name: Mutex<HashMap<String, Arc<Link>>>,
}

impl Links {
    fn live(&self, name: &str) -> Option<Arc<Link>> {
        let mut map = lock(&self.by_name);
        match map.get(name) {
            Some(l) if l.dead().is_none() => Some(l.clone()),
            Some(_) => {
                map.remove(name);
                None
            }
            None => None,
        }
    }

    /// Files `link` under `name`, unless a live link to the same incarnation of the peer (same
    /// advertised address) is there already. A live link to an older incarnation is retired.
    fn file(&self, name: &str, link: &Arc<Link>) {
        let mut map = lock(&self.by_name);
        let stale = match map.get(name) {
            Some(old) if old.dead().is_none() => {
                if old.addr == link.addr {
                    return;
                }
                Some(old.clone())
            }
            _ => None,
        };
        map.insert(name.to_owned(), link.clone());
        drop(map);
        if let Some(old) = stale {
            old.die("the peer restarted at a new address");
        }
    }

    fn kill_all(&self, why: &str) {
        let links: Vec<Arc<Link>> = lock(&self.by_name).drain().map(|(_, l)| l).collect();
        for l in links {
            l.die(why);
        }
    }
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
                host: Mutex::new(None),
                runtime: Mutex::new(None),
                handle: OnceLock::new(),
                stop: watch::channel(false).0,
                closed: AtomicBool::new(false),
                links: Arc::new(Links::default()),
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
        *lock(&self.inner.host) = Some(host.clone());
        rt.spawn(accept_loop(
            listener,
            host,
            self.inner.links.clone(),
            self.inner.stop.subscribe(),
        ));
        *lock(&self.inner.runtime) = Some(rt);
        Ok(())
    }

    fn register(&self, _: &RegInfo<'_>) -> Result<Vec<u8>, RegisterError> {
        Ok(Vec::new())
    }

    fn deregister(&self, _: u64) {}

    fn local_side_needs_registration(&self) -> bool {
        // Transfers reach local memory through the segment's address.
        false
    }

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
        if self.inner.closed.load(Ordering::Acquire) {
            return Err(backend("shut down"));
        }
        if let Some(link) = self.inner.links.live(&peer.name) {
            if link.addr == peer.address {
                return Ok(Arc::new(TcpConnection { link }));
            }
            // Same name, new address: the peer restarted, and this link may not have seen the
            // old process die yet. Writing on it would fail; retire it and dial the new one.
            link.die("the peer restarted at a new address");
        }
        if peer.address.len() > 255 {
            return Err(backend("address longer than 255 bytes"));
        }
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
        let me = self
            .inner
            .name
            .get()
            .ok_or_else(|| backend("not started"))?;
        let host = self.inner.host().ok_or_else(|| backend("not started"))?;
        let std_stream = std::net::TcpStream::connect_timeout(&addr, CONNECT_TIMEOUT)
            .map_err(|e| backend(format!("connecting to {} at {addr}: {e}", peer.name)))?;
        std_stream.set_nodelay(true).map_err(backend)?;
        harden(std_stream.as_raw_fd());
        // Introduce ourselves and wait until the target has filed the link under our name, so
        // that its own `connect` to us, if it comes next, finds and shares this link.
        let mine = self.address();
        let mut hello = vec![0u8; HEADER];
        hello[0] = KIND_HELLO;
        hello[8..12].copy_from_slice(&(me.len() as u32).to_le_bytes());
        hello[12..16].copy_from_slice(&(mine.len() as u32).to_le_bytes());
        hello.extend_from_slice(me.as_bytes());
        hello.extend_from_slice(&mine);
        let handshake = (|| {
            io::Write::write_all(&mut &std_stream, &hello)?;
            std_stream.set_read_timeout(Some(CONNECT_TIMEOUT))?;
            let mut ack = [0u8; HEADER];
            io::Read::read_exact(&mut &std_stream, &mut ack)?;
            if ack[0] != KIND_HELLO_ACK {
                return Err(io::Error::new(io::ErrorKind::InvalidData, "no HELLO_ACK"));
            }
            std_stream.set_read_timeout(None)?;
            std_stream.set_nonblocking(true)
        })();
        handshake.map_err(|e| backend(format!("greeting {} at {addr}: {e}", peer.name)))?;
        let stream = {
            let _guard = handle.enter();
            TcpStream::from_std(std_stream).map_err(backend)?
        };
        let link = spawn_link(
            &handle,
            stream,
            peer.name.clone(),
            peer.address.clone(),
            host,
            self.inner.stop.subscribe(),
        );
        self.inner.links.file(&peer.name, &link);
        Ok(Arc::new(TcpConnection { link }))
    }

    fn tracks_links(&self) -> bool {
        true
    }

    fn shutdown(&self) {
        if self.inner.closed.swap(true, Ordering::AcqRel) {
            return;
        }
        let _ = self.inner.stop.send(true);
        if let Some(rt) = lock(&self.inner.runtime).take() {
            rt.shutdown_background();
        }
        self.inner.links.kill_all("the agent shut down");
    }
}

impl Inner {
    fn host(&self) -> Option<Host> {
        lock(&self.host).clone()
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        if let Some(rt) = lock(&self.runtime).take() {
            rt.shutdown_background();
        }
    }
}

/// One connection to a peer, used in both directions.
struct Link {
    peer: String,
    /// The address the peer advertises (its metadata's, or its `HELLO`'s): a peer that comes
    /// back under the same name at another address is a new incarnation, not this link.
    addr: Vec<u8>,
    jobs: mpsc::UnboundedSender<Job>,
    /// Requests this agent wrote (or is writing), oldest first; responses come back in order.
    pending: Mutex<VecDeque<Xfer>>,
    dead: Mutex<Option<String>>,
    /// Grants returned by the writer, for the reader to reuse.
    spare: Mutex<Vec<Grant>>,
}

/// Work for a link's writer.
enum Job {
    /// This agent's request, as initiator.
    Request(Xfer),
    /// An answer to the peer's request, with the READ payload's pinned spans and the
    /// notification to deliver once it is sent.
    Respond {
        status: u8,
        reason: u8,
        grant: Option<Grant>,
        note: Option<Vec<u8>>,
    },
    HelloAck,
    /// The reader ended: stop.
    Close,
}

impl Link {
    fn gone(&self, detail: &str) -> TransferError {
        TransferError::PeerGone {
            peer: self.peer.clone(),
            detail: detail.to_owned(),
        }
    }

    /// Marks the link dead (first), then fails every pending request.
    fn die(&self, why: &str) {
        lock(&self.dead).get_or_insert_with(|| why.to_owned());
        let pending: Vec<Xfer> = lock(&self.pending).drain(..).collect();
        for x in pending {
            x.done.complete(Err(self.gone(why)));
        }
        let _ = self.jobs.send(Job::Close);
    }

    fn dead(&self) -> Option<String> {
        lock(&self.dead).clone()
    }
}

struct TcpConnection {
    link: Arc<Link>,
}

impl Connection for TcpConnection {
    fn post(&self, xfer: Xfer) {
        if let Some(why) = self.link.dead() {
            xfer.done.complete(Err(self.link.gone(&why)));
            return;
        }
        if let Err(e) = self.link.jobs.send(Job::Request(xfer)) {
            if let Job::Request(xfer) = e.0 {
                let why = self.link.dead().unwrap_or_else(|| "link closed".into());
                xfer.done.complete(Err(self.link.gone(&why)));
            }
        }
    }

    // The link is shared with the peer's own transfers to us: it stays up until either agent
    // shuts down or the connection fails.
}

fn spawn_link(
    handle: &tokio::runtime::Handle,
    stream: TcpStream,
    peer: String,
    addr: Vec<u8>,
    host: Host,
    stop: watch::Receiver<bool>,
) -> Arc<Link> {
    let (tx, rx) = mpsc::unbounded_channel();
    let link = Arc::new(Link {
        peer,
        addr,
        jobs: tx,
        pending: Mutex::new(VecDeque::new()),
        dead: Mutex::new(None),
        spare: Mutex::new(Vec::new()),
    });
    let (rd, wr) = stream.into_split();
    // The peer counts as able to write into this agent's memory until the reader returned.
    let open = host.link_open(&link.peer);
    handle.spawn(write_loop(wr, rx, link.clone(), host.clone(), stop.clone()));
    handle.spawn(read_loop(rd, link.clone(), host, stop, open));
    link
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

    /// Whether every span is done; steps over empty ones first, so no call is made for them.
    fn done(&mut self, spans: &[(usize, u64)]) -> bool {
        while self.span < spans.len() && spans[self.span].1 == self.offset {
            self.span += 1;
            self.offset = 0;
        }
        self.span >= spans.len()
    }
}

/// Largest slice handed to one system call entry (the kernel caps a call near 2 GiB anyway).
const MAX_IOV: u64 = 1 << 30;

/// Most bytes one `sendmsg` is handed. The call copies into the socket's buffer with the
/// socket locked, and the ACKs that arrive meanwhile wait until it returns: a payload handed
/// whole stalls the sender between bursts. Loopback across two cores of the bench machine
/// (receiver woken per 256 KiB): 2.1-2.6 GB/s with the whole 256 MiB per call, 3.8-4.3 with
/// 256 KiB-1 MiB per call, 2.7 with 4 MiB.
const SEND_MAX: u64 = 1 << 20;

/// Fills `iov` with the spans from `cur` on, `budget` bytes at most; returns how many entries
/// it used.
fn fill_iov(
    spans: &[(usize, u64)],
    cur: &Cursor,
    iov: &mut [libc::iovec; IOV_BATCH],
    mut budget: u64,
) -> usize {
    let mut k = 0;
    let (mut j, mut off) = (cur.span, cur.offset);
    while k < IOV_BATCH && j < spans.len() && budget > 0 {
        let (addr, len) = spans[j];
        let chunk = (len - off).min(MAX_IOV).min(budget);
        iov[k] = libc::iovec {
            iov_base: (addr + off as usize) as *mut libc::c_void,
            iov_len: chunk as usize,
        };
        k += 1;
        budget -= chunk;
        if off + chunk < len {
            break;
        }
        j += 1;
        off = 0;
    }
    k
}

fn empty_iov() -> [libc::iovec; IOV_BATCH] {
    [libc::iovec {
        iov_base: std::ptr::null_mut(),
        iov_len: 0,
    }; IOV_BATCH]
}

/// Writes every span, in order, with vectored `sendmsg` calls (`MSG_NOSIGNAL`: a dead peer is
/// an error, not a signal). The bytes go to the kernel straight from the spans; no Rust
/// reference to them is ever made, since other threads or processes may touch the memory.
///
/// # Safety
/// Each span must be readable for its length until this returns (it lies in a pinned
/// registration).
async unsafe fn write_spans(w: &OwnedWriteHalf, spans: &[(usize, u64)]) -> io::Result<()> {
    let stream: &TcpStream = w.as_ref();
    let fd = stream.as_raw_fd();
    let mut cur = Cursor::default();
    while !cur.done(spans) {
        w.writable().await?;
        let result = stream.try_io(Interest::WRITABLE, || {
            let mut iov = empty_iov();
            let k = fill_iov(spans, &cur, &mut iov, SEND_MAX);
            // SAFETY: an all-zero msghdr is valid; it then points at `iov`, whose first `k`
            // entries describe readable memory (the caller's promise), all alive across the
            // call.
            let n = unsafe {
                let mut msg: libc::msghdr = std::mem::zeroed();
                msg.msg_iov = iov.as_mut_ptr();
                msg.msg_iovlen = k as _;
                libc::sendmsg(fd, &msg, libc::MSG_NOSIGNAL)
            };
            if n < 0 {
                Err(io::Error::last_os_error())
            } else {
                Ok(n as usize)
            }
        });
        match result {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => cur.advance(spans, n),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Writes `bytes` (a header) through the same `MSG_NOSIGNAL` path as payloads.
async fn send_bytes(w: &OwnedWriteHalf, bytes: &[u8]) -> io::Result<()> {
    // SAFETY: `bytes` is a live, readable slice borrowed for the whole call.
    unsafe { write_spans(w, &[(bytes.as_ptr() as usize, bytes.len() as u64)]) }.await
}

/// Reads into every span, in order, with `readv`, straight from the kernel into the spans; no
/// Rust reference to them is made (spans may even overlap).
///
/// # Safety
/// Each span must be writable for its length until this returns (it lies in a pinned
/// registration).
async unsafe fn read_spans(r: &OwnedReadHalf, spans: &[(usize, u64)]) -> io::Result<()> {
    let stream: &TcpStream = r.as_ref();
    let fd = stream.as_raw_fd();
    let mut cur = Cursor::default();
    let mut left: u64 = spans.iter().map(|s| s.1).sum();
    // Back to 1 however this returns (or is dropped), for the next header.
    let mut lowat = Lowat { fd, bytes: 1 };
    while !cur.done(spans) {
        // Wake this reader only once a good part of what it still expects is queued: one
        // wake-up per `LOWAT_MAX` bytes instead of one per segment burst. Never above what
        // is still to come, so it cannot wait for bytes the peer will not send (a closed or
        // failed connection wakes it regardless).
        lowat.set(left.min(LOWAT_MAX) as libc::c_int);
        r.readable().await?;
        let result = stream.try_io(Interest::READABLE, || {
            let mut iov = empty_iov();
            let k = fill_iov(spans, &cur, &mut iov, u64::MAX);
            // SAFETY: the first `k` entries of `iov` describe writable memory (the caller's
            // promise), alive across the call.
            let n = unsafe { libc::readv(fd, iov.as_ptr(), k as libc::c_int) };
            if n < 0 {
                Err(io::Error::last_os_error())
            } else {
                Ok(n as usize)
            }
        });
        match result {
            Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => {
                cur.advance(spans, n);
                left -= n as u64;
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// The most a payload reader asks the kernel to queue before waking it.
const LOWAT_MAX: u64 = 256 << 10;

/// The socket's `SO_RCVLOWAT` (readiness once this many bytes are queued) while a payload is
/// read; 1 again when dropped.
struct Lowat {
    fd: std::os::fd::RawFd,
    bytes: libc::c_int,
}

impl Lowat {
    fn set(&mut self, bytes: libc::c_int) {
        if bytes != self.bytes {
            // SAFETY: `fd` is an open socket owned by the reader; the value is a c_int that
            // lives across the call, with its size passed alongside.
            unsafe {
                libc::setsockopt(
                    self.fd,
                    libc::SOL_SOCKET,
                    libc::SO_RCVLOWAT,
                    (&bytes as *const libc::c_int).cast(),
                    size_of::<libc::c_int>() as libc::socklen_t,
                );
            }
            self.bytes = bytes;
        }
    }
}

impl Drop for Lowat {
    fn drop(&mut self) {
        self.set(1);
    }
}

// ----- the writer ------------------------------------------------------------------------

async fn write_loop(
    mut w: OwnedWriteHalf,
    mut rx: mpsc::UnboundedReceiver<Job>,
    link: Arc<Link>,
    host: Host,
    mut stop: watch::Receiver<bool>,
) {
    let mut head = Vec::with_capacity(4096);
    let mut spans: Vec<(usize, u64)> = Vec::new();
    loop {
        let job = tokio::select! {
            j = rx.recv() => match j {
                Some(j) => j,
                None => break,
            },
            _ = stop.changed() => break,
        };
        let sent = match job {
            Job::Close => break,
            Job::HelloAck => {
                head.clear();
                head.resize(HEADER, 0);
                head[0] = KIND_HELLO_ACK;
                send_bytes(&w, &head).await
            }
            Job::Respond {
                status,
                reason,
                grant,
                note,
            } => {
                head.clear();
                head.resize(HEADER, 0);
                head[0] = KIND_RESP;
                head[1] = status;
                head[2] = reason;
                let mut sent = send_bytes(&w, &head).await;
                if let Some(mut grant) = grant {
                    spans.clear();
                    spans.extend((0..grant.len()).map(|i| {
                        let (p, l) = grant.span(i);
                        (p as usize, l)
                    }));
                    if sent.is_ok() {
                        // SAFETY: every span was validated against, and is pinned in, a live
                        // registration of this agent by `grant`, held until the write returns.
                        sent = unsafe { write_spans(&w, &spans) }.await;
                    }
                    grant.clear();
                    lock(&link.spare).push(grant);
                }
                if sent.is_ok() {
                    if let Some(note) = note {
                        host.notify(&link.peer, note);
                    }
                }
                sent
            }
            Job::Request(xfer) => {
                if let Some(why) = link.dead() {
                    xfer.done.complete(Err(link.gone(&why)));
                    continue;
                }
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
                head.resize(HEADER, 0);
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
                // Hold the plan while its payload is written: if the link fails meanwhile, the
                // reader completes the transfer, and the memory must stay pinned until the
                // write call has returned.
                let keep = is_write.then(|| xfer.done.plan_handle());
                // Queue before writing: the response may come back before the write returns.
                lock(&link.pending).push_back(xfer);
                // If the reader already failed, nobody will answer: fail what is queued.
                // (`die` marks the link dead before draining, so either it drained this
                // transfer or this check sees the mark.)
                if let Some(why) = link.dead() {
                    link.die(&why);
                    break;
                }
                let mut sent = send_bytes(&w, &head).await;
                if sent.is_ok() && is_write {
                    // SAFETY: the spans lie in local registrations pinned by the plan that
                    // `keep` holds until the write has returned.
                    sent = unsafe { write_spans(&w, &spans) }.await;
                }
                drop(keep);
                sent
            }
        };
        if let Err(e) = sent {
            link.die(&format!("writing: {e}"));
            break;
        }
    }
    rx.close();
    let why = link.dead().unwrap_or_else(|| "link closed".into());
    link.die(&why);
    while let Ok(job) = rx.try_recv() {
        if let Job::Request(x) = job {
            x.done.complete(Err(link.gone(&why)));
        }
    }
    let _ = w.shutdown().await;
}

// ----- the reader ------------------------------------------------------------------------

/// Reads whatever the peer sends: its requests (this agent as target) and the responses to
/// this agent's requests. Never writes.
async fn read_loop(
    mut r: OwnedReadHalf,
    link: Arc<Link>,
    host: Host,
    mut stop: watch::Receiver<bool>,
    open: crate::engine::LinkGuard,
) {
    let why = match serve(&mut r, &link, &host, &mut stop).await {
        Ok(()) => "the agent shut down".to_owned(),
        Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => "connection closed".to_owned(),
        Err(e) => format!("reading: {e}"),
    };
    link.die(&why);
    // Nothing more is read from this connection, and `serve` released its grants.
    drop(r);
    drop(open);
}

fn malformed(what: &str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, what.to_owned())
}

async fn serve(
    r: &mut OwnedReadHalf,
    link: &Link,
    host: &Host,
    stop: &mut watch::Receiver<bool>,
) -> io::Result<()> {
    let mut head = [0u8; HEADER];
    let mut descs: Vec<u8> = Vec::new();
    let mut note: Vec<u8> = Vec::new();
    let mut spans: Vec<(usize, u64)> = Vec::new();
    let mut scratch: Vec<u8> = Vec::new();
    loop {
        tokio::select! {
            g = r.read_exact(&mut head) => { g?; }
            _ = stop.changed() => return Ok(()),
        }
        let kind = head[0];
        if kind == KIND_RESP {
            receive_response(r, link, host, head[1], head[2], &mut spans).await?;
            continue;
        }
        let (has_note, n, note_len) = (
            head[2] != 0,
            u32::from_le_bytes([head[4], head[5], head[6], head[7]]) as usize,
            u32::from_le_bytes([head[8], head[9], head[10], head[11]]) as usize,
        );
        if !(kind == KIND_XFER || kind == KIND_NOTIFY)
            || n > MAX_DESCS
            || note_len > MAX_NOTIFICATION
        {
            return Err(malformed("bad request header"));
        }
        let op = Op::from_code(head[1]).ok_or_else(|| malformed("bad op"))?;
        descs.resize(n * 24, 0);
        note.resize(note_len, 0);
        r.read_exact(&mut descs).await?;
        r.read_exact(&mut note).await?;
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
        for i in 0..n {
            total = total
                .checked_add(desc(i).2)
                .ok_or_else(|| malformed("payload length overflows"))?;
        }
        let mut grant = lock(&link.spare).pop().unwrap_or_default();
        match host.grant_into(&mut grant, (0..n).map(desc)) {
            Ok(()) => {
                let note = has_note.then(|| note.clone());
                if op == Op::Write {
                    spans.clear();
                    spans.extend((0..grant.len()).map(|i| {
                        let (p, l) = grant.span(i);
                        (p as usize, l)
                    }));
                    // SAFETY: every span was validated against, and is pinned in, a live
                    // registration of this agent by `grant`, which outlives the read. By the
                    // registration contract, registered memory may be written by transfers
                    // at any time and its owner reaches it only through raw-pointer copies.
                    unsafe { read_spans(r, &spans) }.await?;
                    host.count_copied(Op::Write, grant.bytes());
                    grant.clear();
                    lock(&link.spare).push(grant);
                    if let Some(note) = note {
                        host.notify(&link.peer, note);
                    }
                    respond(link, 0, 0, None, None)?;
                } else {
                    respond(link, 0, 0, Some(grant), note)?;
                }
            }
            Err(reason) => {
                lock(&link.spare).push(grant);
                if op == Op::Write {
                    let mut left = total;
                    scratch.resize(64 * 1024, 0);
                    while left > 0 {
                        let chunk = left.min(scratch.len() as u64) as usize;
                        r.read_exact(&mut scratch[..chunk]).await?;
                        left -= chunk as u64;
                    }
                }
                respond(link, 1, reason.code(), None, None)?;
            }
        }
    }
}

fn respond(
    link: &Link,
    status: u8,
    reason: u8,
    grant: Option<Grant>,
    note: Option<Vec<u8>>,
) -> io::Result<()> {
    link.jobs
        .send(Job::Respond {
            status,
            reason,
            grant,
            note,
        })
        .map_err(|_| io::Error::new(io::ErrorKind::BrokenPipe, "the writer stopped"))
}

/// A response to this agent's oldest pending request.
async fn receive_response(
    r: &mut OwnedReadHalf,
    link: &Link,
    host: &Host,
    status: u8,
    reason: u8,
    spans: &mut Vec<(usize, u64)>,
) -> io::Result<()> {
    let xfer = lock(&link.pending)
        .pop_front()
        .ok_or_else(|| malformed("a response without a request"))?;
    if status != 0 {
        xfer.done.complete(Err(TransferError::Rejected {
            peer: link.peer.clone(),
            reason: RejectReason::from_code(reason),
        }));
        return Ok(());
    }
    if xfer.plan().op() == Op::Read {
        spans.clear();
        spans.extend(
            xfer.plan()
                .segments()
                .iter()
                .map(|s| (s.local_ptr() as usize, s.len)),
        );
        // SAFETY: the spans lie in local registrations pinned by this transfer's plan, which
        // `xfer` owns until it is completed below.
        if let Err(e) = unsafe { read_spans(r, spans) }.await {
            xfer.done
                .complete(Err(link.gone(&format!("receiving a payload: {e}"))));
            return Err(e);
        }
        host.count_copied(Op::Read, spans.iter().map(|s| s.1).sum());
    }
    xfer.done.complete(Ok(()));
    Ok(())
}

// ----- accepting ---------------------------------------------------------------------------

async fn accept_loop(
    listener: TcpListener,
    host: Host,
    links: Arc<Links>,
    mut stop: watch::Receiver<bool>,
) {
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
        tokio::spawn(greet(stream, host.clone(), links.clone(), stop.clone()));
    }
}

/// Reads the dialer's `HELLO`, files the link under its name, acknowledges, and runs it.
async fn greet(mut stream: TcpStream, host: Host, links: Arc<Links>, stop: watch::Receiver<bool>) {
    let mut head = [0u8; HEADER];
    let hello = tokio::time::timeout(CONNECT_TIMEOUT, async {
        stream.read_exact(&mut head).await?;
        let len = u32::from_le_bytes([head[8], head[9], head[10], head[11]]) as usize;
        let addr_len = u32::from_le_bytes([head[12], head[13], head[14], head[15]]) as usize;
        if head[0] != KIND_HELLO || len == 0 || len > 255 || addr_len > 255 {
            return Err(malformed("expected HELLO"));
        }
        let mut name = vec![0u8; len];
        stream.read_exact(&mut name).await?;
        let mut addr = vec![0u8; addr_len];
        stream.read_exact(&mut addr).await?;
        let name = String::from_utf8(name).map_err(|_| malformed("name is not UTF-8"))?;
        Ok((name, addr))
    })
    .await;
    let Ok(Ok((peer, addr))) = hello else {
        return;
    };
    let link = spawn_link(
        &tokio::runtime::Handle::current(),
        stream,
        peer.clone(),
        addr,
        host,
        stop,
    );
    links.file(&peer, &link);
    let _ = link.jobs.send(Job::HelloAck);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Agent, LinkState};

    /// Polls `f` until it holds, failing after a generous deadline (a hang guard only).
    pub(crate) fn until(what: &str, f: impl Fn() -> bool) {
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        while !f() {
            assert!(
                std::time::Instant::now() < deadline,
                "{what} never happened"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// A target sees the link from a peer open once the peer connected, on both ends of the
    /// shared link, and closed once the peer's agent is gone and the reader returned; a peer
    /// that comes back opens it again.
    #[test]
    fn peer_link_follows_the_peers_connection() {
        let unit = Agent::new("unit", Tcp::new()).unwrap();
        assert_eq!(unit.peer_link("client"), LinkState::Closed);
        let client = Agent::new("client", Tcp::new()).unwrap();
        let peer = client.add_remote(&unit.metadata()).unwrap();
        assert_eq!(unit.peer_link("client"), LinkState::Open);
        assert_eq!(client.peer_link("unit"), LinkState::Open);
        assert_eq!(unit.peer_link("someone-else"), LinkState::Closed);
        // Dropping the peer handle keeps the link (it is shared and persistent).
        drop(peer);
        assert_eq!(unit.peer_link("client"), LinkState::Open);
        drop(client);
        until("the link closing", || {
            unit.peer_link("client") == LinkState::Closed
        });
        let again = Agent::new("client", Tcp::new()).unwrap();
        let _peer = again.add_remote(&unit.metadata()).unwrap();
        assert_eq!(unit.peer_link("client"), LinkState::Open);
    }

    #[test]
    fn cursor_walks_spans_and_skips_empty_ones() {
        // Addresses are never dereferenced here: only the bookkeeping is checked.
        let spans = [
            (0x1000usize, 10u64),
            (0x2000, 0),
            (0x3000, 5),
            (0x4000, 3 << 30),
        ];
        let mut cur = Cursor::default();
        assert!(!cur.done(&spans));
        let mut iov = empty_iov();
        let k = fill_iov(&spans, &cur, &mut iov, u64::MAX);
        // 10 bytes, an empty entry, 5 bytes, then the 3 GiB span capped at MAX_IOV.
        assert_eq!(k, 4);
        assert_eq!(iov[3].iov_len as u64, MAX_IOV);
        cur.advance(&spans, 12);
        assert_eq!((cur.span, cur.offset), (2, 2));
        cur.advance(&spans, 3);
        assert!(!cur.done(&spans));
        assert_eq!((cur.span, cur.offset), (3, 0));
        cur.advance(&spans, MAX_IOV as usize);
        let k = fill_iov(&spans, &cur, &mut iov, u64::MAX);
        assert_eq!(
            (k, iov[0].iov_base as usize),
            (1, 0x4000 + MAX_IOV as usize)
        );
        cur.advance(&spans, (2 * MAX_IOV) as usize);
        assert!(cur.done(&spans));
    }

    #[test]
    fn a_budget_caps_one_call() {
        let spans = [(0x1000usize, 600u64), (0x2000, 600), (0x3000, 5000)];
        let mut iov = empty_iov();
        let mut cur = Cursor::default();
        // 600 + 400 of the second span: the budget cuts inside it.
        let k = fill_iov(&spans, &cur, &mut iov, 1000);
        let lens: Vec<usize> = iov[..k].iter().map(|v| v.iov_len).collect();
        assert_eq!(lens, [600, 400]);
        cur.advance(&spans, 1000);
        let k = fill_iov(&spans, &cur, &mut iov, 1000);
        let got: Vec<(usize, usize)> = iov[..k]
            .iter()
            .map(|v| (v.iov_base as usize, v.iov_len))
            .collect();
        assert_eq!(got, [(0x2000 + 400, 200), (0x3000, 800)]);
        // Every call of a payload larger than the budget stays within it, and all of it goes.
        let mut cur = Cursor::default();
        let mut sent = 0;
        while !cur.done(&spans) {
            let k = fill_iov(&spans, &cur, &mut iov, 1000);
            let n: usize = iov[..k].iter().map(|v| v.iov_len).sum();
            assert!(n > 0 && n <= 1000);
            cur.advance(&spans, n);
            sent += n;
        }
        assert_eq!(sent, 6200);
    }
}
