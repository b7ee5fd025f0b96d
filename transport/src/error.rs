//! One error enum per operation. Caller misuse, peer misbehaviour and resource exhaustion are
//! separate variants; every transfer error names the peer.

use std::fmt;

/// Why a [`Region`](crate::Region) could not be created or accessed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RegionError {
    /// A region of zero bytes was asked for (caller misuse).
    #[error("a region cannot be empty")]
    Empty,
    /// The length does not fit this address space (caller misuse).
    #[error("a region of {len} bytes does not fit this address space")]
    TooLarge {
        /// The rejected length.
        len: u64,
    },
    /// A shared memfd is shorter than the length it was announced with (peer misbehaviour).
    #[error("shared memory of {actual} bytes is shorter than the announced {len}")]
    TooSmall {
        /// The announced length.
        len: u64,
        /// The memfd's real size.
        actual: u64,
    },
    /// A shared memfd lacks the grow, shrink and seal seals (peer misbehaviour).
    #[error("shared memory is not sealed against resizing")]
    NotSealed,
    /// An access falls outside the region (caller misuse).
    #[error("{len} bytes at offset {offset} fall outside a region of {region_len} bytes")]
    OutOfRange {
        /// First byte of the access.
        offset: u64,
        /// Length of the access.
        len: u64,
        /// Length of the region.
        region_len: u64,
    },
    /// The operating system refused (resource exhaustion, limits).
    #[error("{op} failed: {source}")]
    Os {
        /// The system call.
        op: &'static str,
        /// The OS error.
        source: std::io::Error,
    },
}

/// A failure inside a backend engine, with the backend's name. Engines make one with
/// [`BackendError::new`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{backend} backend: {message}")]
#[non_exhaustive]
pub struct BackendError {
    /// The backend's name (`inproc`, `shm`, `tcp`, ...).
    pub backend: &'static str,
    /// What went wrong.
    pub message: String,
}

impl BackendError {
    /// A backend error with a message.
    pub fn new(backend: &'static str, message: impl fmt::Display) -> Self {
        Self {
            backend,
            message: message.to_string(),
        }
    }
}

/// Why [`Agent::new`](crate::Agent::new) refused.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum AgentError {
    /// Names are 1 to 255 bytes (caller misuse).
    #[error("agent name {name:?} must be 1 to 255 bytes")]
    InvalidName {
        /// The rejected name.
        name: String,
    },
    /// The engine could not start.
    #[error(transparent)]
    Backend(#[from] BackendError),
}

/// Why [`Agent::register`](crate::Agent::register) refused.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RegisterError {
    /// The range falls outside the region (caller misuse).
    #[error("{len} bytes at offset {offset} fall outside a region of {region_len} bytes")]
    OutOfRange {
        /// First byte of the range.
        offset: u64,
        /// Length of the range.
        len: u64,
        /// Length of the region.
        region_len: u64,
    },
    /// The backend cannot reach this kind of memory, e.g. private memory on `shm`.
    #[error("the {backend} backend cannot register this memory: {reason}")]
    Unsupported {
        /// The backend's name.
        backend: &'static str,
        /// Why.
        reason: &'static str,
    },
    /// The agent was shut down.
    #[error("agent {agent:?} is shut down")]
    AgentClosed {
        /// The agent's name.
        agent: String,
    },
    /// The engine refused.
    #[error(transparent)]
    Backend(#[from] BackendError),
}

/// Why a descriptor could not be made.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DescError {
    /// The range falls outside the registration (caller misuse).
    #[error("{len} bytes at offset {offset} fall outside registration {reg} of {reg_len} bytes")]
    OutOfRange {
        /// The registration.
        reg: u64,
        /// First byte, relative to the registration.
        offset: u64,
        /// Length.
        len: u64,
        /// Length of the registration.
        reg_len: u64,
    },
    /// A descriptor of zero bytes (caller misuse): transfers never carry empty descriptors.
    #[error("descriptors cannot be empty")]
    Empty,
    /// A standing exposure of a local-only registration, which no peer can reach (caller
    /// misuse).
    #[error("registration {reg} is local only: no peer can write it")]
    Local {
        /// The registration.
        reg: u64,
    },
}

/// Why metadata could not be decoded. Decoding checks every length before allocating.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum MetadataError {
    /// The bytes end early.
    #[error("metadata truncated: {what} needs {needed} more bytes")]
    Truncated {
        /// The field being read.
        what: &'static str,
        /// Bytes missing.
        needed: usize,
    },
    /// Not Tessera metadata.
    #[error("not tessera-transport metadata")]
    BadMagic,
    /// Written by an incompatible version.
    #[error("metadata version {found} is not supported (expected {expected})")]
    Version {
        /// Version found.
        found: u16,
        /// Version this build reads.
        expected: u16,
    },
    /// A field exceeds its limit.
    #[error("metadata field {what} is {len} long, more than the limit {max}")]
    TooLarge {
        /// The field.
        what: &'static str,
        /// Its announced length.
        len: u64,
        /// The limit.
        max: u64,
    },
    /// A field holds an impossible value.
    #[error("metadata field {what} is invalid")]
    Invalid {
        /// The field.
        what: &'static str,
    },
    /// Bytes follow the metadata.
    #[error("{extra} unexpected bytes after the metadata")]
    Trailing {
        /// How many.
        extra: usize,
    },
}

/// Why [`Agent::add_remote`](crate::Agent::add_remote) refused.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConnectError {
    /// The metadata is malformed (peer misbehaviour).
    #[error(transparent)]
    Metadata(#[from] MetadataError),
    /// The peer runs another backend: there is never a silent fallback.
    #[error("peer {peer:?} uses the {theirs} backend, this agent uses {ours}")]
    BackendMismatch {
        /// The peer.
        peer: String,
        /// Our backend.
        ours: &'static str,
        /// The peer's backend.
        theirs: String,
    },
    /// The metadata is our own.
    #[error("agent {agent:?} cannot add itself as a peer")]
    SelfPeer {
        /// The agent.
        agent: String,
    },
    /// The agent was shut down.
    #[error("agent {agent:?} is shut down")]
    AgentClosed {
        /// The agent's name.
        agent: String,
    },
    /// The engine could not reach the peer.
    #[error("connecting to peer {peer:?}: {source}")]
    Backend {
        /// The peer.
        peer: String,
        /// The engine's error.
        source: BackendError,
    },
}

/// Which side of a transfer a descriptor belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Side {
    /// This agent's memory.
    Local,
    /// The peer's memory.
    Remote,
}

impl fmt::Display for Side {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Side::Local => "local",
            Side::Remote => "remote",
        })
    }
}

/// Why the target refused a transfer, as it reports it over the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum RejectReason {
    /// The registration is unknown to the target (never registered or already deregistered).
    UnknownRegistration,
    /// The range falls outside the registration.
    OutOfRange,
    /// The request is malformed.
    Malformed,
    /// The target is shutting down.
    ShuttingDown,
    /// The registration is scoped and no exposure to this peer for this operation holds the
    /// range.
    NotExposed,
}
impl RejectReason {
    pub(crate) fn code(self) -> u8 {
        match self {
            RejectReason::UnknownRegistration => 1,
            RejectReason::OutOfRange => 2,
            RejectReason::Malformed => 3,
            RejectReason::ShuttingDown => 4,
            RejectReason::NotExposed => 5,
        }
    }

    pub(crate) fn from_code(code: u8) -> Self {
        match code {
            1 => RejectReason::UnknownRegistration,
            2 => RejectReason::OutOfRange,
            4 => RejectReason::ShuttingDown,
            5 => RejectReason::NotExposed,
            _ => RejectReason::Malformed,
        }
    }
}

impl fmt::Display for RejectReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            RejectReason::UnknownRegistration => "unknown registration",
            RejectReason::OutOfRange => "range outside the registration",
            RejectReason::Malformed => "malformed request",
            RejectReason::ShuttingDown => "shutting down",
            RejectReason::NotExposed => "range not exposed to this peer for this operation",
        })
    }
}

/// Why a transfer failed. Every variant names the peer.
///
/// A transfer that returns one of these never moved its bytes as asked: a failed transfer is
/// never reported as done, and an engine that cannot report a status produces
/// [`TransferError::StatusLost`], never success.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum TransferError {
    /// The peer went away (process death, closed connection, shut-down agent).
    #[error("peer {peer:?} is gone: {detail}")]
    PeerGone {
        /// The peer.
        peer: String,
        /// What was observed.
        detail: String,
    },
    /// The transfer did not complete in time. Its resources stay held until it resolves or
    /// the agent is torn down.
    #[error("transfer to peer {peer:?} timed out after {after:?}")]
    Timeout {
        /// The peer.
        peer: String,
        /// How long was waited.
        after: std::time::Duration,
    },
    /// A descriptor falls outside its registration; nothing moved.
    #[error(
        "peer {peer:?}: {side} descriptor {index} ({len} bytes at {offset}) falls outside \
         registration {reg} of {reg_len} bytes"
    )]
    OutOfRange {
        /// The peer.
        peer: String,
        /// Which side was checked.
        side: Side,
        /// Index of the descriptor in the list.
        index: usize,
        /// The registration.
        reg: u64,
        /// First byte.
        offset: u64,
        /// Length.
        len: u64,
        /// Registration length.
        reg_len: u64,
    },
    /// A remote descriptor names a registration the peer never announced; nothing moved.
    #[error("peer {peer:?}: {side} descriptor {index} names unknown registration {reg}")]
    UnknownRegistration {
        /// The peer.
        peer: String,
        /// Which side was checked.
        side: Side,
        /// Index of the descriptor.
        index: usize,
        /// The registration id.
        reg: u64,
    },
    /// Local and remote lists disagree (caller misuse); nothing moved.
    #[error("peer {peer:?}: descriptor lists differ: {detail}")]
    Mismatch {
        /// The peer.
        peer: String,
        /// Which rule was broken.
        detail: String,
    },
    /// The target validated the request against its registrations and refused it.
    #[error("peer {peer:?} rejected the transfer: {reason}")]
    Rejected {
        /// The peer.
        peer: String,
        /// The target's reason.
        reason: RejectReason,
    },
    /// The engine failed.
    #[error("transfer with peer {peer:?} failed: {source}")]
    Backend {
        /// The peer.
        peer: String,
        /// The engine's error.
        source: BackendError,
    },
    /// The engine dropped the transfer without reporting a status. Treated as failure.
    #[error("transfer with peer {peer:?}: the engine lost its status")]
    StatusLost {
        /// The peer.
        peer: String,
    },
    /// The notification exceeds the limit.
    #[error("peer {peer:?}: notification of {len} bytes exceeds {max}")]
    NotificationTooLarge {
        /// The peer.
        peer: String,
        /// Its length.
        len: usize,
        /// The limit.
        max: usize,
    },
}

impl TransferError {
    /// The peer this error is about.
    pub fn peer(&self) -> &str {
        match self {
            TransferError::PeerGone { peer, .. }
            | TransferError::Timeout { peer, .. }
            | TransferError::OutOfRange { peer, .. }
            | TransferError::UnknownRegistration { peer, .. }
            | TransferError::Mismatch { peer, .. }
            | TransferError::Rejected { peer, .. }
            | TransferError::Backend { peer, .. }
            | TransferError::StatusLost { peer }
            | TransferError::NotificationTooLarge { peer, .. } => peer,
        }
    }
}

/// Why a [`RegisteredPool`](crate::RegisteredPool) could not be built or lease a block.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PoolError {
    /// Mapping the pool's memory failed.
    #[error(transparent)]
    Region(#[from] RegionError),
    /// Registering it failed.
    #[error(transparent)]
    Register(#[from] RegisterError),
    /// The allocator refused (exhaustion or misuse).
    #[error(transparent)]
    Alloc(#[from] tessera_alloc::AllocError),
}
