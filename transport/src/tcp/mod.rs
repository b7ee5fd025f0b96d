//! `tcp`: agents on different hosts, one-sided WRITE and READ carried over TCP.
//!
//! Each agent owns a small tokio runtime (one worker thread) that accepts peers and drives its
//! links; nothing needs the caller's runtime, and the public calls never block on it.
//!
//! **One link per pair of agents.** The first agent to add the other dials it and
//! authenticates (`HELLO` with the dialer's nonce, name and address; `CHALLENGE` with the
//! target's nonce and proof; `AUTH` with the dialer's proof), answered by `HELLO_ACK` once
//! the target has filed the link under the dialer's name, or by `REFUSED` (a proof that does
//! not match the target's token, another user without a token, or a name in use); from then
//! on both agents use that one persistent connection, in both directions, pipelined.
//!
//! **Trust.** With a token ([`Tcp::with_token`]) both sides prove they hold it. Without
//! one, the engine only binds loopback addresses ([`Transport::start`] fails otherwise), and
//! each side finds the other's socket in `/proc/net/tcp` (`tcp6`) and refuses another user.
//! Before it authenticated, a peer can send at most 4 KiB and has 5 s, and anything but the
//! handshake closes its connection.
//!
//! **Names.** An agent name belongs to the peer that authenticated as it: a `HELLO` under a
//! name that already has a live link filed is refused (`name in use`), so no one can retire
//! another peer's link. The refused dialer then looks for a link the peer has meanwhile
//! dialed to it (two agents adding each other at once) and shares it; otherwise `add_remote`
//! fails. Only [`Transport::connect`], trusting the metadata its caller passed, retires a
//! live link whose peer now advertises another address (a restarted peer).
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
//! The descriptor and notification buffers grow only as their bytes arrive (doubling), never
//! to a length a header merely announced.
//!
//! Each descriptor is checked against the target's exposures when its registration is
//! scoped ([`crate::Exposure`]); a granted WRITE counts as written in its exposures once its
//! payload landed.

use std::collections::{HashMap, VecDeque};
use std::io;
use std::net::{SocketAddr, ToSocketAddrs};
use std::os::fd::AsRawFd;
use std::time::Duration;
use tessera_sync::unchecked::OnceLock;

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch};

use crate::auth::{Token, MAC_LEN, NONCE_LEN};
use crate::engine::{Connection, Grant, Host, PeerInfo, RegInfo, Transport, Xfer};
use crate::error::{BackendError, RegisterError, TransferError};
use crate::handshake;
use tessera_sync::atomic::{AtomicBool, Ordering};
use tessera_sync::{Arc, Mutex};

mod iov;
use iov::{read_spans, send_bytes, write_spans};
mod link;
use link::{accept_loop, read_loop, write_loop};
#[cfg(test)]
mod tests;

pub(crate) const KIND: &str = "tcp";
pub(crate) const HEADER: usize = 24;
pub(crate) const KIND_XFER: u8 = 1;
pub(crate) const KIND_NOTIFY: u8 = 2;
pub(crate) const KIND_HELLO: u8 = 3;
pub(crate) const KIND_RESP: u8 = 4;
pub(crate) const KIND_HELLO_ACK: u8 = 5;
/// The target's answer to `HELLO`: its nonce and proof.
pub(crate) const KIND_CHALLENGE: u8 = 6;
/// The dialer's proof.
pub(crate) const KIND_AUTH: u8 = 7;
/// The target refuses the handshake (reason in byte 1): a bad proof, another user, or a
/// name that already has a live link.
pub(crate) const KIND_REFUSED: u8 = 8;
/// Most descriptors in one request.
pub(crate) const MAX_DESCS: usize = 1 << 22;
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
    token: OnceLock<Token>,
    /// How long a connecting peer has to authenticate (`PRE_AUTH_DEADLINE` unless set).
    handshake_deadline: OnceLock<Duration>,
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
        let mut map = self.by_name.lock();
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
        let mut map = self.by_name.lock();
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

    /// Files the link `make` builds under `name`, unless a live link is filed there: an
    /// agent name belongs to the peer that authenticated as it first, until that link dies.
    fn claim(&self, name: &str, make: impl FnOnce() -> Arc<Link>) -> Option<Arc<Link>> {
        let mut map = self.by_name.lock();
        if map.get(name).is_some_and(|l| l.dead().is_none()) {
            return None;
        }
        let link = make();
        map.insert(name.to_owned(), link.clone());
        Some(link)
    }

    fn kill_all(&self, why: &str) {
        let links: Vec<Arc<Link>> = self.by_name.lock().drain().map(|(_, l)| l).collect();
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
                token: OnceLock::new(),
                handshake_deadline: OnceLock::new(),
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

    /// Peers must prove they hold `token` (and this engine proves it to them) before
    /// anything else on a connection. Without one, the engine only binds loopback addresses
    /// and serves only processes of this user (found in `/proc/net/tcp`). Set before the
    /// agent starts.
    pub fn with_token(self, token: Token) -> Self {
        let _ = self.inner.token.set(token);
        self
    }

    /// How long a connecting peer has to complete the handshake before its connection is
    /// closed (default 5 s). Set before the agent starts.
    pub fn with_handshake_deadline(self, deadline: Duration) -> Self {
        let _ = self.inner.handshake_deadline.set(deadline);
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
        if self.inner.token.get().is_none() && !self.inner.bind.ip().is_loopback() {
            return Err(backend(format!(
                "refusing to listen on {} without a token: anyone who reaches it could read \
                 and write registered memory; configure a token (Tcp::with_token) or bind a \
                 loopback address",
                self.inner.bind
            )));
        }
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
        *self.inner.host.lock() = Some(host.clone());
        rt.spawn(accept_loop(
            listener,
            host,
            self.inner.token.get().cloned(),
            self.inner
                .handshake_deadline
                .get()
                .copied()
                .unwrap_or(handshake::PRE_AUTH_DEADLINE),
            self.inner.links.clone(),
            self.inner.stop.subscribe(),
        ));
        *self.inner.runtime.lock() = Some(rt);
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
        // Authenticate, and wait until the target has filed the link under our name, so
        // that its own `connect` to us, if it comes next, finds and shares this link.
        let mine = self.address();
        let token = self.inner.token.get();
        match dial_handshake(&std_stream, token, me, &mine, &peer.name) {
            Ok(()) => {}
            Err(Dial::NameInUse(why)) => {
                // The peer may have dialed us meanwhile (both adding each other at once):
                // its link, filed under its name here, is the one to share.
                return match self.inner.links.live(&peer.name) {
                    Some(link) if link.addr == peer.address => Ok(Arc::new(TcpConnection { link })),
                    _ => Err(backend(why)),
                };
            }
            Err(Dial::Failed(why)) => return Err(backend(why)),
        }
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
        if let Some(rt) = self.inner.runtime.lock().take() {
            rt.shutdown_background();
        }
        self.inner.links.kill_all("the agent shut down");
    }
}

impl Inner {
    fn host(&self) -> Option<Host> {
        self.host.lock().clone()
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        if let Some(rt) = self.runtime.lock().take() {
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
    /// A second descriptor of the link's socket, so that [`Connection::cut`] can shut it
    /// down under the reader and writer; closed when the link dies.
    socket: Mutex<Option<std::net::TcpStream>>,
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
        self.dead.lock().get_or_insert_with(|| why.to_owned());
        drop(self.socket.lock().take());
        let pending: Vec<Xfer> = self.pending.lock().drain(..).collect();
        for x in pending {
            x.done.complete(Err(self.gone(why)));
        }
        let _ = self.jobs.send(Job::Close);
    }

    fn dead(&self) -> Option<String> {
        self.dead.lock().clone()
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

    /// Shuts the link's socket down both ways, as a failing connection would: the writer's
    /// next write fails (inside a WRITE's payload if it is sending one), the reader meets the
    /// end (inside a READ's payload if one is arriving), and the link dies, failing every
    /// transfer it carried in either direction with [`TransferError::PeerGone`]. The peer's
    /// side of the link dies the same way. Later transfers through this connection fail;
    /// a new `connect` dials a fresh link.
    fn cut(&self) -> bool {
        match &*self.link.socket.lock() {
            Some(s) => {
                let _ = s.shutdown(std::net::Shutdown::Both);
                true
            }
            // Dead already, or its descriptor could not be duplicated: nothing to cut.
            None => self.link.dead().is_some(),
        }
    }
}

/// How a dialer's handshake failed.
enum Dial {
    /// The target has a live link under our name already.
    NameInUse(String),
    Failed(String),
}

/// The dialer's side of the handshake (see the crate README's trust model), on a blocking
/// stream.
fn dial_handshake(
    stream: &std::net::TcpStream,
    token: Option<&Token>,
    me: &str,
    mine: &[u8],
    peer: &str,
) -> Result<(), Dial> {
    let io = |e: io::Error| Dial::Failed(format!("greeting {peer}: {e}"));
    let nonce = crate::auth::nonce();
    let mut hello = vec![0u8; HEADER];
    hello[0] = KIND_HELLO;
    hello[8..12].copy_from_slice(&(me.len() as u32).to_le_bytes());
    hello[12..16].copy_from_slice(&(mine.len() as u32).to_le_bytes());
    hello.extend_from_slice(&nonce);
    hello.extend_from_slice(me.as_bytes());
    hello.extend_from_slice(mine);
    io::Write::write_all(&mut &*stream, &hello).map_err(io)?;
    stream.set_read_timeout(Some(CONNECT_TIMEOUT)).map_err(io)?;
    let mut head = [0u8; HEADER];
    io::Read::read_exact(&mut &*stream, &mut head).map_err(io)?;
    if head[0] == KIND_REFUSED {
        return Err(refusal(peer, me, head[1]));
    }
    if head[0] != KIND_CHALLENGE {
        return Err(Dial::Failed(format!(
            "greeting {peer}: expected its challenge"
        )));
    }
    let mut challenge = [0u8; NONCE_LEN + MAC_LEN];
    io::Read::read_exact(&mut &*stream, &mut challenge).map_err(io)?;
    let mut theirs = [0u8; NONCE_LEN];
    theirs.copy_from_slice(&challenge[..NONCE_LEN]);
    if !handshake::check_target(token, KIND, &nonce, &theirs, peer, &challenge[NONCE_LEN..]) {
        return Err(Dial::Failed(handshake::bad_target_proof(peer, token)));
    }
    if token.is_none() {
        // The target answered, so it accepted: its socket is listed with our end as remote.
        let (local, remote) = (
            stream.local_addr().map_err(io)?,
            stream.peer_addr().map_err(io)?,
        );
        let ours = handshake::euid();
        match handshake::tcp_socket_uid(remote, local) {
            Some(uid) if uid == ours => {}
            Some(uid) => {
                return Err(Dial::Failed(format!(
                    "{peer} runs as uid {uid}, not ours ({ours}), and no token is configured"
                )))
            }
            None => {
                return Err(Dial::Failed(format!(
                    "{peer} at {remote} is not a socket of this host, so its user cannot be \
                     checked: configure a token"
                )))
            }
        }
    }
    let proof = handshake::dialer_proof(token, KIND, &nonce, &theirs, me, mine);
    let mut auth = vec![0u8; HEADER];
    auth[0] = KIND_AUTH;
    auth.extend_from_slice(&proof);
    io::Write::write_all(&mut &*stream, &auth).map_err(io)?;
    io::Read::read_exact(&mut &*stream, &mut head).map_err(io)?;
    match head[0] {
        KIND_HELLO_ACK => {}
        KIND_REFUSED => return Err(refusal(peer, me, head[1])),
        _ => return Err(Dial::Failed(format!("greeting {peer}: expected HELLO_ACK"))),
    }
    stream.set_read_timeout(None).map_err(io)?;
    stream.set_nonblocking(true).map_err(io)
}

fn refusal(peer: &str, me: &str, code: u8) -> Dial {
    let why = handshake::refused(peer, me, code);
    if code == handshake::REFUSED_NAME_IN_USE {
        Dial::NameInUse(why)
    } else {
        Dial::Failed(why)
    }
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
    let socket = std::os::fd::AsFd::as_fd(&stream)
        .try_clone_to_owned()
        .ok()
        .map(std::net::TcpStream::from);
    let link = Arc::new(Link {
        peer,
        addr,
        jobs: tx,
        pending: Mutex::new(VecDeque::new()),
        dead: Mutex::new(None),
        spare: Mutex::new(Vec::new()),
        socket: Mutex::new(socket),
    });
    let (rd, wr) = stream.into_split();
    // The peer counts as able to write into this agent's memory until the reader returned.
    let open = host.link_open(&link.peer);
    handle.spawn(write_loop(wr, rx, link.clone(), host.clone(), stop.clone()));
    handle.spawn(read_loop(rd, link.clone(), host, stop, open));
    link
}

// ----- vectored I/O straight from and into registered ranges -------------------------------
