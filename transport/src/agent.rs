//! Agents, the registration cache, peers and notifications.

use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use crate::backend::{Connection, Grant, Host, Op, PeerInfo, RegInfo, RemoteReg, Transport};
use crate::desc::{KeepAlive, LocalDesc, RemoteDesc};
use crate::error::{
    AgentError, ConnectError, DescError, RegisterError, RejectReason, TransferError,
};
use crate::interval::IntervalIndex;
use crate::metadata;
use crate::sync::{
    lock, next_id, Arc, AtomicBool, AtomicUsize, Condvar, Counter, Mutex, Ordering, Weak,
};
use crate::transfer::{Prepared, Transfer};
use crate::Region;

/// Largest notification, in bytes.
pub const MAX_NOTIFICATION: usize = 64 * 1024;

/// A named endpoint of one backend: one per process per backend.
///
/// It registers memory, publishes [`metadata`](Agent::metadata) for peers, and turns a peer's
/// metadata into a [`Peer`] to transfer with. Dropping the agent shuts its engine down: pending
/// transfers fail, peers see it as gone, and registrations still held are deregistered as their
/// guards drop.
pub struct Agent {
    core: Arc<AgentCore>,
}

pub(crate) struct AgentCore {
    pub(crate) host: Arc<HostShared>,
    pub(crate) transport: Arc<dyn Transport>,
    peers: Mutex<HashMap<String, Weak<PeerCore>>>,
    pub(crate) in_flight: Arc<AtomicUsize>,
}

/// The part of an agent its engine may hold: registrations and notifications, never the engine.
pub(crate) struct HostShared {
    pub(crate) name: String,
    pub(crate) id: u64,
    pub(crate) registry: Registry,
    pub(crate) notifications: Notifications,
    pub(crate) closed: AtomicBool,
    /// Payload bytes this agent's engine copied into WRITE destinations.
    pub(crate) copied_write: Counter,
    /// Payload bytes this agent's engine copied into READ destinations.
    pub(crate) copied_read: Counter,
    /// Inbound links by peer name: how many of the engine's readers serving that peer are
    /// still running (engines that track them, see [`Transport::tracks_links`]).
    pub(crate) inbound: Mutex<HashMap<String, usize>>,
}

/// Whether a peer can still reach this agent's memory, as far as its engine can tell.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum LinkState {
    /// A link from the peer is open, or its reader is still running: a WRITE it sent may
    /// still land.
    Open,
    /// No link from the peer is open and no reader serving it is running: nothing the peer
    /// sent can land any more (until it connects again).
    Closed,
    /// The engine cannot tell (one-sided engines such as `ucx` and `nixl` have no
    /// target-side signal, and `inproc` peers write from their own thread).
    Unknown,
}

/// Occupancy of an agent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct AgentReport {
    /// Live registrations (each cached range counts once, however many guards it has).
    /// Local-only registrations ([`Agent::register_local`]) are never listed, so never counted.
    pub registrations: usize,
    /// Bytes they cover.
    pub registered_bytes: u64,
    /// Peers with a live handle.
    pub peers: usize,
    /// Transfers posted and not yet completed.
    pub in_flight: usize,
    /// Payload bytes of WRITEs this agent's engine copied into their destination since the
    /// agent started. Engines that copy on the initiator (`inproc`, `shm`: one `memcpy`)
    /// count at the writer; `tcp` counts where the bytes land (the target of the WRITE), so
    /// summed over both agents each byte moved counts once. `ucx` and `nixl` hand the copy to
    /// their library and count nothing.
    pub copied_write_bytes: u64,
    /// The same for READs (`tcp`: counted at the reader, where the bytes land).
    pub copied_read_bytes: u64,
}

const _: () = {
    const fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<Agent>();
    assert_send_sync::<Peer>();
    assert_send_sync::<Registration>();
    assert_send_sync::<LocalDesc>();
};

impl Agent {
    /// An agent named `name` (1 to 255 bytes) on `transport`.
    pub fn new(name: &str, transport: impl Transport) -> Result<Self, AgentError> {
        Self::with_transport(name, Arc::new(transport))
    }

    /// Like [`Agent::new`], for an engine already behind an `Arc`.
    pub fn with_transport(name: &str, transport: Arc<dyn Transport>) -> Result<Self, AgentError> {
        if name.is_empty() || name.len() > metadata::MAX_NAME {
            return Err(AgentError::InvalidName {
                name: name.to_owned(),
            });
        }
        let host = Arc::new(HostShared {
            name: name.to_owned(),
            id: next_id(),
            registry: Registry::default(),
            notifications: Notifications::default(),
            closed: AtomicBool::new(false),
            copied_write: Counter::default(),
            copied_read: Counter::default(),
            inbound: Mutex::new(HashMap::new()),
        });
        transport.start(Host {
            shared: host.clone(),
        })?;
        Ok(Self {
            core: Arc::new(AgentCore {
                host,
                transport,
                peers: Mutex::new(HashMap::new()),
                in_flight: Arc::new(AtomicUsize::new(0)),
            }),
        })
    }

    /// The agent's name.
    pub fn name(&self) -> &str {
        &self.core.host.name
    }

    /// The backend's kind, such as `"shm"`.
    pub fn kind(&self) -> &'static str {
        self.core.transport.kind()
    }

    /// Registers the whole region. See [`Agent::register_range`].
    pub fn register(&self, region: &Region) -> Result<Registration, RegisterError> {
        self.register_range(region, 0, region.len())
    }

    /// Registers `len` bytes at `offset` of `region` and returns a guard; the range is
    /// deregistered when the last guard, descriptor and transfer using it are gone.
    ///
    /// Registrations are cached: if a live registration of this region already covers the
    /// range, this returns a guard on it without asking the engine (a lock and a lookup).
    pub fn register_range(
        &self,
        region: &Region,
        offset: u64,
        len: u64,
    ) -> Result<Registration, RegisterError> {
        let host = &self.core.host;
        if host.closed.load(Ordering::Acquire) {
            return Err(RegisterError::AgentClosed {
                agent: host.name.clone(),
            });
        }
        let end = offset.checked_add(len);
        if len == 0 || end.is_none_or(|e| e > region.len()) {
            return Err(RegisterError::OutOfRange {
                offset,
                len,
                region_len: region.len(),
            });
        }
        if region.mark_registered() {
            if let Some(entry) = host.registry.find(region, offset, len) {
                let start = offset - entry.offset;
                return Ok(Registration { entry, start, len });
            }
        }
        let id = next_id();
        let key = self.core.transport.register(&RegInfo {
            id,
            region,
            offset,
            len,
        })?;
        let entry = Arc::new(RegEntry {
            id,
            agent_id: host.id,
            region: region.clone(),
            offset,
            len,
            key,
            listed: Some(Listed {
                transport: self.core.transport.clone(),
                host: Arc::downgrade(host),
            }),
        });
        host.registry.insert(&entry);
        Ok(Registration {
            entry,
            start: 0,
            len,
        })
    }

    /// Whether the local side of this agent's transfers must be registered with its engine.
    ///
    /// `false` for engines that reach local memory by address alone (`inproc`, `shm`, `tcp`):
    /// [`Agent::register_local`] then creates a local-only registration without asking the
    /// engine. `true` for engines that look up their own handle of the local memory (`ucx`,
    /// `nixl`): there `register_local` is [`Agent::register`], and whatever it registers is
    /// exposed to peers like any registration.
    pub fn local_side_needs_registration(&self) -> bool {
        self.core.transport.local_side_needs_registration()
    }

    /// Registers the whole region for use only as the *local* side of this agent's own
    /// transfers (the source of a WRITE, the destination of a READ).
    ///
    /// Where the engine needs no local registration (see
    /// [`Agent::local_side_needs_registration`]), the registration is local-only: the engine
    /// is not asked, and it is never listed in the agent's registrations, so it is absent from
    /// [`Agent::metadata`] and from [`AgentReport::registrations`],
    /// [`Agent::find_registered`] never returns it, and a peer naming its id is refused like
    /// an unknown registration. Its [`Registration::remote`] descriptors are therefore
    /// useless to peers. Creating and dropping one takes no lock. Otherwise this is exactly
    /// [`Agent::register`].
    ///
    /// In both cases a live registration of this agent that already covers the region is
    /// reused, as [`Agent::register`] does.
    pub fn register_local(&self, region: &Region) -> Result<Registration, RegisterError> {
        if self.core.transport.local_side_needs_registration() {
            return self.register(region);
        }
        let host = &self.core.host;
        if host.closed.load(Ordering::Acquire) {
            return Err(RegisterError::AgentClosed {
                agent: host.name.clone(),
            });
        }
        let len = region.len();
        if region.mark_registered() {
            if let Some(entry) = host.registry.find(region, 0, len) {
                // It covers the whole region, so it starts at the region's first byte.
                return Ok(Registration {
                    entry,
                    start: 0,
                    len,
                });
            }
        }
        let entry = Arc::new(RegEntry {
            id: next_id(),
            agent_id: host.id,
            region: region.clone(),
            offset: 0,
            len,
            key: Vec::new(),
            listed: None,
        });
        Ok(Registration {
            entry,
            start: 0,
            len,
        })
    }

    /// The live registration of this agent that covers `len` bytes at `ptr`, as a window
    /// starting at `ptr`: memory that already lives in registered memory (a pool block, a
    /// received buffer) is described in place with `desc(0, len)`, without registering again.
    pub fn find_registered(&self, ptr: *const u8, len: u64) -> Option<Registration> {
        if len == 0 {
            return None;
        }
        let entry = self.core.host.registry.find_addr(ptr as usize, len)?;
        let start = ptr as u64 - entry.base() as u64;
        Some(Registration { entry, start, len })
    }

    /// Everything a peer needs to reach this agent and its registrations: the engine's
    /// address and each live registration's id, length and remote key. Send it to peers by any
    /// means; call again after registering more memory.
    pub fn metadata(&self) -> Vec<u8> {
        metadata::encode(&PeerInfo {
            name: self.core.host.name.clone(),
            kind: self.core.transport.kind().to_owned(),
            address: self.core.transport.address(),
            regs: self.core.host.registry.remote_regs(),
        })
    }

    /// Adds (or updates) the peer that published `metadata`. Metadata from a peer this agent
    /// already knows replaces the old: the same [`Peer`] handle sees the new registrations.
    pub fn add_remote(&self, metadata: &[u8]) -> Result<Peer, ConnectError> {
        let info = metadata::decode(metadata)?;
        let host = &self.core.host;
        if host.closed.load(Ordering::Acquire) {
            return Err(ConnectError::AgentClosed {
                agent: host.name.clone(),
            });
        }
        let ours = self.core.transport.kind();
        if info.kind != ours {
            return Err(ConnectError::BackendMismatch {
                peer: info.name,
                ours,
                theirs: info.kind,
            });
        }
        if info.name == host.name {
            return Err(ConnectError::SelfPeer { agent: info.name });
        }
        let backend_err = |source| ConnectError::Backend {
            peer: info.name.clone(),
            source,
        };
        let existing = lock(&self.core.peers)
            .get(&info.name)
            .and_then(Weak::upgrade);
        if let Some(existing) = existing {
            let moved = *lock(&existing.address) != info.address;
            if moved {
                // The peer restarted (or rebound): reconnect, and retire the old connection.
                let fresh = self.core.transport.connect(&info).map_err(backend_err)?;
                let old = std::mem::replace(&mut *lock(&existing.conn), fresh);
                old.close();
                *lock(&existing.address) = info.address.clone();
            } else {
                let conn = lock(&existing.conn).clone();
                conn.update(&info).map_err(backend_err)?;
            }
            *lock(&existing.regs) = Arc::new(RegTable::new(&info.regs));
            return Ok(Peer { core: existing });
        }
        // Connect without holding the peer table: engines may take a while.
        let conn = self.core.transport.connect(&info).map_err(backend_err)?;
        let core = Arc::new(PeerCore {
            name: Arc::from(info.name.as_str()),
            agent: self.core.clone(),
            conn: Mutex::new(conn),
            address: Mutex::new(info.address),
            regs: Mutex::new(Arc::new(RegTable::new(&info.regs))),
        });
        lock(&self.core.peers).insert(info.name, Arc::downgrade(&core));
        Ok(Peer { core })
    }

    /// The peer named `name`, if a handle on it is alive.
    pub fn peer(&self, name: &str) -> Option<Peer> {
        let core = lock(&self.core.peers).get(name).and_then(Weak::upgrade)?;
        Some(Peer { core })
    }

    /// The oldest undelivered notification, without waiting.
    pub fn try_notification(&self) -> Option<Notification> {
        self.core.host.notifications.try_pop()
    }

    /// Waits up to `timeout` for a notification (blocking the thread).
    pub fn wait_notification(&self, timeout: Duration) -> Option<Notification> {
        self.core.host.notifications.wait(timeout)
    }

    /// The next notification, as a future.
    pub fn next_notification(&self) -> NextNotification<'_> {
        NextNotification {
            queue: &self.core.host.notifications,
        }
    }

    /// Whether the peer named `name` can still reach this agent's memory: a target-side
    /// question, for deciding when memory a peer was told about (and may still be writing)
    /// can be reused. `Closed` means every link from that peer is closed and the engine's
    /// reader for it has returned, so no byte it sent can land any more; a peer that connects
    /// again makes it `Open` again.
    pub fn peer_link(&self, name: &str) -> LinkState {
        if !self.core.transport.tracks_links() {
            return LinkState::Unknown;
        }
        if lock(&self.core.host.inbound).contains_key(name) {
            LinkState::Open
        } else {
            LinkState::Closed
        }
    }

    /// Occupancy now.
    pub fn report(&self) -> AgentReport {
        let (registrations, registered_bytes) = self.core.host.registry.stats();
        let peers = lock(&self.core.peers)
            .values()
            .filter(|w| w.strong_count() > 0)
            .count();
        AgentReport {
            registrations,
            registered_bytes,
            peers,
            in_flight: self.core.in_flight.load(Ordering::Acquire),
            copied_write_bytes: self.core.host.copied_write.get(),
            copied_read_bytes: self.core.host.copied_read.get(),
        }
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        self.core.host.closed.store(true, Ordering::Release);
        self.core.transport.shutdown();
    }
}

impl fmt::Debug for Agent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Agent")
            .field("name", &self.name())
            .field("kind", &self.kind())
            .field("report", &self.report())
            .finish()
    }
}

/// A notification from a peer, delivered after the data of its transfer landed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Notification {
    /// The sending agent's name.
    pub from: String,
    /// The message.
    pub msg: Vec<u8>,
}

#[derive(Default)]
pub(crate) struct Notifications {
    queue: Mutex<(VecDeque<Notification>, Vec<Waker>)>,
    ready: Condvar,
}

impl Notifications {
    pub(crate) fn push(&self, from: String, msg: Vec<u8>) {
        let wakers = {
            let mut q = lock(&self.queue);
            q.0.push_back(Notification { from, msg });
            std::mem::take(&mut q.1)
        };
        self.ready.notify_all();
        for w in wakers {
            w.wake();
        }
    }

    fn try_pop(&self) -> Option<Notification> {
        lock(&self.queue).0.pop_front()
    }

    fn wait(&self, timeout: Duration) -> Option<Notification> {
        let deadline = Instant::now() + timeout;
        let mut q = lock(&self.queue);
        loop {
            if let Some(n) = q.0.pop_front() {
                return Some(n);
            }
            let left = deadline.checked_duration_since(Instant::now())?;
            q = self
                .ready
                .wait_timeout(q, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }
}

/// Future of [`Agent::next_notification`].
#[must_use = "futures do nothing unless polled"]
pub struct NextNotification<'a> {
    queue: &'a Notifications,
}

impl Future for NextNotification<'_> {
    type Output = Notification;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Notification> {
        let mut q = lock(&self.queue.queue);
        match q.0.pop_front() {
            Some(n) => Poll::Ready(n),
            None => {
                if !q.1.iter().any(|w| w.will_wake(cx.waker())) {
                    q.1.push(cx.waker().clone());
                }
                Poll::Pending
            }
        }
    }
}

/// The registration table: by id for target-side validation, by range for the cache.
#[derive(Default)]
pub(crate) struct Registry {
    table: Mutex<Table>,
}

#[derive(Default)]
struct Table {
    /// Ids are our own counter, not peer input: the fast hasher is safe here.
    by_id: HashMap<u64, Slot, rustc_hash::FxBuildHasher>,
    /// Address ranges of the live registrations. The cache's question "a registration of
    /// this region covering this range?" is asked here too, as the range's addresses with
    /// the region's id checked, so one index serves both lookups.
    by_addr: IntervalIndex,
    /// Bytes the live registrations cover.
    bytes: u64,
}

struct Slot {
    entry: Weak<RegEntry>,
    region: u64,
}

/// The address range `base..base + len` as index keys.
fn addr_range(base: *const u8, len: u64) -> (u64, u64) {
    let lo = base as usize as u64;
    (lo, lo.saturating_add(len))
}

impl Table {
    /// Entry `id` if it is live (one whose last owner is dropping it is not).
    fn live(&self, id: u64) -> Option<Arc<RegEntry>> {
        self.by_id.get(&id).and_then(|s| s.entry.upgrade())
    }
}

impl Registry {
    /// A live registration of `region` covering `offset..offset + len`.
    fn find(&self, region: &Region, offset: u64, len: u64) -> Option<Arc<RegEntry>> {
        let (lo, hi) = addr_range(region.as_ptr().wrapping_add(offset as usize), len);
        let id = region.id();
        let t = lock(&self.table);
        // The region is checked before upgrading: an entry is never dropped under the lock.
        t.by_addr.find_covering(lo, hi, |reg| {
            let slot = t.by_id.get(&reg).filter(|s| s.region == id)?;
            slot.entry.upgrade()
        })
    }

    pub(crate) fn lookup(&self, id: u64) -> Option<(Region, u64, u64)> {
        let entry = lock(&self.table).live(id)?;
        // The lock is released before `entry` can drop.
        Some((entry.region.clone(), entry.offset, entry.len))
    }

    fn insert(&self, entry: &Arc<RegEntry>) {
        let (lo, hi) = addr_range(entry.base(), entry.len);
        let mut t = lock(&self.table);
        t.by_id.insert(
            entry.id,
            Slot {
                entry: Arc::downgrade(entry),
                region: entry.region.id(),
            },
        );
        t.by_addr.insert(lo, hi, entry.id);
        t.bytes += entry.len;
    }

    fn remove(&self, entry: &RegEntry) {
        let (lo, _) = addr_range(entry.base(), entry.len);
        let mut t = lock(&self.table);
        t.by_id.remove(&entry.id);
        if t.by_addr.remove(lo, entry.id) {
            t.bytes -= entry.len;
        }
    }

    /// A live registration covering `addr..addr + len`.
    fn find_addr(&self, addr: usize, len: u64) -> Option<Arc<RegEntry>> {
        let (lo, hi) = addr_range(addr as *const u8, len);
        let t = lock(&self.table);
        t.by_addr.find_covering(lo, hi, |id| t.live(id))
    }

    fn remote_regs(&self) -> Vec<RemoteReg> {
        let t = lock(&self.table);
        let live: Vec<Arc<RegEntry>> = t.by_id.values().filter_map(|s| s.entry.upgrade()).collect();
        // An entry whose other owners let go meanwhile drops here, after the lock.
        drop(t);
        let mut regs: Vec<RemoteReg> = live
            .iter()
            .map(|e| RemoteReg {
                id: e.id,
                len: e.len,
                key: e.key.clone(),
            })
            .collect();
        drop(live);
        regs.sort_unstable_by_key(|r| r.id);
        regs
    }

    fn stats(&self) -> (usize, u64) {
        let t = lock(&self.table);
        (t.by_addr.len(), t.bytes)
    }

    /// Pins every span's registration into `grant`. Never drops an `Arc<RegEntry>` while the
    /// table is locked (that would re-enter the lock from `RegEntry::drop`).
    pub(crate) fn pin_spans(
        &self,
        grant: &mut Grant,
        spans: impl IntoIterator<Item = (u64, u64, u64)>,
    ) -> Result<(), RejectReason> {
        let t = lock(&self.table);
        for (reg, offset, len) in spans {
            let entry = match grant.pins.last() {
                Some(last) if last.id == reg => last,
                _ => {
                    let found = t
                        .by_id
                        .get(&reg)
                        .and_then(|s| s.entry.upgrade())
                        .ok_or(RejectReason::UnknownRegistration)?;
                    grant.pins.push(found);
                    grant.pins.last().ok_or(RejectReason::Malformed)?
                }
            };
            if len == 0 {
                return Err(RejectReason::Malformed);
            }
            match offset.checked_add(len) {
                Some(end) if end <= entry.len => {}
                _ => return Err(RejectReason::OutOfRange),
            }
            grant
                .spans
                .push((entry.base() as usize + offset as usize, len));
        }
        Ok(())
    }
}

/// One live registration, shared by every guard, descriptor and in-flight transfer on it.
pub(crate) struct RegEntry {
    pub(crate) id: u64,
    pub(crate) agent_id: u64,
    region: Region,
    offset: u64,
    pub(crate) len: u64,
    key: Vec<u8>,
    /// Where the registration is listed: `None` for a local-only registration
    /// ([`Agent::register_local`]), which its engine never saw and its agent's registry never
    /// held, so dropping it releases nothing but its memory.
    listed: Option<Listed>,
}

/// The engine that registered an entry and the agent whose registry lists it.
struct Listed {
    transport: Arc<dyn Transport>,
    host: Weak<HostShared>,
}

impl RegEntry {
    pub(crate) fn base(&self) -> *mut u8 {
        self.region.as_ptr().wrapping_add(self.offset as usize)
    }
}

impl Drop for RegEntry {
    fn drop(&mut self) {
        let Some(listed) = &self.listed else {
            return;
        };
        if let Some(host) = listed.host.upgrade() {
            host.registry.remove(self);
        }
        listed.transport.deregister(self.id);
    }
}

/// A registration guard: a window onto a registered range. Cloning is cheap; the range is
/// deregistered when the last guard, descriptor and transfer on it are gone.
#[derive(Clone)]
#[must_use = "dropping the last guard deregisters the memory"]
pub struct Registration {
    pub(crate) entry: Arc<RegEntry>,
    /// Window start, relative to the registration.
    start: u64,
    len: u64,
}

impl Registration {
    /// The registration's id, as peers name it.
    pub fn id(&self) -> u64 {
        self.entry.id
    }

    /// Length of this window.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Always false.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Where this window starts inside the registration that peers see (non-zero when the
    /// cache answered with a larger registration).
    pub fn offset_in_registration(&self) -> u64 {
        self.start
    }

    /// The region this registration covers.
    pub fn region(&self) -> &Region {
        &self.entry.region
    }

    /// Address of the window's first byte.
    pub fn as_ptr(&self) -> *mut u8 {
        self.entry.base().wrapping_add(self.start as usize)
    }

    fn window(&self, offset: u64, len: u64) -> Result<u64, DescError> {
        if len == 0 {
            return Err(DescError::Empty);
        }
        match offset.checked_add(len) {
            Some(end) if end <= self.len => Ok(self.start + offset),
            _ => Err(DescError::OutOfRange {
                reg: self.entry.id,
                offset,
                len,
                reg_len: self.len,
            }),
        }
    }

    /// A local descriptor of `len` bytes at `offset` in this window.
    pub fn desc(&self, offset: u64, len: u64) -> Result<LocalDesc, DescError> {
        Ok(LocalDesc {
            offset: self.window(offset, len)?,
            reg: self.entry.clone(),
            len,
            keep: None,
        })
    }

    /// Like [`Registration::desc`], also keeping `keep` alive as long as the descriptor and
    /// any transfer using it.
    pub fn desc_keeping(
        &self,
        offset: u64,
        len: u64,
        keep: KeepAlive,
    ) -> Result<LocalDesc, DescError> {
        let mut d = self.desc(offset, len)?;
        d.keep = Some(keep);
        Ok(d)
    }

    /// The same range as a peer names it, to send to the peer.
    pub fn remote(&self, offset: u64, len: u64) -> Result<RemoteDesc, DescError> {
        Ok(RemoteDesc::new(
            self.entry.id,
            self.window(offset, len)?,
            len,
        ))
    }
}

impl fmt::Debug for Registration {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Registration")
            .field("id", &self.entry.id)
            .field("start", &self.start)
            .field("len", &self.len)
            .finish()
    }
}

/// A peer's registrations as its latest metadata announced them: id -> length.
pub(crate) struct RegTable {
    lens: HashMap<u64, u64>,
}

impl RegTable {
    fn new(regs: &[RemoteReg]) -> Self {
        Self {
            lens: regs.iter().map(|r| (r.id, r.len)).collect(),
        }
    }

    pub(crate) fn len_of(&self, id: u64) -> Option<u64> {
        self.lens.get(&id).copied()
    }
}

/// A handle on a remote agent. Cloning is cheap; the connection closes when the last handle
/// and the last transfer with the peer are gone.
#[derive(Clone)]
pub struct Peer {
    pub(crate) core: Arc<PeerCore>,
}

pub(crate) struct PeerCore {
    pub(crate) name: Arc<str>,
    pub(crate) agent: Arc<AgentCore>,
    pub(crate) conn: Mutex<Arc<dyn Connection>>,
    address: Mutex<Vec<u8>>,
    pub(crate) regs: Mutex<Arc<RegTable>>,
}

impl Drop for PeerCore {
    fn drop(&mut self) {
        lock(&self.conn).close();
        let mut peers = lock(&self.agent.peers);
        if peers
            .get(&*self.name)
            .is_some_and(|w| w.strong_count() == 0)
        {
            peers.remove(&*self.name);
        }
    }
}

impl Peer {
    /// The peer agent's name.
    pub fn name(&self) -> &str {
        &self.core.name
    }

    /// Whether the peer's latest metadata announced registration `id`, and its length.
    pub fn registration_len(&self, id: u64) -> Option<u64> {
        lock(&self.core.regs).len_of(id)
    }

    /// Validates and coalesces a descriptor pair list once, to post it many times.
    pub fn prepare(
        &self,
        op: Op,
        local: &[LocalDesc],
        remote: &[RemoteDesc],
    ) -> Result<Prepared, TransferError> {
        Prepared::new(self.core.clone(), op, local, remote, true)
    }

    /// Like [`Peer::prepare`] without coalescing: the engine sees one segment per pair, in the
    /// given order. Useful to measure what coalescing saves, or to keep a strict order of
    /// overlapping destinations.
    pub fn prepare_uncoalesced(
        &self,
        op: Op,
        local: &[LocalDesc],
        remote: &[RemoteDesc],
    ) -> Result<Prepared, TransferError> {
        Prepared::new(self.core.clone(), op, local, remote, false)
    }

    /// Copies each `local[i]` to `remote[i]` (pairwise equal lengths), then delivers `notify`
    /// to the peer. Every remote descriptor is checked against the peer's metadata before a
    /// byte moves.
    pub fn write(
        &self,
        local: &[LocalDesc],
        remote: &[RemoteDesc],
        notify: Option<&[u8]>,
    ) -> Result<Transfer, TransferError> {
        self.prepare(Op::Write, local, remote)?.post(notify)
    }

    /// Copies each `remote[i]` into `local[i]` (pairwise equal lengths), then delivers
    /// `notify` to the peer.
    pub fn read(
        &self,
        local: &[LocalDesc],
        remote: &[RemoteDesc],
        notify: Option<&[u8]>,
    ) -> Result<Transfer, TransferError> {
        self.prepare(Op::Read, local, remote)?.post(notify)
    }

    /// Sends a notification alone.
    pub fn notify(&self, msg: &[u8]) -> Result<Transfer, TransferError> {
        self.prepare(Op::Write, &[], &[])?.post(Some(msg))
    }
}

impl fmt::Debug for Peer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Peer").field("name", &self.name()).finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::Xfer;
    use crate::error::BackendError;
    use crate::sync::{model, thread};

    /// An engine that counts registrations and parks posted transfers for the test to
    /// complete from another thread.
    #[derive(Default)]
    struct Counting {
        live: Mutex<i64>,
        parked: Arc<Mutex<Vec<Xfer>>>,
        host: Mutex<Option<Host>>,
        /// Its local side needs no registration (as `inproc`, `shm` and `tcp`).
        by_address: bool,
    }

    impl Transport for Arc<Counting> {
        fn kind(&self) -> &'static str {
            "counting"
        }
        fn start(&self, host: Host) -> Result<(), BackendError> {
            *lock(&self.host) = Some(host);
            Ok(())
        }
        fn register(&self, _: &RegInfo<'_>) -> Result<Vec<u8>, RegisterError> {
            *lock(&self.live) += 1;
            Ok(Vec::new())
        }
        fn deregister(&self, _: u64) {
            *lock(&self.live) -= 1;
        }
        fn address(&self) -> Vec<u8> {
            Vec::new()
        }
        fn connect(&self, _: &PeerInfo) -> Result<Arc<dyn Connection>, BackendError> {
            Ok(Arc::new(Parking(self.parked.clone())))
        }
        fn local_side_needs_registration(&self) -> bool {
            !self.by_address
        }
        fn tracks_links(&self) -> bool {
            true
        }
        fn shutdown(&self) {}
    }

    struct Parking(Arc<Mutex<Vec<Xfer>>>);
    impl Connection for Parking {
        fn post(&self, xfer: Xfer) {
            lock(&self.0).push(xfer);
        }
    }

    #[test]
    fn cache_answers_sub_ranges_and_refcounts() {
        let engine = Arc::new(Counting::default());
        let agent = Agent::new("a", engine.clone()).unwrap();
        let region = Region::anonymous(1 << 16).unwrap();
        let whole = agent.register(&region).unwrap();
        let part = agent.register_range(&region, 4096, 100).unwrap();
        assert_eq!(part.id(), whole.id());
        assert_eq!(part.offset_in_registration(), 4096);
        assert_eq!(
            part.remote(10, 5).unwrap(),
            RemoteDesc::new(whole.id(), 4106, 5)
        );
        assert!(part.desc(0, 101).is_err());
        assert!(part.desc(0, 0).is_err());
        assert_eq!(*lock(&engine.live), 1);
        let desc = whole.desc(0, 10).unwrap();
        drop((whole, part));
        assert_eq!(agent.report().registrations, 1, "the descriptor keeps it");
        drop(desc);
        assert_eq!(agent.report().registrations, 0);
        assert_eq!(*lock(&engine.live), 0);
        let other = Region::anonymous(100).unwrap();
        assert!(agent.register_range(&other, 50, 51).is_err());
    }

    /// An engine that keeps the default (its local side needs registering) gets a normal
    /// registration from `register_local`: the engine is asked, the registry lists it, and
    /// the last guard deregisters it.
    #[test]
    fn register_local_falls_back_where_the_engine_needs_it() {
        let engine = Arc::new(Counting::default());
        let agent = Agent::new("a", engine.clone()).unwrap();
        assert!(agent.local_side_needs_registration());
        let region = Region::anonymous(4096).unwrap();
        let reg = agent.register_local(&region).unwrap();
        assert_eq!(*lock(&engine.live), 1);
        assert_eq!(agent.report().registrations, 1);
        let found = agent.find_registered(region.as_ptr(), 4096).unwrap();
        assert_eq!(found.id(), reg.id());
        drop((reg, found));
        assert_eq!(*lock(&engine.live), 0);
        assert_eq!(agent.report().registrations, 0);
    }

    #[test]
    fn registered_memory_is_found_by_address() {
        let agent = Agent::new("a", Arc::new(Counting::default())).unwrap();
        let region = Region::anonymous(1 << 16).unwrap();
        let other = Region::anonymous(4096).unwrap();
        let reg = agent.register_range(&region, 4096, 8192).unwrap();
        let inside = region.as_ptr().wrapping_add(5000);
        let found = agent.find_registered(inside, 100).unwrap();
        assert_eq!(found.id(), reg.id());
        assert_eq!(found.offset_in_registration(), 5000 - 4096);
        assert_eq!(found.desc(0, 100).unwrap().as_ptr(), inside);
        assert!(found.desc(0, 101).is_err());
        assert!(
            agent.find_registered(inside, 8192).is_none(),
            "runs past the end"
        );
        assert!(
            agent.find_registered(region.as_ptr(), 10).is_none(),
            "before the start"
        );
        assert!(agent.find_registered(other.as_ptr(), 10).is_none());
        assert!(agent.find_registered(inside, 0).is_none());
        drop((reg, found));
        assert!(agent.find_registered(inside, 100).is_none());
    }

    #[derive(Debug, Clone)]
    enum CacheOp {
        Register {
            region: usize,
            offset: u64,
            len: u64,
        },
        DropGuard(usize),
        Desc(usize),
        DropDesc(usize),
        Find {
            region: usize,
            offset: u64,
            len: u64,
        },
    }

    fn cache_op() -> impl proptest::strategy::Strategy<Value = CacheOp> {
        use proptest::prelude::*;
        prop_oneof![
            (0usize..2, 0u64..8, 1u64..8).prop_map(|(region, o, l)| CacheOp::Register {
                region,
                offset: o * 512,
                len: (l * 512).min(4096 - o * 512),
            }),
            any::<usize>().prop_map(CacheOp::DropGuard),
            any::<usize>().prop_map(CacheOp::Desc),
            any::<usize>().prop_map(CacheOp::DropDesc),
            (0usize..2, 0u64..4096, 1u64..4096).prop_map(|(region, offset, len)| {
                CacheOp::Find {
                    region,
                    offset,
                    len: len.min(4096 - offset).max(1),
                }
            }),
        ]
    }

    proptest::proptest! {
        /// Random register / drop / describe sequences against a model of which registrations
        /// are live: the cache answers from a live covering registration when there is one,
        /// and the engine sees exactly the live ones.
        #[test]
        fn registration_cache_matches_model(
            ops in proptest::collection::vec(cache_op(), 1..60)
        ) {
            let engine = Arc::new(Counting::default());
            let agent = Agent::new("a", engine.clone()).unwrap();
            let regions = [Region::anonymous(4096).unwrap(), Region::anonymous(4096).unwrap()];
            // Model: registration id -> (region, start, len).
            let mut model: HashMap<u64, (usize, u64, u64)> = HashMap::new();
            let mut guards: Vec<Registration> = Vec::new();
            let mut descs: Vec<LocalDesc> = Vec::new();
            for op in ops {
                match op {
                    CacheOp::Register { region, offset, len } => {
                        let covering: Vec<u64> = model
                            .iter()
                            .filter(|(_, &(r, s, l))| r == region && s <= offset && offset + len <= s + l)
                            .map(|(&id, _)| id)
                            .collect();
                        let g = agent.register_range(&regions[region], offset, len).unwrap();
                        if covering.is_empty() {
                            proptest::prop_assert!(!model.contains_key(&g.id()));
                            model.insert(g.id(), (region, offset, len));
                        } else {
                            proptest::prop_assert!(covering.contains(&g.id()), "cache missed");
                        }
                        guards.push(g);
                    }
                    CacheOp::DropGuard(i) if !guards.is_empty() => {
                        drop(guards.swap_remove(i % guards.len()));
                    }
                    CacheOp::Desc(i) if !guards.is_empty() => {
                        let g = &guards[i % guards.len()];
                        descs.push(g.desc(0, g.len()).unwrap());
                    }
                    CacheOp::DropDesc(i) if !descs.is_empty() => {
                        descs.swap_remove(i % descs.len());
                    }
                    CacheOp::Find { region, offset, len } => {
                        let covering: Vec<u64> = model
                            .iter()
                            .filter(|(_, &(r, s, l))| r == region && s <= offset && offset + len <= s + l)
                            .map(|(&id, _)| id)
                            .collect();
                        let ptr = regions[region].as_ptr().wrapping_add(offset as usize);
                        match agent.find_registered(ptr, len) {
                            Some(found) => {
                                proptest::prop_assert!(covering.contains(&found.id()));
                                proptest::prop_assert_eq!(found.as_ptr(), ptr);
                            }
                            None => proptest::prop_assert!(covering.is_empty(), "lookup missed"),
                        }
                    }
                    _ => {}
                }
                let live: std::collections::HashSet<u64> = guards
                    .iter()
                    .map(Registration::id)
                    .chain(descs.iter().map(LocalDesc::reg))
                    .collect();
                model.retain(|id, _| live.contains(id));
                proptest::prop_assert_eq!(agent.report().registrations, model.len());
                proptest::prop_assert_eq!(*lock(&engine.live), model.len() as i64);
            }
            drop((guards, descs));
            proptest::prop_assert_eq!(agent.report().registrations, 0);
            proptest::prop_assert_eq!(*lock(&engine.live), 0);
        }
    }

    #[test]
    fn bad_names_are_errors() {
        assert!(Agent::new("", Arc::new(Counting::default())).is_err());
        assert!(Agent::new(&"x".repeat(256), Arc::new(Counting::default())).is_err());
    }

    /// A transfer completed on another thread while its owner drops every handle and waits:
    /// the waiter sees the outcome only after the transfer's registration, pool block and
    /// in-flight count were released (deferred release, then completion).
    #[test]
    fn loom_completion_releases_before_waking() {
        model(|| {
            let engine = Arc::new(Counting::default());
            let a = Agent::new("a", engine.clone()).unwrap();
            let b = Agent::new("b", Arc::new(Counting::default())).unwrap();
            let rb = Region::anonymous(4096).unwrap();
            let gb = b.register(&rb).unwrap();
            let peer = a.add_remote(&b.metadata()).unwrap();
            let pool = crate::RegisteredPool::new(&a, 4096).unwrap();
            let block = pool.lease(64, 8).unwrap();
            let t = peer
                .write(&[block.desc().unwrap()], &[gb.remote(0, 64).unwrap()], None)
                .unwrap();
            drop((block, peer));
            let xfer = lock(&engine.parked).pop().unwrap();
            let completer = thread::spawn(move || xfer.done.complete(Ok(())));
            assert_eq!(t.wait(), Ok(()));
            assert_eq!(pool.report().used, 0, "block released before completion");
            assert_eq!(a.report().in_flight, 0);
            completer.join().unwrap();
            drop(pool);
            assert_eq!(a.report().registrations, 0);
        });
    }

    /// A WRITE from a local-only registration completes on another thread while its owner
    /// drops the guard and waits: the registration lives until the completion, its release
    /// never reaches the engine or the registry, and a listed registration next to it is
    /// untouched, whatever the interleaving.
    #[test]
    fn loom_local_only_registration_outlives_its_transfer() {
        model(|| {
            let engine = Arc::new(Counting {
                by_address: true,
                ..Counting::default()
            });
            let a = Agent::new("a", engine.clone()).unwrap();
            let b = Agent::new("b", Arc::new(Counting::default())).unwrap();
            let rb = Region::anonymous(4096).unwrap();
            let gb = b.register(&rb).unwrap();
            let listed = a.register(&Region::anonymous(4096).unwrap()).unwrap();
            let ra = Region::anonymous(4096).unwrap();
            let local = a.register_local(&ra).unwrap();
            assert_eq!(*lock(&engine.live), 1, "the engine saw only the listed one");
            let peer = a.add_remote(&b.metadata()).unwrap();
            let t = peer
                .write(
                    &[local.desc(0, 8).unwrap()],
                    &[gb.remote(0, 8).unwrap()],
                    None,
                )
                .unwrap();
            let id = local.id();
            drop((local, ra, peer));
            let xfer = lock(&engine.parked).pop().unwrap();
            assert_eq!(xfer.plan().segments()[0].local_reg, id, "the plan pins it");
            let completer = thread::spawn(move || xfer.done.complete(Ok(())));
            assert_eq!(t.wait(), Ok(()));
            completer.join().unwrap();
            assert_eq!(a.report().registrations, 1);
            assert_eq!(*lock(&engine.live), 1);
            drop(listed);
            assert_eq!(a.report().registrations, 0);
            assert_eq!(*lock(&engine.live), 0);
        });
    }

    /// An engine that drops a transfer without reporting it fails the transfer, on any
    /// thread, and releases what it held.
    #[test]
    fn loom_lost_status_is_a_failure() {
        model(|| {
            let engine = Arc::new(Counting::default());
            let a = Agent::new("a", engine.clone()).unwrap();
            let b = Agent::new("b", Arc::new(Counting::default())).unwrap();
            let rb = Region::anonymous(4096).unwrap();
            let gb = b.register(&rb).unwrap();
            let ra = Region::anonymous(4096).unwrap();
            let ga = a.register(&ra).unwrap();
            let peer = a.add_remote(&b.metadata()).unwrap();
            let t = peer
                .write(&[ga.desc(0, 8).unwrap()], &[gb.remote(0, 8).unwrap()], None)
                .unwrap();
            drop(ga);
            let xfer = lock(&engine.parked).pop().unwrap();
            let dropper = thread::spawn(move || drop(xfer));
            assert!(matches!(
                t.wait(),
                Err(TransferError::StatusLost { ref peer }) if peer == "b"
            ));
            dropper.join().unwrap();
            assert_eq!(a.report().registrations, 0);
        });
    }

    /// A peer's request races the owner dropping the last guard: the request is either
    /// refused as unknown or pins the registration, which is then deregistered exactly once,
    /// after the pin is released.
    #[test]
    fn loom_target_grant_races_deregistration() {
        model(|| {
            let engine = Arc::new(Counting::default());
            let agent = Agent::new("a", engine.clone()).unwrap();
            let host = lock(&engine.host).clone().unwrap();
            let region = Region::anonymous(4096).unwrap();
            let reg = agent.register(&region).unwrap();
            let id = reg.id();
            let dropper = thread::spawn(move || drop(reg));
            let mut grant = Grant::new();
            match host.grant_into(&mut grant, [(id, 0, 64)]) {
                Ok(()) => {
                    assert_eq!(grant.len(), 1);
                    assert_eq!(*lock(&engine.live), 1, "pinned memory stays registered");
                }
                Err(reason) => assert_eq!(reason, RejectReason::UnknownRegistration),
            }
            dropper.join().unwrap();
            drop(grant);
            assert_eq!(*lock(&engine.live), 0);
            assert_eq!(agent.report().registrations, 0);
        });
    }

    /// Two engine readers serving the same peer (one learns the peer's name late) return on
    /// their own threads while the owner asks: the peer reads open while either runs and
    /// closed once both returned, whatever the interleaving; the count never goes stale.
    #[test]
    fn loom_peer_link_counts_every_reader() {
        model(|| {
            let engine = Arc::new(Counting::default());
            let agent = Agent::new("a", engine.clone()).unwrap();
            let host = lock(&engine.host).clone().unwrap();
            let first = host.link_open("c");
            let mut second = host.link_open("unnamed");
            let reader = thread::spawn(move || {
                second.rename("c");
                drop(second);
            });
            assert_eq!(agent.peer_link("c"), LinkState::Open);
            let other = thread::spawn(move || drop(first));
            reader.join().unwrap();
            other.join().unwrap();
            assert_eq!(agent.peer_link("c"), LinkState::Closed);
            assert_eq!(agent.peer_link("unnamed"), LinkState::Closed);
            assert!(lock(&agent.core.host.inbound).is_empty());
        });
    }

    /// Registering and dropping the same range on two threads: the engine sees balanced
    /// register/deregister calls, and the table ends empty, whatever the interleaving.
    #[test]
    fn loom_registration_cache_refcounts() {
        model(|| {
            let engine = Arc::new(Counting::default());
            let agent = Arc::new(Agent::new("a", engine.clone()).unwrap());
            let region = Region::anonymous(4096).unwrap();
            let threads: Vec<_> = (0..2)
                .map(|_| {
                    let agent = agent.clone();
                    let region = region.clone();
                    thread::spawn(move || {
                        let r = agent.register_range(&region, 0, 64).unwrap();
                        let d = r.desc(0, 8).unwrap();
                        drop(r);
                        d.reg()
                    })
                })
                .collect();
            for t in threads {
                t.join().unwrap();
            }
            assert_eq!(agent.report().registrations, 0);
            assert_eq!(*lock(&engine.live), 0);
        });
    }
}
