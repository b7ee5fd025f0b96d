//! Errors: what the unit answers ([`RemoteError`]), what framing reports ([`WireError`]),
//! what the client returns ([`ClientError`]), and the local causes they wrap: the payload
//! plane's memory ([`MemoryError`]) and payload transfers ([`PayloadError`]). The lower
//! layers' errors are wrapped, never flattened to text, so that a caller matches on data
//! (`ClientError::OutOfMemory { requested, free, largest_free, .. }`).

use std::time::Duration;

use serde::{Deserialize, Serialize};
use tessera_alloc::AllocError;
use tessera_framecodec::{DecodeError, EncodeError, LayoutError};
use tessera_transport::{
    AgentError, ConnectError, DescError, PoolError, RegionError, RegisterError, TransferError,
};

/// What went wrong, as the unit reports it. Caller misuse, peer misbehaviour and resource
/// exhaustion are kept apart.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[non_exhaustive]
pub enum ErrorKind {
    /// Keys asked for are not stored (`RemoteError::missing` names them).
    Missing,
    /// The request is malformed or inconsistent (caller misuse).
    BadRequest,
    /// The message could not be decoded or is of another protocol version.
    Protocol,
    /// A size exceeds a configured maximum.
    TooLarge,
    /// Storing this would exceed the unit's byte capacity; nothing was stored.
    Capacity,
    /// The unit's registered memory (or its leased / quarantined limit) is exhausted.
    OutOfMemory,
    /// The token is missing or wrong.
    Unauthorized,
    /// The session must say Hello first.
    NoSession,
    /// The session failed earlier (a transfer outcome is unknown); reconnect as a new session.
    PeerFailed,
    /// No prepared PUT or GET has this id (expired, cancelled or never made).
    UnknownTransfer,
    /// A payload transfer failed.
    Transfer,
    /// The unit is shutting down.
    ShuttingDown,
    /// A queue of the unit for this client is full (its transfer queue); nothing was done.
    /// Retry later.
    Busy,
    /// The unit failed while handling the request (a bug, isolated to the session): the
    /// session is closed and what it held released; other sessions carry on. Reconnect.
    Internal,
}

impl ErrorKind {
    /// A short stable name, used as a metrics label.
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorKind::Missing => "missing",
            ErrorKind::BadRequest => "bad_request",
            ErrorKind::Protocol => "protocol",
            ErrorKind::TooLarge => "too_large",
            ErrorKind::Capacity => "capacity",
            ErrorKind::OutOfMemory => "out_of_memory",
            ErrorKind::Unauthorized => "unauthorized",
            ErrorKind::NoSession => "no_session",
            ErrorKind::PeerFailed => "peer_failed",
            ErrorKind::UnknownTransfer => "unknown_transfer",
            ErrorKind::Transfer => "transfer",
            ErrorKind::ShuttingDown => "shutting_down",
            ErrorKind::Internal => "internal",
            ErrorKind::Busy => "busy",
        }
    }
}

/// An error answered by a unit.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
#[error("{}: {message}", kind.as_str())]
pub struct RemoteError {
    /// What kind of failure.
    pub kind: ErrorKind,
    /// Human-readable detail.
    pub message: String,
    /// For [`ErrorKind::Missing`]: the `(field, index)` keys not stored.
    pub missing: Vec<(String, u64)>,
}

/// Framing and message decoding errors.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum WireError {
    /// A frame is longer than the configured maximum.
    #[error("message of {len} bytes exceeds the maximum of {max}")]
    TooLarge {
        /// Announced length.
        len: u64,
        /// Configured maximum.
        max: u64,
    },
    /// Another protocol version.
    #[error("protocol version {got} is not supported")]
    Version {
        /// The version received.
        got: u16,
    },
    /// The bytes are not a valid message.
    #[error("malformed message: {0}")]
    Decode(#[source] rmp_serde::decode::Error),
    /// A message could not be encoded.
    #[error("cannot encode message: {0}")]
    Encode(#[source] rmp_serde::encode::Error),
}

/// Errors of the client API. Caller misuse ([`ClientError::ApiMisuse`],
/// [`ClientError::BackendMismatch`]), the unit's answers and misbehaviour
/// ([`ClientError::Remote`], [`ClientError::Unexpected`], [`ClientError::Wire`],
/// [`ClientError::Decode`]) and resource exhaustion ([`ClientError::OutOfMemory`]) are kept
/// apart.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ClientError {
    /// The unit answered with an error.
    #[error("unit {unit}: {source}")]
    Remote {
        /// Which unit.
        unit: usize,
        /// Its answer.
        #[source]
        source: RemoteError,
    },
    /// The unit's control address could not be connected to.
    #[error("cannot reach unit {unit} at {addr}: {source}")]
    Unreachable {
        /// Which unit.
        unit: usize,
        /// Its address, as given.
        addr: String,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// The control connection failed.
    #[error("connection to unit {unit}: {source}")]
    Io {
        /// Which unit.
        unit: usize,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// A message was malformed.
    #[error("unit {unit}: {source}")]
    Wire {
        /// Which unit.
        unit: usize,
        /// The error.
        #[source]
        source: WireError,
    },
    /// The unit answered something the protocol does not allow here.
    #[error("unit {unit}: unexpected response {what}")]
    Unexpected {
        /// Which unit.
        unit: usize,
        /// What came.
        what: String,
    },
    /// The unit did not prove that it holds the client's token (or the client has none and
    /// the unit has one): the session is not opened, nothing was sent but a nonce and the
    /// client's agent metadata.
    #[error(
        "unit {unit}: {}",
        if *had_token {
            "the unit did not prove it holds this client's token: the tokens differ, or the \
             unit has none"
        } else {
            "the unit requires a token and this client was given none"
        }
    )]
    Unauthenticated {
        /// Which unit.
        unit: usize,
        /// Whether this client had a token (without one, a unit that requires one cannot
        /// prove it holds it).
        had_token: bool,
    },
    /// The unit's payload backend is not this client's; there is never a fallback.
    #[error("unit {unit}: transport: unit uses backend {theirs}, client {ours}; no fallback")]
    BackendMismatch {
        /// Which unit.
        unit: usize,
        /// The unit's backend, as it named it.
        theirs: String,
        /// This client's.
        ours: crate::Backend,
    },
    /// The client's agent could not be created.
    #[error("transport: {0}")]
    Agent(#[from] AgentError),
    /// Connecting to a unit's agent failed.
    #[error("unit {unit}: transport: {source}")]
    Connect {
        /// Which unit.
        unit: usize,
        /// The error.
        #[source]
        source: ConnectError,
    },
    /// A payload transfer failed or timed out. The outcome of the operation is unknown and it
    /// is not retried.
    #[error("unit {unit}: transport: {source}")]
    Transfer {
        /// Which unit.
        unit: usize,
        /// The error.
        #[source]
        source: PayloadError,
    },
    /// The client's own memory of the payload plane (its receive pool, its frames registered
    /// in place) could not be registered or described.
    #[error("client memory: {0}")]
    Memory(#[from] MemoryError),
    /// Encoding the values failed.
    #[error("codec: {0}")]
    Encode(#[from] EncodeError),
    /// The values' frames cannot be laid out.
    #[error("codec: {0}")]
    Layout(#[from] LayoutError),
    /// An answer's values could not be decoded.
    #[error("codec: {0}")]
    Decode(#[from] DecodeError),
    /// The caller passed inconsistent arguments.
    #[error("misuse: {0}")]
    ApiMisuse(String),
    /// Fewer units are live than a request needs: a PUT needs one per replica, a GET or a
    /// CLEAR at least one. The cluster's set may grow again (a unit restarting).
    #[error("only {live} live unit(s) of the cluster, and {needed} needed")]
    TooFewUnits {
        /// Units in the client's current set.
        live: usize,
        /// Units the request needs.
        needed: usize,
    },
    /// The cluster's membership could not be read (etcd did not answer in time, or the
    /// cluster configuration is unusable).
    #[error("cluster membership: {0}")]
    Membership(String),
    /// The client's receive pool cannot hold the values requested.
    #[error(
        "client receive pool: out of memory: {requested} bytes aligned to {align} requested, \
         {free} bytes free, largest free range {largest_free} bytes"
    )]
    OutOfMemory {
        /// Bytes asked for.
        requested: u64,
        /// Their alignment.
        align: u64,
        /// Free bytes in the pool.
        free: u64,
        /// The largest free range.
        largest_free: u64,
    },
    /// A task the client ran in the background (a blocking setup step) panicked or was
    /// cancelled.
    #[error("background task: {0}")]
    Background(#[from] tokio::task::JoinError),
    /// The unit did not answer within the client's timeout; the outcome is unknown and the
    /// request is not retried.
    #[error("unit {unit}: no answer within {after:?}")]
    Timeout {
        /// Which unit.
        unit: usize,
        /// The timeout that passed.
        after: Duration,
    },
    /// A PUT with several replicas that some units holding a copy did not store (each error
    /// names its unit); the others stored theirs.
    #[error("{} of the units holding copies failed: {}", failed.len(), join(failed))]
    Replicas {
        /// What each failed unit answered.
        failed: Vec<ClientError>,
    },
    /// Every replica of these indexes failed: their values are lost (or out of reach), not
    /// missing.
    #[error("{} indexes lost: every replica failed ({})", indexes.len(), join(causes))]
    Lost {
        /// The indexes asked for that no replica could serve.
        indexes: Vec<u64>,
        /// What the failed units answered.
        causes: Vec<ClientError>,
    },
}

fn join(errors: &[ClientError]) -> String {
    errors
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join("; ")
}

impl ClientError {
    /// The unit the error came from, where one did.
    pub fn unit(&self) -> Option<usize> {
        match self {
            ClientError::Remote { unit, .. }
            | ClientError::Unreachable { unit, .. }
            | ClientError::Io { unit, .. }
            | ClientError::Wire { unit, .. }
            | ClientError::Unexpected { unit, .. }
            | ClientError::Unauthenticated { unit, .. }
            | ClientError::BackendMismatch { unit, .. }
            | ClientError::Connect { unit, .. }
            | ClientError::Transfer { unit, .. }
            | ClientError::Timeout { unit, .. } => Some(*unit),
            _ => None,
        }
    }

    /// A unit lacks keys asked for.
    pub fn is_missing(&self) -> bool {
        matches!(self, ClientError::Remote { source, .. } if source.kind == ErrorKind::Missing)
    }

    /// The unit, its session or the payload path failed, so another replica may serve the
    /// request: the unit is unreachable, its connection broke, a transfer failed, it did
    /// not answer in time, or it is shutting down, failed the session or failed inside.
    pub fn is_unit_failure(&self) -> bool {
        match self {
            ClientError::Unreachable { .. }
            | ClientError::Io { .. }
            | ClientError::Wire { .. }
            | ClientError::Connect { .. }
            | ClientError::Transfer { .. }
            | ClientError::Timeout { .. } => true,
            ClientError::Remote { source, .. } => matches!(
                source.kind,
                ErrorKind::ShuttingDown
                    | ErrorKind::PeerFailed
                    | ErrorKind::Internal
                    | ErrorKind::Transfer
            ),
            _ => false,
        }
    }
}

/// The payload plane's local memory: leasing from the registered pool, registering more of
/// it, describing blocks, registering caller frames in place.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum MemoryError {
    /// No chunk has room and registering another would pass the limit (resource exhaustion).
    #[error(
        "registered memory exhausted: {requested} bytes asked, {registered} of {limit} bytes \
         registered, largest free range {largest_free}"
    )]
    Exhausted {
        /// Bytes asked for.
        requested: u64,
        /// Bytes registered now.
        registered: u64,
        /// Bytes registered at most.
        limit: u64,
        /// The largest free range of any chunk.
        largest_free: u64,
        /// What the last chunk tried answered, if any was.
        #[source]
        chunk: Option<Box<MemoryError>>,
    },
    /// A lease too large to size a chunk for (caller misuse).
    #[error("a lease of {size} bytes is too large")]
    LeaseTooLarge {
        /// Bytes asked for.
        size: u64,
    },
    /// The registered memory or its chunks were configured with no size (caller misuse).
    #[error("the registered memory and its chunks need a non-zero size")]
    ZeroSize,
    /// The allocator refused: exhaustion (`AllocError::OutOfMemory`) or misuse.
    #[error(transparent)]
    Alloc(AllocError),
    /// The registered pool failed (other than its allocator).
    #[error(transparent)]
    Pool(PoolError),
    /// A frame's memory could not be wrapped as a region.
    #[error(transparent)]
    Region(#[from] RegionError),
    /// Registering memory failed.
    #[error(transparent)]
    Register(#[from] RegisterError),
    /// Describing part of a block or registration failed.
    #[error(transparent)]
    Desc(#[from] DescError),
    /// A frame to describe is empty: it has no byte to anchor a descriptor (caller misuse).
    #[error("frame {index} is empty: there is nothing to describe")]
    EmptyFrame {
        /// The frame's index.
        index: usize,
    },
    /// A receive block is smaller than the frames laid out in it.
    #[error("receive block of {len} bytes, the frames need {need}")]
    BlockTooSmall {
        /// The block's length.
        len: u64,
        /// Bytes the frames need.
        need: u64,
    },
    /// A receive block would end beyond the address space.
    #[error("receive block beyond the address space")]
    BlockOverflow,
    /// A block to freeze still has a descriptor or a transfer (a bug of this crate).
    #[error("the block is still in use by a descriptor or a transfer")]
    InUse,
    /// Fewer descriptors than frames were made.
    #[error("{descs} descriptors for {frames} frames")]
    Described {
        /// Frames to describe.
        frames: usize,
        /// Descriptors made.
        descs: usize,
    },
}

impl From<PoolError> for MemoryError {
    /// The allocator's refusal stays itself (its `OutOfMemory` is data a caller matches).
    fn from(e: PoolError) -> Self {
        match e {
            PoolError::Alloc(a) => MemoryError::Alloc(a),
            other => MemoryError::Pool(other),
        }
    }
}

impl From<AllocError> for MemoryError {
    fn from(e: AllocError) -> Self {
        MemoryError::Alloc(e)
    }
}

/// A payload transfer (a GET's WRITE, a pulled PUT's READ, a pushed PUT's WRITE) that did not
/// complete; its outcome is unknown.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PayloadError {
    /// The transport reported a failure.
    #[error(transparent)]
    Transfer(#[from] TransferError),
    /// The peer's agent could not be added.
    #[error(transparent)]
    Connect(#[from] ConnectError),
    /// The local memory of the transfer could not be described.
    #[error(transparent)]
    Memory(#[from] MemoryError),
    /// The session's transfers can no longer run: its executor is gone (the session is
    /// closing).
    #[error("session has no executor")]
    NoExecutor,
    /// The transfer did not complete in time.
    #[error("transfer timed out after {after:?}; outcome unknown")]
    TimedOut {
        /// The timeout that passed.
        after: Duration,
    },
    /// The code running the transfer panicked (a bug); `message` is the panic's.
    #[error("the unit failed {what} ({message})")]
    Panicked {
        /// What it was doing.
        what: &'static str,
        /// The panic's message.
        message: String,
    },
}

impl ClientError {
    /// The client's receive pool refused a lease: its allocator's exhaustion becomes
    /// [`ClientError::OutOfMemory`] with the allocator's numbers, anything else
    /// [`ClientError::Memory`].
    pub(crate) fn from_pool(e: PoolError) -> Self {
        match e {
            PoolError::Alloc(AllocError::OutOfMemory {
                requested,
                align,
                free,
                largest_free,
            }) => ClientError::OutOfMemory {
                requested,
                align,
                free,
                largest_free,
            },
            other => ClientError::Memory(other.into()),
        }
    }

    /// The unit's error kind, if the unit answered with an error; [`ErrorKind::Unauthorized`]
    /// too when the unit did not prove it holds the token ([`ClientError::Unauthenticated`]).
    pub fn kind(&self) -> Option<ErrorKind> {
        match self {
            ClientError::Remote { source, .. } => Some(source.kind),
            ClientError::Unauthenticated { .. } => Some(ErrorKind::Unauthorized),
            _ => None,
        }
    }
}
