//! `shm`: agents in different processes of one host.
//!
//! Regions are sealed memfd mappings. The initiator asks the target for each registration it
//! needs; the target checks it is live and passes its memfd over a Unix socket (SCM_RIGHTS);
//! the initiator maps it once and keeps the mapping for the connection's life. A transfer is:
//!
//! 1. initiator → target `XFER` with every (registration, offset, len);
//! 2. the target validates them against its live registrations and pins them (`GRANT`), or
//!    refuses (`REJECT`): a peer never touches memory the target does not currently register;
//! 3. the initiator's own `memcpy` between the mappings;
//! 4. initiator → target `DONE`, with the notification: the target unpins and delivers the
//!    notification, after the data landed.
//!
//! A WRITE that lies wholly inside ranges the target announced as standing
//! ([`Transport::standing`], `STANDING` / `REVOKE`) skips steps 1 and 2: the initiator copies
//! at once, on the caller's thread, and sends `WROTE` with the spans (and the notification);
//! the target checks them against its exposures as it would a grant and records what landed.
//! A peer that keeps a landing block ready for a client this way costs that client no round
//! trip per WRITE. Without a notification the spans go instead into the link's ring of
//! records, a memfd the target maps into the initiator when the link opens (`RING`): a
//! target thread spinning for the WRITE ([`Transport::spin_for_writes`]) takes them from there
//! itself, and the socket carries only a doorbell (`RECORDS`) when none spins, for the
//! serving thread to take them (see `shm_ring`). A record the ring has no room for goes as a
//! `WROTE`.
//!
//! The announcements travel the other way through a second ring (`ANNOUNCE_RING`): the target
//! stores each `STANDING` and `REVOKE` there, and the initiator takes the ring before it
//! posts any transfer, so a storage unit that grants a client its next landing block with
//! every answer wakes none of the client's threads for it. The target rings a doorbell
//! (`ANNOUNCED`) when the ring is half full, for an initiator that posts nothing. An
//! announcement that finds the ring full goes on the socket, and so does every later one of
//! that link; the initiator takes the ring before it applies any from the socket, so none
//! overtakes an earlier one.
//!
//! Each connection has one progress thread per side, blocked in `recvmsg` while idle.
//!
//! **Trust.** Before anything else, the dialer and the target run the challenge-response in
//! the crate README's trust model (`HELLO`, `CHALLENGE`, `AUTH`, then `HELLO_ACK` or `REFUSED`): with
//! a token ([`Shm::with_token`]) each proves it holds it; without one each side checks the
//! other's user id (`SO_PEERCRED`) equals its own. Until then the target reads at most 4 KiB
//! and waits at most 5 s, and anything but the handshake closes the connection. An agent
//! name belongs to the process that authenticated as it: while it has a live inbound link,
//! a connection from another process claiming that name is refused (`name in use`). `connect` waits at most 10 s,
//! for room in a full listen backlog included.
//!
//! Exposures ([`crate::Exposure`]) are checked at the grant (step 2), but the initiator
//! maps the whole memfd of a registration it may reach: an authenticated peer that runs its
//! own code instead of this engine can read and write all of it without asking. Scoped
//! registrations protect against honest mistakes and other processes, not against a
//! malicious authenticated peer.

use std::collections::{HashMap, HashSet, VecDeque};
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixListener, UnixStream};
use std::time::{Duration, Instant};
use tessera_sync::unchecked::OnceLock;

use crate::auth::{Token, NONCE_LEN};
use crate::copy::Copier;
use crate::handshake::{self, PRE_AUTH_DEADLINE, PRE_AUTH_MAX};
use crate::shm_ring::{MappedRing, Pushed, RING_BYTES};

use crate::engine::wire::{u32_at, u64_at};
use crate::engine::{
    Connection, Grant, Host, Op, PeerInfo, RegInfo, Standing, Transport, WriteWatch, Xfer,
};
use crate::error::{BackendError, RegisterError, RejectReason, TransferError};
use crate::region::next_id;
use crate::Region;
use tessera_sync::atomic::{AtomicBool, Ordering};
use tessera_sync::{Arc, Mutex, Weak};

pub(crate) const KIND: &str = "shm";

pub(crate) const HELLO: u8 = 1;
pub(crate) const MAP_REQ: u8 = 2;
pub(crate) const MAP_OK: u8 = 3;
pub(crate) const MAP_ERR: u8 = 4;
pub(crate) const XFER: u8 = 5;
pub(crate) const GRANT: u8 = 6;
pub(crate) const REJECT: u8 = 7;
pub(crate) const DONE: u8 = 8;
pub(crate) const NOTIFY: u8 = 9;
pub(crate) const CHALLENGE: u8 = 10;
pub(crate) const AUTH: u8 = 11;
pub(crate) const HELLO_ACK: u8 = 12;
pub(crate) const REFUSED: u8 = 13;
pub(crate) const STANDING: u8 = 14;
pub(crate) const REVOKE: u8 = 15;
pub(crate) const WROTE: u8 = 16;
/// Target → initiator, with the memfd of the link's ring of WRITE records: its length.
pub(crate) const RING: u8 = 17;
/// Initiator → target: records wait in the ring and no target thread watches it.
pub(crate) const RECORDS: u8 = 18;
/// Target → initiator, with the memfd of the link's ring of announcements (`STANDING` and
/// `REVOKE`, framed as on the socket): its length.
pub(crate) const ANNOUNCE_RING: u8 = 19;
/// Target → initiator: the ring of announcements is half full; take it.
pub(crate) const ANNOUNCED: u8 = 20;

/// How long `connect` waits for the target to accept and answer the handshake.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// Largest message body (a transfer of about 2.8 million descriptors).
pub(crate) const MAX_BODY: usize = 64 << 20;
pub(crate) const HEADER: usize = 8;
/// A reader's buffer to start with; it grows for larger messages as their bytes arrive.
const READ_BUF: usize = 64 * 1024;

/// The shared-memory backend. Only memfd-backed regions ([`Region::new`]) can be the target
/// of a transfer; any region can be the local side.
pub struct Shm {
    inner: Arc<Inner>,
}

struct Inner {
    name: String,
    token: OnceLock<Token>,
    /// How long a connecting peer has to authenticate (`PRE_AUTH_DEADLINE` unless set).
    handshake_deadline: OnceLock<Duration>,
    connect_timeout: OnceLock<Duration>,
    host: OnceLock<Host>,
    closed: AtomicBool,
    /// Every live socket, to shut down with the engine.
    sockets: Mutex<Vec<Weak<UnixStream>>>,
    /// Names with live inbound links, by claiming process.
    claims: Arc<Claims>,
    /// Standing exposures by peer name, and that peer's inbound links to announce them to.
    standing: Arc<StandingTable>,
}

/// Standing exposures by peer name, shared with the links' serving threads.
type StandingTable = Mutex<HashMap<String, PeerStanding>>;

/// One peer's standing exposures and its inbound links to announce them to.
#[derive(Default)]
struct PeerStanding {
    grants: HashMap<u64, Standing>,
    links: Vec<Link>,
}

/// An inbound link, as its peer's standing exposures reach it.
struct Link {
    id: u64,
    tx: Replies,
    /// Its ring of WRITE records, where one could be made.
    records: Option<Arc<Records>>,
    /// Its ring of announcements, until the first that found no room in it: from then on
    /// every announcement goes on the socket, so that none overtakes one before it.
    notices: Option<Notices>,
}

/// The target's side of a link's ring of announcements (see [`Link::announce`]).
struct Notices {
    ring: MappedRing,
    /// Bytes pushed so far.
    tail: u64,
}

impl Link {
    /// Tells the initiator `msg` (one framed `STANDING` or `REVOKE`): through the link's ring
    /// of announcements while it has room, which costs no system call and wakes no thread
    /// (the initiator takes the ring before each transfer it posts, and when its doorbell
    /// rings at half full); on the socket otherwise.
    fn announce(&mut self, msg: &[u8]) {
        if let Some(n) = &mut self.notices {
            let half = n.ring.capacity() / 2;
            let before = n.ring.backlog(n.tail);
            match n.ring.push(&mut n.tail, msg) {
                Pushed::NoRoom => self.notices = None,
                Pushed::Watched | Pushed::Unwatched => {
                    if before < half && n.ring.backlog(n.tail) >= half {
                        let mut bell = Vec::new();
                        frame(&mut bell, ANNOUNCED, |_| {});
                        announce(&self.tx, &bell);
                    }
                    return;
                }
            }
        }
        announce(&self.tx, msg);
    }
}

/// The target's side of a link's ring of WRITE records (see `shm_ring`).
struct Records {
    ring: MappedRing,
    host: Host,
    peer: String,
    /// Ended when the ring is found malformed.
    stream: Arc<UnixStream>,
    taken: Mutex<Taken>,
    /// Doorbells the serving thread answered.
    #[cfg(test)]
    doorbells: tessera_sync::unchecked::AtomicU64,
}

/// Where the target's taking of a ring stands.
#[derive(Default)]
struct Taken {
    head: u64,
    scratch: Vec<u8>,
    grant: Grant,
}

impl Records {
    /// A new ring for the link from `peer` on `stream`; `None` when no memory could be had
    /// for it (the link's records then all travel on the socket).
    fn create(host: &Host, peer: &str, stream: &Arc<UnixStream>) -> Option<Arc<Self>> {
        Some(Arc::new(Self {
            ring: MappedRing::create("tessera-shm-records")?,
            host: host.clone(),
            peer: peer.to_owned(),
            stream: stream.clone(),
            taken: Mutex::new(Taken::default()),
            #[cfg(test)]
            doorbells: Default::default(),
        }))
    }

    /// Records what the ring holds, each span checked against this peer's exposures as a
    /// `WROTE`'s are. A malformed ring or record ends the link.
    fn take(&self) {
        let mut t = self.taken.lock();
        let Taken {
            head,
            scratch,
            grant,
        } = &mut *t;
        let mut good = true;
        let taken = self.ring.take(head, scratch, |rec| {
            good &= mark_wrote(&self.host, &self.peer, grant, rec, 0) == Some(rec.len());
        });
        if taken.is_err() || !good {
            let _ = self.stream.shutdown(std::net::Shutdown::Both);
        }
    }
}

/// Marks as written the spans of a `WROTE` body from byte `at` on (their count, then each
/// span) that lie inside `peer`'s exposures: a WRITE that raced the withdrawal of its
/// standing range records nothing (its memory is the exposure owner's to keep out of reuse
/// until the peer is done with it). Returns where the spans end; `None` when malformed.
fn mark_wrote(host: &Host, peer: &str, grant: &mut Grant, b: &[u8], at: usize) -> Option<usize> {
    let n = u32_at(b, at)? as usize;
    let end = n.checked_mul(24)?.checked_add(at + 4)?;
    if b.len() < end {
        return None;
    }
    if host
        .grant_for(grant, peer, Op::Write, spans_at(b, at + 4, n))
        .is_ok()
    {
        grant.mark_written();
    }
    grant.clear();
    Some(end)
}

/// A link's replies as the target sends them.
type Replies = Arc<LinkOut>;

/// The target's side of one link's socket. A message goes out from the thread that makes it
/// when nothing is queued ahead of it and the socket takes it whole without blocking (no hop
/// to another thread: a GRANT, a standing range); otherwise it waits in order for the link's
/// writer thread, which may block. Messages carrying a file descriptor always go through the
/// writer thread.
struct LinkOut {
    stream: Arc<UnixStream>,
    /// Messages handed to the writer thread and not yet written whole, and whether the link
    /// is broken.
    queued: Arc<Mutex<(usize, bool)>>,
    tx: tessera_sync::unchecked::mpsc::Sender<(Vec<u8>, Option<Region>)>,
}

impl LinkOut {
    /// The link's sender and its writer thread; `None` when no thread could be started.
    fn start(stream: &Arc<UnixStream>) -> Option<Arc<Self>> {
        let (tx, rx) = tessera_sync::unchecked::mpsc::channel::<(Vec<u8>, Option<Region>)>();
        let queued = Arc::new(Mutex::new((0, false)));
        let stream_for_out = stream.clone();
        // The thread holds no sender: it ends once the link's last `LinkOut` is dropped.
        let (stream, q) = (stream.clone(), queued.clone());
        let spawned = std::thread::Builder::new()
            .name("shm-target-tx".into())
            .spawn(move || {
                let (stream, queued) = (&*stream, &*q);
                for (msg, region) in rx {
                    let sent = match region.as_ref().and_then(Region::fd) {
                        Some(fd) => send_with_fd(stream, &msg, fd.as_raw_fd()),
                        None => send_all(stream, &msg),
                    };
                    let mut q = queued.lock();
                    q.0 -= 1;
                    if sent.is_err() {
                        q.1 = true;
                        drop(q);
                        let _ = stream.shutdown(std::net::Shutdown::Both);
                        break;
                    }
                }
            });
        spawned.ok()?;
        Some(Arc::new(Self {
            stream: stream_for_out,
            queued,
            tx,
        }))
    }

    /// Sends `msg` (with `region`'s file descriptor attached, if given), in order after every
    /// message sent before it. Returns `false` once the link is broken.
    fn send(&self, msg: Vec<u8>, region: Option<Region>) -> bool {
        let mut q = self.queued.lock();
        if q.1 {
            return false;
        }
        let mut msg = msg;
        if q.0 == 0 && region.is_none() {
            match send_now(&self.stream, &msg) {
                Ok(n) if n == msg.len() => return true,
                // The rest follows through the writer thread, before anything sent later.
                Ok(n) => {
                    msg.drain(..n);
                }
                Err(_) => {
                    q.1 = true;
                    drop(q);
                    let _ = self.stream.shutdown(std::net::Shutdown::Both);
                    return false;
                }
            }
        }
        q.0 += 1;
        if self.tx.send((msg, region)).is_err() {
            q.1 = true;
            return false;
        }
        true
    }
}

/// This thread's holds on its announcements ([`crate::Agent::hold_announcements`]): how many
/// are alive, and per link what waits for the last to end.
type Held = (usize, Vec<(Replies, Vec<u8>)>);

std::thread_local! {
    static HELD: std::cell::RefCell<Held> = const { std::cell::RefCell::new((0, Vec::new())) };
}

/// A hold on this thread's announcements begins.
pub(crate) fn hold_announcements() {
    HELD.with(|h| h.borrow_mut().0 += 1);
}

/// A hold on this thread's announcements ends; with the last, each link's go out together.
pub(crate) fn release_announcements() {
    let waiting = HELD.with(|h| {
        let mut h = h.borrow_mut();
        h.0 -= 1;
        match h.0 {
            0 => std::mem::take(&mut h.1),
            _ => Vec::new(),
        }
    });
    for (tx, msg) in waiting {
        tx.send(msg, None);
    }
}

/// Sends a STANDING or REVOKE on `tx` now, or, while this thread holds its announcements,
/// after what it already holds for that link.
fn announce(tx: &Replies, msg: &[u8]) {
    let held = HELD.with(|h| {
        let mut h = h.borrow_mut();
        if h.0 == 0 {
            return false;
        }
        match h.1.iter_mut().find(|(t, _)| Arc::ptr_eq(t, tx)) {
            Some((_, waiting)) => waiting.extend_from_slice(msg),
            None => h.1.push((tx.clone(), msg.to_vec())),
        }
        true
    });
    if !held {
        tx.send(msg.to_vec(), None);
    }
}

fn standing_msg(out: &mut Vec<u8>, g: &Standing) {
    frame(out, STANDING, |b| {
        for v in [g.key, g.reg, g.offset, g.len] {
            b.extend_from_slice(&v.to_le_bytes());
        }
    });
}

impl Shm {
    /// The rings of records of `peer`'s inbound links.
    fn rings_of(&self, peer: &str) -> Vec<Arc<Records>> {
        self.inner
            .standing
            .lock()
            .get(peer)
            .map(|p| p.links.iter().filter_map(|l| l.records.clone()).collect())
            .unwrap_or_default()
    }

    /// A new engine listening on an abstract Unix socket named after the process.
    pub fn new() -> Self {
        Self {
            inner: Arc::new(Inner {
                name: format!("tessera-shm-{}-{}", std::process::id(), next_id()),
                token: OnceLock::new(),
                handshake_deadline: OnceLock::new(),
                connect_timeout: OnceLock::new(),
                host: OnceLock::new(),
                closed: AtomicBool::new(false),
                sockets: Mutex::new(Vec::new()),
                claims: Arc::new(Mutex::new(HashMap::new())),
                standing: Arc::new(Mutex::new(HashMap::new())),
            }),
        }
    }
}

impl Shm {
    /// Peers must prove they hold `token` (and this engine proves it to them) before
    /// anything else on a connection; without one, only processes of this user are served.
    /// Set before the agent starts.
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

    /// How long connecting to a peer may take, its listen backlog and the handshake
    /// included, before `add_remote` fails (default 10 s). Set before the agent starts.
    pub fn with_connect_timeout(self, timeout: Duration) -> Self {
        let _ = self.inner.connect_timeout.set(timeout);
        self
    }
}

impl Default for Shm {
    fn default() -> Self {
        Self::new()
    }
}

impl std::fmt::Debug for Shm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shm")
            .field("address", &self.inner.name)
            .finish()
    }
}

fn backend(e: impl std::fmt::Display) -> BackendError {
    BackendError::new(KIND, e)
}

impl Inner {
    fn handshake_deadline(&self) -> Duration {
        self.handshake_deadline
            .get()
            .copied()
            .unwrap_or(PRE_AUTH_DEADLINE)
    }

    fn connect_timeout(&self) -> Duration {
        self.connect_timeout
            .get()
            .copied()
            .unwrap_or(CONNECT_TIMEOUT)
    }

    fn track(&self, s: &Arc<UnixStream>) {
        let mut v = self.sockets.lock();
        v.retain(|w| w.strong_count() > 0);
        v.push(Arc::downgrade(s));
    }
}

impl Transport for Shm {
    fn kind(&self) -> &'static str {
        KIND
    }

    fn start(&self, host: Host) -> Result<(), BackendError> {
        self.inner
            .host
            .set(host)
            .map_err(|_| backend("started twice"))?;
        let addr = SocketAddr::from_abstract_name(self.inner.name.as_bytes()).map_err(backend)?;
        let listener = UnixListener::bind_addr(&addr).map_err(backend)?;
        let inner = self.inner.clone();
        std::thread::Builder::new()
            .name(format!("shm-accept-{}", inner.name))
            .spawn(move || accept_loop(inner, listener))
            .map_err(backend)?;
        Ok(())
    }

    fn register(&self, _: &RegInfo<'_>) -> Result<Vec<u8>, RegisterError> {
        // Nothing to do until a peer asks for the memory; private regions can still be the
        // local side of a transfer, and the target refuses to share them.
        Ok(Vec::new())
    }

    fn deregister(&self, _: u64) {}

    fn local_side_needs_registration(&self) -> bool {
        // Transfers reach local memory through the segment's address.
        false
    }

    fn address(&self) -> Vec<u8> {
        self.inner.name.as_bytes().to_vec()
    }

    fn connect(&self, peer: &PeerInfo) -> Result<Arc<dyn Connection>, BackendError> {
        let host = self
            .inner
            .host
            .get()
            .ok_or_else(|| backend("not started"))?;
        let deadline = Instant::now() + self.inner.connect_timeout();
        let stream = connect_within(&peer.address, self.inner.connect_timeout())
            .map_err(|e| backend(format!("connecting to {}: {e}", peer.name)))?;
        let stream = Arc::new(stream);
        self.inner.track(&stream);
        greet(
            &stream,
            self.inner.token.get(),
            host.name(),
            self.inner.name.as_bytes(),
            &peer.name,
            deadline,
        )
        .map_err(backend)?;
        let conn = Arc::new(ShmConnection {
            local: host.clone(),
            peer: peer.name.clone(),
            writer: Mutex::new(Vec::with_capacity(4096)),
            stream: stream.clone(),
            state: Mutex::new(State::default()),
            records: OnceLock::new(),
            notices: OnceLock::new(),
        });
        let reader = conn.clone();
        std::thread::Builder::new()
            .name(format!("shm-init-{}", peer.name))
            .spawn(move || reader.progress())
            .map_err(backend)?;
        Ok(conn)
    }

    fn tracks_links(&self) -> bool {
        true
    }

    /// Spins on the rings of `peer`'s inbound links, taking their records, until `done` or
    /// the window's end. Their initiators ring no doorbell meanwhile.
    fn spin_for_writes(
        &self,
        peer: &str,
        window: Duration,
        done: &mut dyn FnMut() -> bool,
    ) -> bool {
        let rings = self.rings_of(peer);
        if rings.is_empty() {
            return done();
        }
        for r in &rings {
            r.ring.watch();
        }
        let until = Instant::now() + window;
        loop {
            for r in &rings {
                r.take();
            }
            if done() || Instant::now() >= until {
                break;
            }
            std::hint::spin_loop();
        }
        // What was pushed while this thread still counted as watching came without a
        // doorbell: taken here.
        for r in &rings {
            r.ring.unwatch();
            r.take();
        }
        done()
    }

    /// Counts as a watcher of the rings of `peer`'s inbound links until the watch drops, then
    /// takes what they hold (a link opened meanwhile rings its doorbells as before).
    fn watch_writes(&self, peer: &str) -> WriteWatch {
        let rings = self.rings_of(peer);
        if rings.is_empty() {
            return WriteWatch::default();
        }
        for r in &rings {
            r.ring.watch();
        }
        WriteWatch::new(move || {
            for r in &rings {
                r.ring.unwatch();
                r.take();
            }
        })
    }

    /// Tells every inbound link of `peer` (and any it opens later) that it may WRITE the
    /// range without asking, or no longer may.
    fn standing(&self, peer: &str, grant: Standing, live: bool) {
        let mut all = self.inner.standing.lock();
        let p = all.entry(peer.to_owned()).or_default();
        let mut msg = Vec::new();
        if live {
            p.grants.insert(grant.key, grant);
            standing_msg(&mut msg, &grant);
        } else {
            if p.grants.remove(&grant.key).is_none() {
                return;
            }
            frame(&mut msg, REVOKE, |b| {
                b.extend_from_slice(&grant.key.to_le_bytes())
            });
        }
        // A link whose writer has gone is being torn down; it drops itself.
        for l in &mut p.links {
            l.announce(&msg);
        }
        if p.grants.is_empty() && p.links.is_empty() {
            all.remove(peer);
        }
    }

    fn shutdown(&self) {
        if self.inner.closed.swap(true, Ordering::AcqRel) {
            return;
        }
        // Wake the accept loop so it sees `closed` and exits (never waiting on a full
        // backlog: then the loop is awake anyway).
        let _ = connect_within(self.inner.name.as_bytes(), Duration::ZERO);
        let sockets = std::mem::take(&mut *self.inner.sockets.lock());
        for s in sockets.iter().filter_map(Weak::upgrade) {
            let _ = s.shutdown(std::net::Shutdown::Both);
        }
    }
}

// ----- connecting and the handshake --------------------------------------------------------

/// Connects to the abstract socket `name`, waiting at most `timeout` for room in its listen
/// backlog (`SO_SNDTIMEO` bounds a Unix stream connect; zero means do not wait at all).
fn connect_within(name: &[u8], timeout: Duration) -> io::Result<UnixStream> {
    // SAFETY: an all-zero sockaddr_un is valid.
    let mut addr: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    if name.len() + 1 > addr.sun_path.len() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "socket name too long",
        ));
    }
    addr.sun_family = libc::AF_UNIX as libc::sa_family_t;
    // An abstract name: a NUL, then the name's bytes.
    for (dst, &b) in addr.sun_path[1..].iter_mut().zip(name) {
        *dst = b as libc::c_char;
    }
    let len =
        (std::mem::offset_of!(libc::sockaddr_un, sun_path) + 1 + name.len()) as libc::socklen_t;
    let flags = libc::SOCK_STREAM
        | libc::SOCK_CLOEXEC
        | if timeout.is_zero() {
            libc::SOCK_NONBLOCK
        } else {
            0
        };
    // SAFETY: plain socket creation; the result is checked.
    let fd = unsafe { libc::socket(libc::AF_UNIX, flags, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` is a new socket that nothing else owns; the OwnedFd closes it on every path.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    let stream = UnixStream::from(fd);
    if !timeout.is_zero() {
        stream.set_write_timeout(Some(timeout))?;
    }
    loop {
        // SAFETY: `addr` is an initialized sockaddr_un and `len` covers exactly its family
        // and the abstract name; both live across the call.
        let rc = unsafe {
            libc::connect(
                stream.as_raw_fd(),
                (&addr as *const libc::sockaddr_un).cast(),
                len,
            )
        };
        if rc == 0 {
            break;
        }
        let e = io::Error::last_os_error();
        match e.kind() {
            io::ErrorKind::Interrupted => continue,
            io::ErrorKind::WouldBlock => {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!("the target's listen backlog stayed full for {timeout:?}"),
                ))
            }
            _ => return Err(e),
        }
    }
    stream.set_write_timeout(None)?;
    Ok(stream)
}

/// Reads one handshake message, whose body may be at most `budget` bytes, before `deadline`.
fn read_small(
    stream: &UnixStream,
    deadline: Instant,
    budget: &mut usize,
) -> io::Result<(u8, Vec<u8>)> {
    fn exact(stream: &UnixStream, deadline: Instant, buf: &mut [u8]) -> io::Result<()> {
        let mut got = 0;
        while got < buf.len() {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "handshake deadline",
                ));
            }
            stream.set_read_timeout(Some(left))?;
            match io::Read::read(&mut &*stream, &mut buf[got..]) {
                Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
                Ok(n) => got += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    return Err(io::Error::new(
                        io::ErrorKind::TimedOut,
                        "handshake deadline",
                    ))
                }
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }
    let mut head = [0u8; HEADER];
    if *budget < HEADER {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "handshake too long",
        ));
    }
    exact(stream, deadline, &mut head)?;
    *budget -= HEADER;
    let len = u32::from_le_bytes([head[4], head[5], head[6], head[7]]) as usize;
    if len > *budget {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "handshake too long",
        ));
    }
    *budget -= len;
    let mut body = vec![0u8; len];
    exact(stream, deadline, &mut body)?;
    Ok((head[0], body))
}

/// The dialer's side of the handshake (see [`crate::handshake`]), before `deadline`: on
/// success the target has filed the link under `me`.
fn greet(
    stream: &UnixStream,
    token: Option<&Token>,
    me: &str,
    my_addr: &[u8],
    peer: &str,
    deadline: Instant,
) -> Result<(), String> {
    let io = |e: io::Error| format!("greeting {peer}: {e}");
    if token.is_none() {
        let (_, uid) = handshake::unix_peer_cred(stream.as_raw_fd()).map_err(io)?;
        let ours = handshake::euid();
        if uid != ours {
            return Err(format!(
                "{peer} runs as uid {uid}, not ours ({ours}), and no token is configured"
            ));
        }
    }
    let mut budget = PRE_AUTH_MAX;
    let nonce = crate::auth::nonce();
    let mut out = Vec::new();
    frame(&mut out, HELLO, |b| {
        b.extend_from_slice(&nonce);
        b.push(me.len() as u8);
        b.extend_from_slice(me.as_bytes());
        b.extend_from_slice(my_addr);
    });
    send_all(stream, &out).map_err(io)?;
    let (ty, body) = read_small(stream, deadline, &mut budget).map_err(io)?;
    if ty == REFUSED {
        return Err(handshake::refused(
            peer,
            me,
            body.first().copied().unwrap_or(0),
        ));
    }
    if ty != CHALLENGE || body.len() != NONCE_LEN + crate::auth::MAC_LEN {
        return Err(format!("greeting {peer}: expected its challenge"));
    }
    let mut theirs = [0u8; NONCE_LEN];
    theirs.copy_from_slice(&body[..NONCE_LEN]);
    if !handshake::check_target(token, KIND, &nonce, &theirs, peer, &body[NONCE_LEN..]) {
        return Err(handshake::bad_target_proof(peer, token));
    }
    let proof = handshake::dialer_proof(token, KIND, &nonce, &theirs, me, my_addr);
    out.clear();
    frame(&mut out, AUTH, |b| b.extend_from_slice(&proof));
    send_all(stream, &out).map_err(io)?;
    let (ty, body) = read_small(stream, deadline, &mut budget).map_err(io)?;
    match ty {
        HELLO_ACK => {}
        REFUSED => {
            return Err(handshake::refused(
                peer,
                me,
                body.first().copied().unwrap_or(0),
            ))
        }
        _ => return Err(format!("greeting {peer}: expected its acknowledgement")),
    }
    stream.set_read_timeout(None).map_err(io)?;
    Ok(())
}

/// Agent names with live inbound links, with the process that claimed each (its
/// `SO_PEERCRED` pid) and how many of its connections are open.
type Claims = Mutex<HashMap<String, (i32, usize)>>;

/// One connection's claim on its peer's name. A name belongs to the process that
/// authenticated as it first, until its last connection closed: that process may connect
/// again under it (a peer handle dropped and added again), any other is refused.
struct Claim {
    claims: Arc<Claims>,
    name: String,
}

impl Claim {
    fn new(claims: &Arc<Claims>, name: &str, pid: i32) -> Option<Self> {
        let mut map = claims.lock();
        match map.get_mut(name) {
            Some((owner, n)) if *owner == pid => *n += 1,
            Some(_) => return None,
            None => {
                map.insert(name.to_owned(), (pid, 1));
            }
        }
        Some(Self {
            claims: claims.clone(),
            name: name.to_owned(),
        })
    }
}

impl Drop for Claim {
    fn drop(&mut self) {
        let mut map = self.claims.lock();
        if let Some((_, n)) = map.get_mut(&self.name) {
            *n -= 1;
            if *n == 0 {
                map.remove(&self.name);
            }
        }
    }
}

/// The target's side of the handshake: the authenticated dialer's name and its link guard,
/// or `None` (after telling the dialer why, where that helps it) when the connection must
/// close. At most `PRE_AUTH_MAX` bytes are read, within `deadline`.
fn admit(
    stream: &UnixStream,
    host: &Host,
    token: Option<&Token>,
    claims: &Arc<Claims>,
    deadline: Duration,
) -> Option<(String, (Claim, crate::engine::LinkGuard))> {
    let refuse = |code: u8| {
        let mut out = Vec::new();
        frame(&mut out, REFUSED, |b| b.push(code));
        let _ = send_all(stream, &out);
    };
    let (pid, uid) = handshake::unix_peer_cred(stream.as_raw_fd()).ok()?;
    if token.is_none() && uid != handshake::euid() {
        refuse(handshake::REFUSED_UID);
        return None;
    }
    let deadline = Instant::now() + deadline;
    let mut budget = PRE_AUTH_MAX;
    let (ty, body) = read_small(stream, deadline, &mut budget).ok()?;
    if ty != HELLO || body.len() < NONCE_LEN + 1 {
        return None;
    }
    let mut theirs = [0u8; NONCE_LEN];
    theirs.copy_from_slice(&body[..NONCE_LEN]);
    let name_len = body[NONCE_LEN] as usize;
    let rest = &body[NONCE_LEN + 1..];
    if name_len == 0 || rest.len() < name_len {
        return None;
    }
    let name = std::str::from_utf8(&rest[..name_len]).ok()?.to_owned();
    let addr = &rest[name_len..];
    let ours = crate::auth::nonce();
    let proof = handshake::target_proof(token, KIND, &theirs, &ours, host.name());
    let mut out = Vec::new();
    frame(&mut out, CHALLENGE, |b| {
        b.extend_from_slice(&ours);
        b.extend_from_slice(&proof);
    });
    send_all(stream, &out).ok()?;
    let (ty, body) = read_small(stream, deadline, &mut budget).ok()?;
    if ty != AUTH {
        return None;
    }
    if !handshake::check_dialer(token, KIND, &theirs, &ours, &name, addr, &body) {
        refuse(handshake::REFUSED_PROOF);
        return None;
    }
    let Some(claim) = Claim::new(claims, &name, pid) else {
        refuse(handshake::REFUSED_NAME_IN_USE);
        return None;
    };
    let guard = (claim, host.link_open(&name));
    out.clear();
    frame(&mut out, HELLO_ACK, |_| {});
    send_all(stream, &out).ok()?;
    stream.set_read_timeout(None).ok()?;
    Some((name, guard))
}

// ----- framing -----------------------------------------------------------------------------

/// Appends a message: type, three zero bytes, body length, body.
pub(crate) fn frame(out: &mut Vec<u8>, ty: u8, body: impl FnOnce(&mut Vec<u8>)) {
    let start = out.len();
    out.extend_from_slice(&[ty, 0, 0, 0, 0, 0, 0, 0]);
    body(out);
    let len = (out.len() - start - HEADER) as u32;
    out[start + 4..start + 8].copy_from_slice(&len.to_le_bytes());
}

fn send_all(stream: &UnixStream, mut data: &[u8]) -> io::Result<()> {
    while !data.is_empty() {
        // SAFETY: `data` is a valid readable buffer for its length; MSG_NOSIGNAL turns a dead
        // peer into EPIPE instead of a signal.
        let n = unsafe {
            libc::send(
                stream.as_raw_fd(),
                data.as_ptr().cast(),
                data.len(),
                libc::MSG_NOSIGNAL,
            )
        };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        data = &data[n as usize..];
    }
    Ok(())
}

/// Appends a transfer's spans as `XFER` and `WROTE` carry them: their count, then each
/// (registration, offset, length).
fn put_spans(b: &mut Vec<u8>, segments: &[crate::engine::Segment]) {
    b.extend_from_slice(&(segments.len() as u32).to_le_bytes());
    for s in segments {
        b.extend_from_slice(&s.remote_reg.to_le_bytes());
        b.extend_from_slice(&s.remote_offset.to_le_bytes());
        b.extend_from_slice(&s.len.to_le_bytes());
    }
}

/// The `n` spans of a message body from byte `at` on (their count before them was checked
/// against the body's length).
fn spans_at(b: &[u8], at: usize, n: usize) -> impl Iterator<Item = (u64, u64, u64)> + '_ {
    (0..n).map(move |i| {
        let at = at + i * 24;
        (
            u64_at(b, at).unwrap_or(0),
            u64_at(b, at + 8).unwrap_or(0),
            u64_at(b, at + 16).unwrap_or(0),
        )
    })
}

/// Sends as much of `data` as the socket takes without blocking; returns the bytes sent.
fn send_now(stream: &UnixStream, data: &[u8]) -> io::Result<usize> {
    let mut sent = 0;
    while sent < data.len() {
        let rest = &data[sent..];
        // SAFETY: `rest` is a valid readable buffer for its length; MSG_NOSIGNAL turns a dead
        // peer into EPIPE instead of a signal, MSG_DONTWAIT a full socket into EAGAIN.
        let n = unsafe {
            libc::send(
                stream.as_raw_fd(),
                rest.as_ptr().cast(),
                rest.len(),
                libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT,
            )
        };
        if n < 0 {
            let e = io::Error::last_os_error();
            match e.kind() {
                io::ErrorKind::Interrupted => continue,
                io::ErrorKind::WouldBlock => return Ok(sent),
                _ => return Err(e),
            }
        }
        sent += n as usize;
    }
    Ok(sent)
}

/// Sends `data` with `fd` attached (SCM_RIGHTS) to its first byte.
fn send_with_fd(stream: &UnixStream, data: &[u8], fd: RawFd) -> io::Result<()> {
    // u64 words keep the control buffer aligned for `cmsghdr`.
    let mut control = [0u64; 8];
    let mut iov = libc::iovec {
        iov_base: data.as_ptr() as *mut libc::c_void,
        iov_len: data.len(),
    };
    // SAFETY: an all-zero msghdr is valid (null pointers, zero lengths).
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    // SAFETY: CMSG_SPACE is a pure size computation.
    msg.msg_controllen = unsafe { libc::CMSG_SPACE(size_of::<RawFd>() as u32) } as _;
    // SAFETY: `msg` points at `control`, which is large enough (64 bytes) and aligned for one
    // cmsghdr carrying one fd, so CMSG_FIRSTHDR is non-null and CMSG_DATA lies inside it.
    unsafe {
        let cmsg = libc::CMSG_FIRSTHDR(&msg);
        (*cmsg).cmsg_level = libc::SOL_SOCKET;
        (*cmsg).cmsg_type = libc::SCM_RIGHTS;
        (*cmsg).cmsg_len = libc::CMSG_LEN(size_of::<RawFd>() as u32) as _;
        std::ptr::write_unaligned(libc::CMSG_DATA(cmsg).cast::<RawFd>(), fd);
    }
    let sent = loop {
        // SAFETY: `msg` and everything it points to (iov, data, control) live across the call.
        let n = unsafe { libc::sendmsg(stream.as_raw_fd(), &msg, libc::MSG_NOSIGNAL) };
        if n >= 0 {
            break n as usize;
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    };
    send_all(stream, &data[sent..])
}

/// Reads framed messages, collecting any passed file descriptors in arrival order.
struct Reader {
    buf: Vec<u8>,
    start: usize,
    end: usize,
    fds: VecDeque<OwnedFd>,
}

impl Reader {
    fn new() -> Self {
        Self {
            buf: vec![0; READ_BUF],
            start: 0,
            end: 0,
            fds: VecDeque::new(),
        }
    }

    fn fill(&mut self, stream: &UnixStream) -> io::Result<usize> {
        if self.start > 0 && self.start == self.end {
            self.start = 0;
            self.end = 0;
        }
        if self.end == self.buf.len() {
            self.buf.copy_within(self.start..self.end, 0);
            self.end -= self.start;
            self.start = 0;
        }
        let mut control = [0u64; 16];
        let free = &mut self.buf[self.end..];
        let mut iov = libc::iovec {
            iov_base: free.as_mut_ptr().cast(),
            iov_len: free.len(),
        };
        // SAFETY: an all-zero msghdr is valid.
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        msg.msg_control = control.as_mut_ptr().cast();
        msg.msg_controllen = size_of_val(&control) as _;
        let n = loop {
            // SAFETY: `msg` points at a writable iovec over our buffer's free tail and a
            // writable, aligned control buffer of the stated size; all outlive the call.
            let n = unsafe { libc::recvmsg(stream.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC) };
            if n >= 0 {
                break n as usize;
            }
            let e = io::Error::last_os_error();
            if e.kind() != io::ErrorKind::Interrupted {
                return Err(e);
            }
        };
        // SAFETY: `msg` was filled by recvmsg; the CMSG_* walk stays within msg_controllen,
        // and each SCM_RIGHTS payload holds `count` descriptors that are now ours.
        unsafe {
            let mut cmsg = libc::CMSG_FIRSTHDR(&msg);
            while !cmsg.is_null() {
                if (*cmsg).cmsg_level == libc::SOL_SOCKET && (*cmsg).cmsg_type == libc::SCM_RIGHTS {
                    let data = libc::CMSG_DATA(cmsg);
                    let bytes = (*cmsg).cmsg_len as usize - libc::CMSG_LEN(0) as usize;
                    for i in 0..bytes / size_of::<RawFd>() {
                        let fd = std::ptr::read_unaligned(data.cast::<RawFd>().add(i));
                        self.fds.push_back(OwnedFd::from_raw_fd(fd));
                    }
                }
                cmsg = libc::CMSG_NXTHDR(&msg, cmsg);
            }
        }
        self.end += n;
        Ok(n)
    }

    /// The next message as (type, body range in `self.buf`), or `None` at end of stream.
    fn next(&mut self, stream: &UnixStream) -> io::Result<Option<(u8, std::ops::Range<usize>)>> {
        loop {
            let avail = self.end - self.start;
            if avail >= HEADER {
                let h = &self.buf[self.start..self.start + HEADER];
                let ty = h[0];
                let len = u32::from_le_bytes([h[4], h[5], h[6], h[7]]) as usize;
                if len > MAX_BODY {
                    return Err(io::Error::new(
                        io::ErrorKind::InvalidData,
                        "message too large",
                    ));
                }
                if avail >= HEADER + len {
                    let body = self.start + HEADER..self.start + HEADER + len;
                    self.start += HEADER + len;
                    return Ok(Some((ty, body)));
                }
                // Room grows only as bytes arrive: doubled (at most to the message's size)
                // each time the buffer is full, never to the announced length at once.
                if self.end == self.buf.len() {
                    if self.start > 0 {
                        self.buf.copy_within(self.start..self.end, 0);
                        self.end -= self.start;
                        self.start = 0;
                    } else {
                        let grown = (self.buf.len() * 2).min(HEADER + len);
                        self.buf.resize(grown, 0);
                    }
                }
            }
            if self.fill(stream)? == 0 {
                return Ok(None);
            }
        }
    }
}

// ----- initiator side ----------------------------------------------------------------------

struct Mapped {
    region: Region,
    /// Where the registration starts in the mapped memfd.
    base: u64,
    len: u64,
}

/// The span of pages around a read fault that the kernel maps at once from a file's page
/// cache (`fault_around_bytes`, 64 KiB unless changed; a window aligned to its size).
const FAULT_AROUND: usize = 64 << 10;

/// Reads one byte of `[dst, dst + len)` in each [`FAULT_AROUND`] window the range enters,
/// ahead of a copy into it. A page of the peer's memfd that this process has not mapped yet
/// costs a fault of its own when written (a write fault maps one page), while a read fault
/// maps every page of its window the memfd already holds, writable in a shared mapping of
/// shmem: the copy then faults once per window instead of once per page. On the benchmark
/// machine that is 0.15-0.2 us a page instead of 1.06 (each of 32 sessions' first writes into
/// a unit's 1 GiB pool paid the latter; so did the first PUTs into each credit). Every byte
/// read lies in the range the copy writes next, so no page is allocated that the copy would
/// not have faulted in, and a window this process mapped already costs one load.
///
/// # Safety
///
/// `dst` must be valid for reads of `len` bytes.
unsafe fn fault_around(dst: *const u8, len: usize) {
    let (mut at, end) = (dst as usize, (dst as usize).saturating_add(len));
    while at < end {
        // SAFETY: `at` lies in the caller's range. Volatile: the value is not used, the fault
        // is the point; a peer may write the byte meanwhile, which only changes what is read.
        unsafe { std::ptr::read_volatile(at as *const u8) };
        at = (at | (FAULT_AROUND - 1)) + 1;
    }
}

#[derive(Default)]
struct State {
    mapped: HashMap<u64, Arc<Mapped>>,
    requested: HashSet<u64>,
    pending: HashMap<u64, Xfer>,
    dead: Option<String>,
    standing: Standings,
    /// Bytes taken from the ring of announcements, and a record's buffer.
    notices: (u64, Vec<u8>),
}

/// The target's standing exposures to us, as its announcements told them.
#[derive(Default)]
struct Standings {
    /// `(registration, offset)` to `(len, key)`.
    ranges: std::collections::BTreeMap<(u64, u64), (u64, u64)>,
    /// Each key's place in `ranges`.
    keys: HashMap<u64, (u64, u64)>,
}

impl Standings {
    /// Applies the body `b` of a `STANDING` or `REVOKE`; `Err` names what is malformed.
    fn apply(&mut self, ty: u8, b: &[u8]) -> Result<(), &'static str> {
        if ty == REVOKE {
            let key = u64_at(b, 0).ok_or("malformed REVOKE")?;
            if let Some(at) = self.keys.remove(&key) {
                self.ranges.remove(&at);
            }
            return Ok(());
        }
        let (Some(key), Some(reg), Some(off), Some(len)) =
            (u64_at(b, 0), u64_at(b, 8), u64_at(b, 16), u64_at(b, 24))
        else {
            return Err("malformed STANDING");
        };
        if off.checked_add(len).is_none() {
            return Err("malformed STANDING");
        }
        if let Some(old) = self.keys.insert(key, (reg, off)) {
            self.ranges.remove(&old);
        }
        self.ranges.insert((reg, off), (len, key));
        Ok(())
    }
}

/// The type and body of a record of the ring of announcements: one framed `STANDING` or
/// `REVOKE`.
fn announcement(rec: &[u8]) -> Result<(u8, &[u8]), &'static str> {
    let bad = "malformed announcement";
    let (head, body) = rec.split_at_checked(HEADER).ok_or(bad)?;
    let len = u32_at(head, 4).ok_or(bad)? as usize;
    match head[0] {
        STANDING | REVOKE if len == body.len() => Ok((head[0], body)),
        _ => Err(bad),
    }
}

impl State {
    /// Whether every segment of a WRITE lies in one standing range of its registration, and
    /// that registration is mapped: then it needs no grant.
    fn standing_covers(&self, plan: &crate::engine::Plan) -> bool {
        plan.op() == Op::Write
            && !self.standing.ranges.is_empty()
            && plan.segments().iter().all(|seg| {
                self.mapped.contains_key(&seg.remote_reg)
                    && self
                        .standing
                        .ranges
                        .range(..=(seg.remote_reg, seg.remote_offset))
                        .next_back()
                        .is_some_and(|(&(reg, off), &(len, _))| {
                            reg == seg.remote_reg
                                && seg
                                    .remote_offset
                                    .checked_add(seg.len)
                                    .is_some_and(|end| end <= off + len)
                        })
            })
    }
}

struct ShmConnection {
    /// The initiating agent, which runs the copy and counts it.
    local: Host,
    peer: String,
    stream: Arc<UnixStream>,
    writer: Mutex<Vec<u8>>,
    state: Mutex<State>,
    /// The link's ring of WRITE records, once the target sent it.
    records: OnceLock<Producer>,
    /// The link's ring of announcements, once the target sent it (its head is in `state`).
    notices: OnceLock<MappedRing>,
}

/// The initiator's side of a link's ring of WRITE records (see `shm_ring`).
struct Producer {
    ring: MappedRing,
    /// Bytes pushed so far, and a record's buffer.
    tail: Mutex<(u64, Vec<u8>)>,
}

impl ShmConnection {
    fn gone(&self, detail: &str) -> TransferError {
        TransferError::PeerGone {
            peer: self.peer.clone(),
            detail: detail.to_owned(),
        }
    }

    /// Fails every pending transfer; later posts fail at once.
    fn die(&self, why: &str) {
        let pending: Vec<Xfer> = {
            let mut st = self.state.lock();
            st.dead.get_or_insert_with(|| why.to_owned());
            st.pending.drain().map(|(_, x)| x).collect()
        };
        for x in pending {
            x.done.complete(Err(self.gone(why)));
        }
    }

    /// Applies what the link's ring of announcements holds, in order (under the state's lock,
    /// on whichever thread needs them now). `Err`, and the link must end, when it is
    /// malformed.
    fn take_notices(&self, st: &mut State) -> Result<(), &'static str> {
        let Some(ring) = self.notices.get() else {
            return Ok(());
        };
        let State {
            standing, notices, ..
        } = st;
        let mut applied = Ok(());
        let taken = ring.take(&mut notices.0, &mut notices.1, |rec| {
            if applied.is_ok() {
                applied = announcement(rec).and_then(|(ty, b)| standing.apply(ty, b));
            }
        });
        taken.map_err(|_| "malformed ring of announcements")?;
        applied
    }

    fn send(&self, build: impl FnOnce(&mut Vec<u8>)) -> io::Result<()> {
        let mut buf = self.writer.lock();
        buf.clear();
        build(&mut buf);
        send_all(&self.stream, &buf)
    }

    fn progress(self: Arc<Self>) {
        let mut reader = Reader::new();
        let why = loop {
            let (ty, body) = match reader.next(&self.stream) {
                Ok(Some(m)) => m,
                Ok(None) => break "connection closed".to_owned(),
                Err(e) => break format!("connection failed: {e}"),
            };
            let b = &reader.buf[body];
            match ty {
                MAP_OK => {
                    let (Some(reg), Some(base), Some(len)) =
                        (u64_at(b, 0), u64_at(b, 8), u64_at(b, 16))
                    else {
                        break "malformed MAP_OK".to_owned();
                    };
                    let Some(fd) = reader.fds.pop_front() else {
                        break "MAP_OK without a file descriptor".to_owned();
                    };
                    let mapped = base
                        .checked_add(len)
                        .ok_or(crate::RegionError::TooLarge { len })
                        .and_then(|total| Region::map_sealed(fd, total));
                    let mut st = self.state.lock();
                    st.requested.remove(&reg);
                    // A mapping that fails leaves the registration unmapped: transfers to it
                    // fail with a backend error naming it.
                    if let Ok(region) = mapped {
                        st.mapped
                            .insert(reg, Arc::new(Mapped { region, base, len }));
                    }
                }
                RING => {
                    let Some(len) = u64_at(b, 0) else {
                        break "malformed RING".to_owned();
                    };
                    let Some(fd) = reader.fds.pop_front() else {
                        break "RING without a file descriptor".to_owned();
                    };
                    // A ring that cannot be mapped leaves every record on the socket.
                    if let Some(ring) = MappedRing::map(fd, len) {
                        let _ = self.records.set(Producer {
                            ring,
                            tail: Mutex::new((0, Vec::new())),
                        });
                    }
                }
                MAP_ERR => {
                    let Some(reg) = u64_at(b, 0) else {
                        break "malformed MAP_ERR".to_owned();
                    };
                    self.state.lock().requested.remove(&reg);
                }
                ANNOUNCE_RING => {
                    let Some(len) = u64_at(b, 0) else {
                        break "malformed ANNOUNCE_RING".to_owned();
                    };
                    let Some(fd) = reader.fds.pop_front() else {
                        break "ANNOUNCE_RING without a file descriptor".to_owned();
                    };
                    // The target announces through it from now on: announcements this side
                    // cannot read would be lost, so the link cannot go on without it.
                    let Some(ring) = MappedRing::map(fd, len) else {
                        break "the ring of announcements could not be mapped".to_owned();
                    };
                    if self.notices.set(ring).is_err() {
                        break "a second ring of announcements".to_owned();
                    }
                }
                ANNOUNCED => {
                    if let Err(why) = self.take_notices(&mut self.state.lock()) {
                        break why.to_owned();
                    }
                }
                STANDING | REVOKE => {
                    // What the ring holds was announced before anything on the socket.
                    let mut st = self.state.lock();
                    let applied = self
                        .take_notices(&mut st)
                        .and_then(|()| st.standing.apply(ty, b));
                    if let Err(why) = applied {
                        break why.to_owned();
                    }
                }
                GRANT | REJECT => {
                    let Some(id) = u64_at(b, 0) else {
                        break "malformed GRANT".to_owned();
                    };
                    let reason = b.get(8).copied().unwrap_or(0);
                    let xfer = self.state.lock().pending.remove(&id);
                    let Some(xfer) = xfer else {
                        break "GRANT for an unknown transfer".to_owned();
                    };
                    if ty == REJECT {
                        xfer.done.complete(Err(TransferError::Rejected {
                            peer: self.peer.clone(),
                            reason: RejectReason::from_code(reason),
                        }));
                        continue;
                    }
                    self.execute(id, xfer);
                }
                _ => break format!("unexpected message type {ty}"),
            }
        };
        self.die(&why);
        let _ = self.stream.shutdown(std::net::Shutdown::Both);
    }

    /// Copies a granted transfer, then tells the target it is done.
    fn execute(&self, id: u64, xfer: Xfer) {
        let copied = self.copy(&xfer);
        // The target releases its pins either way; the notification only follows data that
        // landed.
        let notify = xfer.notify.as_deref().filter(|_| copied.is_ok());
        let sent = self.send(|out| {
            frame(out, DONE, |b| {
                b.extend_from_slice(&id.to_le_bytes());
                b.push(u8::from(copied.is_ok()));
                b.push(u8::from(notify.is_some()));
                b.extend_from_slice(notify.unwrap_or_default());
            })
        });
        let result = match (copied, sent) {
            (Err(e), _) => Err(e),
            (Ok(()), Err(e)) => Err(self.gone(&format!("sending DONE: {e}"))),
            (Ok(()), Ok(())) => Ok(()),
        };
        xfer.done.complete(result);
    }

    /// Pushes the record of a WRITE of `segments` into the link's ring (after its copy
    /// completed: the copy's stores are fenced); `None` without a ring.
    fn push_record(&self, segments: &[crate::engine::Segment]) -> Option<Pushed> {
        let p = self.records.get()?;
        let mut t = p.tail.lock();
        let (tail, record) = &mut *t;
        record.clear();
        put_spans(record, segments);
        Some(p.ring.push(tail, record))
    }

    /// A WRITE inside the target's standing ranges: copied here and now, then the record of
    /// which spans landed goes into the link's ring (with a doorbell when no target thread
    /// watches it), or as `WROTE` when it carries a notification or the ring has no room,
    /// and the transfer completes on the caller's thread. No round trip.
    fn write_standing(&self, xfer: Xfer) {
        if let Some(why) = self.state.lock().dead.clone() {
            xfer.done.complete(Err(self.gone(&why)));
            return;
        }
        let copied = self.copy(&xfer);
        let notify = xfer.notify.as_deref().filter(|_| copied.is_ok());
        let pushed = match (&copied, notify) {
            (Ok(()), None) => self.push_record(xfer.plan().segments()),
            _ => None,
        };
        let sent = match (&copied, pushed) {
            // Nothing landed: the target has nothing to record.
            (Err(_), _) => Ok(()),
            (Ok(()), Some(Pushed::Watched)) => Ok(()),
            (Ok(()), Some(Pushed::Unwatched)) => self.send(|out| frame(out, RECORDS, |_| {})),
            (Ok(()), Some(Pushed::NoRoom) | None) => self.send(|out| {
                frame(out, WROTE, |b| {
                    let segments = xfer.plan().segments();
                    b.push(u8::from(notify.is_some()));
                    put_spans(b, segments);
                    b.extend_from_slice(notify.unwrap_or_default());
                })
            }),
        };
        let result = match (copied, sent) {
            (Err(e), _) => Err(e),
            (Ok(()), Err(e)) => {
                self.die(&format!("sending WROTE: {e}"));
                Err(self.gone(&format!("sending WROTE: {e}")))
            }
            (Ok(()), Ok(())) => {
                self.local.count_standing_write();
                Ok(())
            }
        };
        xfer.done.complete(result);
    }

    fn copy(&self, xfer: &Xfer) -> Result<(), TransferError> {
        let plan = xfer.plan();
        let mut copied = 0u64;
        // The mapping of the current registration, held (not cloned) across its segments: an
        // atomic per segment would wait for the previous copy's stores to drain.
        let mut current: Option<(u64, Arc<Mapped>)> = None;
        let mut copier = Copier::with_slice(self.local.copy_slice());
        for seg in plan.segments() {
            let m: &Mapped = match &mut current {
                Some((reg, m)) if *reg == seg.remote_reg => m,
                slot => {
                    let m = self
                        .state
                        .lock()
                        .mapped
                        .get(&seg.remote_reg)
                        .cloned()
                        .ok_or_else(|| TransferError::Backend {
                            peer: self.peer.clone(),
                            source: backend(format!(
                                "registration {} could not be mapped (private memory?)",
                                seg.remote_reg
                            )),
                        })?;
                    &slot.insert((seg.remote_reg, m)).1
                }
            };
            match seg.remote_offset.checked_add(seg.len) {
                Some(end) if end <= m.len => {}
                _ => {
                    return Err(TransferError::Rejected {
                        peer: self.peer.clone(),
                        reason: RejectReason::OutOfRange,
                    })
                }
            }
            let remote = m
                .region
                .as_ptr()
                .wrapping_add((m.base + seg.remote_offset) as usize);
            let (src, dst) = match plan.op() {
                Op::Write => {
                    // SAFETY: the remote range, checked above, lies in the mapping.
                    unsafe { fault_around(remote, seg.len as usize) };
                    (seg.local_ptr(), remote)
                }
                Op::Read => (remote, seg.local_ptr()),
            };
            // SAFETY: the local range lies in a registration the plan pins, or, for a WRITE
            // from unregistered sources, in memory the plan's keep-alive owns and nobody
            // writes (`Peer::write_unregistered`'s contract); the remote range was checked
            // against the mapping (sealed, so never truncated) and the target
            // pinned its registration for this transfer.
            unsafe { copier.copy(src, dst, seg.len as usize) };
            copied += seg.len;
        }
        self.local.count_copied(plan.op(), copied);
        Ok(())
    }
}

impl Connection for ShmConnection {
    fn post(&self, xfer: Xfer) {
        if xfer.plan().segments().is_empty() {
            if let Some(why) = self.state.lock().dead.clone() {
                xfer.done.complete(Err(self.gone(&why)));
                return;
            }
            let msg = xfer.notify.as_deref().unwrap_or_default();
            let sent = self.send(|out| frame(out, NOTIFY, |b| b.extend_from_slice(msg)));
            let result = sent.map_err(|e| self.gone(&format!("sending a notification: {e}")));
            xfer.done.complete(result);
            return;
        }
        let standing = {
            let mut st = self.state.lock();
            self.take_notices(&mut st)
                .map(|()| st.standing_covers(xfer.plan()))
        };
        match standing {
            Ok(true) => return self.write_standing(xfer),
            Ok(false) => {}
            Err(why) => {
                self.die(why);
                let _ = self.stream.shutdown(std::net::Shutdown::Both);
                return xfer.done.complete(Err(self.gone(why)));
            }
        }
        let id = next_id();
        // Lock order: writer, then state. The progress thread never holds both, and the
        // target always keeps reading, so a blocked send cannot deadlock.
        let mut out = self.writer.lock();
        out.clear();
        {
            let mut st = self.state.lock();
            if let Some(why) = st.dead.clone() {
                drop(st);
                drop(out);
                xfer.done.complete(Err(self.gone(&why)));
                return;
            }
            let segments = xfer.plan().segments();
            for seg in segments {
                let r = seg.remote_reg;
                if !st.mapped.contains_key(&r) && st.requested.insert(r) {
                    frame(&mut out, MAP_REQ, |b| b.extend_from_slice(&r.to_le_bytes()));
                }
            }
            frame(&mut out, XFER, |b| {
                b.extend_from_slice(&id.to_le_bytes());
                b.push(xfer.plan().op().code());
                put_spans(b, segments);
            });
            st.pending.insert(id, xfer);
        }
        let sent = send_all(&self.stream, &out);
        drop(out);
        if let Err(e) = sent {
            self.die(&format!("sending a request: {e}"));
        }
    }

    /// Unmaps registrations the peer no longer announces, so their memory can be freed on
    /// its side (a transfer still copying keeps its own handle on the mapping).
    fn update(&self, peer: &PeerInfo) -> Result<(), BackendError> {
        let live: HashSet<u64> = peer.regs.iter().map(|r| r.id).collect();
        let dropped: Vec<Arc<Mapped>> = {
            let mut st = self.state.lock();
            let gone: Vec<u64> = st
                .mapped
                .keys()
                .filter(|k| !live.contains(k))
                .copied()
                .collect();
            gone.iter().filter_map(|k| st.mapped.remove(k)).collect()
        };
        drop(dropped);
        Ok(())
    }

    fn close(&self) {
        let _ = self.stream.shutdown(std::net::Shutdown::Both);
    }

    /// Shuts the socket down both ways, as `close` does: the progress thread reads the end
    /// and fails every transfer waiting for its grant; a transfer already copying finishes
    /// its `memcpy` and then fails sending `DONE`. The target sees the end, drops the grants
    /// it held for this link and serves others on.
    fn cut(&self) -> bool {
        let _ = self.stream.shutdown(std::net::Shutdown::Both);
        true
    }
}

// ----- target side -------------------------------------------------------------------------

fn accept_loop(inner: Arc<Inner>, listener: UnixListener) {
    for stream in listener.incoming() {
        if inner.closed.load(Ordering::Acquire) {
            break;
        }
        let Ok(stream) = stream else { continue };
        let Some(host) = inner.host.get().cloned() else {
            break;
        };
        let stream = Arc::new(stream);
        inner.track(&stream);
        let token = inner.token.get().cloned();
        let claims = inner.claims.clone();
        let deadline = inner.handshake_deadline();
        let standing = inner.standing.clone();
        let spawned = std::thread::Builder::new()
            .name("shm-target".into())
            .spawn(move || serve(host, stream, token, claims, standing, deadline));
        if spawned.is_err() {
            continue;
        }
    }
}

/// Serves one initiator until it disconnects. Grants live here, so a dead initiator's pins
/// are released when this returns.
fn serve(
    host: Host,
    stream: Arc<UnixStream>,
    token: Option<Token>,
    claims: Arc<Claims>,
    standing: Arc<StandingTable>,
    deadline: Duration,
) {
    // Nothing but the handshake is read from a peer that has not authenticated. The peer
    // counts as able to write into this agent's memory from then on until its socket closed
    // and its grants are gone (below). Its own mapping of our memory is not ours to see: an
    // initiator process that outlives its socket could still copy.
    let Some((peer, open)) = admit(&stream, &host, token.as_ref(), &claims, deadline) else {
        let _ = stream.shutdown(std::net::Shutdown::Both);
        return;
    };
    // Replies never block this thread, so it always keeps reading and an initiator blocked
    // sending to us always makes progress: each goes out at once when the socket takes it
    // whole, else through the link's writer thread (see `LinkOut`).
    let Some(tx) = LinkOut::start(&stream) else {
        let _ = stream.shutdown(std::net::Shutdown::Both);
        return;
    };
    // The link's ring of WRITE records goes to the initiator first (a link without one
    // sends every record on the socket).
    let records = Records::create(&host, &peer, &stream);
    if let Some(r) = &records {
        let mut msg = Vec::new();
        frame(&mut msg, RING, |b| {
            b.extend_from_slice(&RING_BYTES.to_le_bytes())
        });
        tx.send(msg, Some(r.ring.memory().clone()));
    }
    // Then its ring of announcements, before any announcement (a link without one sends
    // them all on the socket).
    let notices = MappedRing::create("tessera-shm-announcements").map(|ring| {
        let mut msg = Vec::new();
        frame(&mut msg, ANNOUNCE_RING, |b| {
            b.extend_from_slice(&RING_BYTES.to_le_bytes())
        });
        tx.send(msg, Some(ring.memory().clone()));
        Notices { ring, tail: 0 }
    });
    // The peer's standing exposures reach it through this link from now on, those made
    // before it first.
    let link = next_id();
    {
        let mut all = standing.lock();
        let p = all.entry(peer.clone()).or_default();
        let mut l = Link {
            id: link,
            tx: tx.clone(),
            records: records.clone(),
            notices,
        };
        for g in p.grants.values() {
            let mut msg = Vec::new();
            standing_msg(&mut msg, g);
            l.announce(&msg);
        }
        p.links.push(l);
    }
    let mut reader = Reader::new();
    let mut grants: HashMap<u64, Grant> = HashMap::new();
    let mut spare: Vec<Grant> = Vec::new();
    while let Ok(Some((ty, body))) = reader.next(&stream) {
        let b = &reader.buf[body];
        let mut out = Vec::new();
        let ok = match ty {
            MAP_REQ => {
                let Some(reg) = u64_at(b, 0) else { break };
                match host
                    .registration(reg)
                    .filter(|(region, _, _)| region.is_shareable())
                {
                    Some((region, base, len)) => {
                        frame(&mut out, MAP_OK, |o| {
                            o.extend_from_slice(&reg.to_le_bytes());
                            o.extend_from_slice(&base.to_le_bytes());
                            o.extend_from_slice(&len.to_le_bytes());
                        });
                        tx.send(out, Some(region))
                    }
                    None => {
                        frame(&mut out, MAP_ERR, |o| {
                            o.extend_from_slice(&reg.to_le_bytes())
                        });
                        tx.send(out, None)
                    }
                }
            }
            XFER => {
                let (Some(id), Some(&op), Some(n)) = (u64_at(b, 0), b.get(8), u32_at(b, 9)) else {
                    break;
                };
                let n = n as usize;
                if Op::from_code(op).is_none() || b.len() != 13 + n * 24 {
                    break;
                }
                let spans = spans_at(b, 13, n);
                let Some(op) = Op::from_code(op) else { break };
                let mut grant = spare.pop().unwrap_or_default();
                match host.grant_for(&mut grant, &peer, op, spans) {
                    Ok(()) => {
                        grants.insert(id, grant);
                        frame(&mut out, GRANT, |o| o.extend_from_slice(&id.to_le_bytes()));
                    }
                    Err(reason) => {
                        spare.push(grant);
                        frame(&mut out, REJECT, |o| {
                            o.extend_from_slice(&id.to_le_bytes());
                            o.push(reason.code());
                        });
                    }
                }
                tx.send(out, None)
            }
            DONE => {
                let (Some(id), Some(&copied), Some(&has_note)) = (u64_at(b, 0), b.get(8), b.get(9))
                else {
                    break;
                };
                if let Some(mut g) = grants.remove(&id) {
                    // The initiator reports whether its copy succeeded: only then do the
                    // exposures count the bytes as written.
                    if copied != 0 {
                        g.mark_written();
                    }
                    g.clear();
                    spare.push(g);
                }
                if has_note != 0 {
                    host.notify(&peer, b[10..].to_vec());
                }
                true
            }
            NOTIFY => {
                host.notify(&peer, b.to_vec());
                true
            }
            WROTE => {
                let Some(&has_note) = b.first() else { break };
                // Checked as a grant would have been: only spans inside this peer's exposures
                // count as written.
                let mut grant = spare.pop().unwrap_or_default();
                let end = mark_wrote(&host, &peer, &mut grant, b, 1);
                spare.push(grant);
                let Some(end) = end else { break };
                if has_note != 0 {
                    host.notify(&peer, b[end..].to_vec());
                }
                true
            }
            RECORDS => {
                if let Some(r) = &records {
                    #[cfg(test)]
                    r.doorbells.fetch_add(1, Ordering::Relaxed);
                    r.take();
                }
                true
            }
            _ => false,
        };
        if !ok {
            break;
        }
    }
    // Records the initiator left before its socket closed count as its WROTEs would have.
    if let Some(r) = &records {
        r.take();
    }
    {
        let mut all = standing.lock();
        if let Some(p) = all.get_mut(&peer) {
            p.links.retain(|l| l.id != link);
            if p.grants.is_empty() && p.links.is_empty() {
                all.remove(&peer);
            }
        }
    }
    let _ = stream.shutdown(std::net::Shutdown::Both);
    drop(grants);
    drop(open);
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use super::*;
    use crate::{Agent, LinkState};

    /// How long a test waits for what should take milliseconds: the testing feature's hang
    /// guard (short in mutation runs, which then end the process at a failure), else 60 s.
    fn bound() -> Duration {
        #[cfg(feature = "testing")]
        return crate::testing::hang_guard();
        #[cfg(not(feature = "testing"))]
        Duration::from_secs(60)
    }

    /// Standing ranges made or withdrawn reach the peer through the link's ring of
    /// announcements at once, under a hold on announcements too (it holds back only what
    /// goes on the socket); the target's checks change at once as well.
    #[test]
    fn announcements_reach_the_peer_through_the_ring_at_once() {
        use crate::{Ops, Status, TransferError};
        let side = UnitSide::new();
        let reg = side.reg();
        let granted = reg.expose("client", 4096, 4096, Ops::WRITE).unwrap();
        let sender = ClientSide::new(&side, 8192, 0x11);
        let write = |offset, len| sender.write(&side, offset, len, None).wait_timeout(bound());
        // Maps the registration and opens the link (through a grant).
        write(4096, 64).unwrap();
        let hold = Agent::hold_announcements();
        let standing = reg.expose_standing("client", 0, 4096).unwrap();
        let t = sender.write(&side, 100, 100, None);
        assert!(
            matches!(t.status(), Status::Done),
            "no round trip to wait for"
        );
        assert_eq!(sender.client.report().standing_writes, 1);
        assert_eq!(standing.wait_written(100, bound()), 100);
        // Withdrawn: the next WRITE there asks, and is refused.
        drop(standing);
        let refused = write(300, 100);
        assert!(
            matches!(refused, Err(TransferError::Rejected { .. })),
            "{refused:?}"
        );
        assert_eq!(sender.client.report().standing_writes, 1);
        drop(hold);
        drop(granted);
    }

    /// Whether `peer`'s first inbound link still announces through its ring, and the bytes
    /// waiting there.
    fn notices_of(engine: &Arc<Inner>, peer: &str) -> Option<u64> {
        let all = engine.standing.lock();
        let link = all.get(peer)?.links.first()?;
        link.notices.as_ref().map(|n| n.ring.backlog(n.tail))
    }

    /// Announcements the initiator does not take (it posts no transfer) ring its doorbell
    /// once the ring is half full: its serving thread then takes them, and the ring never
    /// fills.
    #[test]
    fn a_half_full_ring_of_announcements_rings_the_initiators_doorbell() {
        let side = UnitSide::new();
        let reg = side.reg();
        let sender = ClientSide::new(&side, 4096, 0);
        // Opens the link (refused: nothing is exposed).
        sender
            .write(&side, 0, 64, None)
            .wait_timeout(bound())
            .unwrap_err();
        // Ranges kept, each one STANDING: the push that reaches half is the last.
        let half = (RING_BYTES - crate::shm_ring::DATA_AT as u64) / 2;
        let mut made = Vec::new();
        while notices_of(&side.engine, "client").expect("the ring") < half {
            made.push(reg.expose_standing("client", 0, 64).unwrap());
            assert!(made.len() < 10_000, "the ring never reached half");
        }
        let deadline = Instant::now() + bound();
        while notices_of(&side.engine, "client") != Some(0) {
            assert!(
                Instant::now() < deadline,
                "the initiator never took the ring"
            );
            std::thread::sleep(Duration::from_millis(2));
        }
    }

    /// Announcements that find the ring full (its doorbell held back here) go on the socket
    /// from then on, and the initiator applies them after everything the ring holds: a range
    /// the ring announced and the socket withdrew stays withdrawn. Held, they go out when the
    /// hold ends.
    #[test]
    fn announcements_past_a_full_ring_follow_it_on_the_socket() {
        use crate::{Ops, TransferError};
        let side = UnitSide::new();
        let reg = side.reg();
        let granted = reg.expose("client", 4096, 4096, Ops::WRITE).unwrap();
        let sender = ClientSide::new(&side, 4096, 0x22);
        let write = |offset, len| sender.write(&side, offset, len, None).wait_timeout(bound());
        write(4096, 64).unwrap();
        let hold = Agent::hold_announcements();
        let early = reg.expose_standing("client", 0, 1024).unwrap();
        let mut made = 0;
        while notices_of(&side.engine, "client").is_some() {
            drop(reg.expose_standing("client", 8192, 64).unwrap());
            made += 1;
            assert!(made < 10_000, "the ring never filled");
        }
        drop(early);
        let late = reg.expose_standing("client", 2048, 1024).unwrap();
        // The ring's announcements reach it, the held ones not yet: `early` still stands to
        // it (the target records nothing of the copy), `late` needs a grant.
        write(0, 100).unwrap();
        write(2048, 100).unwrap();
        assert_eq!(sender.client.report().standing_writes, 1);
        drop(hold);
        // A grant's round trip: the GRANT comes after the held announcements.
        write(4096, 64).unwrap();
        let refused = write(0, 100);
        assert!(
            matches!(refused, Err(TransferError::Rejected { .. })),
            "{refused:?}"
        );
        write(2048, 100).unwrap();
        assert_eq!(sender.client.report().standing_writes, 2);
        drop((late, granted));
    }

    /// A ring of announcements holding what no honest target stores ends the link at the
    /// initiator's next transfer: a record that is not one framed announcement, a STANDING
    /// whose range overflows.
    #[test]
    fn a_malformed_ring_of_announcements_ends_the_link() {
        use crate::TransferError;
        let mut overflowing = Vec::new();
        standing_msg(
            &mut overflowing,
            &Standing {
                key: 1,
                reg: 1,
                offset: u64::MAX,
                len: 2,
            },
        );
        let mut short = Vec::new();
        frame(&mut short, REVOKE, |b| b.extend_from_slice(&[1, 2, 3]));
        let mut wrong_type = Vec::new();
        frame(&mut wrong_type, GRANT, |b| b.extend_from_slice(&[0; 8]));
        let cases = [
            ("a bare body", vec![0u8; 8]),
            ("a length past the record", {
                let mut m = overflowing.clone();
                m.truncate(HEADER + 8);
                m
            }),
            ("an overflowing range", overflowing),
            ("a short REVOKE", short),
            ("another message type", wrong_type),
        ];
        for (what, record) in cases {
            let side = UnitSide::new();
            let standing = side.reg().expose_standing("client", 0, 4096).unwrap();
            let sender = ClientSide::new(&side, 4096, 0);
            let write = |offset| sender.write(&side, offset, 64, None).wait_timeout(bound());
            write(8192).unwrap_err();
            write(0).unwrap();
            assert_eq!(standing.wait_written(64, bound()), 64, "{what}");
            {
                let mut all = side.engine.standing.lock();
                let link = &mut all.get_mut("client").unwrap().links[0];
                let n = link.notices.as_mut().unwrap();
                assert_eq!(n.ring.push(&mut n.tail, &record), Pushed::Unwatched);
            }
            let after = write(0);
            assert!(
                matches!(after, Err(TransferError::PeerGone { .. })),
                "{what}: {after:?}"
            );
            let deadline = Instant::now() + bound();
            while side.unit.peer_link("client") != LinkState::Closed {
                assert!(Instant::now() < deadline, "the link stayed open: {what}");
                std::thread::sleep(Duration::from_millis(2));
            }
            assert_eq!(standing.written(), 64, "{what}");
        }
    }

    /// A unit agent with a scoped pool of 64 KiB: the target of the standing-range tests.
    struct UnitSide {
        /// Its engine, to reach the links' rings.
        engine: Arc<Inner>,
        unit: Agent,
        pool: crate::RegisteredPool,
    }

    impl UnitSide {
        fn new() -> Self {
            let shm = Shm::new();
            let engine = shm.inner.clone();
            let unit = Agent::new("unit", shm).unwrap();
            let pool = crate::RegisteredPool::new_scoped(&unit, 1 << 16).unwrap();
            Self { engine, unit, pool }
        }

        fn reg(&self) -> &crate::Registration {
            self.pool.registration()
        }
    }

    /// An agent named `client` connected to a [`UnitSide`], WRITEing from `len` bytes of
    /// `fill`.
    struct ClientSide {
        client: Agent,
        local: crate::Registration,
        peer: crate::Peer,
        _src: Region,
    }

    impl ClientSide {
        fn new(unit: &UnitSide, len: u64, fill: u8) -> Self {
            let client = Agent::new("client", Shm::new()).unwrap();
            let src = Region::new(len).unwrap();
            src.fill(0, len, fill).unwrap();
            let local = client.register(&src).unwrap();
            let peer = client.add_remote(&unit.unit.metadata()).unwrap();
            Self {
                client,
                local,
                peer,
                _src: src,
            }
        }

        /// A WRITE of `len` bytes from the start of the source to `offset` in the unit's pool.
        fn write(
            &self,
            unit: &UnitSide,
            offset: u64,
            len: u64,
            note: Option<&[u8]>,
        ) -> crate::Transfer {
            self.peer
                .write(
                    &[self.local.desc(0, len).unwrap()],
                    &[unit.reg().remote(offset, len).unwrap()],
                    note,
                )
                .unwrap()
        }
    }

    /// A WRITE inside a standing range is copied at once, with no grant: it is done when
    /// `write` returns, the initiator counts it, the target records it as written and its
    /// notification arrives after the data. A WRITE reaching past the range, or into it once
    /// it is withdrawn, asks for its grant as before, and a scoped registration refuses one
    /// outside every exposure. Standing ranges made before the link opened reach it too.
    #[test]
    fn writes_inside_standing_ranges_need_no_grant() {
        use crate::{Ops, Status, TransferError};
        let side = UnitSide::new();
        let (unit, reg) = (&side.unit, side.reg());
        // Made before the client connects: announced when its link opens.
        let early = reg.expose_standing("client", 0, 4096).unwrap();
        let wider = reg.expose("client", 4096, 8192, Ops::WRITE).unwrap();
        let sender = ClientSide::new(&side, 16384, 0x5A);
        let client = &sender.client;
        let write = |offset, len, note| sender.write(&side, offset, len, note);
        // The first WRITE maps the registration (through a grant); the announcement came
        // before its GRANT on the same socket.
        write(4096, 64, None).wait_timeout(bound()).unwrap();
        assert_eq!(client.report().standing_writes, 0);
        let t = write(100, 1000, Some(b"landed"));
        assert!(
            matches!(t.status(), Status::Done),
            "no round trip to wait for"
        );
        assert_eq!(client.report().standing_writes, 1);
        assert_eq!(early.wait_written(1000, bound()), 1000);
        let n = unit.wait_notification(bound()).expect("the notification");
        assert_eq!(
            (n.from.as_str(), n.msg.as_slice()),
            ("client", &b"landed"[..])
        );
        let mut got = vec![0u8; 1000];
        reg.region().read_at(100, &mut got).unwrap();
        assert!(got.iter().all(|b| *b == 0x5A));
        // Past the standing range's end, into the next exposure: no one exposure holds it,
        // so it asks for a grant, which is refused.
        let straddling = write(4000, 200, None).wait_timeout(bound());
        assert!(
            matches!(straddling, Err(TransferError::Rejected { .. })),
            "{straddling:?}"
        );
        assert_eq!(client.report().standing_writes, 1);
        // Withdrawn: once a later grant's round trip shows the REVOKE was read, the range
        // asks again and is refused.
        drop(early);
        write(4096, 64, None).wait_timeout(bound()).unwrap();
        let late = write(100, 100, None).wait_timeout(bound());
        assert!(
            matches!(late, Err(TransferError::Rejected { .. })),
            "{late:?}"
        );
        assert_eq!(client.report().standing_writes, 1);
        // Made while the link is open: announced at once.
        let now = reg.expose_standing("client", 8192, 1024).unwrap();
        write(4096, 64, None).wait_timeout(bound()).unwrap();
        write(8192, 512, None).wait_timeout(bound()).unwrap();
        assert_eq!(client.report().standing_writes, 2);
        assert_eq!(now.wait_written(512, bound()), 512);
        drop((now, wider));
    }

    /// The ring of WRITE records of `peer`'s first inbound link to `engine`, once the
    /// initiator has it too (a STANDING sent after it reached `client`'s side).
    fn ring_of(engine: &Arc<Inner>, peer: &str) -> Arc<Records> {
        let deadline = Instant::now() + bound();
        loop {
            let r = engine
                .standing
                .lock()
                .get(peer)
                .and_then(|p| p.links.first().and_then(|l| l.records.clone()));
            if let Some(r) = r {
                return r;
            }
            assert!(Instant::now() < deadline, "no ring");
            std::thread::sleep(Duration::from_millis(2));
        }
    }

    /// A standing WRITE's record goes through the link's ring: taken by a target thread that
    /// spins for it with no message on the socket, or by the serving thread after a doorbell
    /// when none spins. A notification still goes as `WROTE`.
    #[test]
    fn standing_writes_are_recorded_through_the_ring() {
        let side = UnitSide::new();
        let (unit, reg) = (&side.unit, side.reg());
        let sender = ClientSide::new(&side, 8192, 0x3C);
        let write =
            |offset, len, note| sender.write(&side, offset, len, note).wait_timeout(bound());
        let first = reg.expose_standing("client", 0, 4096).unwrap();
        // Maps the registration through a grant; the RING and the STANDING came before it.
        write(8192, 64, None).unwrap_err();
        let ring = ring_of(&side.engine, "client");

        // A spin for a WRITE that does not come ends with its window.
        let spin = || first.spin_written(1000, Duration::from_millis(1));
        #[cfg(feature = "testing")]
        let spun = crate::testing::finish_or_exit("a spin past its window", spin, || {});
        #[cfg(not(feature = "testing"))]
        let spun = spin();
        assert!(!spun);
        assert_eq!(ring.ring.watchers(), 0);

        // A spinning target thread: no doorbell.
        std::thread::scope(|s| {
            let spinner = s.spawn(|| first.spin_written(1000, bound()));
            let deadline = Instant::now() + bound();
            while ring.ring.watchers() == 0 {
                assert!(Instant::now() < deadline, "never watched");
                std::hint::spin_loop();
            }
            write(0, 1000, None).unwrap();
            assert!(spinner.join().unwrap(), "the spinner saw the WRITE");
        });
        assert_eq!(ring.ring.watchers(), 0);
        assert_eq!(ring.doorbells.load(Ordering::Relaxed), 0);
        assert_eq!(first.written(), 1000);

        // Nobody spins: the doorbell wakes the serving thread, which takes the record.
        write(1000, 500, None).unwrap();
        assert_eq!(first.wait_written(1500, bound()), 1500);
        assert_eq!(ring.doorbells.load(Ordering::Relaxed), 1);

        // With a notification: a WROTE, which records as well.
        write(1500, 100, Some(b"n")).unwrap();
        assert_eq!(first.wait_written(1600, bound()), 1600);
        assert!(unit.wait_notification(bound()).is_some());
        assert_eq!(ring.doorbells.load(Ordering::Relaxed), 1);

        // Outside every exposure the ring records nothing, as a WROTE would not.
        let second = reg.expose_standing("client", 4096, 4096).unwrap();
        // A round trip after the announcement: the client has it.
        write(8192, 64, None).unwrap_err();
        write(4096, 64, None).unwrap();
        assert_eq!(second.wait_written(64, bound()), 64);
        drop(second);
        assert_eq!(sender.client.report().standing_writes, 4);
        let mut got = vec![0u8; 1600];
        reg.region().read_at(0, &mut got).unwrap();
        assert!(got.iter().all(|b| *b == 0x3C));
    }

    /// While a watch of the peer's WRITEs lives, a standing WRITE of that peer rings no
    /// doorbell and is not recorded; the watch's end records it, and the next WRITE rings
    /// again.
    #[test]
    fn a_watch_keeps_standing_writes_quiet_until_it_ends() {
        let side = UnitSide::new();
        let sender = ClientSide::new(&side, 4096, 0x5C);
        let standing = side.reg().expose_standing("client", 0, 4096).unwrap();
        // Maps the registration through a grant (refused: outside every exposure).
        sender
            .write(&side, 8192, 64, None)
            .wait_timeout(bound())
            .unwrap_err();
        let ring = ring_of(&side.engine, "client");
        let doorbells = || ring.doorbells.load(Ordering::Relaxed);
        let watch = standing.watch_written();
        assert_eq!(ring.ring.watchers(), 1);
        sender
            .write(&side, 0, 1000, None)
            .wait_timeout(bound())
            .unwrap();
        assert_eq!(sender.client.report().standing_writes, 1);
        std::thread::sleep(Duration::from_millis(20));
        assert_eq!((doorbells(), standing.written()), (0, 0));
        drop(watch);
        assert_eq!((ring.ring.watchers(), standing.written()), (0, 1000));
        sender
            .write(&side, 1000, 100, None)
            .wait_timeout(bound())
            .unwrap();
        assert_eq!(standing.wait_written(1100, bound()), 1100);
        assert_eq!(doorbells(), 1);
        // A peer with no link watches nothing.
        let elsewhere = side.reg().expose_standing("nobody", 2048, 64).unwrap();
        drop(elsewhere.watch_written());
        assert_eq!(ring.ring.watchers(), 0);
    }

    /// A ring whose producer stored what no honest one would ends the link at the next take:
    /// a tail beyond what it can hold, a record whose spans run past its end, a record with
    /// bytes after its spans.
    #[test]
    fn a_malformed_ring_ends_the_link() {
        use crate::TransferError;
        type Corrupt = fn(&crate::shm_ring::Ring);
        let cases: [(&str, Corrupt); 3] = [
            ("tail", |r| r.set_tail(u64::MAX / 2)),
            ("spans past the record", |r| {
                assert_eq!(r.push_as_producer(&5u32.to_le_bytes()), Pushed::Unwatched);
            }),
            ("bytes after the spans", |r| {
                let record = [0, 0, 0, 0, 1, 2, 3, 4];
                assert_eq!(r.push_as_producer(&record), Pushed::Unwatched);
            }),
        ];
        for (what, corrupt) in cases {
            let side = UnitSide::new();
            let unit = &side.unit;
            let standing = side.reg().expose_standing("client", 0, 4096).unwrap();
            let sender = ClientSide::new(&side, 4096, 0);
            let write = |offset| sender.write(&side, offset, 64, None).wait_timeout(bound());
            write(8192).unwrap_err();
            let ring = ring_of(&side.engine, "client");
            write(0).unwrap();
            assert_eq!(standing.wait_written(64, bound()), 64, "{what}");
            corrupt(&ring.ring);
            ring.take();
            let deadline = Instant::now() + bound();
            while unit.peer_link("client") != LinkState::Closed {
                assert!(Instant::now() < deadline, "the link stayed open: {what}");
                std::thread::sleep(Duration::from_millis(2));
            }
            let after = write(0);
            assert!(
                matches!(after, Err(TransferError::PeerGone { .. })),
                "{what}: {after:?}"
            );
            assert_eq!(standing.written(), 64, "{what}");
        }
    }

    /// The target sees a peer's link open from its HELLO on, and closed once the peer's agent
    /// is gone (its socket closed and the serving thread returned).
    #[test]
    fn peer_link_follows_the_peers_socket() {
        let unit = Agent::new("unit", Shm::new()).unwrap();
        assert_eq!(unit.peer_link("client"), LinkState::Closed);
        let client = Agent::new("client", Shm::new()).unwrap();
        let peer = client.add_remote(&unit.metadata()).unwrap();
        let deadline = Instant::now() + bound();
        while unit.peer_link("client") != LinkState::Open {
            assert!(Instant::now() < deadline, "the link never opened");
            std::thread::sleep(Duration::from_millis(5));
        }
        drop(peer);
        drop(client);
        while unit.peer_link("client") != LinkState::Closed {
            assert!(Instant::now() < deadline, "the link never closed");
            std::thread::sleep(Duration::from_millis(5));
        }
        let inproc = Agent::new("other", crate::Inproc::new()).unwrap();
        assert_eq!(inproc.peer_link("unit"), LinkState::Unknown);
    }

    /// A target whose CHALLENGE carries a proof that does not verify (made under another
    /// token, or for another name) is refused by the dialer: `add_remote` fails saying the
    /// proofs do not match, and the dialer never sends the impostor its own proof. The target
    /// is a raw listener that would acknowledge anything.
    #[test]
    fn a_dialer_refuses_a_target_whose_proof_does_not_verify() {
        use std::io::Read;

        use crate::engine::PeerInfo;
        use crate::error::ConnectError;

        let ours = Token::new("the shared secret").unwrap();
        let theirs = Token::new("another secret").unwrap();
        // (the dialer's token, the token the target proves under, the name it proves as)
        for (i, (dialer_token, proving, as_name)) in [
            (Some(ours.clone()), Some(theirs), "fake"),
            (Some(ours.clone()), None, "fake"),
            (None, None, "someone-else"),
        ]
        .into_iter()
        .enumerate()
        {
            let address = format!("tessera-fake-target-{}-{i}", std::process::id()).into_bytes();
            let listener =
                UnixListener::bind_addr(&SocketAddr::from_abstract_name(&address).unwrap())
                    .unwrap();
            let target = std::thread::spawn(move || {
                let (s, _) = listener.accept().unwrap();
                s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
                let mut head = [0u8; HEADER];
                (&s).read_exact(&mut head).unwrap();
                assert_eq!(head[0], HELLO);
                let len = u32::from_le_bytes(head[4..8].try_into().unwrap()) as usize;
                let mut hello = vec![0u8; len];
                (&s).read_exact(&mut hello).unwrap();
                let mut dialer_nonce = [0u8; NONCE_LEN];
                dialer_nonce.copy_from_slice(&hello[..NONCE_LEN]);
                let nonce = crate::auth::nonce();
                let proof =
                    handshake::target_proof(proving.as_ref(), KIND, &dialer_nonce, &nonce, as_name);
                let mut out = Vec::new();
                frame(&mut out, CHALLENGE, |b| {
                    b.extend_from_slice(&nonce);
                    b.extend_from_slice(&proof);
                });
                send_all(&s, &out).unwrap();
                // An honest dialer hangs up here; one that answers gets acknowledged.
                let got_auth = (&s).read_exact(&mut head).is_ok() && head[0] == AUTH;
                if got_auth {
                    out.clear();
                    frame(&mut out, HELLO_ACK, |_| {});
                    let _ = send_all(&s, &out);
                }
                got_auth
            });
            let shm = match &dialer_token {
                Some(t) => Shm::new().with_token(t.clone()),
                None => Shm::new(),
            };
            let a = Agent::new("a", shm).unwrap();
            let meta = crate::metadata::encode(&PeerInfo {
                name: "fake".into(),
                kind: KIND.into(),
                address,
                regs: Vec::new(),
            });
            let outcome = a.add_remote(&meta);
            let expected = handshake::bad_target_proof("fake", dialer_token.as_ref());
            assert!(
                matches!(
                    &outcome,
                    Err(ConnectError::Backend { peer, source })
                        if peer == "fake" && source.message == expected
                ),
                "{outcome:?}"
            );
            assert!(
                !target.join().unwrap(),
                "the dialer sent its proof to a target that did not prove itself"
            );
        }
    }

    /// A fake target that accepts one dialer and then does `then` with the connection.
    fn fake_target(name: &str, then: impl FnOnce(UnixStream) + Send + 'static) -> Vec<u8> {
        let address = format!("{name}-{}", std::process::id()).into_bytes();
        let listener =
            UnixListener::bind_addr(&SocketAddr::from_abstract_name(&address).unwrap()).unwrap();
        std::thread::spawn(move || {
            let (s, _) = listener.accept().unwrap();
            then(s);
        });
        crate::metadata::encode(&PeerInfo {
            name: "fake".into(),
            kind: KIND.into(),
            address,
            regs: Vec::new(),
        })
    }

    /// What `add_remote` to `meta` said, as text.
    fn dial_error(shm: Shm, meta: &[u8]) -> (String, Duration) {
        let a = Agent::new("a", shm).unwrap();
        let t = Instant::now();
        let err = a.add_remote(meta).map(drop).unwrap_err().to_string();
        (err, t.elapsed())
    }

    /// Messages the socket takes only in part (its peer is not reading yet) arrive whole and
    /// in order: the rest of the one cut short, then those sent after it, through the writer
    /// thread.
    #[test]
    fn a_message_the_socket_takes_in_part_arrives_whole_and_in_order() {
        use std::io::Read;
        let (ours, mut theirs) = UnixStream::pair().unwrap();
        let out = LinkOut::start(&Arc::new(ours)).unwrap();
        let msgs: Vec<Vec<u8>> = [3usize << 20, 10, 1 << 20]
            .iter()
            .enumerate()
            .map(|(i, &len)| (0..len).map(|b| (b % 251 + i) as u8).collect())
            .collect();
        for m in &msgs {
            assert!(out.send(m.clone(), None));
        }
        // The writer thread ends once it has written what it holds: the socket then closes.
        drop(out);
        let want: Vec<u8> = msgs.concat();
        let mut got = Vec::with_capacity(want.len());
        theirs.set_read_timeout(Some(bound())).unwrap();
        theirs.read_to_end(&mut got).unwrap();
        assert_eq!(got.len(), want.len());
        assert!(got == want, "the bytes arrived out of order");
    }

    /// A target that closes the connection with the dialer's HELLO unread (the kernel resets
    /// it) fails the handshake as a reset, at once: not as a deadline, not retried.
    #[test]
    fn a_handshake_the_target_resets_fails_as_a_reset() {
        let meta = fake_target("tessera-reset-target", |s| {
            std::thread::sleep(Duration::from_millis(300));
            drop(s);
        });
        let (err, took) = dial_error(Shm::new(), &meta);
        assert!(
            err.contains("greeting fake") && err.contains("reset"),
            "{err}"
        );
        assert!(took < Duration::from_secs(5), "{took:?}");
    }

    /// A target that reads the HELLO and never answers fails the handshake when the dialer's
    /// connect timeout passes, saying it was the deadline.
    #[test]
    fn a_silent_target_fails_the_handshake_at_the_connect_timeout() {
        let meta = fake_target("tessera-silent-target", |s| {
            let mut buf = [0u8; 4096];
            let _ = io::Read::read(&mut &s, &mut buf);
            std::thread::sleep(Duration::from_secs(5));
        });
        let timeout = Duration::from_millis(400);
        let (err, took) = dial_error(Shm::new().with_connect_timeout(timeout), &meta);
        assert!(err.contains("greeting fake: handshake deadline"), "{err}");
        assert!(
            took >= timeout && took < Duration::from_secs(4),
            "failed after {took:?}"
        );
    }

    /// A target whose MAP_OK maps less than its metadata announced: the initiator's check
    /// against the metadata passes, so the copy's own check against the mapping is what keeps
    /// a READ past the mapping's end from touching memory outside it. The transfer is
    /// rejected as out of range and nothing is copied. The target is a raw listener that
    /// grants everything.
    #[test]
    fn a_mapping_shorter_than_announced_is_refused_by_the_copy() {
        use std::io::Read;

        use crate::engine::RemoteReg;

        fn read_msg(s: &UnixStream) -> (u8, Vec<u8>) {
            let mut head = [0u8; HEADER];
            (&*s).read_exact(&mut head).unwrap();
            let len = u32::from_le_bytes(head[4..8].try_into().unwrap()) as usize;
            let mut body = vec![0u8; len];
            (&*s).read_exact(&mut body).unwrap();
            (head[0], body)
        }

        const MAPPED: u64 = 4096;
        const ANNOUNCED: u64 = 1 << 20;
        const REG: u64 = 7;
        let address = format!("tessera-short-mapping-{}", std::process::id()).into_bytes();
        let listener =
            UnixListener::bind_addr(&SocketAddr::from_abstract_name(&address).unwrap()).unwrap();
        let target = std::thread::spawn(move || {
            let (s, _) = listener.accept().unwrap();
            s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
            let (ty, hello) = read_msg(&s);
            assert_eq!(ty, HELLO);
            let mut theirs = [0u8; NONCE_LEN];
            theirs.copy_from_slice(&hello[..NONCE_LEN]);
            let nonce = crate::auth::nonce();
            let proof = handshake::target_proof(None, KIND, &theirs, &nonce, "fake");
            let mut out = Vec::new();
            frame(&mut out, CHALLENGE, |b| {
                b.extend_from_slice(&nonce);
                b.extend_from_slice(&proof);
            });
            send_all(&s, &out).unwrap();
            assert_eq!(read_msg(&s).0, AUTH);
            out.clear();
            frame(&mut out, HELLO_ACK, |_| {});
            send_all(&s, &out).unwrap();
            let memory = Region::new(MAPPED).unwrap();
            let mut granted = 0;
            loop {
                let (ty, body) = read_msg(&s);
                out.clear();
                match ty {
                    MAP_REQ => {
                        frame(&mut out, MAP_OK, |o| {
                            o.extend_from_slice(&REG.to_le_bytes());
                            o.extend_from_slice(&0u64.to_le_bytes());
                            o.extend_from_slice(&MAPPED.to_le_bytes());
                        });
                        let fd = memory.fd().unwrap().as_raw_fd();
                        send_with_fd(&s, &out, fd).unwrap();
                    }
                    XFER => {
                        frame(&mut out, GRANT, |o| o.extend_from_slice(&body[..8]));
                        send_all(&s, &out).unwrap();
                        granted += 1;
                    }
                    DONE => return (granted, body[8]),
                    other => panic!("unexpected message {other}"),
                }
            }
        });
        let a = Agent::new("a", Shm::new()).unwrap();
        let meta = crate::metadata::encode(&PeerInfo {
            name: "fake".into(),
            kind: KIND.into(),
            address,
            regs: vec![RemoteReg {
                id: REG,
                len: ANNOUNCED,
                key: Vec::new(),
            }],
        });
        let peer = a.add_remote(&meta).unwrap();
        let local = Region::new(MAPPED).unwrap();
        local.fill(0, MAPPED, 0xAB).unwrap();
        let g = a.register(&local).unwrap();
        // Inside the announced registration, from the mapping's last byte to past its end.
        let outcome = peer
            .read(
                &[g.desc(0, 2).unwrap()],
                &[crate::RemoteDesc::new(REG, MAPPED - 1, 2)],
                None,
            )
            .unwrap()
            .wait_timeout(bound());
        assert!(
            matches!(
                &outcome,
                Err(TransferError::Rejected { peer, reason: RejectReason::OutOfRange })
                    if peer == "fake"
            ),
            "{outcome:?}"
        );
        let (granted, copied) = target.join().unwrap();
        assert_eq!((granted, copied), (1, 0), "the initiator reported a copy");
        let mut after = vec![0u8; 2];
        local.read_at(0, &mut after).unwrap();
        assert_eq!(after, [0xAB, 0xAB], "bytes landed from outside the mapping");
    }

    /// A MAP_REQ from an authenticated peer for a live, shareable registration is answered
    /// MAP_OK with the registration's id, base in its region and length; an unknown id gets
    /// MAP_ERR.
    #[cfg(feature = "testing")]
    #[test]
    fn a_map_request_names_the_live_registration() {
        use crate::testing::raw::{RawPeer, RawShm};

        let unit = Agent::new("unit", Shm::new()).unwrap();
        let region = Region::new(1 << 16).unwrap();
        let g = unit.register(&region).unwrap();
        let mut raw = RawShm::authenticated(&unit.metadata(), "raw", None).unwrap();
        assert_eq!(
            raw.read_frame().unwrap(),
            (RING, RING_BYTES.to_le_bytes().to_vec()),
            "the link's ring of records first"
        );
        assert_eq!(
            raw.read_frame().unwrap(),
            (ANNOUNCE_RING, RING_BYTES.to_le_bytes().to_vec()),
            "then its ring of announcements"
        );
        raw.send_frame(MAP_REQ, &g.id().to_le_bytes()).unwrap();
        let (ty, body) = raw.read_frame().unwrap();
        assert_eq!(ty, MAP_OK);
        let at = |i: usize| u64::from_le_bytes(body[i..i + 8].try_into().unwrap());
        assert_eq!((at(0), at(8), at(16)), (g.id(), 0, 1 << 16));
        raw.send_frame(MAP_REQ, &(g.id() ^ 1).to_le_bytes())
            .unwrap();
        assert_eq!(
            raw.read_frame().unwrap(),
            (MAP_ERR, (g.id() ^ 1).to_le_bytes().to_vec())
        );
    }

    /// Minor faults of the calling thread so far.
    fn thread_faults() -> i64 {
        // SAFETY: an all-zero rusage is a valid buffer for getrusage to fill.
        let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
        // SAFETY: `ru` is a writable rusage; RUSAGE_THREAD counts this thread alone.
        assert_eq!(unsafe { libc::getrusage(libc::RUSAGE_THREAD, &mut ru) }, 0);
        ru.ru_minflt
    }

    /// Writes one byte into each page of `[at, at + len)`, returning the faults it took.
    fn write_pages(at: *mut u8, len: usize) -> i64 {
        let before = thread_faults();
        for off in (0..len).step_by(4096) {
            // SAFETY: the caller's mapping holds `len` bytes from `at`.
            unsafe { at.add(off).write_volatile(2) };
        }
        thread_faults() - before
    }

    /// A link's ring is faulted in where it is made and where it is mapped: the records of its
    /// first lap stop neither side on a fresh page.
    #[test]
    fn a_rings_pages_are_faulted_in_on_both_sides() {
        let made = MappedRing::create("tessera-test-ring").unwrap();
        let fd = made.memory().fd().unwrap().try_clone_to_owned().unwrap();
        let mapped = MappedRing::map(fd, RING_BYTES).unwrap();
        assert_ne!(made.memory().as_ptr(), mapped.memory().as_ptr());
        let pages = (RING_BYTES / 4096) as i64;
        for (side, ring) in [("made", &made), ("mapped", &mapped)] {
            let faults = write_pages(ring.memory().as_ptr(), RING_BYTES as usize);
            assert!(faults <= 2, "{faults} faults over the {pages} pages {side}");
        }
    }

    /// The memory a peer already holds, mapped here afresh: written page by page it faults
    /// once a page; after `fault_around` (a read in each 64 KiB window) the same writes fault
    /// hardly at all, and `fault_around` itself about once a window.
    #[test]
    fn fault_around_maps_a_peers_resident_pages_a_window_at_a_time() {
        let len = 16usize << 20;
        let (pages, windows) = ((len / 4096) as i64, (len / FAULT_AROUND) as i64);
        let owner = Region::new(len as u64).unwrap();
        owner.populate().unwrap();
        let map = || {
            let fd = owner.fd().unwrap().try_clone_to_owned().unwrap();
            Region::map_sealed(fd, len as u64).unwrap()
        };
        let plain = map();
        assert!(write_pages(plain.as_ptr(), len) >= pages / 2);
        // Unmapped, so that the next mapping is a fresh one rather than this one shared.
        drop(plain);
        let around = map();
        let before = thread_faults();
        // SAFETY: the mapping holds `len` bytes.
        unsafe { fault_around(around.as_ptr(), len) };
        let reads = thread_faults() - before;
        let writes = write_pages(around.as_ptr(), len);
        assert!(
            reads <= windows + 16,
            "{reads} faults for {windows} windows"
        );
        assert!(
            writes <= pages / 16,
            "{writes} faults for {pages} pages after it"
        );
        // Once mapped, a range costs no fault at all.
        let before = thread_faults();
        // SAFETY: as above, a range inside the mapping.
        unsafe { fault_around(around.as_ptr().add(4096), len - 8192) };
        assert_eq!(thread_faults() - before, 0);
    }
}
