//! The engine SPI: the one trait every engine implements, and what the agent hands an engine.
//! A user of agents, regions and transfers never needs this module; an engine crate (the
//! in-tree `inproc`, `shm` and `tcp`, or `tessera-ucx` and `tessera-nixl`) implements it.
//!
//! The split follows what NIXL and UCX need, so that their engines fit without changing it:
//!
//! | here | UCX | NIXL |
//! |---|---|---|
//! | [`Transport::register`] returns the remote key | `ucp_mem_map` + `ucp_rkey_pack` | `registerMem` |
//! | [`Transport::address`] | worker address | `getLocalMD` |
//! | [`Transport::connect`] / [`Connection::update`] | endpoint + `ucp_ep_rkey_unpack` | `loadRemoteMD` |
//! | [`Connection::post`] + [`Completion`] | `ucp_put_nbx`/`ucp_get_nbx` per segment, flush, callback | `createXferReq` + `postXferReq`, `getXferStatus` |
//! | notification in [`Xfer`], [`Host::notify`] | active message after the flush | `notifMsg`, `getNotifs` |
//! | [`Connection::close`], [`Transport::shutdown`] | endpoint close, `ucp_mem_unmap`, worker, context | `invalidateRemoteMD`, agent drop |
//!
//! The agent layer above does everything that is the same for all engines: the registration
//! cache and refcounts, metadata encoding, validation of remote descriptors, coalescing,
//! keeping in-flight resources alive, typed completion, and the notification queue.

use std::fmt;

use crate::agent::{HostShared, RegEntry};
use crate::error::{BackendError, RegisterError, RejectReason};
use crate::sync::{lock, Arc, Ordering};
use crate::Region;

pub use crate::transfer::{Completion, Plan, Segment};

/// Direction of a transfer, seen from the initiator.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub enum Op {
    /// Local memory to remote memory.
    Write,
    /// Remote memory to local memory.
    Read,
}
impl Op {
    pub(crate) fn code(self) -> u8 {
        match self {
            Op::Write => 1,
            Op::Read => 2,
        }
    }

    pub(crate) fn from_code(code: u8) -> Option<Self> {
        match code {
            1 => Some(Op::Write),
            2 => Some(Op::Read),
            _ => None,
        }
    }
}

/// A range an engine is asked to register.
#[derive(Debug)]
pub struct RegInfo<'a> {
    /// Id the agent gave the registration; remote descriptors name it.
    pub id: u64,
    /// The region holding the range.
    pub region: &'a Region,
    /// First byte of the range inside the region.
    pub offset: u64,
    /// Length of the range.
    pub len: u64,
}

impl RegInfo<'_> {
    /// Address of the first byte.
    pub fn ptr(&self) -> *mut u8 {
        self.region.as_ptr().wrapping_add(self.offset as usize)
    }
}

/// One registration a peer announced in its metadata.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RemoteReg {
    /// Its id.
    pub id: u64,
    /// Its length.
    pub len: u64,
    /// The engine's remote key (empty for engines that need none).
    pub key: Vec<u8>,
}

/// Everything a peer's metadata says, decoded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerInfo {
    /// The peer agent's name.
    pub name: String,
    /// The peer's backend kind.
    pub kind: String,
    /// The engine's address (socket address, worker address, NIXL metadata).
    pub address: Vec<u8>,
    /// Its registrations.
    pub regs: Vec<RemoteReg>,
}

/// An engine: one per agent. Object safe, so agents hold `Arc<dyn Transport>`.
///
/// Engines run their own progress (threads or a tokio runtime they own); they never need the
/// caller to poll them, and they never busy-spin while idle.
pub trait Transport: Send + Sync + 'static {
    /// Short name, such as `"tcp"`; peers must use the same kind.
    fn kind(&self) -> &'static str;

    /// Called once by [`Agent::new`](crate::Agent::new) before anything else: `host` is how
    /// the engine, acting as a target, validates requests and delivers notifications.
    fn start(&self, host: Host) -> Result<(), BackendError>;

    /// Registers a range; returns the remote key peers need to reach it (may be empty).
    fn register(&self, reg: &RegInfo<'_>) -> Result<Vec<u8>, RegisterError>;

    /// Forgets registration `id`. Called once, after every transfer using it completed.
    fn deregister(&self, id: u64);

    /// Whether the local side of a transfer (the source of a WRITE, the destination of a
    /// READ) must be registered with this engine. Engines that reach local memory through the
    /// segment's address alone ([`Segment::local_ptr`](crate::engine::Segment::local_ptr)) and whose
    /// [`register`](Transport::register) does nothing for it return `false`: the agent then
    /// never calls them for [`Agent::register_local`](crate::Agent::register_local), and
    /// their plans may name local registrations this engine never saw. The default, `true`,
    /// suits engines that look up their own handle of the local memory by
    /// [`Segment::local_reg`](crate::engine::Segment::local_reg).
    fn local_side_needs_registration(&self) -> bool {
        true
    }

    /// What peers need to reach this engine, placed in the agent's metadata.
    fn address(&self) -> Vec<u8>;

    /// Opens (or prepares to open lazily) a connection to a peer.
    fn connect(&self, peer: &PeerInfo) -> Result<Arc<dyn Connection>, BackendError>;

    /// Whether the engine reports its inbound links through [`Host::link_open`], so that
    /// [`Agent::peer_link`](crate::Agent::peer_link) can tell when a peer can no longer
    /// write. Engines without a target-side signal keep the default (`false`).
    fn tracks_links(&self) -> bool {
        false
    }

    /// Stops progress, fails every pending transfer with a peer-gone or shutdown error, and
    /// releases the engine's resources. Called once, when the agent is dropped.
    fn shutdown(&self);
}

/// An engine's handle on one peer.
pub trait Connection: Send + Sync {
    /// Starts a transfer. The engine must eventually call [`Completion::complete`] (from any
    /// thread), after the last byte landed and after the notification, if any, was handed
    /// over; until then it must not touch memory outside the plan's segments. Dropping the
    /// completion without completing it fails the transfer with a lost status.
    fn post(&self, xfer: Xfer);

    /// The peer published new metadata (such as new registrations).
    fn update(&self, peer: &PeerInfo) -> Result<(), BackendError> {
        let _ = peer;
        Ok(())
    }

    /// The last handle on the peer is gone; no transfer is pending on it any more.
    fn close(&self) {}
}

/// A transfer handed to an engine.
pub struct Xfer {
    /// The notification to deliver to the peer after the data landed.
    pub notify: Option<Vec<u8>>,
    /// Report the outcome here. It also owns the plan (see [`Completion::plan`]), so the
    /// transfer's resources are released exactly when the outcome is reported.
    pub done: Completion,
}

impl Xfer {
    /// What to move, validated and coalesced.
    pub fn plan(&self) -> &Plan {
        self.done.plan()
    }
}

impl fmt::Debug for Xfer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Xfer")
            .field("op", &self.plan().op())
            .field("segments", &self.plan().segments().len())
            .field("bytes", &self.plan().bytes())
            .field("notify", &self.notify.as_ref().map(Vec::len))
            .finish()
    }
}

/// The agent, as its engine sees it when a peer reaches it: target-side validation and
/// notification delivery. Cheap to clone.
#[derive(Clone)]
pub struct Host {
    pub(crate) shared: Arc<HostShared>,
}

impl fmt::Debug for Host {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Host")
            .field("name", &self.shared.name)
            .finish()
    }
}

impl Host {
    /// The agent's name.
    pub fn name(&self) -> &str {
        &self.shared.name
    }

    /// Target-side validation: checks every `(registration, offset, len)` a peer asks to
    /// touch against this agent's live registrations and pins them in `grant`, so none can be
    /// deregistered until the grant is cleared or dropped. On error `grant` is left empty.
    pub fn grant_into(
        &self,
        grant: &mut Grant,
        spans: impl IntoIterator<Item = (u64, u64, u64)>,
    ) -> Result<(), RejectReason> {
        grant.clear();
        if self.shared.closed.load(Ordering::Acquire) {
            return Err(RejectReason::ShuttingDown);
        }
        let result = self.shared.registry.pin_spans(grant, spans);
        if result.is_err() {
            grant.clear();
        }
        result
    }

    /// A live registration by id: its region, where it starts in the region and its length.
    /// Engines that hand memory to peers (such as `shm` passing a memfd) use it.
    pub fn registration(&self, id: u64) -> Option<(Region, u64, u64)> {
        self.shared.registry.lookup(id)
    }

    /// Queues a notification from peer `from` for the agent's user.
    pub fn notify(&self, from: &str, msg: Vec<u8>) {
        self.shared.notifications.push(from.to_owned(), msg);
    }

    /// Counts `bytes` of payload this engine copied into the destination of an `op`, for the
    /// agent's [`report`](crate::Agent::report). Count each byte once, where it lands (or
    /// where the one copy runs); a relaxed atomic add.
    pub fn count_copied(&self, op: Op, bytes: u64) {
        match op {
            Op::Write => self.shared.copied_write.add(bytes),
            Op::Read => self.shared.copied_read.add(bytes),
        }
    }

    /// Whether the agent is shutting down.
    pub fn is_closed(&self) -> bool {
        self.shared.closed.load(Ordering::Acquire)
    }

    /// An inbound link from peer `peer` is open: the peer counts as able to write into this
    /// agent's memory until the returned guard drops. Engines take it when a link is set up
    /// and drop it only after the link's reader returned (no grant of it is live any more).
    pub fn link_open(&self, peer: &str) -> LinkGuard {
        *lock(&self.shared.inbound)
            .entry(peer.to_owned())
            .or_insert(0) += 1;
        LinkGuard {
            host: self.clone(),
            peer: peer.to_owned(),
        }
    }
}

/// An open inbound link, counted until dropped (see [`Host::link_open`]).
#[must_use = "the link counts as closed as soon as the guard drops"]
pub struct LinkGuard {
    host: Host,
    peer: String,
}

impl LinkGuard {
    /// Files the link under another peer name (engines that learn the name after accepting).
    pub fn rename(&mut self, peer: &str) {
        if peer == self.peer {
            return;
        }
        let mut map = lock(&self.host.shared.inbound);
        forget(&mut map, &self.peer);
        *map.entry(peer.to_owned()).or_insert(0) += 1;
        self.peer = peer.to_owned();
    }
}

fn forget(map: &mut std::collections::HashMap<String, usize>, peer: &str) {
    if let Some(n) = map.get_mut(peer) {
        *n -= 1;
        if *n == 0 {
            map.remove(peer);
        }
    }
}

impl Drop for LinkGuard {
    fn drop(&mut self) {
        forget(&mut lock(&self.host.shared.inbound), &self.peer);
    }
}

impl fmt::Debug for LinkGuard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LinkGuard")
            .field("peer", &self.peer)
            .finish()
    }
}

/// Registrations pinned for a peer's request, with the address of each span. Reusable:
/// [`Grant::clear`] keeps the allocation, so a steady stream of requests allocates nothing.
#[derive(Default)]
pub struct Grant {
    pub(crate) pins: Vec<Arc<RegEntry>>,
    pub(crate) spans: Vec<(usize, u64)>,
}

impl Grant {
    /// An empty grant.
    pub fn new() -> Self {
        Self::default()
    }

    /// Releases the pins, keeping capacity.
    pub fn clear(&mut self) {
        self.pins.clear();
        self.spans.clear();
    }

    /// Number of spans granted.
    pub fn len(&self) -> usize {
        self.spans.len()
    }

    /// Whether nothing is granted.
    pub fn is_empty(&self) -> bool {
        self.spans.is_empty()
    }

    /// Address and length of span `i`. The memory stays registered while the grant holds it.
    pub fn span(&self, i: usize) -> (*mut u8, u64) {
        let (addr, len) = self.spans[i];
        (addr as *mut u8, len)
    }

    /// Total bytes granted.
    pub fn bytes(&self) -> u64 {
        self.spans.iter().map(|s| s.1).sum()
    }
}

impl fmt::Debug for Grant {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Grant")
            .field("spans", &self.spans.len())
            .field("bytes", &self.bytes())
            .finish()
    }
}
