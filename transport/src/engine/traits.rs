//! The traits an engine implements and the plain data it exchanges with the agent.

use std::fmt;

use super::host::Host;
use crate::error::{BackendError, RegisterError};
use crate::transfer::{Completion, Plan};
use crate::Region;
use tessera_sync::Arc;

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
    /// segment's address alone ([`Segment::local_ptr`](crate::transfer::Segment::local_ptr)) and whose
    /// [`register`](Transport::register) does nothing for it return `false`: the agent then
    /// never calls them for [`Agent::register_local`](crate::Agent::register_local), and
    /// their plans may name local registrations this engine never saw. The default, `true`,
    /// suits engines that look up their own handle of the local memory by
    /// [`Segment::local_reg`](crate::transfer::Segment::local_reg).
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

    /// A standing exposure of one of this agent's registrations came (`live`) or went: peer
    /// `peer` may WRITE `grant`'s range until it goes
    /// ([`Registration::expose_standing`](crate::Registration::expose_standing)). An engine
    /// whose initiator asks the target for a grant before every transfer may hand this one to
    /// the peer's side in advance, so that a WRITE inside it costs no round trip (`shm`);
    /// every WRITE is still checked against the target's exposures where the target sees it.
    /// The default ignores it (each transfer is granted as it comes).
    fn standing(&self, peer: &str, grant: Standing, live: bool) {
        let _ = (peer, grant, live);
    }

    /// Spins for up to `window` until `done` holds, recording meanwhile the WRITEs of
    /// `peer` that this engine learns of where a spinning thread can see them (`shm`: the
    /// rings of records its initiators copy into standing ranges with); returns whether
    /// `done` held. For a waiter that expects a WRITE within microseconds and would
    /// otherwise sleep until the engine's own thread records it. The default spins on
    /// nothing: it returns `done()`.
    fn spin_for_writes(
        &self,
        peer: &str,
        window: std::time::Duration,
        done: &mut dyn FnMut() -> bool,
    ) -> bool {
        let _ = (peer, window);
        done()
    }

    /// Keeps `peer`'s WRITEs into standing ranges from waking this engine's thread until the
    /// returned watch drops, and records them then (`shm`: the rings of records of `peer`'s
    /// inbound links count as watched, so their initiators ring no doorbell; the watch's end
    /// takes what they hold). For a target that learns from elsewhere that such a WRITE
    /// landed (a server's answer, sent after its WRITE) and needs no wake-up for its record;
    /// a WRITE of `peer` that something waits for meanwhile is recorded only once the watch
    /// ends, or by a spin. The default watches nothing.
    fn watch_writes(&self, peer: &str) -> WriteWatch {
        let _ = peer;
        WriteWatch::default()
    }

    /// Stops progress, fails every pending transfer with a peer-gone or shutdown error, and
    /// releases the engine's resources. Called once, when the agent is dropped.
    fn shutdown(&self);
}

/// What [`Transport::watch_writes`] returns: runs its end when dropped.
#[derive(Default)]
#[must_use = "the watch ends when it is dropped"]
pub struct WriteWatch(Option<Box<dyn FnOnce() + Send>>);

impl WriteWatch {
    /// A watch that ends with `end`.
    pub fn new(end: impl FnOnce() + Send + 'static) -> Self {
        Self(Some(Box::new(end)))
    }
}

impl Drop for WriteWatch {
    fn drop(&mut self) {
        if let Some(end) = self.0.take() {
            end();
        }
    }
}

impl fmt::Debug for WriteWatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("WriteWatch")
            .field("watching", &self.0.is_some())
            .finish()
    }
}

/// A range of a registration one peer may WRITE until it is withdrawn
/// ([`Transport::standing`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Standing {
    /// Names it among the agent's standing exposures (unique while it is live).
    pub key: u64,
    /// The registration's id.
    pub reg: u64,
    /// First byte, as peers name offsets in the registration.
    pub offset: u64,
    /// Its length.
    pub len: u64,
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

    /// Cuts the engine's real link to the peer now, as a failing network or a dying peer
    /// would, with transfers possibly in flight on it: they then fail through the engine's
    /// own failure path. For fault injection (`testing::Fault::CutLink`, behind the feature
    /// `testing`).
    /// Returns `false` where the engine has no link to cut (the default).
    fn cut(&self) -> bool {
        false
    }
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
