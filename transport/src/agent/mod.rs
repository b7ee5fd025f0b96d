//! Agents: one named endpoint of one engine, and what it owns. The registration cache
//! (`registry`), peers (`peer`) and the notification queue (`notify`) each live in a module of
//! their own.

mod peer;
mod prepared;
mod registration;
#[cfg(test)]
mod tests;

pub use peer::Peer;
pub(crate) use peer::{PeerCore, RegTable};
pub use prepared::Prepared;
pub use registration::Registration;

use crate::engine::HostShared;
use crate::notify::{NextNotification, Notification, Notifications};
use crate::registry::{Listed, ListedEngine, RegEntry, Registry};

use std::collections::HashMap;
use std::fmt;
use std::time::Duration;

use crate::desc::LocalDesc;
use crate::engine::{Host, PeerInfo, RegInfo, RemoteReg, Transport};
use crate::error::{AgentError, ConnectError, RegisterError};
use crate::exposure::Scope;
use crate::metadata;
use crate::region::next_id;
use crate::Region;
use tessera_sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use tessera_sync::{Arc, Counter, Mutex, Weak};

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
    /// The engine, as the registrations it listed see it.
    deregister: Arc<dyn ListedEngine>,
    peers: Mutex<HashMap<String, Weak<PeerCore>>>,
    pub(crate) in_flight: Arc<AtomicUsize>,
}

/// An agent's engine as its registrations reach it: to deregister them and to announce
/// their standing exposures.
struct EngineDeregister(Arc<dyn Transport>);

impl ListedEngine for EngineDeregister {
    fn deregister(&self, id: u64) {
        self.0.deregister(id);
    }

    fn standing(&self, peer: &str, grant: crate::engine::Standing, live: bool) {
        self.0.standing(peer, grant, live);
    }

    fn spin_for_writes(
        &self,
        peer: &str,
        window: Duration,
        done: &mut dyn FnMut() -> bool,
    ) -> bool {
        self.0.spin_for_writes(peer, window, done)
    }

    fn watch_writes(&self, peer: &str) -> crate::engine::WriteWatch {
        self.0.watch_writes(peer)
    }
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
    /// WRITEs this agent's engine made inside a peer's standing ranges, without asking the
    /// peer first (`shm`; see [`Registration::expose_standing`]).
    pub standing_writes: u64,
}

const _: () = {
    const fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<Agent>();
    assert_send_sync::<Peer>();
    assert_send_sync::<Registration>();
    assert_send_sync::<LocalDesc>();
};

/// Holds back this thread's announcements of standing exposures while it lives (see
/// [`Agent::hold_announcements`]). Not `Send`: it ends on the thread that took it.
#[must_use = "the announcements go out when the hold is dropped"]
pub struct AnnouncementHold(std::marker::PhantomData<*const ()>);

impl Drop for AnnouncementHold {
    fn drop(&mut self) {
        crate::shm::release_announcements();
    }
}

impl Agent {
    /// Holds back the announcements that standing exposures made or withdrawn on this thread
    /// send to their peers on a socket ([`Registration::expose_standing`], `shm`'s `STANDING`
    /// and `REVOKE`) until the returned hold is dropped; then each peer link's go out in one
    /// message, in the order they were made. The target's own checks change at once: a
    /// withdrawn range records no WRITE from then on, whether or not its peer has heard.
    /// A server takes it around a request's handling so that the answer leaves before the
    /// announcements the handling made (each a system call, and a wake-up of the peer's engine
    /// thread). Announcements that travel through shared memory instead (`shm`'s ring of
    /// announcements, while it has room) cost neither and are not held: the peer has them
    /// before the answer. Holds nest; engines that announce nothing ignore them.
    pub fn hold_announcements() -> AnnouncementHold {
        crate::shm::hold_announcements();
        AnnouncementHold(std::marker::PhantomData)
    }

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
            registry: Arc::new(Registry::default()),
            notifications: Notifications::default(),
            closed: AtomicBool::new(false),
            copied_write: Counter::default(),
            standing_writes: Counter::default(),
            copied_read: Counter::default(),
            copy_slice: AtomicUsize::new(crate::copy::SLICE),
            inbound: Mutex::new(HashMap::new()),
        });
        transport.start(Host {
            shared: host.clone(),
        })?;
        Ok(Self {
            core: Arc::new(AgentCore {
                host,
                deregister: Arc::new(EngineDeregister(transport.clone())),
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

    /// Sets how many bytes a large copy this agent makes (its WRITEs and READs over the
    /// memory engines, `shm` and `inproc`) runs between offers of its core to other threads
    /// (`sched_yield`); at least 64 KiB, 4 MiB unless set. A shorter slice lets a thread
    /// woken on the copy's core (another worker of a server, with a small request to answer)
    /// in sooner, and costs the copy itself where a thread that spins shares its core.
    pub fn set_copy_slice(&self, bytes: usize) {
        self.core
            .host
            .copy_slice
            .store(bytes.max(crate::copy::MIN_SLICE), Ordering::Relaxed);
    }

    /// Bytes a copy of this agent runs between offers of its core
    /// ([`Agent::set_copy_slice`]).
    pub fn copy_slice(&self) -> usize {
        self.core.host.copy_slice.load(Ordering::Relaxed)
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
        self.register_with(region, offset, len, false)
    }

    /// Registers the whole region *scoped*: a peer's request touching it is granted only
    /// inside an [`Exposure`](crate::Exposure) to that peer for that operation
    /// ([`Registration::expose`]), and refused with
    /// [`RejectReason::NotExposed`](crate::RejectReason::NotExposed) elsewhere. Enforced by
    /// `tcp`, `inproc` and (at its grant only, see the crate README's trust model) `shm`; the
    /// one-sided `ucx` and `nixl` engines cannot enforce it. Never answered from, nor
    /// answering, the registration cache: it is always a registration of its own.
    pub fn register_scoped(&self, region: &Region) -> Result<Registration, RegisterError> {
        self.register_with(region, 0, region.len(), true)
    }

    fn register_with(
        &self,
        region: &Region,
        offset: u64,
        len: u64,
        scoped: bool,
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
        if region.mark_registered() && !scoped {
            if let Some(entry) = host.registry.find_unscoped(region, offset, len) {
                let start = offset - entry.offset;
                return Ok(Registration { entry, start, len });
            }
        }
        let id = host.registry.fresh_id();
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
            scope: Arc::new(Scope::new(scoped)),
            listed: Some(Listed {
                engine: self.core.deregister.clone(),
                registry: Arc::downgrade(&host.registry),
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
            if let Some(entry) = host.registry.find_unscoped(region, 0, len) {
                // It covers the whole region, so it starts at the region's first byte.
                return Ok(Registration {
                    entry,
                    start: 0,
                    len,
                });
            }
        }
        let entry = Arc::new(RegEntry {
            id: crate::auth::random_u64(),
            agent_id: host.id,
            region: region.clone(),
            offset: 0,
            len,
            key: Vec::new(),
            scope: Arc::new(Scope::new(false)),
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
            regs: self
                .core
                .host
                .registry
                .remote_regs()
                .into_iter()
                .map(|(id, len, key)| RemoteReg { id, len, key })
                .collect(),
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
        let existing = self
            .core
            .peers
            .lock()
            .get(&info.name)
            .and_then(Weak::upgrade);
        if let Some(existing) = existing {
            let moved = *existing.address.lock() != info.address;
            if moved {
                // The peer restarted (or rebound): reconnect, and retire the old connection.
                let fresh = self.core.transport.connect(&info).map_err(backend_err)?;
                let old = std::mem::replace(&mut *existing.conn.lock(), fresh);
                old.close();
                *existing.address.lock() = info.address.clone();
            } else {
                let conn = existing.conn.lock().clone();
                conn.update(&info).map_err(backend_err)?;
            }
            *existing.regs.lock() = Arc::new(RegTable::new(&info.regs));
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
        self.core
            .peers
            .lock()
            .insert(info.name, Arc::downgrade(&core));
        Ok(Peer { core })
    }

    /// The peer named `name`, if a handle on it is alive.
    pub fn peer(&self, name: &str) -> Option<Peer> {
        let core = self.core.peers.lock().get(name).and_then(Weak::upgrade)?;
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
        if self.core.host.inbound.lock().contains_key(name) {
            LinkState::Open
        } else {
            LinkState::Closed
        }
    }

    /// Occupancy now.
    pub fn report(&self) -> AgentReport {
        let (registrations, registered_bytes) = self.core.host.registry.stats();
        let peers = self
            .core
            .peers
            .lock()
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
            standing_writes: self.core.host.standing_writes.get(),
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
